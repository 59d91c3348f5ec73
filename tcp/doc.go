// Package tcp is the TCP transport: what every deployment has. Its wire
// protocol is written down in PROTOCOL.md.
//
// The initiator keeps a small pool of persistent connections per peer (the
// rails). Each connection pipelines many slices: the engine's poller posts
// them into a lock-free queue, a sender goroutine writes their request
// frames (WRITE payloads straight from registered memory, with writev), and
// a receiver goroutine reads the responses in order, landing READ payloads
// straight in registered memory, unless a caller that posted Driven slices
// reads them itself (Endpoint.Drive, drive.go: a caller waiting for a
// small answer saves the receiver's hand-off). A broken connection fails its slices with a
// retryable error, so the engine moves them to another rail, and is redialed
// with backoff.
//
// Slices go to the rails in proportion to what each has been measured to
// move (internal/rails): the receiver times each answer against its
// slice's post, and a rail that is backed up shows its speed. A rail whose
// connection broke, or whose redial failed, cools down: it gets no slices
// (though it is redialed at once) for 100 ms, doubled by each failed probe
// up to 10 s, then one probe slice, whose success gives the rail its share
// again.
//
// A slice of transport.ClassHigh takes the endpoint's express lane, a
// connection that carries nothing else, so that it never waits behind the
// bulk frames queued on a rail (a connection answers in order). The first
// high-class slice dials it, in the background: a peer that never sees one
// holds no more than its rails. Until it is up, and while it is redialed,
// high-class slices take the rails. It is not a rail: Rails does not count
// it, and the target sees one more connection (within MaxConns) and the
// same protocol.
//
// The target serves each connection on one goroutine: it checks every
// request against its own registrations and moves the payload between the
// socket and the registered buffer with no intermediate copy and no
// allocation per frame.
//
// # Concurrency
//
// A Transport and its endpoints are safe for concurrent use.
//
// # Lifetimes
//
// A Transport listens from New until Close; Close ends its connections and
// completes every slice in flight with an error. An Endpoint's rails and
// express lane live until its Close (or the Transport's), which waits for
// their goroutines, the express lane's dial included. Unregister waits for
// frames that are moving bytes of the buffer.
//
// # Security
//
// A connection starts with an HMAC challenge over fresh nonces that proves
// both sides hold the segment key; every frame names a buffer and its key,
// and the target accepts only buffers registered remote-accessible. The
// frames after the hello are neither encrypted nor authenticated: a relay
// on the path can read and change them. Config.AutoTLS closes that without
// a PKI: a self-signed certificate whose hash the endpoint pins, in a
// descriptor the engine signs (PROTOCOL.md, Security). TLS with a
// certificate of one's own is Config.TLS.
//
// A peer without the key holds little: the target bounds the connections
// that have not proved it (Config.MaxHandshakes, overall and per source,
// closing the oldest past the bound) and the time they have to
// (HandshakeTimeout); those that did are bounded too (MaxConns) and closed
// when idle (IdleTimeout). Transport.Refusals counts what was refused.
package tcp
