//go:build linux

package uring

import (
	"fmt"
	"testing"

	"golang.org/x/sys/unix"
)

// BenchmarkUringNop measures IORING_OP_NOP submit-and-complete through this
// binding the way /work/shared/baselines/uring_nop.c measures liburing:
// prepare batch NOPs, one SubmitAndWait(batch), reap them all. One b.Loop
// iteration is one batch; req/s and ns/req count NOPs. syscall=getppid and
// rawsyscall=getppid are the plain-syscall floor of this kernel/VM, as in the
// C baseline.
func BenchmarkUringNop(b *testing.B) {
	for _, batch := range []int{1, 32} {
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) {
			r := newRing(b, 64)
			b.ReportAllocs()
			ops := 0
			for b.Loop() {
				for i := range batch {
					PrepNop(r.SQE(), uint64(i))
				}
				if n, err := r.SubmitAndWait(uint32(batch)); n != batch || err != nil {
					b.Fatalf("SubmitAndWait: %d, %v", n, err)
				}
				for {
					_, res, ok := r.PeekCQE()
					if !ok {
						break
					}
					if res < 0 {
						b.Fatalf("NOP res %d", res)
					}
					r.CQEAdvance(1)
					ops++
				}
			}
			b.ReportMetric(float64(ops)/b.Elapsed().Seconds(), "req/s")
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(ops), "ns/req")
		})
	}
	// unix.Syscall is the path io_uring_enter takes (entersyscall and
	// exitsyscall around the trap); unix.RawSyscall is the bare trap, the
	// C baseline's syscall(SYS_getppid).
	b.Run("syscall=getppid", func(b *testing.B) {
		for b.Loop() {
			unix.Syscall(unix.SYS_GETPPID, 0, 0, 0)
		}
		b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "req/s")
	})
	b.Run("rawsyscall=getppid", func(b *testing.B) {
		for b.Loop() {
			unix.RawSyscall(unix.SYS_GETPPID, 0, 0, 0)
		}
		b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "req/s")
	})
}
