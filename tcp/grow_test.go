package tcp

import (
	"fmt"
	mrand "math/rand/v2"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/transport"
)

// slots is the count of a connection's slots, after checking that its
// queue and its arrays agree.
func slots(t testing.TB, c *conn) int {
	t.Helper()
	n := c.q.Cap()
	if len(c.hdrs) != n || len(c.parts) != n || len(c.pre) != n || (c.notes != nil && len(c.notes) != n) {
		t.Fatalf("slots disagree: queue %d, headers %d, parts %d, group headers %d, notes %d", n, len(c.hdrs), len(c.parts), len(c.pre), len(c.notes))
	}
	return n
}

// TestConnGrows: a connection starts with startDepth slots; READs,
// WRITEs and NOTIFYs posted from four goroutines at once fill it, it
// grows to Config.Depth on the same socket, and every slice lands whole
// and completes once: through the poller's kick, the sender alone, its
// io_uring and TLS. A Depth below startDepth is the connection's from
// its dial, and it never grows.
func TestConnGrows(t *testing.T) {
	for _, tc := range []struct {
		name   string
		cfg    Config
		before int // the slots at the dial
		after  int // the slots after the load
	}{
		{"kick", Config{}, startDepth, DefaultDepth},
		{"senderOnly", Config{senderOnly: true}, startDepth, DefaultDepth},
		{"iouring", Config{senderOnly: true, IOUring: true}, startDepth, DefaultDepth},
		{"tls", Config{AutoTLS: true}, startDepth, DefaultDepth},
		{"depth=256", Config{Depth: 256}, startDepth, 256},
		{"depth=16", Config{Depth: 16}, 16, 16},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const block, writers = 4 << 10, 4
			const each = 3 * DefaultDepth / writers // more in flight than a connection holds
			targCfg := Config{}
			if tc.cfg.AutoTLS {
				targCfg.AutoTLS = true
			}
			targ := newSide(t, targCfg)
			var mu sync.Mutex
			notes := map[uint64]string{}
			targ.tr.SetNotify("target", func(n *transport.Notification) error {
				mu.Lock()
				notes[n.Tag] = string(n.Msg)
				mu.Unlock()
				return nil
			})
			remote := targ.register(t, targ.alloc(t, writers*each*block, 0), true)
			cfg := tc.cfg
			cfg.Rails = 1
			init := newSide(t, cfg)
			init.tr.SetNotify("initiator", func(*transport.Notification) error { return nil })
			ep, err := init.tr.Open(t.Context(), targ.desc("", remote))
			if err != nil {
				t.Fatal(err)
			}
			defer ep.Close()
			e := ep.(*Endpoint)
			c := e.rails[0].Load()
			if n := slots(t, c); n != tc.before {
				t.Fatalf("a new connection has %d slots; want %d", n, tc.before)
			}
			local := init.alloc(t, writers*each*block, 0)
			testpattern.Fill(local, 5)
			testpattern.Fill(remote.mem, 6)
			want := append([]byte(nil), remote.mem...) // what the target must end with
			ops := make([]transport.Op, writers*each)
			comp := make(chanCompleter, writers*each)
			var wg sync.WaitGroup
			for w := range writers {
				wg.Go(func() {
					rng := mrand.New(mrand.NewPCG(uint64(w), 3))
					for i := range each {
						k := w*each + i
						off := k * block
						op := []transport.Op{transport.Read, transport.Write, transport.Notify}[rng.IntN(3)]
						ops[k] = op
						s := localSlice(op, local[off:off+block], remote.addr+uint64(off), uint64(k+1))
						switch op {
						case transport.Write:
							copy(want[off:off+block], local[off:off+block])
						case transport.Read:
							clear(local[off : off+block])
						case transport.Notify:
							msg := fmt.Sprintf("note %d", k)
							copy(local[off:], msg)
							s.Length, s.Remote = uint64(len(msg)), uint64(k+1)
						}
						for deadline := time.Now().Add(hang); ; {
							n, err := ep.Post(comp, []transport.Slice{s})
							if err != nil {
								t.Errorf("slice %d: Post: %v", k, err)
								return
							}
							if n == 1 {
								break
							}
							if time.Now().After(deadline) {
								t.Errorf("slice %d: the connection took nothing for %v", k, hang)
								return
							}
							runtime.Gosched()
						}
					}
				})
			}
			wg.Wait()
			if t.Failed() {
				return
			}
			for tok, err := range comp.await(t, writers*each) {
				if err != nil {
					t.Fatalf("slice %d: %v", tok-1, err)
				}
			}
			// Every WRITE landed and nothing else changed the target,
			// every READ brought the target's bytes, every NOTIFY came
			// with its own message.
			if d := testpattern.FirstDiff(remote.mem, want); d >= 0 {
				t.Fatalf("the target differs at %d (block %d, a %v)", d, d/block, ops[d/block])
			}
			mu.Lock()
			defer mu.Unlock()
			for k, op := range ops {
				off := k * block
				switch op {
				case transport.Read:
					if d := testpattern.FirstDiff(local[off:off+block], want[off:off+block]); d >= 0 {
						t.Fatalf("READ %d differs at %d", k, d)
					}
				case transport.Notify:
					if m := notes[uint64(k+1)]; m != fmt.Sprintf("note %d", k) {
						t.Fatalf("NOTIFY %d came with %q", k, m)
					}
				}
			}
			if e.rails[0].Load() != c {
				t.Fatal("the connection was dialed again")
			}
			if n := slots(t, c); n != tc.after {
				t.Fatalf("after %d slices in flight the connection has %d slots; want %d", writers*each, n, tc.after)
			}
			if c.growing.Load() {
				t.Fatal("the connection still waits to grow")
			}
		})
	}
}
