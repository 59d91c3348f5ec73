package moonring_test

// Child processes for the tests and benchmarks that need two OS processes:
// the test binary re-executes itself with MOONRING_CHILD set.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime/pprof"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/internal/childproc"
	"github.com/moonring/moonring/metadata"
	etcdstore "github.com/moonring/moonring/metadata/etcd"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/shm"
	"github.com/moonring/moonring/tcp"
)

// childKey is the segment key the parent and its children share.
var childKey = []byte("moonring two-process test key")

// runChild runs the role named by MOONRING_CHILD and exits; it reports
// false when this process is not a child.
func runChild() bool {
	role := os.Getenv("MOONRING_CHILD")
	if role == "" {
		return false
	}
	var err error
	switch role {
	case "target":
		err = childTarget()
	case "sink", "source", "pong":
		err = childRaw(role)
	case "answer":
		err = childAnswer()
	case "peers":
		err = childPeers()
	default:
		err = fmt.Errorf("unknown child role %q", role)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		os.Exit(1)
	}
	os.Exit(0)
	return true
}

// childTarget serves a remote-accessible buffer over TCP and prints the
// engine's descriptor as one JSON line; it stops when stdin closes
// (internal/childproc's protocol, no commands).
// MOONRING_SIZE is the buffer's size; MOONRING_LISTEN, when set, is the
// TCP listen address (default 127.0.0.1:0), for a target inside a network
// namespace.
//
// With MOONRING_ETCD set (an etcd client URL) the target publishes its
// segment there, named MOONRING_NAME, under a lease of MOONRING_ETCD_TTL
// (a duration; default the store's), so peers discover it through etcd.
// MOONRING_CHILD_CPUPROFILE=FILE writes a CPU profile to FILE.<pid>.
// With MOONRING_SHM set it also installs the shm transport; with
// MOONRING_HEAP set its buffer is Go memory rather than from Alloc (which
// shm then reaches through process_vm calls, not a mapping); with
// MOONRING_HUGETLB set Alloc takes reserved huge pages (Config.HugeTLB).
// It takes two
// commands: "shm-off" uninstalls its shm transport (peers' shm paths
// die, TCP stays) and answers "ok"; "shm-on" installs a new one and
// answers its descriptor, republished.
func childTarget() error {
	size, _ := strconv.Atoi(os.Getenv("MOONRING_SIZE"))
	var store metadata.Store = metadata.NewMemory()
	if ep := os.Getenv("MOONRING_ETCD"); ep != "" {
		ttl, _ := time.ParseDuration(os.Getenv("MOONRING_ETCD_TTL"))
		es, err := etcdstore.New(etcdstore.Config{Endpoints: []string{ep}, TTL: ttl})
		if err != nil {
			return err
		}
		defer es.Close()
		store = es
	}
	cfg := moonring.Config{Name: os.Getenv("MOONRING_NAME"), Metadata: store, TCP: &tcp.Config{Key: childKey, Listen: os.Getenv("MOONRING_LISTEN")}}
	if os.Getenv("MOONRING_SHM") != "" {
		cfg.SHM = &shm.Config{}
	}
	cfg.HugeTLB = os.Getenv("MOONRING_HUGETLB") != ""
	e, err := moonring.New(cfg)
	if err != nil {
		return err
	}
	defer e.Close()
	buf := make([]byte, size)
	if os.Getenv("MOONRING_HEAP") == "" {
		if buf, err = e.Alloc(size, "cpu:0"); err != nil {
			return err
		}
	}
	for i := range buf {
		buf[i] = byte(i * 7)
	}
	if _, err := e.RegisterLocalMemory(buf, "cpu:0", true); err != nil {
		return err
	}
	d, err := store.Get(context.Background(), e.Name())
	if err != nil {
		return err
	}
	j, err := json.Marshal(d)
	if err != nil {
		return err
	}
	if path := os.Getenv("MOONRING_CHILD_CPUPROFILE"); path != "" {
		// For profiling the target side of a benchmark: one file per child.
		f, err := os.Create(fmt.Sprintf("%s.%d", path, os.Getpid()))
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	return childproc.Serve(string(j), func(cmd string) string {
		switch cmd {
		case "shm-off":
			if err := e.UninstallTransport(shm.Name); err != nil {
				return "error: " + err.Error()
			}
			return "ok"
		case "shm-on":
			t, err := shm.New(shm.Config{Key: childKey})
			if err == nil {
				if err = e.InstallTransport(t); err != nil && e.Transport(shm.Name) == nil {
					t.Close() // refused (one installed whose publish failed is the engine's)
				}
			}
			if err != nil {
				return "error: " + err.Error()
			}
			d, err := store.Get(context.Background(), e.Name())
			if err != nil {
				return "error: " + err.Error()
			}
			j, err := json.Marshal(d)
			if err != nil {
				return "error: " + err.Error()
			}
			return string(j)
		}
		return "error: unknown command " + cmd
	})
}

// childRaw is the raw TCP baseline's far end: a sink that reads and drops,
// a source that writes without end, or an 8-byte echo.
func childRaw(role string) error {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	go func() { childproc.Serve(ln.Addr().String(), nil); os.Exit(0) }()
	c, err := ln.Accept()
	if err != nil {
		return err
	}
	c.(*net.TCPConn).SetNoDelay(true)
	buf := make([]byte, 1<<20)
	switch role {
	case "sink":
		// Read into buf itself: io.CopyBuffer would ignore it (the
		// connection's WriteTo and io.Discard's ReadFrom take over) and
		// read through an 8 KiB buffer that never leaves the L1 cache,
		// which is not landing the bytes in memory as a target does.
		for err == nil {
			_, err = c.Read(buf)
		}
	case "source":
		for err == nil {
			_, err = c.Write(buf)
		}
	case "pong":
		var b [8]byte
		for {
			if _, err = io.ReadFull(c, b[:]); err != nil {
				break
			}
			if _, err = c.Write(b[:]); err != nil {
				break
			}
		}
	}
	if errors.Is(err, io.EOF) || errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET) {
		err = nil // the parent closed the connection: the normal end
	}
	return err
}

