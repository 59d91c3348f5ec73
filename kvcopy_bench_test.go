package moonring_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/internal/fastcopy"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/shm"
)

// BenchmarkKVCopy is the memory's own share of `moonring bench --pattern
// kv`: the engine's copy routine (internal/fastcopy, what the local and
// shm transports copy with) alone, with no engine, of the same bytes the same ways, one
// request per op: 512 MiB as 16,384 transfers of 32 KiB between random
// blocks of two 2 GiB pools (pattern=kv), or as 512 transfers of 1 MiB
// (pattern=contig, the command's contig row). The pools are what the
// command's engines allocate: Engine.Alloc's memory, a memfd with the shm
// transport installed (mem=shared, 4 KiB pages where the kernel's
// shmem_enabled is never, as here) or anonymous memory with transparent
// huge pages advised (mem=anon, the in-process case). The ratio kv/contig
// of this benchmark is what the engine's kv/contig can reach at best;
// streams=2 splits each request between two goroutines, as the poller and
// one copy worker do (Config.CopyWorkers).
func BenchmarkKVCopy(b *testing.B) {
	const pool, small, large, request = 2 << 30, 32 << 10, 1 << 20, 512 << 20
	for _, kind := range []string{"shared", "anon"} {
		cfg := moonring.Config{Name: "kvcopy-" + kind, Metadata: metadata.NewMemory()}
		if kind == "shared" {
			cfg.Key, cfg.SHM = make([]byte, 32), &shm.Config{}
			for i := range cfg.Key {
				cfg.Key[i] = byte(i*31 + 7)
			}
		}
		e, err := moonring.New(cfg)
		if err != nil {
			b.Fatal(err)
		}
		if (e.Transport(shm.Name) != nil) != (kind == "shared") {
			e.Close()
			b.Skipf("mem=%s: the engine's transports do not give that memory", kind)
		}
		src, err := e.Alloc(pool, "cpu:0")
		if err != nil {
			e.Close()
			b.Fatal(err)
		}
		dst, err := e.Alloc(pool, "cpu:0")
		if err != nil {
			e.Close()
			b.Fatal(err)
		}
		for i := 0; i < pool; i += 4096 { // every page in before any is timed
			src[i], dst[i] = 1, 1
		}
		for _, streams := range []int{1, 2} {
			for _, pattern := range []string{"contig", "kv"} {
				b.Run(fmt.Sprintf("mem=%s/streams=%d/pattern=%s", kind, streams, pattern), func(b *testing.B) {
					size := small
					if pattern == "contig" {
						size = large
					}
					n, blocks := request/size, pool/size
					b.SetBytes(request)
					for b.Loop() {
						var wg sync.WaitGroup
						for g := range streams {
							wg.Go(func() {
								rng := rand.New(rand.NewPCG(3, uint64(g)))
								for range n / streams {
									s, d := rng.IntN(blocks)*size, rng.IntN(blocks)*size
									fastcopy.Copy(dst[d:d+size], src[s:s+size])
								}
							})
						}
						wg.Wait()
					}
				})
			}
		}
		e.Free(src)
		e.Free(dst)
		e.Close()
	}
}

// kvTarget starts a target engine of this process, with its own memory
// metadata store, and registers a pool of size bytes from its Alloc,
// remote-accessible; b's cleanup closes the engine, then frees the pool.
func kvTarget(b *testing.B, name string, size int) (*moonring.Engine, []byte) {
	t, err := moonring.New(moonring.Config{Name: name, Metadata: metadata.NewMemory()})
	if err != nil {
		b.Fatal(err)
	}
	var mem []byte
	b.Cleanup(func() {
		t.Close()
		if mem != nil {
			t.Free(mem)
		}
	})
	if mem, err = t.Alloc(size, "cpu:0"); err != nil {
		b.Fatal(err)
	}
	if _, err := t.RegisterLocalMemory(mem, "cpu:0", true); err != nil {
		b.Fatal(err)
	}
	return t, mem
}

