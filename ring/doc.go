// Package ring turns submission entries into transport slices and slice
// completions into completion entries: the Ring (SQ + CQ + a fixed in-flight
// table) and the Poller that drains the rings of one NUMA node.
//
// # Data path
//
// The caller pushes 64-byte entries into the ring's SQ. The ring's poller
// takes them in order, checks the local range against the buffer table and
// the remote range against the segment's descriptor (a bad entry completes at
// once with its error code), takes the segment's current path (or the one
// its transport hint names), records the request in a slot of the in-flight
// table, cuts it into slices (the transport's slice size, 64 KiB by default,
// a short tail merged into the slice before it), spreads the slices over the
// endpoint's rails and posts them. An entry with sq.FlagList moves a run of
// a prepared List instead: every block checked first, one slice a block,
// one completion for the run. Transports report each slice through the
// ring's Completer, which only pushes a token onto a lock-free queue; the
// poller applies it. The last slice of a request writes one completion.
//
// # Concurrency
//
// Everything about a request belongs to its ring's poller goroutine: the
// in-flight table has no locks and no atomics. While the poller is parked
// it lends its rings, token and all, to the goroutine that brings the next
// work (a submitter, or a transport goroutine completing a slice), which
// steps them itself rather than wake it; the poller takes the token back
// when it wakes, handed over by a borrower still stepping. Submit, Cancel and the
// completion-reading methods are safe for concurrent use as documented on
// each; the CQ has one reader at a time.
//
// # Failures and deadlines
//
// A slice that fails with a retryable error is posted again on the next
// rail, up to RetryLimit times per request; then the request FAILs. A
// slice that fails for a reason of its path (transport.ErrPeer,
// ErrClosed) moves its request to the segment's next path that is up
// (segtable.Segment.Fail marks the failed one down and tells the engine
// through Tables.PathDown), for one retry; slices of it still out on the
// path it left then cost none. A request with sq.FlagTransportOnly does
// not move: it FAILs with CodeTransportDown. With no other path up, a
// path failure is retried on the next rail as any other. A
// request that passes its deadline completes with TIMEOUT, and a Cancel
// entry completes it with CANCELED. Slices of such a request may still be in
// flight: its slot stays reserved, and its buffer and segment referenced,
// until the transport has returned every one of them; their completions are
// then applied to nothing. Tokens carry the slot's generation, so a
// completion from an earlier use of a slot is recognized and ignored.
// This holds for synchronous copies too (local, shm) once the poller's
// copy workers take part of a batch (share.go): a slice a worker is
// copying when its request ends still lands, and the request's later
// slices at the worker are skipped (but for a transport.BatchCopier's,
// shm's: a worker hands its whole part to one CopyBatch, which lands
// them all; a slice in flight landing after its request ended is the
// rule above, and skipping is only a saving).
//
// # Order
//
// Requests in flight at once are not ordered: rails, retries and the copy
// workers move their slices at the same time, so a READ of a range that a
// WRITE in flight writes may see either. A request's notification follows
// every byte of its data; notifications of different requests may arrive
// in any order. A caller that needs one request after another waits for
// the first's completion.
//
// # Lifetimes
//
// A Ring lives until Close, which completes every request not yet complete
// with ErrClosed. A Poller lives until Stop. The Completion pointer that Peek
// returns is valid until the next Advance.
package ring
