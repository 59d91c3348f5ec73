package rdma

import (
	"fmt"
	"net/netip"
	"strings"
)

// GIDType is the kind of a GID table entry.
type GIDType uint8

// GID types, as the kernel reports them.
const (
	GIDTypeIB GIDType = iota
	GIDTypeRoCEv1
	GIDTypeRoCEv2
)

func (t GIDType) String() string {
	switch t {
	case GIDTypeIB:
		return "IB"
	case GIDTypeRoCEv1:
		return "RoCEv1"
	case GIDTypeRoCEv2:
		return "RoCEv2"
	}
	return fmt.Sprintf("GIDType(%d)", uint8(t))
}

// GID is one entry of a port's GID table.
type GID struct {
	Index int
	Raw   [16]byte
	Type  GIDType
}

// Addr returns the GID as an IPv6 address (IPv4-mapped for RoCE over
// IPv4).
func (g GID) Addr() netip.Addr { return netip.AddrFrom16(g.Raw) }

func (g GID) String() string {
	return fmt.Sprintf("%d:%s(%s)", g.Index, g.Addr().Unmap(), g.Type)
}

// routability ranks a GID for the automatic choice: 0 is unusable.
func routability(g GID, ethernet bool) int {
	a := g.Addr()
	if g.Raw == ([16]byte{}) {
		return 0
	}
	if !ethernet {
		// InfiniBand: the port GID (index 0) is always right.
		if g.Type == GIDTypeIB {
			return 1
		}
		return 0
	}
	if g.Type != GIDTypeRoCEv2 {
		return 0 // RoCE v1 is not routable
	}
	switch {
	case a.Is4In6():
		u := a.Unmap()
		if u.IsLinkLocalUnicast() || u.IsUnspecified() {
			return 0
		}
		return 3
	case a.IsLinkLocalUnicast() || a.IsUnspecified() || a.IsLoopback():
		return 0 // fe80::: the anchors' "Failed to modify QP to RTR"
	default:
		return 2
	}
}

// ChooseGID picks the GID a port uses. With override set, the entry with
// that index, whatever its kind (an error when the table has none). Else,
// on Ethernet (RoCE), the RoCE v2 GID of an IPv4 address, then one of a
// global IPv6 address, lowest index first; link-local (fe80::) and RoCE v1
// GIDs are never chosen automatically. On InfiniBand, the lowest IB GID.
// It is pure logic, safe to call from anywhere.
func ChooseGID(table []GID, ethernet bool, override *int) (GID, error) {
	if override != nil {
		for _, g := range table {
			if g.Index == *override && g.Raw != ([16]byte{}) {
				return g, nil
			}
		}
		return GID{}, fmt.Errorf("%w: GID index %d is not in the table (%s)", ErrNoGID, *override, describe(table))
	}
	best, rank := -1, 0
	for i, g := range table {
		r := routability(g, ethernet)
		if r > rank || (r == rank && r > 0 && g.Index < table[best].Index) {
			best, rank = i, r
		}
	}
	if best < 0 {
		return GID{}, fmt.Errorf("%w: no routable RoCE v2 or IB GID (table: %s); set Config.GIDIndex to force one", ErrNoGID, describe(table))
	}
	return table[best], nil
}

func describe(table []GID) string {
	if len(table) == 0 {
		return "empty"
	}
	s := make([]string, len(table))
	for i, g := range table {
		s[i] = g.String()
	}
	return strings.Join(s, " ")
}