// BenchmarkKVBatch is the engine's per-task cost on the kv pattern: a
// batch of 4,096 READs of 32 KiB between random blocks of two 256 MiB
// pools of one process (the local transport: the copy is the engine's
// copy routine on the poller and its copy workers), through the batch API
// (AllocateBatchID, SubmitTransfer, WaitBatch, FreeBatchID), with the
// engine's default copy workers (api=batch) and with none
// (api=batch-noworkers), beside the same copies alone on one goroutine
// (api=copy). The difference per task is the engine's.
func BenchmarkKVBatch(b *testing.B) {
	const pool, size, tasks = 256 << 20, 32 << 10, 4096
	t, tmem := kvTarget(b, "kvbatch-t", pool)
	amem, err := t.Alloc(pool, "cpu:0")
	if err != nil {
		b.Fatal(err)
	}
	defer t.Free(amem)
	rng := rand.New(rand.NewPCG(5, 6))
	base := uint64(moonring.AddressOf(tmem))
	type task struct{ local, remote uint64 }
	ts := make([]task, tasks)
	for i := range ts {
		ts[i] = task{uint64(rng.IntN(pool/size) * size), uint64(rng.IntN(pool/size) * size)}
	}
	b.Run("api=copy", func(b *testing.B) {
		b.SetBytes(tasks * size)
		for b.Loop() {
			for _, x := range ts {
				fastcopy.Copy(amem[x.local:x.local+size], tmem[x.remote:x.remote+size])
			}
		}
	})
	for _, workers := range []int{0, -1} {
		name := "api=batch"
		if workers < 0 {
			name = "api=batch-noworkers"
		}
		b.Run(name, func(b *testing.B) {
			a, err := moonring.New(moonring.Config{Name: "kvbatch-a", Metadata: t.Config().Metadata, CopyWorkers: workers})
			if err != nil {
				b.Fatal(err)
			}
			defer a.Close()
			id, err := a.RegisterLocalMemory(amem, "cpu:0", false)
			if err != nil {
				b.Fatal(err)
			}
			defer a.UnregisterLocalMemory(context.Background(), amem)
			seg, err := a.OpenSegment(b.Context(), t.Name())
			if err != nil {
				b.Fatal(err)
			}
			reqs := make([]moonring.TransferRequest, tasks)
			for i, x := range ts {
				reqs[i] = moonring.TransferRequest{Opcode: moonring.Read, Buffer: id, Local: x.local,
					TargetID: seg, TargetOffset: base + x.remote, Length: size}
			}
			b.SetBytes(tasks * size)
			b.ReportAllocs()
			for b.Loop() {
				bid, err := a.AllocateBatchID(tasks)
				if err != nil {
					b.Fatal(err)
				}
				if err := a.SubmitTransfer(bid, reqs); err != nil {
					b.Fatal(err)
				}
				if err := a.WaitBatch(b.Context(), bid); err != nil {
					b.Fatal(err)
				}
				if err := a.FreeBatchID(bid); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkKVAPIs sets the batch API, the ring API and prepared lists
// beside each other on the kv pattern, request by request: one op is a
// request of 8,192 WRITEs of 32 KiB between random blocks of two 1 GiB
// pools moved through the batch API (AllocateBatchID, SubmitTransfer,
// GetTransferStatus of every task, FreeBatchID), a request of the same
// shape moved through a ring of 4,096 entries (Submit, PeekBatch,
// Advance, the CQ's Wait), and one moved as a prepared list (PrepareList
// of its blocks, entries of 256 of them through the ring, FreeList), in
// turn, the first of the three rotating; the engine's default copy
// workers; one or two requests in flight (inflight), as `moonring bench
// --pattern kv` keeps two. The target is an engine of this process
// (transport=local) or a child process whose pool the initiator maps
// (transport=shm). Interleaving at
// a request's grain (tens of ms) keeps the machine's drift out of the
// ratio: batch/ring is the batch API's rate over the ring's, and what it
// lacks of 1 is the batch API's own cost (its submit, its task table,
// its waits) against the ring's; lists/ring is what a prepared list saves
// of the ring's entry a block (or costs: the list is made per request).
func BenchmarkKVAPIs(b *testing.B) {
	const pool = 1 << 30
	b.Run("transport=local", func(b *testing.B) {
		t, tmem := kvTarget(b, "kvapis-t", pool)
		a, err := moonring.New(moonring.Config{Name: "kvapis-a", Metadata: t.Config().Metadata})
		if err != nil {
			b.Fatal(err)
		}
		defer a.Close()
		seg, err := a.OpenSegment(b.Context(), t.Name())
		if err != nil {
			b.Fatal(err)
		}
		for _, blk := range kvAPIBlocks {
			for _, inflight := range []int{1, 2} {
				b.Run(fmt.Sprintf("pattern=%s/inflight=%d", blk.pattern, inflight), func(b *testing.B) {
					kvAPIs(b, a, seg, uint64(moonring.AddressOf(tmem)), pool, inflight, blk.size)
				})
			}
		}
	})
	b.Run("transport=shm", func(b *testing.B) {
		c := startChild(b, "target", "MOONRING_SIZE="+strconv.Itoa(pool), "MOONRING_SHM=1")
		cfg := benchConfig()
		cfg.SHM = &shm.Config{}
		a, seg, d := remoteEngine(b, c, cfg)
		if name, _ := a.SegmentTransport(seg); name != shm.Name {
			b.Fatalf("segment opened over %q, want shm", name)
		}
		for _, blk := range kvAPIBlocks {
			for _, inflight := range []int{1, 2} {
				b.Run(fmt.Sprintf("pattern=%s/inflight=%d", blk.pattern, inflight), func(b *testing.B) {
					kvAPIs(b, a, seg, d.Buffers[0].Addr, pool, inflight, blk.size)
				})
			}
		}
	})
}

// kvAPIBlocks are BenchmarkKVAPIs' patterns: the kv pattern's scattered
// 32 KiB blocks, and the same bytes as 1 MiB blocks (the contig rows of
// `moonring bench --pattern kv`).
var kvAPIBlocks = []struct {
	pattern string
	size    int
}{{"kv", 32 << 10}, {"contig", 1 << 20}}

// kvAPIs is BenchmarkKVAPIs against a target pool of pool bytes at base
// in segment seg, open on a, with inflight requests in flight: each phase
// starts one request per stream, all through one API, and ends when all
// have (each stream with a ring of its own for the ring API; the batch
// API's streams share the engine's batch ring, as its callers do).
func kvAPIs(b *testing.B, a *moonring.Engine, seg moonring.SegmentID, base uint64, pool, inflight, size int) {
	tasks := 256 << 20 / size
	amem, err := a.Alloc(pool, "cpu:0")
	if err != nil {
		b.Fatal(err)
	}
	defer a.Free(amem)
	id, err := a.RegisterLocalMemory(amem, "cpu:0", false)
	if err != nil {
		b.Fatal(err)
	}
	defer a.UnregisterLocalMemory(context.Background(), amem)
	type stream struct {
		reqs   []moonring.TransferRequest
		es     []moonring.Entry
		ring   *moonring.Ring
		cqes   []moonring.Completion
		blocks []moonring.Block // the lists API's: es as a list
		les    []moonring.Entry // and its entries
	}
	streams := make([]stream, inflight)
	for w := range streams {
		ring, err := a.NewRing(moonring.RingConfig{Entries: 4096})
		if err != nil {
			b.Fatal(err)
		}
		defer ring.Close()
		streams[w] = stream{make([]moonring.TransferRequest, tasks), make([]moonring.Entry, tasks), ring, make([]moonring.Completion, 256),
			make([]moonring.Block, tasks), make([]moonring.Entry, 0, tasks/kvListBlocks+1)}
	}
	rng := rand.New(rand.NewPCG(7, 8))
	// Mooncake names a task's local side by address (Source), the ring
	// by buffer and offset: each API as its users call it. Streams never
	// share a block in flight.
	draw := func() {
		blocks := rng.Perm(pool / size)
		for w := range streams {
			st := &streams[w]
			for i := range st.reqs {
				l, r := uint64(blocks[(w*tasks+i)%len(blocks)]*size), uint64(rng.IntN(pool/size)*size)
				st.reqs[i] = moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(amem) + uintptr(l),
					TargetID: seg, TargetOffset: base + r, Length: uint64(size)}
				st.es[i] = moonring.Entry{Op: moonring.OpWrite, Segment: seg, Buffer: id, Local: l, Remote: base + r, Length: uint64(size), UserData: uint64(i)}
			}
		}
	}
	viaBatch := func(st *stream) error {
		bid, err := a.AllocateBatchID(tasks)
		if err != nil {
			return err
		}
		defer a.FreeBatchID(bid)
		if err := a.SubmitTransfer(bid, st.reqs); err != nil {
			return err
		}
		if err := a.WaitBatch(b.Context(), bid); err != nil {
			return err
		}
		for i := range tasks {
			if s, err := a.GetTransferStatus(bid, i); err != nil || s.Status != moonring.COMPLETED {
				return fmt.Errorf("batch task %d: %+v, %v", i, s, err)
			}
		}
		return nil
	}
	viaEntries := func(st *stream, es []moonring.Entry) error {
		next, done, tasks := 0, 0, len(es)
		for done < tasks {
			if next < tasks {
				n, err := st.ring.Submit(es[next:min(tasks, done+4096)])
				next += n
				if err != nil && !errors.Is(err, moonring.ErrSQFull) {
					return err
				}
			}
			n := st.ring.PeekBatch(st.cqes)
			if n == 0 {
				if done < next {
					if err := st.ring.CQ().Wait(b.Context(), 1); err != nil {
						return err
					}
				}
				continue
			}
			for _, c := range st.cqes[:n] {
				if c.Status != moonring.COMPLETED {
					return fmt.Errorf("ring entry %d: %+v", c.UserData, c)
				}
			}
			st.ring.Advance(n)
			done += n
		}
		return nil
	}
	viaLists := func(st *stream) error {
		for i, e := range st.es {
			st.blocks[i] = moonring.Block{Local: e.Local, Remote: e.Remote, Length: e.Length}
		}
		lid, err := a.PrepareList(st.blocks)
		if err != nil {
			return err
		}
		defer a.FreeList(lid)
		les := st.les[:0]
		for first := 0; first < tasks; first += kvListBlocks {
			les = append(les, moonring.ListEntry(moonring.OpWrite, id, seg, lid, first, min(kvListBlocks, tasks-first), uint64(len(les))))
		}
		return viaEntries(st, les)
	}
	errs := make([]error, inflight)
	phase := func(api int) time.Duration {
		start := time.Now()
		var wg sync.WaitGroup
		for w := range streams {
			wg.Go(func() {
				switch api {
				case apiBatch:
					errs[w] = viaBatch(&streams[w])
				case apiRing:
					errs[w] = viaEntries(&streams[w], streams[w].es)
				default:
					errs[w] = viaLists(&streams[w])
				}
			})
		}
		wg.Wait()
		d := time.Since(start)
		if err := errors.Join(errs...); err != nil {
			b.Fatal(err)
		}
		return d
	}
	draw()
	for api := range apis { // the batch ring made, the task table grown
		phase(api)
	}
	var in [apis]time.Duration
	b.SetBytes(int64(apis * inflight * tasks * size))
	round := 0
	for b.Loop() {
		draw()
		for k := range apis {
			api := (round + k) % apis
			in[api] += phase(api)
		}
		round++
	}
	gbps := func(d time.Duration) float64 { return float64(round*inflight*tasks*size) / d.Seconds() / 1e9 }
	b.ReportMetric(gbps(in[apiBatch]), "batch-GB/s")
	b.ReportMetric(gbps(in[apiRing]), "ring-GB/s")
	b.ReportMetric(gbps(in[apiLists]), "lists-GB/s")
	b.ReportMetric(gbps(in[apiBatch])/gbps(in[apiRing]), "batch/ring")
	b.ReportMetric(gbps(in[apiLists])/gbps(in[apiRing]), "lists/ring")
}

// kvAPIs' APIs, taken in turn.
const (
	apiBatch = iota
	apiRing
	apiLists
	apis
)

// kvListBlocks is how many of a prepared list's blocks kvAPIs' lists API
// moves with one entry.
const kvListBlocks = 256
