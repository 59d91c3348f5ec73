// Package netaddr picks the address a listener on all interfaces
// advertises to its peers.
package netaddr

import "net"

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