// childAnswer is BenchmarkScalePeersApartRaw's far end: it prints its
// listen address, then serves every connection to it with rawAnswer until
// stdin closes.
func childAnswer() error {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	go func() { childproc.Serve(ln.Addr().String(), nil); os.Exit(0) }()
	answer := rawAnswerBuffer()
	for {
		c, err := ln.Accept()
		if err != nil {
			return err
		}
		c.(*net.TCPConn).SetNoDelay(true)
		go rawAnswer(c, answer)
	}
}

// child is a running child process; Line is the first line it printed.
type child struct{ *childproc.Proc }

// startChild starts a child in role (MOONRING_CHILD) with env added.
func startChild(t testing.TB, role string, env ...string) *child {
	t.Helper()
	return startChildVia(t, nil, role, env...)
}

// startChildVia starts the child through a wrapper command that execs its
// arguments, such as "ip netns exec NS".
func startChildVia(t testing.TB, wrapper []string, role string, env ...string) *child {
	t.Helper()
	return &child{childproc.Start(t, childproc.Config{Env: append([]string{"MOONRING_CHILD=" + role}, env...),
		Wrapper: wrapper, Name: role})}
}

// targetDesc decodes the descriptor a target child printed.
func (c *child) targetDesc(t testing.TB) *segtable.SegmentDesc {
	t.Helper()
	d, err := segtable.UnmarshalDesc([]byte(c.Line))
	if err != nil {
		t.Fatalf("child descriptor: %v", err)
	}
	return d
}

// remoteEngine starts an initiator engine that knows the target child's
// descriptor through its own store, and opens the segment.
func remoteEngine(t testing.TB, c *child, cfg moonring.Config) (*moonring.Engine, moonring.SegmentID, *segtable.SegmentDesc) {
	t.Helper()
	d := c.targetDesc(t)
	store := metadata.NewMemory()
	if err := store.Put(context.Background(), d); err != nil {
		t.Fatal(err)
	}
	cfg.Metadata = store
	if cfg.TCP == nil {
		cfg.TCP = &tcp.Config{Key: childKey}
	}
	e, err := moonring.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	seg, err := e.OpenSegment(context.Background(), d.Name)
	if err != nil {
		t.Fatal(err)
	}
	return e, seg, d
}
