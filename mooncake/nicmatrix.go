// nicmatrix.go holds the priority matrix in moonring's form of a Mooncake
// segment (Endpoints[EndpointRDMAMatrix]): per buffer location, the NICs
// its peers pick from, by index into the segment's NIC list, and the rule
// by which Mooncake's RDMA transport picks from them (NICMatrix.Row,
// SegmentsLocations). FORMATS.md, "Moonring's form", says the same.

package mooncake

import (
	"fmt"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/moonring/moonring/segtable"
)

// Bounds of a NICMatrix, beside MaxMatrix locations and MaxDevices NICs
// per list.
const (
	// MaxMatrixLocation bounds the bytes of a location name.
	MaxMatrixLocation = 256
	// MaxMatrixBytes bounds the encoded matrix (EndpointRDMAMatrix).
	MaxMatrixBytes = 256 << 10
)

// WildcardLocation is the location Mooncake gives memory of no known
// place; its row is every NIC the matrix names (NICMatrix.Row).
const WildcardLocation = "*"

// segmentsPrefix starts a location that spreads a buffer over NUMA nodes
// (SegmentsLocations).
const segmentsPrefix = "segments:"

// NICRow is one location's row of a NICMatrix: the NICs preferred for it
// and those also usable, as indices into the segment's NIC list, each NIC
// at most once in the row (in Preferred when it is in both).
type NICRow struct {
	Preferred, Available []int
}

// NICMatrix is a Mooncake segment's priority matrix with its NICs named by
// index into the segment's devices (EndpointRDMANICs' order): what an RDMA
// initiator needs to pick the peer's NIC for a buffer's location. nil or
// empty: the segment published none (every NIC serves every location).
//
// Its text form (String, ParseNICMatrix) is the value of
// [EndpointRDMAMatrix]: rows "location=preferred/available", each list
// comma-separated decimal indices, joined by ';' in location order, e.g.
// "cpu:0=0/1;cuda:0=1/". A location is 1 to MaxMatrixLocation bytes
// without ';' or '='.
//
// A NICMatrix is a value: read it from any goroutine, never change one
// that others may read.
type NICMatrix map[string]NICRow

// Row returns the row Mooncake's RDMA transport picks a peer's NIC from for
// memory at loc (topology.cpp, Topology::selectDevice and resolve; the
// transport's selectDevice falls back to the wildcard): loc's own row when
// it names a NIC, else (no row, an empty one, or loc "*") the wildcard row,
// every NIC the matrix names, all preferred, in index order. Mooncake
// picks the first try among Preferred (Available when Preferred is empty)
// and cycles through both on retries. An empty matrix gives an empty row.
func (m NICMatrix) Row(loc string) NICRow {
	if r, ok := m[loc]; ok && loc != WildcardLocation && len(r.Preferred)+len(r.Available) > 0 {
		return r
	}
	var all []int
	for _, r := range m {
		all = append(all, r.Preferred...)
		all = append(all, r.Available...)
	}
	slices.Sort(all)
	return NICRow{Preferred: slices.Compact(all)}
}

