package mooncake

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/moonring/moonring/segtable"
)

// The names under which a Mooncake segment's transports and their
// addresses appear in a moonring [segtable.SegmentDesc]'s Endpoints, and
// its buffers' keys in Keys.
const (
	// TransportTCP: Mooncake's TCP data protocol. Endpoint "host:port" (the
	// host of the rpc_meta entry or of the segment name, the segment's
	// tcp_data_port); every buffer carries an empty key under it (the
	// protocol has none).
	TransportTCP = "mooncake-tcp"
	// EndpointTCPVersion: the TCP data protocol version the segment's
	// server speaks, "1" or "2" (and so on).
	EndpointTCPVersion = "mooncake-tcp.version"
	// TransportRDMA: Mooncake's RDMA transport. Endpoint "host:port" of the
	// RPC daemon, where the handshake goes; a buffer's key is its rkeys in
	// device order, decimal, comma-separated ("1234,5678").
	TransportRDMA = "mooncake-rdma"
	// EndpointRDMANICs: the segment's NICs in order, comma-separated, each
	// "name/lid/gid" (e.g. "mlx5_0/0/fe80:00:...").
	EndpointRDMANICs = "mooncake-rdma.nics"
	// EndpointRDMAMatrix: the segment's priority matrix by NIC index
	// ([NICMatrix]'s text form, e.g. "cpu:0=0/1;cuda:0=1/"): the NICs a
	// peer picks from for a buffer's location. Absent: none published
	// (every NIC serves every location).
	EndpointRDMAMatrix = "mooncake-rdma.matrix"
	// EndpointRDMAServer: the server name of the handshake's NIC paths when
	// it is not the segment name (Mooncake's rdma_server_name).
	EndpointRDMAServer = "mooncake-rdma.server"
	// EndpointRPC: "host:port" of the segment's RPC daemon (handshake,
	// notify, probe, P2P metadata), when known.
	EndpointRPC = "mooncake-rpc"
)

// ErrUnsupported reports a Mooncake descriptor of a protocol moonring has no
// transport for (nvlink, cxl, nvmeof, ascend, ...). A retry does not help.
var ErrUnsupported = errors.New("mooncake: protocol not supported by moonring")

// SplitServerName splits a Mooncake server name into host and port as
// Mooncake does: "[v6]:port", a bare IPv6 address (no port), or
// "host:port" split at the last colon. ok is false when the name carries no
// valid port.
func SplitServerName(name string) (host string, port uint16, ok bool) {
	if strings.HasPrefix(name, "[") {
		if i := strings.IndexByte(name, ']'); i > 0 {
			if _, err := netip.ParseAddr(name[1:i]); err == nil {
				host, rest := name[1:i], name[i+1:]
				if p, found := strings.CutPrefix(rest, ":"); found {
					n, err := strconv.ParseUint(p, 10, 16)
					return host, uint16(n), err == nil
				}
				return host, 0, false
			}
		}
	}
	if a, err := netip.ParseAddr(name); err == nil && a.Is6() {
		return name, 0, false
	}
	i := strings.LastIndexByte(name, ':')
	if i < 0 {
		return name, 0, false
	}
	n, err := strconv.ParseUint(name[i+1:], 10, 16)
	return name[:i], uint16(n), err == nil
}

