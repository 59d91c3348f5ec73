// mooncake_nics.go holds Mooncake mode's choice of the peer's NIC, in every
// build (its tests run without a device), from the peer's priority matrix
// (mooncake.NICMatrix, Endpoints["mooncake-rdma.matrix"]): the peer NIC
// each local device's rails connect to (mcPair), and per remote buffer the
// local devices whose rails reach no NIC the matrix picks for the buffer's
// location (nicPick), which the choice of rail avoids (chooser.choose).

package rdma

import (
	"slices"

	"github.com/moonring/moonring/mooncake"
)

// mcPair returns the peer NIC of each of nlocal local devices' rails, for a
// peer of npeer NICs (npeer > 0) whose priority matrix is m. Every NIC
// some location of m tries first (m.FirstTries) should have a rail: local
// device i takes the peer's NIC i when it is one of them (on a
// rail-optimized fabric NIC i of every host shares a switch), the other
// devices in order take those no device reaches yet, then those NICs in
// turn. Without a matrix (or one naming no NIC) device i takes NIC i
// modulo npeer, as outside Mooncake mode.
func mcPair(nlocal, npeer int, m mooncake.NICMatrix) []int {
	rdev := make([]int, nlocal)
	first := m.FirstTries()
	if len(first) == 0 {
		for li := range rdev {
			rdev[li] = li % npeer
		}
		return rdev
	}
	reached := make([]bool, npeer)
	var rest []int
	for li := range rdev {
		if li < npeer && slices.Contains(first, li) {
			rdev[li], reached[li] = li, true
		} else {
			rest = append(rest, li)
		}
	}
	k := 0
	for _, li := range rest {
		r := -1
		for _, n := range first {
			if !reached[n] {
				r = n
				break
			}
		}
		if r < 0 {
			r = first[k%len(first)]
			k++
		}
		rdev[li], reached[r] = r, true
	}
	return rdev
}

// nicPick is where the slices of one remote buffer may go: the local
// devices (one bit per index) whose rails the choice of rail avoids, for
// the whole buffer or, for one spread over NUMA nodes, per part. The zero
// value avoids none. Set when the buffer is read (Open, Update), read by
// Post; never changed after.
type nicPick struct {
	avoid  uint64   // the whole buffer's, when avoids is nil
	part   uint64   // the bytes of each part (avoids non-nil)
	avoids []uint64 // each part's; the last one takes the tail
}

// at returns the devices to avoid for a slice at offset off of the buffer.
func (p *nicPick) at(off uint64) uint64 {
	if p.avoids == nil {
		return p.avoid
	}
	i := off / p.part
	if n := uint64(len(p.avoids)); i >= n {
		i = n - 1
	}
	return p.avoids[i]
}

// nicPicker makes the nicPicks of one peer's buffers, for its matrix and
// the pairing of local devices with its NICs (mcPair). Not safe for
// concurrent use; made and dropped by one setBuffers.
type nicPicker struct {
	m    mooncake.NICMatrix
	rdev []int             // the peer NIC of each local device
	memo map[string]uint64 // each location's devices to avoid
}

func newNICPicker(m mooncake.NICMatrix, rdev []int) *nicPicker {
	return &nicPicker{m: m, rdev: rdev, memo: map[string]uint64{}}
}

// pick returns the nicPick of a buffer of length bytes at loc ("" is
// mooncake.DefaultLocation, the location moonring publishes for it).
func (np *nicPicker) pick(loc string, length uint64) nicPick {
	if len(np.m) == 0 {
		return nicPick{}
	}
	if loc == "" {
		loc = mooncake.DefaultLocation
	}
	parts := mooncake.SegmentsLocations(loc)
	if parts == nil {
		return nicPick{avoid: np.avoid(loc)}
	}
	part := length / uint64(len(parts))
	if part == 0 {
		return nicPick{avoid: np.avoid(mooncake.WildcardLocation)}
	}
	avoids := make([]uint64, len(parts))
	same := true
	for i, l := range parts {
		avoids[i] = np.avoid(l)
		same = same && avoids[i] == avoids[0]
	}
	if same {
		return nicPick{avoid: avoids[0]}
	}
	return nicPick{part: part, avoids: avoids}
}

// avoid returns the local devices to avoid for memory at loc: those whose
// peer NIC is not among the NICs loc's row prefers (Mooncake's first try),
// or when no device reaches one of those, not among its available NICs
// (Mooncake's retries); none when no device reaches either (every rail
// then serves, a departure: Mooncake would use only the row's NICs).
func (np *nicPicker) avoid(loc string) uint64 {
	if v, ok := np.memo[loc]; ok {
		return v
	}
	row := np.m.Row(loc)
	var v uint64
	for _, tier := range [2][]int{row.Preferred, row.Available} {
		var on, all uint64
		for li, r := range np.rdev {
			all |= 1 << li
			if slices.Contains(tier, r) {
				on |= 1 << li
			}
		}
		if on != 0 {
			v = all &^ on
			break
		}
	}
	np.memo[loc] = v
	return v
}