// FirstTries returns the NICs some location tries first (its Preferred, or
// its Available when it prefers none), in index order: the NICs an
// initiator should have a path to.
func (m NICMatrix) FirstTries() []int {
	var out []int
	for _, r := range m {
		if len(r.Preferred) > 0 {
			out = append(out, r.Preferred...)
		} else {
			out = append(out, r.Available...)
		}
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// String returns the matrix's text form (see NICMatrix): "" when empty.
func (m NICMatrix) String() string {
	locs := make([]string, 0, len(m))
	for l := range m {
		locs = append(locs, l)
	}
	sort.Strings(locs)
	var b strings.Builder
	list := func(l []int) {
		for i, n := range l {
			if i > 0 {
				b.WriteByte(',')
			}
			b.WriteString(strconv.Itoa(n))
		}
	}
	for i, l := range locs {
		if i > 0 {
			b.WriteByte(';')
		}
		b.WriteString(l)
		b.WriteByte('=')
		list(m[l].Preferred)
		b.WriteByte('/')
		list(m[l].Available)
	}
	return b.String()
}

// ParseNICMatrix reads the text form of a matrix (see NICMatrix) over a
// segment of nics NICs. It refuses, with an error wrapping
// segtable.ErrBadDesc: more than MaxMatrixBytes, more than MaxMatrix rows,
// a location repeated or not 1 to MaxMatrixLocation bytes, an index not
// below nics, a NIC twice in a row. "" is the empty matrix (nil).
func ParseNICMatrix(v string, nics int) (NICMatrix, error) {
	if v == "" {
		return nil, nil
	}
	if len(v) > MaxMatrixBytes {
		return nil, fmt.Errorf("%w: NIC matrix of %d bytes, more than %d", segtable.ErrBadDesc, len(v), MaxMatrixBytes)
	}
	if n := strings.Count(v, ";") + 1; n > MaxMatrix {
		return nil, fmt.Errorf("%w: NIC matrix of %d rows, more than %d", segtable.ErrBadDesc, n, MaxMatrix)
	}
	m := NICMatrix{}
	for row := range strings.SplitSeq(v, ";") {
		loc, lists, ok := strings.Cut(row, "=")
		if !ok || checkLocation(loc) != nil {
			return nil, fmt.Errorf("%w: NIC matrix row %.100q", segtable.ErrBadDesc, row)
		}
		if _, dup := m[loc]; dup {
			return nil, fmt.Errorf("%w: NIC matrix location %.100q twice", segtable.ErrBadDesc, loc)
		}
		p, a, ok := strings.Cut(lists, "/")
		if !ok {
			return nil, fmt.Errorf("%w: NIC matrix row %.100q is not location=preferred/available", segtable.ErrBadDesc, row)
		}
		var r NICRow
		var err error
		if r.Preferred, err = parseIndices(p, nics, nil); err == nil {
			r.Available, err = parseIndices(a, nics, r.Preferred)
		}
		if err != nil {
			return nil, fmt.Errorf("%w: NIC matrix row %.100q: %v", segtable.ErrBadDesc, row, err)
		}
		m[loc] = r
	}
	return m, nil
}

// parseIndices reads a comma-separated list of NIC indices below nics,
// none twice and none in seen.
func parseIndices(s string, nics int, seen []int) ([]int, error) {
	out := []int{}
	if s == "" {
		return out, nil
	}
	for f := range strings.SplitSeq(s, ",") {
		n, err := strconv.ParseUint(f, 10, 16)
		if err != nil || int(n) >= nics {
			return nil, fmt.Errorf("NIC %.20q of %d", f, nics)
		}
		if slices.Contains(out, int(n)) || slices.Contains(seen, int(n)) {
			return nil, fmt.Errorf("NIC %d twice", n)
		}
		out = append(out, int(n))
	}
	return out, nil
}

// checkLocation refuses a location name the text form cannot carry.
func checkLocation(loc string) error {
	if loc == "" || len(loc) > MaxMatrixLocation || strings.ContainsAny(loc, ";=") {
		return fmt.Errorf("location %.100q: want 1 to %d bytes without ';' or '='", loc, MaxMatrixLocation)
	}
	return nil
}

// nicMatrix converts a descriptor's priority matrix to a NICMatrix: each
// NIC name looked up in d.Devices. Mooncake's reader instead numbers the
// NICs in the order it first meets them in the matrix and uses that number
// as the index into devices, which agrees with devices only while both
// sides walk the matrix alike; a name not among the devices (Mooncake
// would index another device, or none) is dropped here, as is a NIC
// repeated in a row. Rows left empty are dropped (Mooncake treats them as
// absent). A location the text form cannot carry, or a matrix over its
// bounds, fails with ErrBadDoc.
func nicMatrix(d *SegmentDesc) (NICMatrix, error) {
	idx := make(map[string]int, len(d.Devices))
	for i, dev := range d.Devices {
		if _, dup := idx[dev.Name]; !dup {
			idx[dev.Name] = i
		}
	}
	m := NICMatrix{}
	for loc, e := range d.PriorityMatrix {
		if err := checkLocation(loc); err != nil {
			return nil, fmt.Errorf("%w: priority matrix: %v", ErrBadDoc, err)
		}
		var r NICRow
		for _, n := range e.Preferred {
			if i, ok := idx[n]; ok && !slices.Contains(r.Preferred, i) {
				r.Preferred = append(r.Preferred, i)
			}
		}
		for _, n := range e.Available {
			if i, ok := idx[n]; ok && !slices.Contains(r.Preferred, i) && !slices.Contains(r.Available, i) {
				r.Available = append(r.Available, i)
			}
		}
		if len(r.Preferred)+len(r.Available) > 0 {
			r.Preferred, r.Available = nonNilInts(r.Preferred), nonNilInts(r.Available)
			m[loc] = r
		}
	}
	if len(m) == 0 {
		return nil, nil
	}
	if n := len(m.String()); n > MaxMatrixBytes {
		return nil, fmt.Errorf("%w: priority matrix of %d bytes in moonring's form, more than %d", ErrBadDoc, n, MaxMatrixBytes)
	}
	return m, nil
}

func nonNilInts(s []int) []int {
	if s == nil {
		return []int{}
	}
	return s
}

// topology converts m back to a Mooncake priority matrix over devs.
func (m NICMatrix) topology(devs []Device) map[string]TopologyEntry {
	names := func(l []int) []string {
		out := make([]string, len(l))
		for i, n := range l {
			out[i] = devs[n].Name
		}
		return out
	}
	t := make(map[string]TopologyEntry, len(m))
	for loc, r := range m {
		t[loc] = TopologyEntry{Preferred: names(r.Preferred), Available: names(r.Available)}
	}
	return t
}

// SegmentsLocations returns, for a buffer location that spreads the
// buffer over NUMA nodes ("segments:<page size>:<n0>,<n1>,...", as
// Mooncake's store registers its segments; memory_location.cpp), the
// location of each of its equal parts ("cpu:<n0>", "cpu:<n1>", ...), in
// order: Mooncake picks a NIC for the bytes at offset o of a buffer of
// length l from the row of part o/(l/parts) (the last part takes the
// tail; when l/parts is 0, from the wildcard row). nil for any other
// location, and for one that does not parse (read more strictly than
// Mooncake: decimal numbers only).
func SegmentsLocations(loc string) []string {
	body, ok := strings.CutPrefix(loc, segmentsPrefix)
	if !ok {
		return nil
	}
	page, nodes, ok := strings.Cut(body, ":")
	if _, err := strconv.ParseUint(page, 10, 64); !ok || err != nil {
		return nil
	}
	var out []string
	for f := range strings.SplitSeq(nodes, ",") {
		if f == "" {
			continue // Mooncake skips empty entries
		}
		n, err := strconv.Atoi(f)
		if err != nil {
			return nil
		}
		out = append(out, "cpu:"+strconv.Itoa(n))
	}
	return out
}
