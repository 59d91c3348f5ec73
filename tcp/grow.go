// grow.go holds the growing of a connection's slots. A slot (its queue
// entry, request header, group header and gathered pieces) is about 240
// bytes, so Config.Depth's 1,024 made every connection about 240 KiB at
// its dial, which a peer that never has more than a few slices in flight
// (most of a fleet's, most of the time) kept for its life. A connection
// starts with startDepth slots and takes Config.Depth the first time a
// post finds them all in flight.
//
// The slots are indexed by queue position modulo their count, by posters
// (any goroutine), the sender and the reader of answers at once, so they
// change only while none of them holds one: the post that finds the queue
// full sets growing, and posts are refused from then on (the ring offers
// them again, as to any full connection); once every slice in flight is
// answered and no post is in progress, the sender, holding the sending
// flag, makes the larger slots and clears growing. The connection moves
// nothing for a round trip, once in its life.
//
// Who wakes the sender: the post that sets growing, and each post refused
// while it is set, ring its doorbell after leaving posting; the reader
// rings it after the answer that empties the queue. A refused post sees
// growing before it reserves (posting is counted first), so the sender
// that sees posting at 0 with growing set has the queue to itself.

package tcp

// startDepth is how many slots a connection has until it first fills
// (Config.Depth when that is smaller).
const startDepth = 64

// growReady reports whether the connection waits to grow and nothing
// holds it back: no slice in flight, no post in progress.
func (c *conn) growReady() bool {
	return c.growing.Load() && c.q.Len() == 0 && c.posting.Load() == 0
}

// grow gives a connection that waits to grow Config.Depth slots, keeping
// its positions, when nothing holds it back and every frame is wholly
// written. The sending flag must be held.
func (c *conn) grow() {
	if !c.growReady() || c.next != c.q.Committed() || c.off != 0 {
		return
	}
	// Grow cannot fail here (the queue is empty, Depth a power of two
	// above its Cap); were it to, the connection goes on as it was.
	if depth := c.e.t.cfg.Depth; c.q.Grow(depth) == nil {
		c.hdrs = make([][reqSize]byte, depth)
		c.parts = make([][3][]byte, depth)
		c.pre = make([][reqSize]byte, depth)
		c.notes = nil // made again at the next NOTIFY, as many as the slots
	}
	c.growing.Store(false)
}
