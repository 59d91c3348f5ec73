package chunkwire

import (
	"encoding/json"
	"errors"
	"fmt"
	"testing"

	"github.com/moonring/moonring/segtable"
)

// chunked returns a Chunked descriptor of n buffers of 4 KiB.
func chunked(t *testing.T, n int) *segtable.SegmentDesc {
	t.Helper()
	var l segtable.ChunkList
	for i := range n {
		if err := l.Insert(segtable.BufferDesc{Addr: uint64(1+i) << 16, Length: 4096, Keys: map[string]string{"tcp": fmt.Sprint(i)}}); err != nil {
			t.Fatal(err)
		}
	}
	return &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "seg", Epoch: 3, Endpoints: map[string]string{"tcp": "127.0.0.1:1"}, Chunked: l.Chunks()}
}

// TestRoundTrip: a descriptor's header and chunks, encoded, parsed,
// decoded and assembled, are the flat descriptor, byte for byte.
func TestRoundTrip(t *testing.T) {
	d := chunked(t, 100)
	h := NewHeader(d)
	held := map[uint64]Held{}
	var err error
	d.Chunked.EachChunk(func(info segtable.ChunkInfo, bufs []segtable.BufferDesc) bool {
		var v []byte
		if v, err = Encode(bufs); err != nil {
			return false
		}
		c := Chunk{Seq: info.Seq, N: info.N, Sum: Sum(v)}
		h.Chunks = append(h.Chunks, c)
		var hc Held
		if hc, err = DecodeListed(c, v); err != nil {
			return false
		}
		if !hc.Matches(c) {
			err = fmt.Errorf("chunk %d does not match its listing", c.Seq)
			return false
		}
		held[c.Seq] = hc
		return true
	})
	if err != nil {
		t.Fatal(err)
	}
	body, err := json.Marshal(&h)
	if err != nil {
		t.Fatal(err)
	}
	if !IsHeader(body) {
		t.Fatalf("not a header: %.60s", body)
	}
	p, err := ParseHeader("seg", body)
	if err != nil {
		t.Fatal(err)
	}
	got, err := Assemble(p, func(seq uint64) Held { return held[seq] }, true)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := json.Marshal(d)
	gotB, _ := json.Marshal(got)
	if string(want) != string(gotB) {
		t.Fatalf("assembled:\n%s\nwant:\n%s", gotB, want)
	}
	flat, _ := json.Marshal(d)
	if IsHeader(flat) {
		t.Fatal("a whole descriptor taken for a header")
	}
}

// TestRefused: headers and chunks that a reader must not take.
func TestRefused(t *testing.T) {
	d := chunked(t, 1)
	h := NewHeader(d)
	h.Chunks = []Chunk{{Seq: 1, N: 1}}
	ok, _ := json.Marshal(&h)
	if _, err := ParseHeader("seg", ok); err != nil {
		t.Fatal(err)
	}
	for name, f := range map[string]func(h *Header){
		"another segment's": func(h *Header) { h.Desc.Name = "other" },
		"another layout":    func(h *Header) { h.Layout = "moonring-chunks/0" },
		"buffers inline":    func(h *Header) { h.Desc.Buffers = []segtable.BufferDesc{{Addr: 1 << 16, Length: 1}} },
		"an empty chunk":    func(h *Header) { h.Chunks[0].N = 0 },
		"a chunk too large": func(h *Header) { h.Chunks[0].N = MaxChunkBuffers + 1 },
		"too many chunks":   func(h *Header) { h.Chunks = make([]Chunk, MaxChunks+1) },
	} {
		c := NewHeader(d)
		c.Chunks = []Chunk{{Seq: 1, N: 1}}
		f(&c)
		b, _ := json.Marshal(&c)
		if _, err := ParseHeader("seg", b); !errors.Is(err, segtable.ErrBadDesc) {
			t.Errorf("%s: %v; want ErrBadDesc", name, err)
		}
	}
	v, _ := Encode([]segtable.BufferDesc{{Addr: 1 << 16, Length: 4096}})
	if _, err := DecodeListed(Chunk{Seq: 1, N: 1, Sum: Sum(v) + 1}, v); !errors.Is(err, segtable.ErrBadDesc) {
		t.Errorf("a chunk of another sum: %v", err)
	}
	if _, err := DecodeListed(Chunk{Seq: 1, N: 2, Sum: Sum(v)}, v); !errors.Is(err, segtable.ErrBadDesc) {
		t.Errorf("a chunk of another count: %v", err)
	}
	bad, _ := json.Marshal([]segtable.BufferDesc{{Addr: 2 << 16, Length: 4096}, {Addr: 1 << 16, Length: 4096}})
	if _, err := Decode(bad); !errors.Is(err, segtable.ErrBadDesc) {
		t.Errorf("a chunk out of order: %v", err)
	}
}
