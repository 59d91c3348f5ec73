// Package shm is the same-host transport: engines of one host move bytes
// with plain memory copies into each other's buffers, without the network
// stack.
//
// A target engine's transport listens on an abstract Unix socket
// (SOCK_SEQPACKET) named in its Endpoint together with the kernel's boot
// id. An initiator whose boot id differs knows at once that the segment is
// elsewhere (Open fails with ErrUnreachable and the engine tries its next
// transport, TCP); otherwise it connects, which proves the two share a
// kernel and a network namespace. Both sides then prove that they hold
// the segment key (HMACs over fresh nonces, as the TCP transport's hello;
// the engine gives shm its TCP key), and the initiator asks for each
// buffer of the segment with the buffer's key. The target checks the key (constant time), that
// the buffer is registered with exactly that range and is
// remote-accessible, and answers with one of:
//
//   - the buffer's memfd (SCM_RIGHTS), when the buffer is the whole of a
//     memfd from mem.AllocShared (the engine's Alloc with shm installed):
//     the initiator maps it once, and every slice is then a copy on the
//     poller's goroutine, with no system call;
//   - a grant for process_vm_readv/writev, for any other memory (a memfd
//     is handed out only whole, never when it holds other memory).
//
// A buffer registered local-only is never handed out. The initiator maps a
// file only if it is sealed against shrinking (F_SEAL_SHRINK) and holds the
// granted range, so a target cannot kill its peers with SIGBUS by
// truncating it. Small slices that go through process_vm calls move in
// runs, one call per run (transport.BatchCopier).
//
// Write-with-notify sends the notification over the same socket once the
// data slices are copied; the target's engine queues it and answers, and
// the slice completes with that answer.
//
// # Concurrency
//
// A Transport and its endpoints are safe for concurrent use. Copy and
// CopyBatch run on the caller's goroutine; each connection has one reader
// goroutine on each side.
//
// # Lifetimes
//
// Unregister on the target tells every connected peer to drop the buffer;
// a peer answers once the copies running on it have finished and its
// mapping is gone, and only then does Unregister return (or, after
// Config.RevokeTimeout, disconnect the peer and report it). Close does the
// same for every buffer. When the target dies, its peers see the socket
// close and drop every mapping the same way. Slices to a dropped buffer
// fail: ErrDenied while the segment still lists it, ErrPeer once the target
// is gone. Nothing is ever copied through a mapping that is gone.
//
// # Limits
//
// Any process of the host in the same network namespace, of any user, can
// connect to a target's socket. Connections that have not proved the key
// are bounded (Config.MaxPending, and MaxPendingPerUID per user id of the
// connecting process): past a bound the oldest of them is closed to make
// room, so connections held open without the key cannot lock peers out.
// Connections that proved it are bounded by Config.MaxConns. A revoke, and
// an Unregister, wait for a peer no longer than RevokeTimeout or the
// caller's context (UnregisterContext): then the peer is cut. Stats counts
// what the bounds did; Config.Logger hears of it.
//
// # Trust
//
// The segment key never crosses the socket. Buffer keys are sent in the
// clear over it, which only processes of the same kernel and network
// namespace can reach. A peer that holds a
// buffer's key is trusted with the buffer until it answers a revoke: the
// revoke is how an honest peer stops, not a way to take memory back from a
// hostile one (whose mapping of a memfd the target cannot undo). The same
// goes for process_vm grants: after RevokeTimeout the target disconnects a
// peer that did not answer, but a process_vm_writev that peer had already
// begun may still land, so memory registered without a memfd (not from
// Alloc) should not be reused at once after an Unregister that reported a
// timeout.
package shm
