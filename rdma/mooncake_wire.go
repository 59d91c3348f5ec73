// mooncake_wire.go holds what Mooncake mode reads from and writes into
// descriptors, in every build (its tests run without a device): a Mooncake
// segment's RDMA endpoint (RPC port, NIC path server, NICs, priority
// matrix) and rkeys in moonring's form of Mooncake's descriptor
// (mooncake/FORMATS.md).

package rdma

import (
	"fmt"
	"net"
	"strconv"
	"strings"

	"github.com/moonring/moonring/mooncake"
	"github.com/moonring/moonring/segtable"
)

// mcPeer is what a Mooncake segment's descriptor says of its RDMA side.
type mcPeer struct {
	rpc    string   // its RPC port, where handshakes go
	server string   // the server part of its NIC paths
	devs   []string // its NICs' names, in descriptor order (the rkeys' order)
	// matrix is its priority matrix by NIC index (nil: none published),
	// from which mooncake_nics.go picks its NICs.
	matrix mooncake.NICMatrix
}

// maxMCDevices bounds the NICs of a Mooncake segment (its descriptor's
// bound, mooncake.MaxDevices).
const maxMCDevices = mooncake.MaxDevices

// parseMooncakePeer reads a Mooncake segment's RDMA endpoint from desc.
func parseMooncakePeer(desc *segtable.SegmentDesc) (mcPeer, error) {
	p := mcPeer{rpc: desc.Endpoints[MooncakeName], server: desc.Endpoints[mooncake.EndpointRDMAServer]}
	if p.server == "" {
		p.server = desc.Name
	}
	if h, _, err := net.SplitHostPort(p.rpc); err != nil || h == "" {
		return p, fmt.Errorf("rdma: segment %q: %s endpoint %.100q is not host:port", desc.Name, MooncakeName, p.rpc)
	}
	if p.server == "" || strings.Contains(p.server, "@") {
		return p, fmt.Errorf("rdma: segment %q: NIC path server %.100q", desc.Name, p.server)
	}
	nics := desc.Endpoints[mooncake.EndpointRDMANICs]
	if nics == "" {
		return p, fmt.Errorf("rdma: segment %q publishes no %s", desc.Name, mooncake.EndpointRDMANICs)
	}
	parts := strings.Split(nics, ",")
	if len(parts) > maxMCDevices {
		return p, fmt.Errorf("rdma: segment %q: %d NICs, more than %d", desc.Name, len(parts), maxMCDevices)
	}
	for _, n := range parts {
		f := strings.Split(n, "/")
		if len(f) != 3 || f[0] == "" || strings.Contains(f[0], "@") {
			return p, fmt.Errorf("rdma: segment %q: NIC %.100q is not name/lid/gid", desc.Name, n)
		}
		if _, err := strconv.ParseUint(f[1], 10, 16); err != nil {
			return p, fmt.Errorf("rdma: segment %q: NIC %.100q: LID", desc.Name, n)
		}
		if _, err := mooncake.ParseGID(f[2]); err != nil {
			return p, fmt.Errorf("rdma: segment %q: NIC %.100q: %w", desc.Name, n, err)
		}
		p.devs = append(p.devs, f[0])
	}
	m, err := mooncake.ParseNICMatrix(desc.Endpoints[mooncake.EndpointRDMAMatrix], len(p.devs))
	if err != nil {
		return p, fmt.Errorf("rdma: segment %q: %w", desc.Name, err)
	}
	p.matrix = m
	return p, nil
}

// formatMooncakeKey writes rkeys as Mooncake's descriptor carries them in
// moonring's form: decimal, comma-separated, in device order.
func formatMooncakeKey(rkeys []uint32) string {
	var b strings.Builder
	for i, k := range rkeys {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.FormatUint(uint64(k), 10))
	}
	return b.String()
}

// parseMooncakeKey undoes formatMooncakeKey for a peer with n NICs.
func parseMooncakeKey(s string, n int) ([]uint32, error) {
	if s == "" {
		return nil, fmt.Errorf("no rkey: the buffer is not remote-accessible")
	}
	parts := strings.Split(s, ",")
	if len(parts) != n {
		return nil, fmt.Errorf("key %.100q has %d rkeys for %d NICs", s, len(parts), n)
	}
	out := make([]uint32, n)
	for i, p := range parts {
		v, err := strconv.ParseUint(p, 10, 32)
		if err != nil {
			return nil, fmt.Errorf("key %.100q: %v", s, err)
		}
		out[i] = uint32(v)
	}
	return out, nil
}
