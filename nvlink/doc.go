// Package nvlink is the NVLink transport: it moves bytes between GPU
// memory of processes on one host through CUDA IPC, and stages GPU memory
// through pinned host buffers for the transports that only reach host
// memory (TCP, shared memory).
//
// The CUDA driver API is loaded at run time from libcuda.so.1 with purego,
// so the package builds everywhere with CGO_ENABLED=0; New fails with an
// error wrapping transport.ErrNotSupported, saying why, where there is no
// driver or no GPU, and the engine goes on without it.
//
// # How a slice moves
//
// A target registers GPU memory remote-accessible: Register exports the
// allocation that holds the buffer (cuIpcGetMemHandle) and publishes, as
// the buffer's key, the 64-byte handle, where the buffer lies in the
// allocation, the PCI bus id of its GPU and a slot of its grant table.
// The Endpoint string names the host's boot id and the grant table's path.
//
// An initiator on the same host (same boot id, another process) maps each
// exported allocation once (cuIpcOpenMemHandle, shared by all endpoints of
// the transport). Post queues the slices of one call as a group on a
// stream of the GPU that holds the remote buffer, with one event recorded
// behind it: device-to-device slices of up to 1 MiB in one launch of the
// gather kernel (kernel.go; Config.NoCopyKernel leaves them to the copy
// engines, which spend microseconds on each copy), other device-to-device
// ones (larger, unaligned, or from another GPU) in one cuMemcpyBatchAsync
// where the driver has it, HtoD/DtoH copies when the local buffer is host
// memory a call each. The engine hands an endpoint
// up to a group's 256 slices a Post, or a quarter of Depth when that is
// fewer (Endpoint.PostWidth). Poll queries the
// oldest events of each stream and completes their groups: nothing on the
// hot path waits for the GPU. The engine's pollers call Poll (Transport
// implements transport.Poller).
//
// One-sided copies leave the target no say per slice, so the target's
// grants live in shared memory: a slot per exported buffer, with a
// generation and a count of copies in flight. An initiator counts itself in
// (one CAS) before queueing a copy and out when its event fired; the
// target's Unregister revokes the slot and waits until the count is zero.
// See table.go for the layout.
//
// # Concurrency
//
// A Transport and its Endpoints, staging ones included, are safe for
// concurrent use.
// Post may be called by several pollers at once: each slice takes the
// stream's posting lock for the copy and the event record only. Poll may
// be called by several pollers at once: one reaps a stream while the others
// skip it (TryLock), and Complete is called without a lock that Post takes.
// A goroutine that calls the driver locks its OS thread and makes the
// GPU's primary context current, once per Post or Poll, not per slice.
//
// # Lifetimes
//
// A Transport lives from New until Close. An Endpoint lives until its
// Close or the transport's: Close stops taking slices, waits for the
// streams (Close is not the hot path), completes the endpoint's slices
// still in flight with transport.ErrClosed, and drops its IPC mappings
// when no other endpoint uses them. An Update that replaces the
// endpoint's view (a buffer gone, a restarted peer) drops what only the
// old view used, mappings and the old peer's grant table, once the copies
// queued with it completed: at once when none is in flight, else in a
// later Poll or Update. Memory from Alloc lives until Free or the
// transport's Close; the staging arena until the transport's Close. The grant
// table file (/dev/shm/moonring-nvlink-*) is removed by Close; a process
// that dies leaves it behind, harmless and small.
//
// # Staging
//
// GPU memory is the local side of requests over TCP, shared memory and the
// other host-memory transports through the staging arena (staged.go):
// pinned host memory cut in units, a run of units per slice, with the
// GPU's copies queued on the same lanes and completed by the same Poll.
// The engine wires it (transport.Stager): it registers the arena, gives
// GPU buffers a staged registration on the other transports, and gives
// their segments a staging endpoint around theirs. Transport implements
// transport.InFlight, so the engine's pollers keep polling while copies
// are queued: no event would wake a parked one.
//
// # Safety
//
// Everything from a descriptor is checked before use: the endpoint string
// and the table path (only a table file in the table directory is
// mapped), every key (exact length, lowercase hex, magic, reserved bytes
// zero, the buffer inside its allocation, no wrap-around) and its match
// with the descriptor's buffer. A slice must lie inside one buffer with a
// valid key (else ErrRange or ErrDenied) and its local range inside the
// local registration; a revoked grant fails it with ErrDenied. Local-only
// buffers and host memory are never exported.
//
// A CUDA IPC handle is a capability: a process of the host that has it
// can map the allocation. The grant table protects against mistakes and
// stale descriptors, not against a hostile process of the same host.
//
// # Costs
//
// A slice costs two driver calls (the copy and the event record) and a
// share of one cuEventQuery; a Post or Poll adds one cuCtxSetCurrent.
// purego.SyscallN allocates one small argument block per call (measured:
// 1 allocation), so the hot path is not allocation-free: with slices of
// megabytes (Config.SliceSize, 64 MiB by default) that is noise next to
// the copy, but it is there.
//
// # What is tested where
//
// The transport's logic (keys, grants, mappings, event polling, exactly
// one completion, close with copies in flight, the conformance suite)
// runs in `make test` against an in-memory fake driver. The real driver
// layer (cuda.go: purego bindings, argument order, the IPC handle passed by
// value) and the two-process path run in `make test` against
// testdata/mockcuda.c, a C model of libcuda built by the test: that checks
// the bindings against a C ABI, not CUDA's behaviour. The gather kernel's
// PTX is assembled by NVIDIA's ptxas for Volta, Ampere and Hopper in `make
// test` too (TestGatherPTXAssembles; scripts/ptxas.sh fetches ptxas from
// Debian's non-free CUDA toolkit package): that checks the PTX, not what
// it copies. On a real GPU the
// package runs through scripts/gpu-check.sh, on a machine lent for it (an
// H200, on 2026-11-29 and 2026-12-04, the gather kernel too: every test
// passed; figures in BENCHMARKS.md).
package nvlink
