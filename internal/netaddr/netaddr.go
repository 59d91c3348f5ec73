// Package netaddr holds the address rules every listener shares: the name
// a listener advertises to its peers, and the source a connection counts
// under for per-source bounds.
package netaddr

import (
	"fmt"
	"net"
	"net/netip"
	"strconv"
)

// InterfaceIP picks the address to advertise for a listener on all
// interfaces: the first non-loopback unicast address of an interface that
// is up, IPv4 first and IPv6 only when v6 (the listener takes it), else
// loopback. Link-local addresses are left out: they need a zone to dial.
func InterfaceIP(v6 bool) net.IP {
	ifs, _ := net.Interfaces()
	var six net.IP
	for _, ifc := range ifs {
		if ifc.Flags&net.FlagUp == 0 || ifc.Flags&net.FlagLoopback != 0 {
			continue
		}
		addrs, _ := ifc.Addrs()
		for _, a := range addrs {
			n, ok := a.(*net.IPNet)
			if !ok || !n.IP.IsGlobalUnicast() {
				continue
			}
			if n.IP.To4() != nil {
				return n.IP
			}
			if v6 && six == nil {
				six = n.IP
			}
		}
	}
	switch {
	case six != nil:
		return six
	case v6:
		return net.IPv6loopback
	}
	return net.IPv4(127, 0, 0, 1)
}

// Advertise returns the host:port peers reach a listener at addr by: adv
// where it gives them, the listener's port where adv has none (or 0), and
// for a host it lacks the listener's IP, or InterfaceIP for a listener on
// all interfaces.
func Advertise(adv string, addr *net.TCPAddr) (string, error) {
	host, port := "", ""
	if adv != "" {
		var err error
		if host, port, err = net.SplitHostPort(adv); err != nil {
			return "", fmt.Errorf("advertise %q: %w", adv, err)
		}
	}
	if port == "" || port == "0" {
		port = strconv.Itoa(addr.Port)
	}
	if host == "" {
		ip := addr.IP
		if ip == nil || ip.IsUnspecified() {
			ip = InterfaceIP(ip == nil || ip.To4() == nil)
		}
		host = ip.String()
	}
	return net.JoinHostPort(host, port), nil
}

// Source is the address a connection from a counts under for per-source
// bounds: an IPv4 address as it is, an IPv6 one masked to its /64 (one
// host commonly holds a whole /64); the zero Addr when a is not TCP.
func Source(a net.Addr) netip.Addr {
	ta, ok := a.(*net.TCPAddr)
	if !ok {
		return netip.Addr{}
	}
	ip := ta.AddrPort().Addr().Unmap()
	if ip.Is6() {
		if p, err := ip.Prefix(64); err == nil {
			return p.Addr()
		}
	}
	return ip
}
