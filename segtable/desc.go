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
// A SegmentDesc is a plain value; it is not safe for concurrent mutation.
// Stores hand out copies: flat ones whole (Clone), Chunked ones as a
// header of their own that shares the immutable chunks (CloneShared).
type SegmentDesc struct {
	Version int    `json:"version"`
	Name    string `json:"name"`
	// Epoch identifies the engine instance; a restarted engine publishes a
	// new epoch, which invalidates what peers cached.
	Epoch uint64 `json:"epoch"`
	// Endpoints maps a transport name to the address peers dial for it.
	Endpoints map[string]string `json:"endpoints"`
	// Rev counts the publisher's republishes within the epoch; a signed
	// descriptor (see Signer) carries one of at least 1, and readers refuse
	// one older than a Rev they accepted (a rollback within the epoch).
	Rev uint64 `json:"rev,omitempty"`
	// Buffers are the remote-accessible buffers, sorted by Addr, not
	// overlapping; nil when Chunked holds them.
	Buffers []BufferDesc `json:"buffers"`
	// Chunks partitions a signed descriptor's Buffers into the chunks its
	// signature covers, in order (see Signer); nil when unsigned or when
	// Chunked holds the buffers.
	Chunks []ChunkInfo `json:"chunks,omitempty"`
	// Chunked, when set, holds the buffers instead of Buffers and Chunks
	// (both then nil): the publisher's copy-on-write list (ChunkList),
	// shared by pointer with the descriptors published before, so that a
	// republish copies and signs one chunk, not every buffer. It is what
	// a publisher hands a store; the in-process store keeps it by pointer
	// and hands it out shared (CloneShared: readers must not modify what
	// it holds, the Keys maps included), networked stores flat, and JSON
	// encodes it as Buffers and Chunks.
	Chunked *BufferChunks `json:"-"`
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
// sorted by address, non-empty and not overlapping, no address overflow,
// and Chunks, when set, partitioning Buffers. A Chunked descriptor's
// buffers are valid by construction (ChunkList checks each change), so
// Validate costs it O(1).
func (d *SegmentDesc) Validate() error {
	if d.Version < 1 || d.Version > DescVersion {
		return fmt.Errorf("%w: version %d", ErrBadDesc, d.Version)
	}
	if d.Name == "" {
		return fmt.Errorf("%w: empty name", ErrBadDesc)
	}
	if d.Chunked != nil {
		if d.Buffers != nil || d.Chunks != nil {
			return fmt.Errorf("%w: both Chunked and Buffers or Chunks", ErrBadDesc)
		}
		return nil
	}
	if err := checkRun(d.Buffers, 0, false); err != nil {
		return err
	}
	if d.Chunks != nil {
		n := 0
		for i, c := range d.Chunks {
			if c.N < 1 || c.N > len(d.Buffers)-n {
				return fmt.Errorf("%w: chunk %d of %d buffers, %d left", ErrBadDesc, i, c.N, len(d.Buffers)-n)
			}
			n += c.N
		}
		if n != len(d.Buffers) {
			return fmt.Errorf("%w: chunks of %d buffers, not %d", ErrBadDesc, n, len(d.Buffers))
		}
	}
	return nil
}

// Marshal encodes the descriptor as JSON.
func (d *SegmentDesc) Marshal() ([]byte, error) { return json.Marshal(d) }

// plainDesc is SegmentDesc without its methods, for MarshalJSON.
type plainDesc SegmentDesc

// MarshalJSON encodes the descriptor; a Chunked one as its Buffers and,
// when signed, Chunks, so that every reader decodes a flat list.
func (d SegmentDesc) MarshalJSON() ([]byte, error) {
	if d.Chunked != nil {
		d.Buffers = d.Chunked.Buffers()
		if d.Chunked.signed {
			d.Chunks = d.Chunked.infos()
		}
		d.Chunked = nil
	}
	return json.Marshal((*plainDesc)(&d))
}

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

// Clone returns a deep copy of the descriptor. The copy of a Chunked
// descriptor is flat: its Buffers (and Chunks, when signed) are the
// chunks', with maps of its own.
func (d *SegmentDesc) Clone() *SegmentDesc {
	c := *d
	c.Endpoints = cloneMap(d.Endpoints)
	bufs := d.Buffers
	if d.Chunked != nil {
		bufs = d.Chunked.Buffers()
		if d.Chunked.signed {
			c.Chunks = d.Chunked.infos()
		}
		c.Chunked = nil
	} else {
		c.Chunks = append([]ChunkInfo(nil), d.Chunks...)
	}
	c.Buffers = make([]BufferDesc, len(bufs))
	for i, b := range bufs {
		b.Keys = cloneMap(b.Keys)
		c.Buffers[i] = b
	}
	c.Devices = append([]DeviceDesc(nil), d.Devices...)
	return &c
}

// CloneShared returns a copy of the descriptor that shares its Chunked
// list, which is immutable, by pointer: the header (endpoints, devices)
// is the copy's own, the buffers and their Keys maps are shared and must
// not be modified. It costs the header, whatever the number of buffers:
// what the in-process store hands each reader of a republish. A flat
// descriptor is copied whole (Clone).
func (d *SegmentDesc) CloneShared() *SegmentDesc {
	if d.Chunked == nil {
		return d.Clone()
	}
	c := *d
	c.Endpoints = cloneMap(d.Endpoints)
	c.Devices = append([]DeviceDesc(nil), d.Devices...)
	return &c
}

// NumBuffers returns the number of buffers, Chunked or flat.
func (d *SegmentDesc) NumBuffers() int {
	if d.Chunked != nil {
		return d.Chunked.Len()
	}
	return len(d.Buffers)
}

// AllBuffers returns the descriptor's buffers in address order: Buffers,
// or a new slice of a Chunked descriptor's (whose Keys maps are shared and
// must not be modified), O(n): the flat path of the transports that keep
// no per-chunk tables (efa, rdma, nvlink, mctcp).
func (d *SegmentDesc) AllBuffers() []BufferDesc {
	if d.Chunked != nil {
		return d.Chunked.Buffers()
	}
	return d.Buffers
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
