// Package moonring moves bytes between registered memory in different
// processes and machines: a transfer engine for KV-cache systems, shaped
// like io_uring.
//
// A caller registers local buffers (RegisterLocalMemory), opens remote
// segments by name (OpenSegment) and moves bytes in one of two ways:
//
//   - the ring API: NewRing returns a Ring; the caller fills 64-byte Entry
//     descriptors (READ: remote -> local, WRITE: local -> remote), submits
//     them and reaps Completions from the ring's CQ, from its own event loop
//     (Peek/Advance, no syscall), blocking (Wait) or through an eventfd;
//     many scattered blocks (a KV cache's pages) go as a prepared list
//     (PrepareList, ListEntry): one entry for a run of up to 65,536 blocks;
//   - the Mooncake-style batch API: AllocateBatchID, SubmitTransfer,
//     GetTransferStatus, FreeBatchID, and Transfer for one synchronous call.
//
// Per-NUMA poller goroutines drain the rings onto the transports. Status
// words say whether bytes moved, nothing more.
//
// # GPU memory
//
// With the nvlink transport installed (InstallTransport), Alloc on
// "cuda:N" returns GPU memory. Peers of the same host reach GPU buffers
// over CUDA IPC. As the local side of requests to segments reached over
// TCP, shm or another transport of host memory, GPU memory is staged
// through nvlink's pinned host arena; such peers cannot reach it as the
// remote side.
//
// # Concurrency
//
// An Engine is safe for concurrent use. A Ring accepts submissions from any
// goroutine and has one completion reader at a time. Batch IDs may be used
// from any goroutine, but one batch should be filled by one goroutine.
//
// # Lifetimes
//
// An Engine lives until Close, which closes its rings and segments, fails
// what is in flight with ErrClosed, withdraws its segment from the metadata
// store and unregisters its buffers. A registered buffer must stay valid
// until UnregisterLocalMemory returns; memory from Alloc until Free. A
// prepared list lives until FreeList (requests already taken keep it).
//
// # Errors
//
// Completions and task status carry small codes; Completion.Err and
// TransferStatus.Err map them to the sentinels below without allocating.
// Methods return errors that wrap those sentinels once per layer.
package moonring
