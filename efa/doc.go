// Package efa is the libfabric transport: RMA (fi_writemsg, fi_readmsg) on
// one reliable-datagram endpoint (FI_EP_RDM) per engine, which is how AWS
// exposes EFA. The code is the same on every provider; only the provider
// name in Config differs. Tests and benchmarks run it on libfabric's
// software providers, tcp (with ofi_rxm) and shm.
//
// The real transport needs cgo and the build tag efa (and libfabric-dev to
// build, libfabric to run); without them New fails with an error wrapping
// transport.ErrNotSupported, so the default pure-Go build works anywhere.
//
// # Addressing
//
// The transport publishes no control channel of its own. Its Endpoint is
// the provider's name and its fabric address (fi_getname); Open inserts a
// peer's address into the one address vector that all endpoints share.
// It leaves again once no endpoint uses it (Close, or Update with a
// restarted peer's new address) and the provider holds no operation to
// it: libfabric leaves operations to a removed address undefined, and
// reuses its index for the next address inserted. An Update whose
// descriptor lists no efa endpoint (the peer uninstalled the transport)
// leaves the endpoint failing slices with ErrPeer, a failure of the path
// that the engine fails over, until one lists it again.
// Register registers a buffer with fi_mr_reg, following the provider's
// mr_mode bits (FI_MR_LOCAL descriptors, FI_MR_PROV_KEY or keys of our
// own, FI_MR_VIRT_ADDR or offsets, FI_MR_ENDPOINT binding); a
// remote-accessible buffer gets remote access and a key naming the MR key,
// the buffer's address and its length, a local-only one neither.
//
// # Data path
//
// Post turns up to 64 slices into operations in one cgo call; when the
// provider's queue or the transport's slots (Config.Depth) are full it
// accepts fewer, and the engine posts the rest later. When the provider
// took nothing, Post takes nothing more until the next Poll, which is what
// frees the provider's queue; and it prepares no more operations for a
// peer than the provider last took before it was full, doubling that after
// each batch taken whole. Poll reads up to 64
// completions with fi_cq_read in one cgo call, errors with fi_cq_readerr.
// Software providers emulate RMA, so the target moves bytes only while it
// polls: every transport must be polled, the target's too (the engine's
// pollers, or the goroutine Config.Progress starts). Real EFA hardware
// needs no target progress.
//
// # Concurrency
//
// A Transport and its endpoints are safe for concurrent use: libfabric is
// opened with FI_THREAD_SAFE, and two read-write locks keep Close and
// Unregister from closing objects under a Post or Poll in progress: one
// that posts hold shared, one that Poll holds shared around reading the
// completion queue, taken exclusively only while no post is in the
// provider. Neither Post nor Poll waits for a lock that a post in the
// provider holds up (a software provider's post may wait for progress,
// which only Poll makes): Post takes no slices meanwhile, and Poll leaves
// what needs the lock (the timeout scan, a peer's removal or reset) to a
// goroutine that waits for it. Complete is never called with a lock held.
//
// # Lifetimes
//
// Every slice Post accepted completes exactly once: from Poll when the
// provider reports it; with an error wrapping ErrPeer when the provider
// has not reported it within Config.Timeout (a dead peer); with ErrClosed
// when its endpoint or the transport closed first. An operation that
// failed as if its connection broke is posted again, up to 4 times over
// about 85 ms, since tcp;ofi_rxm fails every operation queued on a
// connection that broke and reconnects only for later ones. Endpoint.Close
// and Close first wait, polling, up to Config.Linger for slices in flight.
// A slice failed by the timeout keeps its operation context until the
// provider returns it, so a late completion is ignored; what the provider
// still does with that operation's memory meanwhile, no software can stop.
//
// # Safety
//
// The target's provider checks every access against its MRs: only
// remote-accessible buffers have remote access, and only with their key.
// The initiator also refuses, before posting, a range outside every
// buffer of the descriptor (ErrRange) and a buffer whose key is missing,
// malformed, or names another buffer (ErrDenied): software providers
// answer a bad key by dropping the connection (tcp) or not at all (shm),
// which would otherwise cost a timeout.
//
// Known limits of libfabric 1.17's software providers: after Unregister,
// a peer's operation already being received may still land in the buffer
// (tcp moves a large write over several progress calls); with shm, two
// transports of one process share a peer's memory region, so one closing
// under the other's traffic can crash the process (engines of one process
// use the local transport instead), and an access with a closed MR's key
// wedges the pair until the timeout fails its slices.
package efa
