package mooncake

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/moonring/moonring/segtable"
)

func addGoldens(f *testing.F) {
	files, _ := filepath.Glob("testdata/*.json")
	for _, p := range files {
		if b, err := os.ReadFile(p); err == nil {
			f.Add(b)
		}
	}
}

// FuzzDecode: Decode never panics; what it accepts encodes, decodes again
// and encodes to the same bytes, and converts to moonring's form or fails
// with a typed error.
func FuzzDecode(f *testing.F) {
	addGoldens(f)
	f.Add([]byte(`{"name":"n","protocol":["tcp","rdma"],"devices":[{"name":"d","gid":"g"}],"buffers":[{"name":"x","addr":1,"length":1,"protocol":"rdma","rkey":[1],"lkey":[1]}]}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		d, err := Decode(b)
		if err != nil {
			if !errors.Is(err, ErrBadDoc) {
				t.Fatalf("untyped error %v", err)
			}
			return
		}
		enc, err := d.Encode()
		if err != nil {
			t.Fatalf("accepted but does not encode: %v", err)
		}
		d2, err := Decode(enc)
		if err != nil {
			t.Fatalf("our encoding %s is refused: %v", enc, err)
		}
		enc2, err := d2.Encode()
		if err != nil || !bytes.Equal(enc, enc2) {
			t.Fatalf("encoding not stable:\n%s\n%s (%v)", enc, enc2, err)
		}
		s, err := ToSegtable(d, nil)
		if err != nil {
			return
		}
		if err := s.Validate(); err != nil {
			t.Fatalf("converted to an invalid descriptor: %v", err)
		}
		if v, ok := s.Endpoints[EndpointRDMAMatrix]; ok && d.Moonring == nil { // (an extension's is the publisher's)
			if m, err := ParseNICMatrix(v, len(s.Devices)); err != nil || len(m) == 0 {
				t.Fatalf("converted to a matrix %q that does not parse: %v", v, err)
			}
		}
	})
}

// FuzzNICMatrix: ParseNICMatrix never panics, refuses with a typed error,
// and what it accepts is within its bounds and reads back the same from
// its text form; Row and FirstTries name only NICs below the count.
func FuzzNICMatrix(f *testing.F) {
	f.Add("cpu:0=0/1;cuda:0=1/", 2)
	f.Add("segments:4096:0,1=0,1/;*=/", 2)
	f.Add("a=0/;a=0/", 1)
	f.Fuzz(func(t *testing.T, v string, nics int) {
		nics = int(uint(nics) % (MaxDevices + 1))
		m, err := ParseNICMatrix(v, nics)
		if err != nil {
			if !errors.Is(err, segtable.ErrBadDesc) {
				t.Fatalf("untyped error %v", err)
			}
			return
		}
		if len(m) > MaxMatrix {
			t.Fatalf("%d rows", len(m))
		}
		back, err := ParseNICMatrix(m.String(), nics)
		if err != nil || !reflect.DeepEqual(back, m) {
			t.Fatalf("%q -> %q -> %v, %v", v, m.String(), back, err)
		}
		for _, loc := range []string{"cpu:0", "*", "x"} {
			r := m.Row(loc)
			for _, n := range append(r.Preferred, r.Available...) {
				if n < 0 || n >= nics {
					t.Fatalf("Row(%q) names NIC %d of %d", loc, n, nics)
				}
			}
		}
		for _, n := range m.FirstTries() {
			if n < 0 || n >= nics {
				t.Fatalf("FirstTries names NIC %d of %d", n, nics)
			}
		}
	})
}

func FuzzDecodeRPCMeta(f *testing.F) {
	f.Add([]byte(`{"ip_or_host_name":"10.0.0.1","rpc_port":12345}`))
	f.Add([]byte(`{"ip_or_host_name":"h","rpc_port":65535,"x":[]}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := DecodeRPCMeta(b)
		if err != nil {
			return
		}
		enc, _ := r.Encode()
		r2, err := DecodeRPCMeta(enc)
		if err != nil || *r2 != *r {
			t.Fatalf("round trip %+v -> %s -> %+v, %v", r, enc, r2, err)
		}
	})
}

// FuzzFrame: ParseFrame and ReadFrame agree on any input; a parsed frame
// encodes back to the bytes it came from; the documents of each type
// decode without panic.
func FuzzFrame(f *testing.F) {
	for _, t := range []FrameType{FrameConnection, FrameMetadata, FrameNotify, FrameProbe, FrameOld} {
		f.Add(AppendFrame(nil, t, []byte(`{"name":"a","notify_msg":"m","qp_num":[1]}`+"\n")))
	}
	f.Add([]byte{0, 0, 0, 0, 0, 0, 0, 0})
	f.Add([]byte{1, 0, 0, 0, 0, 0, 0, 0, 0x80})
	f.Fuzz(func(t *testing.T, b []byte) {
		const max = 4096
		fr, n, err := ParseFrame(b, max)
		fr2, err2 := ReadFrame(bytes.NewReader(b), max)
		if (err == nil) != (err2 == nil) {
			t.Fatalf("ParseFrame %v, ReadFrame %v", err, err2)
		}
		if err != nil {
			return
		}
		if fr.Type != fr2.Type || !bytes.Equal(fr.Body, fr2.Body) {
			t.Fatalf("ParseFrame %v %q, ReadFrame %v %q", fr.Type, fr.Body, fr2.Type, fr2.Body)
		}
		if enc := AppendFrame(nil, fr.Type, fr.Body); !bytes.Equal(enc, b[:n]) {
			t.Fatalf("re-encoded %x, read %x", enc, b[:n])
		}
		switch fr.Type {
		case FrameConnection, FrameOld:
			DecodeHandshake(fr.Body)
		case FrameMetadata:
			Decode(fr.Body)
		case FrameNotify:
			DecodeNotify(fr.Body)
		case FrameProbe:
			DecodeProbeReply(fr.Body)
		}
	})
}

// FuzzFrameDocuments: the documents of the RPC port decode without panic,
// and what they accept round-trips.
func FuzzFrameDocuments(f *testing.F) {
	for _, p := range []string{"handshake.json", "handshake-refused.json", "notify.json", "notify-reply.json", "probe-reply.json"} {
		if b, err := os.ReadFile("testdata/" + p); err == nil {
			f.Add(b)
		}
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		if h, err := DecodeHandshake(b); err == nil {
			enc, err := h.Encode()
			if err != nil {
				t.Fatal(err)
			}
			h2, err := DecodeHandshake(enc)
			if err != nil || h2.LocalLID != h.LocalLID || len(h2.QPNums) != len(h.QPNums) || h2.ReplyMsg != h.ReplyMsg ||
				h2.ReadyAck != h.ReadyAck || h2.LocalNICPath != h.LocalNICPath {
				t.Fatalf("handshake round trip %+v -> %s -> %+v, %v", h, enc, h2, err)
			}
		} else if !errors.Is(err, ErrBadFrame) {
			t.Fatalf("untyped error %v", err)
		}
		if n, err := DecodeNotify(b); err == nil {
			enc, _ := n.Encode()
			if n2, err := DecodeNotify(enc); err != nil || *n2 != *n {
				t.Fatalf("notify round trip %+v -> %s -> %+v, %v", n, enc, n2, err)
			}
		}
		DecodeProbeReply(b)
	})
}
