// express.go holds the express lane: a connection of an endpoint's own
// for its high-class slices, dialed on the first of them.
//
// A connection is a strict FIFO: the target answers its frames in order,
// and the receiver reads the answers in order. A 4 KiB READ queued behind
// a rail's 1 MiB WRITEs waits for every byte of them to cross, however
// the engine orders its slices before they reach the connection. So a
// slice of transport.ClassHigh goes on a connection that carries nothing
// else: it waits only for high-class slices before it (and for the
// target's handling of its frame, on a goroutine of its own there).
//
// The lane is dialed lazily, in the background, by the first high-class
// slice: a peer that never sees one holds no more connections and no more
// memory than its rails (issue 19 counts the memory per peer). Until the
// lane is up, and while it is redialed after a break, high-class slices
// take the rails. It is kept like a rail (Endpoint.keep), but it is not
// one: Rails does not count it, the Picker never chooses it, and its
// speed is not measured.

package tcp

// expressLane returns the express lane's connection while it is up, and
// starts the lane when it was never started; nil while it is not up.
func (e *Endpoint) expressLane() *conn {
	if c := e.express.Load(); c != nil && !c.failed.Load() {
		return c
	}
	if !e.expressOn.Load() {
		e.startExpress()
	}
	return nil
}

// startExpress starts the express lane's keeper, once, unless the
// endpoint is closing. Under mu, as Close stops the endpoint: the keeper
// is added to wg before Close waits for it, or not at all.
func (e *Endpoint) startExpress() {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.expressOn.Load() || e.closed.Load() {
		return
	}
	e.expressOn.Store(true)
	e.wg.Add(1)
	go e.keep(&e.express, -1, nil)
}
