package moonring_test

import (
	"bytes"
	"context"
	"fmt"
	"log"
	"math/rand/v2"
	"time"

	"golang.org/x/sys/unix"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/nvlink"
	"github.com/moonring/moonring/tcp"
)

// exampleKey stands for the deployment's segment key; read it from a file
// or MOONRING_KEY in a real program, never compile it in.
var exampleKey = []byte("example segment key")

// Two engines of one process over TCP: the target registers a buffer that
// peers may read and write, the initiator opens its segment by name and
// writes into it. In a deployment each engine is its own process, and the
// store is a metadata server, etcd or p2p (metadata.NewP2P).
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	store := metadata.NewMemory()
	newEngine := func(name string) *moonring.Engine {
		e, err := moonring.New(moonring.Config{Name: name, Metadata: store, Key: exampleKey,
			Transports: []string{"tcp"}, TCP: &tcp.Config{Listen: "127.0.0.1:0"}})
		if err != nil {
			log.Fatal(err)
		}
		return e
	}
	target, initiator := newEngine("example-target"), newEngine("example-initiator")
	defer target.Close()
	defer initiator.Close()

	remote := make([]byte, 4096)
	if _, err := target.RegisterLocalMemory(remote, "cpu:0", true); err != nil {
		log.Fatal(err)
	}
	local := []byte("hello, segment")
	if _, err := initiator.RegisterLocalMemory(local, "cpu:0", false); err != nil {
		log.Fatal(err)
	}
	seg, err := initiator.OpenSegment(ctx, "example-target")
	if err != nil {
		log.Fatal(err)
	}
	info, _ := initiator.Segment(seg) // what the target offers
	err = initiator.Transfer(ctx, moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(local),
		TargetID: seg, TargetOffset: info.Buffers[0].Addr, Length: uint64(len(local))})
	fmt.Println(info.Transport, err, string(remote[:len(local)]))
	// Output: tcp <nil> hello, segment
}

// The Mooncake-style batch API: allocate a batch, submit its tasks, poll
// their status words (or WaitBatch), free it.
func ExampleEngine_AllocateBatchID() {
	e, err := moonring.New(moonring.Config{Name: "example-batch"})
	if err != nil {
		log.Fatal(err)
	}
	defer e.Close()
	src, dst := bytes.Repeat([]byte{7}, 8192), make([]byte, 8192)
	e.RegisterLocalMemory(src, "cpu:0", false)
	e.RegisterLocalMemory(dst, "cpu:0", true)

	id, err := e.AllocateBatchID(2)
	if err != nil {
		log.Fatal(err)
	}
	reqs := []moonring.TransferRequest{
		{Opcode: moonring.Write, Source: moonring.AddressOf(src), TargetID: moonring.LocalSegmentID, TargetOffset: uint64(moonring.AddressOf(dst)), Length: 4096},
		{Opcode: moonring.Write, Source: moonring.AddressOf(src[4096:]), TargetID: moonring.LocalSegmentID, TargetOffset: uint64(moonring.AddressOf(dst[4096:])), Length: 4096},
	}
	if err := e.SubmitTransfer(id, reqs); err != nil {
		log.Fatal(err)
	}
	if err := e.WaitBatch(context.Background(), id); err != nil {
		log.Fatal(err)
	}
	for i := range reqs {
		st, _ := e.GetTransferStatus(id, i)
		fmt.Println(i, st.Status, st.Bytes)
	}
	if err := e.FreeBatchID(id); err != nil {
		log.Fatal(err)
	}
	// Output:
	// 0 COMPLETED 4096
	// 1 COMPLETED 4096
}