// ToSegtable converts a Mooncake descriptor to moonring's, for the
// transports of [TransportTCP] and [TransportRDMA]. rpc is the segment's
// rpc_meta entry, nil when there is none (P2PHANDSHAKE: the host and RPC
// port come from the segment name).
//
// A descriptor published by moonring carries the moonring extension: its
// moonring descriptor is returned, after checking that it names the same
// segment and the same buffer ranges as the Mooncake members, so that
// moonring and Mooncake readers see the same memory.
//
// Otherwise the result has epoch 0 (Mooncake has none), Endpoints as the
// constants above say, a buffer per distinct range (the tcp and rdma
// entries of one range in a multi-protocol descriptor merge), Location the
// Mooncake buffer name of rdma buffers ("" for tcp, whose buffers bear the
// segment name), the NICs as Devices of kind "rnic", node -1, and the
// priority matrix as [EndpointRDMAMatrix] (by NIC index: names not among
// the devices dropped, see [NICMatrix]; absent when it names none). Lkeys
// and timestamp do not map. Descriptors of other protocols fail with
// [ErrUnsupported]; a matrix location the endpoint cannot carry (';' or
// '=', over MaxMatrixLocation bytes) with [ErrBadDoc].
func ToSegtable(d *SegmentDesc, rpc *RPCMeta) (*segtable.SegmentDesc, error) {
	if d.Moonring != nil {
		return fromExtension(d)
	}
	hasTCP, hasRDMA := d.Has(ProtoTCP), d.Has(ProtoRDMA)
	if !hasTCP && !hasRDMA {
		return nil, fmt.Errorf("%w: segment %q speaks %q", ErrUnsupported, d.Name, d.Protocol)
	}
	s := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: d.Name, Endpoints: map[string]string{}}
	host, port, hasPort := SplitServerName(d.Name)
	if rpc != nil {
		host, port, hasPort = rpc.IPOrHostName, rpc.RPCPort, true
	}
	rpcAddr := ""
	if hasPort && host != "" && port != 0 {
		rpcAddr = net.JoinHostPort(host, strconv.Itoa(int(port)))
		s.Endpoints[EndpointRPC] = rpcAddr
	}
	if d.TCPDataPort > 0 && host != "" {
		s.Endpoints[TransportTCP] = net.JoinHostPort(host, strconv.Itoa(d.TCPDataPort))
		s.Endpoints[EndpointTCPVersion] = strconv.Itoa(d.TCPProtoVersion)
	}
	_, tcpOK := s.Endpoints[TransportTCP]
	if hasRDMA {
		nics := make([]string, len(d.Devices))
		for i, dev := range d.Devices {
			if strings.ContainsAny(dev.Name, "/,") {
				return nil, fmt.Errorf("%w: device name %q", ErrBadDoc, dev.Name)
			}
			nics[i] = fmt.Sprintf("%s/%d/%s", dev.Name, dev.LID, dev.GID)
			s.Devices = append(s.Devices, segtable.DeviceDesc{Name: dev.Name, Kind: "rnic", Node: -1})
		}
		if rpcAddr != "" {
			s.Endpoints[TransportRDMA] = rpcAddr
		}
		s.Endpoints[EndpointRDMANICs] = strings.Join(nics, ",")
		if d.RDMAServerName != "" {
			s.Endpoints[EndpointRDMAServer] = d.RDMAServerName
		}
		m, err := nicMatrix(d)
		if err != nil {
			return nil, fmt.Errorf("segment %q: %w", d.Name, err)
		}
		if len(m) > 0 {
			s.Endpoints[EndpointRDMAMatrix] = m.String()
		}
	}
	multi := len(d.Protocols()) > 1
	type span struct{ addr, length uint64 }
	at := map[span]int{}
	for _, b := range d.Buffers {
		p := d.Protocol
		if multi {
			p = b.Protocol
		}
		if p != ProtoTCP && p != ProtoRDMA {
			continue // a range no moonring transport reaches
		}
		k := span{b.Addr, b.Length}
		i, seen := at[k]
		if !seen {
			i = len(s.Buffers)
			at[k] = i
			s.Buffers = append(s.Buffers, segtable.BufferDesc{Addr: b.Addr, Length: b.Length, Keys: map[string]string{}})
			if tcpOK {
				s.Buffers[i].Keys[TransportTCP] = ""
			}
		}
		bd := &s.Buffers[i]
		if p == ProtoRDMA {
			bd.Location = b.Name
			if len(b.RKey) > 0 {
				ks := make([]string, len(b.RKey))
				for j, k := range b.RKey {
					ks[j] = strconv.FormatUint(k, 10)
				}
				bd.Keys[TransportRDMA] = strings.Join(ks, ",")
			}
		} else if bd.Location == "" && b.Name != d.Name {
			bd.Location = b.Name
		}
	}
	sort.Slice(s.Buffers, func(i, j int) bool { return s.Buffers[i].Addr < s.Buffers[j].Addr })
	if err := s.Validate(); err != nil {
		return nil, fmt.Errorf("segment %q: %w", d.Name, err)
	}
	return s, nil
}

