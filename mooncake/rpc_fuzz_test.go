package mooncake

import (
	"bytes"
	"errors"
	"io"
	"testing"

	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

func rpcSeeds(f *testing.F) {
	for _, t := range []FrameType{FrameConnection, FrameMetadata, FrameNotify, FrameProbe, FrameOld} {
		f.Add(AppendFrame(nil, t, []byte(`{"name":"a:1","notify_msg":"m","qp_num":[1,2],"local_lid":3}`+"\n")))
		f.Add(AppendFrame(nil, t, []byte("null\n")))
		f.Add(AppendFrame(nil, t, []byte("{}")))
	}
	f.Add(AppendFrame(nil, FrameMetadata, readGolden(f, "rdma.json")))
	f.Add([]byte{1, 0, 0, 0, 0, 0, 0, 0, 0x80})
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 1})
}

// FuzzRPCServe: the daemon's handling of one connection's bytes never
// panics; it writes either nothing (a refused request) or exactly one
// frame of the request's type, whose document is the one the type calls
// for.
func FuzzRPCServe(f *testing.F) {
	rpcSeeds(f)
	d := publishable()
	s := &RPCServer{max: 4096, desc: func() *segtable.SegmentDesc { return d }}
	s.SetNotify(func(n *transport.Notification) error {
		if len(n.Msg) > 8 {
			return transport.ErrNotifyFull
		}
		return nil
	})
	f.Fuzz(func(t *testing.T, b []byte) {
		var w bytes.Buffer
		typ, err := s.exchange(bytes.NewReader(b), &w)
		if err != nil {
			if w.Len() != 0 {
				t.Fatalf("refused (%v) but wrote %q", err, w.Bytes())
			}
			return
		}
		fr, n, perr := ParseFrame(w.Bytes(), MaxFrameLimit)
		if perr != nil || n != w.Len() || fr.Type != typ {
			t.Fatalf("answer %q to a %v request: %v", w.Bytes(), typ, perr)
		}
		switch typ {
		case FrameMetadata:
			if md, err := Decode(fr.Body); err != nil || md.Name != d.Name {
				t.Fatalf("metadata answer %v", err)
			}
		case FrameProbe:
			if !bytes.Equal(fr.Body, probeBody) {
				t.Fatalf("probe answer %q", fr.Body)
			}
		case FrameNotify:
			if _, err := DecodeNotify(fr.Body); err != nil {
				t.Fatalf("notify answer %q: %v", fr.Body, err)
			}
		case FrameConnection, FrameOld:
			if h, err := DecodeHandshake(fr.Body); err != nil || h.ReplyMsg == "" {
				t.Fatalf("handshake answer %q: %v", fr.Body, err)
			}
		}
	})
}

// FuzzRPCAnswer: the client's reading of an answer never panics, refuses
// (ErrBadFrame) a frame of another type, and the documents it then
// decodes are refused with typed errors.
func FuzzRPCAnswer(f *testing.F) {
	rpcSeeds(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		for _, want := range []FrameType{FrameConnection, FrameMetadata, FrameNotify, FrameProbe} {
			body, err := readAnswer(bytes.NewReader(b), want, 4096)
			if err != nil {
				if !errors.Is(err, ErrBadFrame) && !errors.Is(err, io.ErrUnexpectedEOF) && err != io.EOF {
					t.Fatalf("untyped error %v", err)
				}
				continue
			}
			switch want {
			case FrameMetadata:
				if !isNull(body) {
					if _, err := Decode(body); err != nil && !errors.Is(err, ErrBadDoc) {
						t.Fatalf("untyped error %v", err)
					}
				}
			case FrameNotify:
				if _, err := DecodeNotify(body); err != nil && !errors.Is(err, ErrBadFrame) {
					t.Fatalf("untyped error %v", err)
				}
			case FrameProbe:
				if _, err := DecodeProbeReply(body); err != nil && !errors.Is(err, ErrBadFrame) {
					t.Fatalf("untyped error %v", err)
				}
			case FrameConnection:
				if _, err := DecodeHandshake(body); err != nil && !errors.Is(err, ErrBadFrame) {
					t.Fatalf("untyped error %v", err)
				}
			}
		}
	})
}
