package tcp

import (
	"fmt"
	"testing"
	"time"

	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/transport"
)

// TestIdleConnHoldsNoReadBuffer: an initiator's connection with nothing in
// flight waits for the socket with no read buffer of its own (idleWait) and
// takes one when answers come; a TLS connection keeps its own. Rounds of
// small READs (through the buffer), large READs (straight from the socket)
// and WRITEs, each round after the connection went idle, all bring the
// target's bytes, over one socket; the short response timeout makes the
// idle wait end at its deadline now and then between rounds.
func TestIdleConnHoldsNoReadBuffer(t *testing.T) {
	for _, secure := range []bool{false, true} {
		t.Run(fmt.Sprintf("tls=%v", secure), func(t *testing.T) {
			const small, large, rounds = 300, 256 << 10, 40
			targ := newSide(t, Config{AutoTLS: secure})
			span := rounds * (2*small + large)
			remote := targ.register(t, targ.alloc(t, span, 0), true)
			testpattern.Fill(remote.mem, 9)
			init := newSide(t, Config{Rails: 1, AutoTLS: secure, ResponseTimeout: 250 * time.Millisecond})
			ep, err := init.tr.Open(t.Context(), targ.desc("", remote))
			if err != nil {
				t.Fatal(err)
			}
			defer ep.Close()
			e := ep.(*Endpoint)
			c := e.rails[0].Load()
			local := init.alloc(t, span, 0)
			testpattern.Fill(local, 4)
			want := append([]byte(nil), remote.mem...)
			comp := make(chanCompleter, 3)
			for r := range rounds {
				// The connection goes idle after each round: without TLS
				// it gives its buffer back, with TLS it keeps it.
				deadline := time.Now().Add(hang)
				for c.holdsIn.Load() != secure {
					if time.Now().After(deadline) {
						t.Fatalf("round %d: idle for %v, the connection holds a read buffer: %v", r, hang, c.holdsIn.Load())
					}
					time.Sleep(time.Millisecond)
				}
				if r%10 == 9 {
					time.Sleep(300 * time.Millisecond) // a deadline or two in the idle wait
				}
				if secure && !c.holdsIn.Load() {
					t.Fatalf("round %d: a TLS connection gave its read buffer back", r)
				}
				base := r * (2*small + large)
				sr := base                 // a small READ
				lr := base + small         // a large READ
				sw := base + small + large // a small WRITE
				clear(local[sr : sr+small])
				clear(local[lr : lr+large])
				copy(want[sw:sw+small], local[sw:sw+small])
				s := []transport.Slice{
					localSlice(transport.Read, local[sr:sr+small], remote.addr+uint64(sr), 1),
					localSlice(transport.Read, local[lr:lr+large], remote.addr+uint64(lr), 2),
					localSlice(transport.Write, local[sw:sw+small], remote.addr+uint64(sw), 3),
				}
				if n, err := ep.Post(comp, s); n != len(s) || err != nil {
					t.Fatalf("round %d: Post = %d, %v", r, n, err)
				}
				for tok, err := range comp.await(t, len(s)) {
					if err != nil {
						t.Fatalf("round %d, slice %d: %v", r, tok, err)
					}
				}
				for _, b := range [][2]int{{sr, small}, {lr, large}} {
					if d := testpattern.FirstDiff(local[b[0]:b[0]+b[1]], want[b[0]:b[0]+b[1]]); d >= 0 {
						t.Fatalf("round %d: the READ at %d differs at %d", r, b[0], d)
					}
				}
			}
			if d := testpattern.FirstDiff(remote.mem, want); d >= 0 {
				t.Fatalf("the target differs at %d", d)
			}
			if e.rails[0].Load() != c {
				t.Fatal("the connection was dialed again")
			}
		})
	}
}
