package segtable

import (
	"encoding/json"
	"errors"
	"fmt"
	"sort"
)

// DescVersion is the version of the SegmentDesc JSON encoding written by this
// code. A descriptor with a newer major version is refused by Validate.
const DescVersion = 1

// SegmentDesc describes one engine's remotely addressable space: its name, the
// epoch of the engine instance that published it, an endpoint per installed
// transport, and the buffers registered remote-accessible with the key each
// transport attached to them. It is what metadata stores hold, encoded as JSON.
//
// A SegmentDesc is a plain value; it is not safe for concurrent mutation, and
// stores hand out copies.
type SegmentDesc struct {
	Version int    `json:"version"`
	Name    string `json:"name"`
	// Epoch identifies the engine instance; a restarted engine publishes a
	// new epoch, which invalidates what peers cached.
	Epoch uint64 `json:"epoch"`
	// Endpoints maps a transport name to the address peers dial for it.
	Endpoints map[string]string `json:"endpoints"`
	// Buffers are the remote-accessible buffers, sorted by Addr, not overlapping.
	Buffers []BufferDesc `json:"buffers"`
	// Devices lists devices (NICs, GPUs) and their NUMA nodes; informative.
	Devices []DeviceDesc `json:"devices,omitempty"`
	// MAC authenticates the descriptor under the deployment's segment key
	// (see Signer); empty when the publisher has no key.
	MAC string `json:"mac,omitempty"`
}

// BufferDesc is one remote-accessible buffer in a SegmentDesc.
type BufferDesc struct {
	Addr     uint64 `json:"addr"`
	Length   uint64 `json:"length"`
	Location string `json:"location"`
	// Keys maps a transport name to the key that transport attached to the
	// buffer (an rkey, a capability); peers must present it.
	Keys map[string]string `json:"keys"`
	// MAC authenticates the buffer, bound to the segment's name and epoch
	// (see Signer); empty when the publisher has no key.
	MAC string `json:"mac,omitempty"`
}

// DeviceDesc names a device of the engine's host and its NUMA node.
type DeviceDesc struct {
	Name string `json:"name"`
	Kind string `json:"kind"`
	Node int    `json:"node"`
}

// ErrBadDesc reports a malformed segment descriptor; a retry does not help.
var ErrBadDesc = errors.New("segtable: malformed segment descriptor")

// Validate checks the descriptor's invariants: known version, a name, buffers
// sorted by address, non-empty and not overlapping, no address overflow.
func (d *SegmentDesc) Validate() error {
	if d.Version < 1 || d.Version > DescVersion {
		return fmt.Errorf("%w: version %d", ErrBadDesc, d.Version)
	}
	if d.Name == "" {
		return fmt.Errorf("%w: empty name", ErrBadDesc)
	}
	var end uint64
	for i, b := range d.Buffers {
		if b.Length == 0 || b.Addr+b.Length < b.Addr {
			return fmt.Errorf("%w: buffer %d has bad range [%#x, +%d)", ErrBadDesc, i, b.Addr, b.Length)
		}
		if i > 0 && b.Addr < end {
			return fmt.Errorf("%w: buffer %d overlaps or is out of order", ErrBadDesc, i)
		}
		end = b.Addr + b.Length
	}
	return nil
}

// Marshal encodes the descriptor as JSON.
func (d *SegmentDesc) Marshal() ([]byte, error) { return json.Marshal(d) }

// UnmarshalDesc decodes and validates a JSON descriptor.
func UnmarshalDesc(b []byte) (*SegmentDesc, error) {
	d := new(SegmentDesc)
	if err := json.Unmarshal(b, d); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrBadDesc, err)
	}
	sort.Slice(d.Buffers, func(i, j int) bool { return d.Buffers[i].Addr < d.Buffers[j].Addr })
	if err := d.Validate(); err != nil {
		return nil, err
	}
	return d, nil
}

// Clone returns a deep copy of the descriptor.
func (d *SegmentDesc) Clone() *SegmentDesc {
	c := *d
	c.Endpoints = cloneMap(d.Endpoints)
	c.Buffers = make([]BufferDesc, len(d.Buffers))
	for i, b := range d.Buffers {
		b.Keys = cloneMap(b.Keys)
		c.Buffers[i] = b
	}
	c.Devices = append([]DeviceDesc(nil), d.Devices...)
	return &c
}

func cloneMap(m map[string]string) map[string]string {
	if m == nil {
		return nil
	}
	c := make(map[string]string, len(m))
	for k, v := range m {
		c[k] = v
	}
	return c
}

// Find returns the index of the buffer that holds [addr, addr+length), or -1.
func (d *SegmentDesc) Find(addr, length uint64) int {
	// sort.Search by hand: this runs for every request.
	i, j := 0, len(d.Buffers)
	for i < j {
		h := int(uint(i+j) >> 1)
		if d.Buffers[h].Addr+d.Buffers[h].Length > addr {
			j = h
		} else {
			i = h + 1
		}
	}
	if i == len(d.Buffers) {
		return -1
	}
	b := d.Buffers[i]
	if addr < b.Addr || length > b.Length || addr-b.Addr > b.Length-length {
		return -1
	}
	return i
}