// fromExtension returns the moonring descriptor a moonring publisher kept
// in the document, if it agrees with the Mooncake members.
func fromExtension(d *SegmentDesc) (*segtable.SegmentDesc, error) {
	s, err := segtable.UnmarshalDesc(d.Moonring)
	if err != nil {
		return nil, fmt.Errorf("segment %q: moonring extension: %w", d.Name, err)
	}
	if s.Name != d.Name {
		return nil, fmt.Errorf("%w: segment %q carries a moonring descriptor of %q", ErrBadDoc, d.Name, s.Name)
	}
	var a, b [][2]uint64
	for _, x := range s.Buffers {
		a = append(a, [2]uint64{x.Addr, x.Length})
	}
	for _, x := range d.Buffers {
		if k := [2]uint64{x.Addr, x.Length}; !slices.Contains(b, k) {
			b = append(b, k)
		}
	}
	sortSpans(a)
	sortSpans(b)
	if !slices.Equal(a, b) {
		return nil, fmt.Errorf("%w: segment %q: the moonring descriptor's buffers are not the Mooncake buffers", ErrBadDoc, d.Name)
	}
	return s, nil
}

func sortSpans(s [][2]uint64) {
	slices.SortFunc(s, func(x, y [2]uint64) int {
		if x[0] != y[0] {
			if x[0] < y[0] {
				return -1
			}
			return 1
		}
		switch {
		case x[1] < y[1]:
			return -1
		case x[1] > y[1]:
			return 1
		}
		return 0
	})
}

// DefaultLocation is the Mooncake buffer name given to an rdma buffer whose
// moonring Location is empty.
const DefaultLocation = "cpu:0"

// FromSegtable converts a moonring descriptor to a Mooncake one that a
// Mooncake engine can use, and the rpc_meta entry to publish beside it
// (nil when the descriptor names neither [EndpointRPC] nor [TransportTCP]).
//
// The protocol is "rdma" when [EndpointRDMANICs] is present, else "tcp":
// never a multi-protocol list, which Mooncake builds without
// multi-protocol support cannot read; an rdma descriptor still carries
// tcp_data_port, which is all a Mooncake TCP initiator needs. Buffers are
// named by their Location (rdma; [DefaultLocation] when empty) or by the
// segment name (tcp), as Mooncake names its own; the rkeys come from
// Keys[TransportRDMA] and are repeated as lkeys (a peer never uses those).
// The priority matrix is [EndpointRDMAMatrix] when it names a NIC;
// otherwise it prefers every NIC for every buffer location.
// tcp_proto_version is [EndpointTCPVersion], or 2 when absent. The whole
// moonring descriptor travels in the moonring extension, so that moonring
// readers lose nothing (epoch, endpoints, keys, devices, MACs).
func FromSegtable(s *segtable.SegmentDesc) (*SegmentDesc, *RPCMeta, error) {
	if s == nil {
		return nil, nil, fmt.Errorf("%w: nil descriptor", segtable.ErrBadDesc)
	}
	if err := s.Validate(); err != nil {
		return nil, nil, fmt.Errorf("segment %q: %w", s.Name, err)
	}
	ext, err := json.Marshal(s)
	if err != nil {
		return nil, nil, fmt.Errorf("segment %q: %w: %v", s.Name, segtable.ErrBadDesc, err)
	}
	d := &SegmentDesc{Name: s.Name, Protocol: ProtoTCP, TCPProtoVersion: 2, Moonring: ext}
	var rpc *RPCMeta
	if a, ok := s.Endpoints[EndpointRPC]; ok {
		h, p, err := splitEndpoint(a)
		if err != nil {
			return nil, nil, fmt.Errorf("segment %q: %s: %w", s.Name, EndpointRPC, err)
		}
		rpc = &RPCMeta{IPOrHostName: h, RPCPort: p}
	}
	if a, ok := s.Endpoints[TransportTCP]; ok {
		h, p, err := splitEndpoint(a)
		if err != nil {
			return nil, nil, fmt.Errorf("segment %q: %s: %w", s.Name, TransportTCP, err)
		}
		switch {
		case rpc == nil:
			rpc = &RPCMeta{IPOrHostName: h}
		case rpc.IPOrHostName != h:
			return nil, nil, fmt.Errorf("%w: segment %q: the TCP host %q is not the RPC host %q (Mooncake takes both from one entry)",
				segtable.ErrBadDesc, s.Name, h, rpc.IPOrHostName)
		}
		d.TCPDataPort = int(p)
	}
	if v, ok := s.Endpoints[EndpointTCPVersion]; ok {
		n, err := strconv.ParseUint(v, 10, 16)
		if err != nil || n == 0 {
			return nil, nil, fmt.Errorf("%w: segment %q: %s %q", segtable.ErrBadDesc, s.Name, EndpointTCPVersion, v)
		}
		d.TCPProtoVersion = int(n)
	}
	nics, rdma := s.Endpoints[EndpointRDMANICs]
	ownMatrix := false // the descriptor's matrix, not the default
	if rdma {
		d.Protocol = ProtoRDMA
		if d.Devices, err = parseNICs(nics); err != nil {
			return nil, nil, fmt.Errorf("segment %q: %w", s.Name, err)
		}
		d.RDMAServerName = s.Endpoints[EndpointRDMAServer]
		m, err := ParseNICMatrix(s.Endpoints[EndpointRDMAMatrix], len(d.Devices))
		if err != nil {
			return nil, nil, fmt.Errorf("segment %q: %s: %w", s.Name, EndpointRDMAMatrix, err)
		}
		if ownMatrix = len(m.FirstTries()) > 0; ownMatrix { // else it names no NIC: Mooncake could reach nothing
			d.PriorityMatrix = m.topology(d.Devices)
		} else {
			d.PriorityMatrix = map[string]TopologyEntry{}
		}
	}
	for _, b := range s.AllBuffers() { // an engine's own may come Chunked
		mb := Buffer{Name: s.Name, Addr: b.Addr, Length: b.Length, DeviceID: -1}
		if rdma {
			mb.Name = b.Location
			if mb.Name == "" {
				mb.Name = DefaultLocation
			}
			if k, ok := b.Keys[TransportRDMA]; ok {
				if mb.RKey, err = parseRKeys(k, len(d.Devices)); err != nil {
					return nil, nil, fmt.Errorf("segment %q: buffer %#x: %w", s.Name, b.Addr, err)
				}
				mb.LKey = slices.Clone(mb.RKey)
			}
			if _, ok := d.PriorityMatrix[mb.Name]; !ok && !ownMatrix {
				all := make([]string, len(d.Devices))
				for i, dev := range d.Devices {
					all[i] = dev.Name
				}
				d.PriorityMatrix[mb.Name] = TopologyEntry{Preferred: all, Available: []string{}}
			}
		}
		d.Buffers = append(d.Buffers, mb)
	}
	// What we publish must be what Mooncake reads back.
	enc, err := d.Encode()
	if err == nil {
		_, err = Decode(enc)
	}
	if err != nil {
		return nil, nil, fmt.Errorf("segment %q: not publishable to Mooncake: %w", s.Name, err)
	}
	return d, rpc, nil
}

