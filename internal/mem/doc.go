// Package mem allocates the engine's memory: page-aligned anonymous mappings
// outside the Go heap, placed on a NUMA node, that the garbage collector
// never moves or frees, so a NIC or a peer may be handed their addresses for
// as long as they stay mapped.
//
// [Alloc] and [Free] serve registered buffers and rings. [AllocGuarded]
// serves tests: its buffer ends at an inaccessible page, so a write or read
// past its end faults at once instead of corrupting a neighbour.
//
// The memory is not scanned by the garbage collector: it must never hold Go
// pointers.
//
// # Concurrency
//
// Every function is safe for concurrent use. The memory itself is plain
// memory; whoever shares a buffer between goroutines (or with a device)
// orders its accesses.
//
// # Lifetimes
//
// A buffer from [Alloc] lives until [Free]; one from [AllocGuarded] until its
// free function is called. Any access after that faults, or worse, touches
// whatever the kernel mapped there since, so the caller must first make sure
// that no transport, device or peer still uses the range. Nothing frees
// memory implicitly: a buffer that is dropped without Free leaks until the
// process exits.
//
// # Errors
//
// [ErrBadSize] and [ErrNotAllocated] report caller mistakes and do not go
// away with a retry. A failed mapping wraps the kernel's errno (ENOMEM, say);
// a retry may help once memory is released.
package mem
