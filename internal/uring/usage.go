package uring

import "sync/atomic"

// Usage is what io_uring did in this process since it started, counted
// over every [Ring].
type Usage struct {
	// Rings is how many rings [New] set up ([Available]'s probe among
	// them): the kernel allowed io_uring_setup and knew every opcode
	// this package submits.
	Rings uint64
	// Submitted is how many SQEs the kernel took from the rings'
	// submission queues through [Ring.Submit] and [Ring.SubmitAndWait]
	// (io_uring_enter's counts).
	Submitted uint64
}

// usage is the process's Usage, kept with atomic adds: one per ring set
// up and one per io_uring_enter that took SQEs, next to a system call.
var usage struct{ rings, submitted atomic.Uint64 }

// Used returns what io_uring did in this process so far. A test asserts
// with it that a path really went through io_uring, not a fallback that
// passes the same checks: Used().Submitted grows across the work, and
// Used().Rings across the setup of what should own a ring. Outside Linux
// it stays zero. It is safe for concurrent use.
func Used() Usage {
	return Usage{Rings: usage.rings.Load(), Submitted: usage.submitted.Load()}
}