func splitEndpoint(a string) (string, uint16, error) {
	h, p, err := net.SplitHostPort(a)
	if err != nil {
		return "", 0, fmt.Errorf("%w: %v", segtable.ErrBadDesc, err)
	}
	n, err := strconv.ParseUint(p, 10, 16)
	if err != nil || h == "" {
		return "", 0, fmt.Errorf("%w: endpoint %q", segtable.ErrBadDesc, a)
	}
	return h, uint16(n), nil
}

// parseNICs reads the value of EndpointRDMANICs.
func parseNICs(v string) ([]Device, error) {
	if v == "" {
		return nil, nil
	}
	parts := strings.Split(v, ",")
	if len(parts) > MaxDevices {
		return nil, fmt.Errorf("%w: %d NICs", segtable.ErrBadDesc, len(parts))
	}
	devs := make([]Device, len(parts))
	for i, p := range parts {
		f := strings.SplitN(p, "/", 3)
		if len(f) != 3 || f[0] == "" || f[2] == "" {
			return nil, fmt.Errorf("%w: NIC %q is not name/lid/gid", segtable.ErrBadDesc, p)
		}
		lid, err := strconv.ParseUint(f[1], 10, 16)
		if err != nil {
			return nil, fmt.Errorf("%w: NIC %q: lid", segtable.ErrBadDesc, p)
		}
		devs[i] = Device{Name: f[0], LID: uint16(lid), GID: f[2]}
	}
	return devs, nil
}

// parseRKeys reads a buffer's Keys[TransportRDMA]: n decimal keys.
func parseRKeys(v string, n int) ([]uint64, error) {
	parts := strings.Split(v, ",")
	if len(parts) != n {
		return nil, fmt.Errorf("%w: %d rkeys for %d NICs", segtable.ErrBadDesc, len(parts), n)
	}
	keys := make([]uint64, n)
	for i, p := range parts {
		k, err := strconv.ParseUint(p, 10, 32)
		if err != nil {
			return nil, fmt.Errorf("%w: rkey %q", segtable.ErrBadDesc, p)
		}
		keys[i] = k
	}
	return keys, nil
}
