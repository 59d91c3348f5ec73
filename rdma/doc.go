// Package rdma is the RDMA transport on ibverbs: RDMA READ and WRITE over
// reliable-connected queue pairs, on InfiniBand or RoCE, and on Soft-RoCE
// (rdma_rxe) where there is no NIC. It is built with cgo and the build tag
// "rdma" and links libibverbs; without the tag (or without cgo) the package
// is a pure-Go twin whose New fails with an error wrapping
// transport.ErrNotSupported, so the default build needs no C library.
//
// New opens every usable device (an ACTIVE port and a usable GID) with a
// protection domain and one completion queue each. Register puts an MR on
// every device: local access only, or also remote read and write when the
// buffer is remote-accessible, and then its key, published in the segment
// descriptor, is the rkeys in device order. The endpoint the engine
// publishes is the control listener's host:port and the device names.
//
// Open connects Rails() RC queue pairs to the peer, QPsPerDevice per local
// device, each through a handshake on the peer's control listener: the two
// sides exchange GID, LID, QPN, PSN and MTU (wire.go) and move their queue
// pairs RESET -> INIT -> RTR -> RTS. The GID is a routable one by default:
// the RoCE v2 GID of an IPv4 address, else of a global IPv6 address, never
// a link-local fe80:: or RoCE v1 GID (ChooseGID); Config.GIDIndex forces
// one. The control connection stays open as long as the queue pair: when it
// ends, the other side tears its queue pair down at once instead of after
// the retry timeout.
//
// In Mooncake mode (Config.Mooncake) the transport is "mooncake-rdma" and
// speaks the Mooncake Transfer Engine's RDMA transport instead: no control
// listener, queue pairs connected through Mooncake's handshake on the
// engine's Mooncake RPC port (MooncakeHandshake as target, a handshake per
// local device as initiator, to the peer NIC its priority matrix picks:
// mooncake_nics.go), rkeys published in Mooncake's form. Posting, polling
// and rails are the same, but that a slice keeps to the rails whose peer
// NIC the matrix picks for its remote buffer. PROTOCOL.md says what
// travels.
//
// Post checks each slice, writes it into the C memory of its queue pair
// and posts the chains of every queue pair the batch touches in one cgo
// call (shim.h builds the work requests and scatter/gather entries there).
// Poll reaps up to 64 completions of a device in one cgo call. A full
// queue pair makes Post accept fewer slices (the engine retries the rest),
// never fail.
//
// # Rails
//
// An endpoint's rails are its queue pairs, and each READ or WRITE goes to
// the rail its endpoint's rails.Picker chooses (choose.go), not to the
// engine's Rail hint: in proportion to each rail's measured speed, the
// moving average of what it completes per second (Post notes when a slice
// was posted, Poll tells the picker of its bytes when it is reaped), so a
// slow queue pair, device or path gets proportionally fewer slices. A
// device on another NUMA node than the slice's local memory (its
// Location; memory of no node, GPU memory, and memory on a node with no
// device prefer none) gets a FarNUMA share, half of what it would get
// near: its rails are passed over on every other pick. The endpoint has
// one picker, not one per node, since a rail's speed and health are its
// queue pair's, whatever memory feeds it.
//
// A rail whose queue pair fails (a completion error but for one that is
// the request's fault, a failed post, its control connection gone, a queue
// pair or port event), or whose reconnect fails, cools: it gets no slices
// for 100 ms, then one probe, whose success makes it healthy again; each
// failed probe doubles the cooldown, up to 10 s. The next Post reconnects
// it meanwhile, on a goroutine. A device whose port goes down (an
// asynchronous event) has its queue pairs failed at once, and none of its
// rails is chosen until the port is ACTIVE again (its probes go elsewhere,
// and do not lengthen its cooldown); the GID is chosen anew then. A
// notification keeps its Rail hint (those sent on one rail arrive in
// order), moved to a device that is up.
//
// Write-with-notify: the engine's Notify slice, posted after the request's
// WRITEs completed, becomes a SEND on the same queue pair into one of eight
// receive buffers the target posted (notify.go has the format). The
// target's own goroutine, woken by a completion channel, hands it to the
// engine (transport.Notifier) and answers with an inline SEND; the slice
// completes on that answer, with ErrNotifyFull (retryable) when the target
// engine's queue is full. Eight unanswered notifications per queue pair is
// the credit: a ninth waits (Post accepts fewer).
//
// # Errors
//
// A slice outside every buffer of the segment completes with ErrRange, one
// on a buffer without an rkey (local-only, or a garbled key) with
// ErrDenied, both before anything is posted. The target's hardware checks
// the rest: a remote access error (a wrong rkey, an unregistered buffer)
// completes the slice with ErrDenied, final. Any other completion error
// (retries exceeded, a peer gone) completes it with ErrPeer, which the
// engine retries, on another rail since this one cools; the queue pair,
// now in the error state, flushes its other work requests (ErrPeer too),
// is retired, and the next Post connects a new one.
//
// # Concurrency
//
// A Transport and its endpoints are safe for concurrent use. Posts on one
// endpoint are serialized by the endpoint; Polls of one device by its
// completion queue's lock (a poller that finds it taken moves on). Neither
// lock is held across a call of the Completer, which may Post again. An
// endpoint's picker takes no lock on its hot path: pollers tell it of
// completions, and any goroutine of failures, while a Post picks.
// A queue pair's slots are a ring: Post fills them at the head, the poller
// empties them at the tail, since a send queue completes in order.
//
// # Lifetimes
//
// A Transport listens from New until Close, and runs two goroutines per
// device (completion events of peers' queue pairs, asynchronous events)
// plus one per control connection (at most 64 of them still in the
// handshake; see Config.MaxPeerQPs). Queue pairs are created by Open and,
// after one failed or was evicted, by a goroutine the next Post starts (a
// Post never waits for a dial; the rail's slices wait for the ring's next
// try, and after a failed reconnect the rail fails Posts at once for a
// backoff of 100 ms doubling to 10 s). Config.MaxQPs bounds them, and past
// it the idle queue pairs of the least recently used endpoints are closed
// (they reconnect when used again). Endpoint.Close and
// Transport.Close move the queue pairs to the error state and wait (up to
// 5 s) for the flushed completions, so every slice accepted completes
// exactly once, with ErrClosed then. Poll after Close returns 0.
//
// # Safety
//
// The control handshake proves the segment key both ways (HMAC-SHA256 over
// fresh nonces and the queue pair addresses exchanged, wire.go) before the
// target creates a queue pair: with Config.Key shared by the deployment,
// only its holders connect; without it, a random key is published in the
// endpoint, and whoever reads the descriptor may connect. Once connected,
// the rkey is the capability: the target's hardware lets a connected peer
// read and write whatever a published rkey covers, and rkeys are 32 bits,
// not secrets against a peer that holds the segment key. Local-only buffers
// are registered without remote access flags, so the hardware refuses them
// whatever key is presented. Nothing is encrypted: RDMA traffic and the
// control connection travel in the clear, as on every RDMA fabric.
// Registered memory must stay pinned (segtable pins Go memory) until
// Unregister; the hardware reads and writes it behind Go's back.
package rdma
