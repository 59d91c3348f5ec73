package mooncake

import (
	"errors"
	"os"
	"reflect"
	"testing"
)

// FuzzRDMAHandshake: any document a peer sends either fails with a typed
// error (ErrBadFrame, or ErrBadHandshake for one the RDMA transport cannot
// use) or checks into a handshake whose fields are in bounds and which
// encodes and checks back to itself; nothing panics.
func FuzzRDMAHandshake(f *testing.F) {
	for _, p := range []string{"handshake.json", "handshake-answer.json", "handshake-ready-ack.json", "handshake-ib-old.json", "handshake-refused.json"} {
		if b, err := os.ReadFile("testdata/" + p); err == nil {
			f.Add(b)
		}
	}
	f.Add([]byte(`{"local_nic_path":"a@b","peer_nic_path":"c@d","local_gid":"0:0:0:0:0:0:0:0:0:0:0:0:0:0:0:1","qp_num":[2]}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := DecodeHandshake(b)
		if err != nil {
			if !errors.Is(err, ErrBadFrame) {
				t.Fatalf("untyped error %v", err)
			}
			return
		}
		r, err := h.RDMA()
		if err != nil {
			if !errors.Is(err, ErrBadHandshake) {
				t.Fatalf("untyped error %v", err)
			}
			return
		}
		if len(r.QPNums) == 0 || len(r.QPNums) > MaxRDMAQPs || r.LocalServer == "" || r.LocalDevice == "" || r.PeerServer == "" || r.PeerDevice == "" {
			t.Fatalf("out of bounds: %+v", r)
		}
		enc, err := r.Desc().Encode()
		if err != nil {
			t.Fatal(err)
		}
		h2, err := DecodeHandshake(enc)
		if err != nil {
			t.Fatalf("%s: %v", enc, err)
		}
		r2, err := h2.RDMA()
		if err != nil || !reflect.DeepEqual(r, r2) {
			t.Fatalf("round trip %+v -> %s -> %+v, %v", r, enc, r2, err)
		}
		a, err := r.Answer(r.LID, r.GID, r.QPNums).RDMA()
		if err != nil || r.CheckAnswer(a) != nil {
			t.Fatalf("the answer to %+v does not check: %+v, %v", r, a, err)
		}
	})
}
