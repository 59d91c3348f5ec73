package tcp

// What the target served: requests and bytes per peer (its source address)
// and op, counted by each connection's goroutine without a lock and added
// up when asked.

import (
	"net/netip"
	"sync/atomic"
)

// served is what one connection, or the ended connections of one source,
// served.
type served struct {
	reads, readBytes   atomic.Uint64
	writes, writeBytes atomic.Uint64
	// denied counts READs and WRITEs answered with a refusal (no such
	// buffer, a wrong key, out of range).
	denied atomic.Uint64
}

func (s *served) add(o *served) {
	s.reads.Add(o.reads.Load())
	s.readBytes.Add(o.readBytes.Load())
	s.writes.Add(o.writes.Load())
	s.writeBytes.Add(o.writeBytes.Load())
	s.denied.Add(o.denied.Load())
}

// maxRetired bounds the sources whose ended connections' counts are kept
// apart; past it they are added up under the zero address.
const maxRetired = 4096

// retire keeps what pc served once it ends. A connection that served
// nothing (one that never proved the key, say) leaves no trace: sources
// without the key must not fill the table. mu must be held.
func (t *Transport) retire(pc *peerConn) {
	if pc.served.reads.Load()+pc.served.writes.Load()+pc.served.denied.Load() == 0 {
		return
	}
	src := pc.src
	r := t.retired[src]
	if r == nil {
		if len(t.retired) >= maxRetired {
			src = netip.Addr{}
			r = t.retired[src]
		}
		if r == nil {
			r = new(served)
			t.retired[src] = r
		}
	}
	r.add(&pc.served)
}

// Served is what the target served one peer: the READ and WRITE requests
// it moved the bytes of, their bytes, and the requests it refused.
type Served struct {
	// Peer is the peer's source address (an IPv6 one masked to its /64);
	// the zero Addr adds up the sources past the 4,096 kept apart.
	Peer               netip.Addr
	Reads, ReadBytes   uint64
	Writes, WriteBytes uint64
	Denied             uint64
}

// Served calls fn with what the target served each peer since New, its
// open connections and its ended ones added up per source. Safe for
// concurrent use; fn runs without the transport's locks held.
func (t *Transport) Served(fn func(Served)) {
	sum := map[netip.Addr]*served{}
	get := func(a netip.Addr) *served {
		s := sum[a]
		if s == nil {
			s = new(served)
			sum[a] = s
		}
		return s
	}
	t.mu.Lock()
	for _, pc := range t.conns {
		get(pc.src).add(&pc.served)
	}
	for a, r := range t.retired {
		get(a).add(r)
	}
	t.mu.Unlock()
	for a, s := range sum {
		if s.reads.Load()+s.writes.Load()+s.denied.Load() == 0 {
			continue
		}
		fn(Served{Peer: a, Reads: s.reads.Load(), ReadBytes: s.readBytes.Load(), Writes: s.writes.Load(), WriteBytes: s.writeBytes.Load(), Denied: s.denied.Load()})
	}
}
