package moonring_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/internal/proccpu"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/tcp"
)

// BenchmarkKVRawTCP is the kernel's own share of `moonring bench --pattern
// kv --protocol tcp`, as BenchmarkKVCopy is the memory's: the same bytes
// the same ways over loopback TCP with no engine and no protocol, one
// request per op. 512 MiB go as 16,384 blocks of 32 KiB from random blocks
// of a 2 GiB pool into random blocks of another (pattern=kv), or as 512
// blocks of 1 MiB (pattern=contig, the command's contig row), over two
// connections (the TCP transport's two rails), each with the engine's
// loopback send buffer (tcp.DefaultLoopbackSendBuffer). A sender writes
// 32 blocks a writev (1 MiB, a wide group frame's payloads) and a receiver
// reads them with readv straight into their destinations, as the
// engine's target reads a group's payloads; with 1 MiB blocks one block a
// call. The pools are Engine.Alloc's without shm (anonymous memory, huge
// pages advised), as the command's initiator has them. Its kv/contig ratio
// is what an engine over TCP can reach here; cpu-s/GB is both sides'
// (getrusage of this process).
func BenchmarkKVRawTCP(b *testing.B) {
	const pool, request, group, conns = 2 << 30, 512 << 20, 32, 2
	e, err := moonring.New(moonring.Config{Name: "kvrawtcp", Metadata: metadata.NewMemory(), Transports: []string{"tcp"}})
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	src, err := e.Alloc(pool, "cpu:0")
	if err != nil {
		b.Fatal(err)
	}
	defer e.Free(src)
	dst, err := e.Alloc(pool, "cpu:0")
	if err != nil {
		b.Fatal(err)
	}
	defer e.Free(dst)
	for i := 0; i < pool; i += 4096 { // every page in before any is timed
		src[i], dst[i] = 1, 1
	}
	for _, pattern := range []string{"contig", "kv"} {
		b.Run("pattern="+pattern, func(b *testing.B) {
			size, per := 32<<10, group
			if pattern == "contig" {
				size, per = 1<<20, 1
			}
			blocks := pool / size
			calls := request / size / per / conns // per connection per op
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				b.Fatal(err)
			}
			defer ln.Close()
			var senders, receivers [conns]*net.TCPConn
			for i := range conns {
				senders[i], receivers[i] = dialPair(b, ln)
				defer senders[i].Close()
				defer receivers[i].Close()
				senders[i].SetWriteBuffer(tcp.DefaultLoopbackSendBuffer)
				receivers[i].SetWriteBuffer(tcp.DefaultLoopbackSendBuffer)
			}
			cpu0 := proccpu.Self()
			b.SetBytes(request)
			round := uint64(0)
			for b.Loop() {
				round++
				var wg sync.WaitGroup
				errs := make(chan error, 2*conns)
				for i := range conns {
					wg.Go(func() {
						rng := rand.New(rand.NewPCG(round, uint64(2*i)))
						blks := make([][]byte, per)
						for range calls {
							for k := range blks {
								o := rng.IntN(blocks) * size
								blks[k] = src[o : o+size]
							}
							iov := net.Buffers(blks) // WriteTo consumes iov, not blks
							if _, err := iov.WriteTo(senders[i]); err != nil {
								errs <- err
								return
							}
						}
					})
					wg.Go(func() {
						rng := rand.New(rand.NewPCG(round, uint64(2*i+1)))
						iov := make([][]byte, per)
						for range calls {
							for k := range iov {
								o := rng.IntN(blocks) * size
								iov[k] = dst[o : o+size]
							}
							if err := readvFull(receivers[i], iov); err != nil {
								errs <- err
								return
							}
						}
					})
				}
				wg.Wait()
				close(errs)
				for err := range errs {
					b.Fatal(err)
				}
			}
			cpu := proccpu.Self() - cpu0
			gb := float64(b.N) * request / 1e9
			b.ReportMetric(gb/b.Elapsed().Seconds(), "GB/s")
			b.ReportMetric(cpu.Seconds()/gb, "cpu-s/GB")
		})
	}
}

// readvFull fills iov from c with readv, waiting in the netpoller while
// nothing is to be read.
func readvFull(c *net.TCPConn, iov [][]byte) error {
	rc, err := c.SyscallConn()
	if err != nil {
		return err
	}
	want := 0
	for _, v := range iov {
		want += len(v)
	}
	var got int
	var rerr error
	for got < want && rerr == nil {
		err := rc.Read(func(fd uintptr) bool {
			n, err := unix.Readv(int(fd), iov)
			switch {
			case errors.Is(err, unix.EAGAIN):
				return false
			case err != nil:
				rerr = err
			case n == 0:
				rerr = fmt.Errorf("readv: EOF after %d of %d bytes", got, want)
			default:
				got += n
				for n > 0 { // drop what came
					k := min(n, len(iov[0]))
					iov[0] = iov[0][k:]
					n -= k
					if len(iov[0]) == 0 {
						iov = iov[1:]
					}
				}
			}
			return true
		})
		if err != nil {
			return err
		}
	}
	return rerr
}