// The ring API from an event loop: submit 64-byte entries, then wait for
// completions with CQ().Wait, which parks the goroutine. Do not spin on
// Peek: with few Ps a spinning caller holds the CPU the engine's poller
// and transports need (a 4 KiB TCP READ took 40 ms at GOMAXPROCS=1 that
// way, 60 µs with Wait).
func ExampleRing() {
	e, err := moonring.New(moonring.Config{Name: "example-ring"})
	if err != nil {
		log.Fatal(err)
	}
	defer e.Close()
	src, dst := bytes.Repeat([]byte{1}, 1<<16), make([]byte, 1<<16)
	sid, _ := e.RegisterLocalMemory(src, "cpu:0", false)
	e.RegisterLocalMemory(dst, "cpu:0", true)
	r, err := e.NewRing(moonring.RingConfig{Entries: 64})
	if err != nil {
		log.Fatal(err)
	}
	defer r.Close()
	for i := range 4 {
		off := uint64(i) << 14
		err := r.SubmitOne(&moonring.Entry{Op: moonring.OpWrite, Segment: moonring.LocalSegmentID, Buffer: sid,
			Local: off, Remote: uint64(moonring.AddressOf(dst)) + off, Length: 1 << 14, UserData: uint64(i)})
		if err != nil {
			log.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for done := 0; done < 4; {
		if err := r.CQ().Wait(ctx, 1); err != nil {
			log.Fatal(err)
		}
		for c := r.Peek(); c != nil; c = r.Peek() {
			if c.Err() != nil {
				log.Fatal(c.Err())
			}
			done++
			r.Advance(1)
		}
	}
	fmt.Println(bytes.Equal(src, dst))
	// Output: true
}

// A prepared list: a KV cache's scattered pages, here 64 of 4 KiB each
// placed at random in the destination, moved with one entry. The list is
// checked when the poller takes the entry (any block outside its buffer
// or the segment fails it before a byte moves) and completes once, with
// the bytes of all its blocks. Lists may be kept and reused, or made and
// freed per request.
func ExampleEngine_PrepareList() {
	e, err := moonring.New(moonring.Config{Name: "example-lists"})
	if err != nil {
		log.Fatal(err)
	}
	defer e.Close()
	const page, pages = 4096, 64
	src, dst := make([]byte, page*pages), make([]byte, page*pages)
	for i := range src {
		src[i] = byte(i / page)
	}
	sid, _ := e.RegisterLocalMemory(src, "cpu:0", false)
	e.RegisterLocalMemory(dst, "cpu:0", true)
	base := uint64(moonring.AddressOf(dst))
	blocks := make([]moonring.Block, pages)
	for i, j := range rand.New(rand.NewPCG(1, 2)).Perm(pages) {
		blocks[i] = moonring.Block{Local: uint64(i * page), Remote: base + uint64(j*page), Length: page}
	}
	list, err := e.PrepareList(blocks)
	if err != nil {
		log.Fatal(err)
	}
	defer e.FreeList(list)
	r, err := e.NewRing(moonring.RingConfig{Entries: 8})
	if err != nil {
		log.Fatal(err)
	}
	defer r.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	le := moonring.ListEntry(moonring.OpWrite, sid, moonring.LocalSegmentID, list, 0, pages, 1)
	if _, err := r.SubmitAndWait(ctx, []moonring.Entry{le}, 1); err != nil {
		log.Fatal(err)
	}
	c := r.Peek()
	fmt.Println(c.Err(), c.Bytes, dst[blocks[10].Remote-base] == 10)
	r.Advance(1)
	// Output: <nil> 262144 true
}

// The ring's eventfd on the caller's own epoll: the descriptor is readable
// while completions wait, so the ring joins an event loop that also waits
// on sockets and timers.
func ExampleRing_eventFD() {
	e, err := moonring.New(moonring.Config{Name: "example-eventfd"})
	if err != nil {
		log.Fatal(err)
	}
	defer e.Close()
	src, dst := []byte("through epoll"), make([]byte, 64)
	sid, _ := e.RegisterLocalMemory(src, "cpu:0", false)
	e.RegisterLocalMemory(dst, "cpu:0", true)
	r, err := e.NewRing(moonring.RingConfig{})
	if err != nil {
		log.Fatal(err)
	}
	defer r.Close()
	efd, err := r.CQ().EventFD() // the ring owns it and closes it
	if err != nil {
		log.Fatal(err)
	}
	ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		log.Fatal(err)
	}
	defer unix.Close(ep)
	if err := unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, efd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(efd)}); err != nil {
		log.Fatal(err)
	}
	r.SubmitOne(&moonring.Entry{Op: moonring.OpWrite, Segment: moonring.LocalSegmentID, Buffer: sid,
		Remote: uint64(moonring.AddressOf(dst)), Length: uint64(len(src)), UserData: 9})
	events := make([]unix.EpollEvent, 8)
	for {
		n, err := unix.EpollWait(ep, events, 10_000)
		if err == unix.EINTR {
			continue
		}
		if err != nil || n == 0 {
			log.Fatal("no completion: ", err)
		}
		if c := r.Peek(); c != nil { // the eventfd may be readable on an empty ring; Peek resets it
			fmt.Println(c.UserData, c.Err(), string(dst[:len(src)]))
			r.Advance(1)
			return
		}
	}
	// Output: 9 <nil> through epoll
}

// Write-with-notify: the target hears of the write once its bytes are in
// its memory, with a tag and a short message.
func ExampleNotify() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	store := metadata.NewMemory()
	target, err := moonring.New(moonring.Config{Name: "example-notify-target", Metadata: store})
	if err != nil {
		log.Fatal(err)
	}
	defer target.Close()
	initiator, err := moonring.New(moonring.Config{Name: "example-notify-initiator", Metadata: store})
	if err != nil {
		log.Fatal(err)
	}
	defer initiator.Close()
	kv := make([]byte, 4096)
	target.RegisterLocalMemory(kv, "cpu:0", true)
	src := bytes.Repeat([]byte{42}, 4096)
	initiator.RegisterLocalMemory(src, "cpu:0", false)
	seg, err := initiator.OpenSegment(ctx, "example-notify-target")
	if err != nil {
		log.Fatal(err)
	}
	err = initiator.Transfer(ctx, moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(src),
		TargetID: seg, TargetOffset: uint64(moonring.AddressOf(kv)), Length: 4096,
		Notify: &moonring.Notify{Tag: 7, Msg: []byte("kv ready")}})
	if err != nil {
		log.Fatal(err)
	}
	n := <-target.Notifications()
	fmt.Println(n.From, n.Tag, string(n.Msg), kv[4095])
	// Output: example-notify-initiator 7 kv ready 42
}

// GPU memory: with the nvlink transport installed (where libcuda.so.1 is),
// Alloc and RegisterLocalMemory take "cuda:N" locations. Peers on the same
// host reach it over CUDA IPC; as the local side of requests over TCP or
// shm it is staged through pinned host memory. This example has no output
// to check: go test compiles it and runs it only on a machine with a GPU
// (scripts/gpu-check.sh).
func ExampleEngine_InstallTransport_gpu() {
	e, err := moonring.New(moonring.Config{Name: "example-gpu"})
	if err != nil {
		log.Fatal(err)
	}
	defer e.Close()
	nv, err := nvlink.New(nvlink.Config{})
	if err != nil {
		fmt.Println("no CUDA driver here:", err)
		return
	}
	if err := e.InstallTransport(nv); err != nil {
		log.Fatal(err)
	}
	g, err := e.Alloc(1<<30, "cuda:0")
	if err != nil {
		log.Fatal(err)
	}
	defer e.Free(g)
	if _, err := e.RegisterLocalMemory(g, "cuda:0", true); err != nil {
		log.Fatal(err)
	}
}
