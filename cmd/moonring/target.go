// target.go holds what a bench sweep runs against: a second engine of this
// process, or a target process (one bench starts on loopback, or another
// given with --segment) reached over TCP or shm; opening its segment, what
// its buffer holds, and the errors that say what became of it.

package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/metadata/etcd"
	"github.com/moonring/moonring/shm"
	"github.com/moonring/moonring/tcp"
)

// pattern is what a bench target's buffer holds at offset i before any
// WRITE: the initiator checks READs against it.
func pattern(i int) byte { return byte(i*7 ^ i>>9) }

// patternRun is pattern over one 512-byte run that starts at a multiple of
// 512 with i>>9 == 0, as words: byte(i*7) repeats every 256 bytes, so
// every such run is this one with its bytes XORed with i>>9.
var patternRun = func() (w [64]uint64) {
	var b [512]byte
	for i := range b {
		b[i] = pattern(i)
	}
	for k := range w {
		w[k] = binary.LittleEndian.Uint64(b[8*k:])
	}
	return w
}()

// fillPattern sets b[i] to pattern(i), 8 bytes at a time: about 15 GB/s
// on the development VM where a byte at a time filled 1.5-2.0
// (BenchmarkFillPattern), 1-1.4 s of a 2 GiB bench target's start.
func fillPattern(b []byte) {
	i := 0
	for ; i+512 <= len(b); i += 512 {
		x := uint64(byte(i>>9)) * 0x0101010101010101
		run := b[i : i+512 : i+512]
		for k, w := range patternRun {
			binary.LittleEndian.PutUint64(run[8*k:], w^x)
		}
	}
	for ; i < len(b); i++ {
		b[i] = pattern(i)
	}
}

// target is what a sweep runs against: an initiator engine, the target's
// segment and buffer, and what the buffer holds.
type target struct {
	// progress, when set, shows a live line while a step runs; the
	// function it returns ends it.
	progress  func(res result, d time.Duration) func()
	transport string
	name      string // the target's segment
	pid       int    // the target's process, when known
	started   bool   // by this command
	ini       *moonring.Engine
	seg       moonring.SegmentID
	base      uint64 // the remote buffer's address
	model     []byte // what the remote buffer holds
	closers   []func()
	store     metadata.Store  // the initiator's, for asking after the target
	exited    <-chan struct{} // closed when the target process this command started exits
	exit      atomic.Pointer[error]
	// peers are every target (the first is the one above): --targets N.
	peers []peer
	// mcArgs are the Mooncake flags of the target processes this command
	// starts (bench --mooncake), or nil.
	mcArgs []string
	pids   []int // of the target processes this command started
	// ttl is --ttl, handed to the target processes this command starts;
	// 0 when not given.
	ttl time.Duration
	// huge is --hugetlb, handed to the target processes this command
	// starts.
	huge bool
}

// peer is one target of a sweep.
type peer struct {
	name    string
	pid     int
	started bool
	seg     moonring.SegmentID
	base    uint64
	mem     []byte // the target's buffer, when it is in this process
}

// firstLine is the stdout of a target process: it hands on the first line
// (the target's "serving segment ..." line) and drops the rest.
type firstLine struct {
	line chan string
	buf  []byte
	sent bool
}

func (w *firstLine) Write(p []byte) (int, error) {
	if w.sent {
		return len(p), nil
	}
	w.buf = append(w.buf, p...)
	if i := bytes.IndexByte(w.buf, '\n'); i >= 0 || len(w.buf) > 4096 {
		if i < 0 {
			i = len(w.buf)
		}
		w.line <- string(w.buf[:i])
		w.sent, w.buf = true, nil
	}
	return len(p), nil
}

// openError says why the target's segment could not be opened, naming the
// side that refused and what to check.
func openError(name string, noKey bool, err error) error {
	fix := "check that both sides hold the same key (--key-file FILE or " + keyEnv + ")"
	switch {
	case errors.Is(err, metadata.ErrForged):
		if noKey {
			break
		}
		return &explained{fmt.Sprintf("this process refused the descriptor of segment %s: it is not signed with this process's segment key, so the target runs with another key (or the descriptor was changed on its way); %s", name, fix), err}
	case errors.Is(err, tcp.ErrPinMismatch):
		return &explained{fmt.Sprintf("the target %s answered with a TLS certificate other than the one its descriptor pins (a relay on the path, or a target restarted since its descriptor was read)", name), err}
	case noKey && (errors.Is(err, moonring.ErrDenied) || errors.Is(err, tcp.ErrAuth)):
		return &explained{fmt.Sprintf("the target %s needs the segment key and this process has none: give it with --key-file FILE or %s", name, keyEnv), err}
	case errors.Is(err, moonring.ErrDenied), errors.Is(err, tcp.ErrAuth):
		return &explained{fmt.Sprintf("the target %s refused this process's segment key; %s", name, fix), err}
	}
	if noKey {
		return fmt.Errorf("open segment %s (no segment key given: --key-file FILE or %s): %w", name, keyEnv, err)
	}
	return fmt.Errorf("open segment %s: %w", name, err)
}

// healthPID asks the p2p endpoint addr (a moonring serve) for its
// process id on /healthz; 0 when it does not say.
func healthPID(ctx context.Context, addr string) int {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/healthz", nil)
	if err != nil {
		return 0
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	var h healthInfo
	if resp.StatusCode != http.StatusOK || json.NewDecoder(io.LimitReader(resp.Body, 4096)).Decode(&h) != nil || h.Segment != addr {
		return 0
	}
	return h.PID
}

// explained is an error told in the command's words: its text says what
// happened and what to do, and it wraps the library's error for errors.Is
// without printing its chain.
type explained struct {
	msg string
	err error
}

func (e *explained) Error() string { return e.msg }

func (e *explained) Unwrap() error { return e.err }

// stepError says what became of the target when a step's requests failed:
// a connection lost, a process that exited, a buffer withdrawn.
func (t *target) stepError(err error) error {
	if t.exited != nil {
		select {
		case <-t.exited:
			return fmt.Errorf("the target process (pid %d) exited (%v), so the connection to it was lost: %w", t.pid, *t.exit.Load(), err)
		case <-time.After(200 * time.Millisecond):
		}
	}
	gone := ""
	if t.store != nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		if _, gerr := t.store.Get(ctx, t.name); gerr != nil {
			gone = fmt.Sprintf(" (its segment is no longer published: %v)", gerr)
		}
		cancel()
	}
	switch {
	case errors.Is(err, moonring.ErrDenied):
		return fmt.Errorf("the target %s refused the requests: it no longer serves the buffer (stopping, or restarted)%s: %w", t.name, gone, err)
	case errors.Is(err, moonring.ErrTransport), errors.Is(err, moonring.ErrTimeout):
		return fmt.Errorf("the connection to the target %s was lost%s: %w", t.name, gone, err)
	}
	return err
}

func (t *target) close() {
	for i := len(t.closers) - 1; i >= 0; i-- {
		t.closers[i]()
	}
}

// localTarget is a second engine of this process (n of them for --targets
// n); the initiator engine runs pollers pollers a NUMA node. Without a
// model (kv) the buffers are left as Alloc made them.
func localTarget(ctx context.Context, size, n, pollers int, model, huge bool) (*target, error) {
	t := &target{transport: "local"}
	ini, err := moonring.New(moonring.Config{Pollers: pollers, HugeTLB: huge})
	if err != nil {
		return nil, err
	}
	t.ini = ini
	t.closers = append(t.closers, func() { ini.Close() })
	for range max(1, n) {
		tgt, err := moonring.New(moonring.Config{HugeTLB: huge})
		if err != nil {
			t.close()
			return nil, err
		}
		t.closers = append(t.closers, func() { tgt.Close() })
		remote, err := tgt.Alloc(size, "cpu:0")
		if err != nil {
			t.close()
			return nil, err
		}
		if model {
			fillPattern(remote)
		}
		if _, err := tgt.RegisterLocalMemory(remote, "cpu:0", true); err != nil {
			t.close()
			return nil, err
		}
		seg, err := ini.OpenSegment(ctx, tgt.Name())
		if err != nil {
			t.close()
			return nil, err
		}
		t.peers = append(t.peers, peer{name: tgt.Name(), pid: os.Getpid(), seg: seg, base: uint64(moonring.AddressOf(remote)), mem: remote})
	}
	p := t.peers[0]
	t.seg, t.base, t.name, t.pid = p.seg, p.base, p.name, p.pid
	if model {
		t.model = bytes.Clone(p.mem)
	}
	return t, nil
}

// remoteTarget opens the segments names over TCP or shm (proto), first
// starting n target processes on loopback when names is empty: those
// processes and this one then share a key made for the run. Otherwise the
// key comes from keyFile or MOONRING_KEY (loadKey). ttl, when not 0, is the
// time to live of what this process's store and the target processes it
// starts publish. Without a model (kv) the first target's contents are not
// modelled.
func remoteTarget(ctx context.Context, proto string, noMap, useTLS bool, names []string, n int, meta, localName, keyFile string, ttl time.Duration, size, pollers int, model, huge bool, mc *mooncakeFlags) (*target, error) {
	if localName != "" && meta == "p2p" {
		return nil, errors.New("--local-name needs --metadata http or etcd: with p2p the name is the endpoint's address")
	}
	t := &target{transport: proto, ttl: ttl, huge: huge}
	if mc != nil {
		t.mcArgs = mc.args()
	}
	var key []byte
	started := len(names) == 0
	if started {
		key = newKey()
		for i := range max(1, n) {
			name, err := t.start(ctx, key, size, meta, useTLS, i == 0)
			if err != nil {
				t.close()
				return nil, err
			}
			names = append(names, name)
		}
	} else {
		var err error
		if key, err = loadKey(keyFile); err != nil {
			return nil, fmt.Errorf("bench: %w", err)
		}
	}
	var store metadata.Store
	var err error
	switch {
	case mc != nil:
		store, err = mc.store() // nil with p2p: the engine makes its P2PHANDSHAKE store
	case meta == "p2p":
		store, err = metadata.NewP2P(metadata.P2PConfig{})
	case strings.HasPrefix(meta, "etcd://"):
		var ec etcd.Config
		if ec, err = etcd.ParseURL(meta); err == nil {
			ec.TTL = ttl
			store, err = etcd.New(ec)
		}
	default:
		store, err = metadata.NewHTTP(metadata.HTTPConfig{URL: meta, Key: key, TTL: ttl})
	}
	if err != nil {
		t.close()
		return nil, err
	}
	if store != nil {
		t.closers = append(t.closers, func() { store.Close() })
	}
	cfg := moonring.Config{Name: localName, Metadata: store, Transports: []string{proto}, TCP: &tcp.Config{Key: key}, Pollers: pollers, HugeTLB: huge}
	if proto == "shm" {
		cfg.SHM = &shm.Config{NoMap: noMap}
	}
	if mc != nil {
		cfg.Mooncake, cfg.Transports = mc.config(), []string{mc.dataTransport()}
	}
	ini, err := moonring.New(cfg)
	if err != nil {
		t.close()
		return nil, err
	}
	t.ini = ini
	t.closers = append(t.closers, func() { ini.Close() })
	t.store = ini.Config().Metadata // the P2PHANDSHAKE store the engine made, with --mooncake
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for i, name := range names {
		desc, err := t.store.Get(ctx, name)
		if err != nil {
			t.close()
			return nil, fmt.Errorf("segment %s: %w", name, err)
		}
		if useTLS && !strings.Contains(desc.Endpoints[tcp.Name], "?tls=") {
			t.close()
			return nil, fmt.Errorf("bench --tls: the target %s serves plain TCP (its endpoint %q pins no certificate): start it with serve --tls, or leave out --tls", name, desc.Endpoints[tcp.Name])
		}
		bufs := desc.AllBuffers()
		if len(bufs) == 0 || bufs[0].Length < uint64(size) {
			t.close()
			return nil, fmt.Errorf("segment %s serves no buffer of %d bytes", name, size)
		}
		p := peer{name: name, base: bufs[0].Addr, started: started}
		if p.seg, err = ini.OpenSegment(ctx, name); err != nil {
			t.close()
			return nil, openError(name, key == nil, err)
		}
		if i == 0 {
			if t.transport, err = ini.SegmentTransport(p.seg); err != nil {
				t.close()
				return nil, err
			}
			if t.transport == tcp.Name && strings.Contains(desc.Endpoints[tcp.Name], "?tls=") {
				t.transport = "tcp/tls" // the endpoint pins a certificate: the initiator dials TLS
			}
			if t.transport == "shm" && noMap {
				t.transport = "shm/process_vm"
			}
		}
		switch {
		case started:
			p.pid = t.pids[i]
		case meta == "p2p" && mc == nil:
			p.pid = healthPID(ctx, name)
		}
		t.peers = append(t.peers, p)
	}
	p := t.peers[0]
	t.name, t.seg, t.base, t.pid = p.name, p.seg, p.base, p.pid
	if model {
		t.model = make([]byte, size)
		fillPattern(t.model)
		if mc != nil && !started {
			// A Mooncake engine's buffer holds what it holds: write the
			// model into it first, so that READs can be checked.
			if err := t.seed(ctx); err != nil {
				t.close()
				return nil, fmt.Errorf("bench --mooncake: writing the pattern into %s's buffer first: %w", t.name, err)
			}
		}
	}
	return t, nil
}

// targetName is the segment name of a target process this command
// starts (bench --mode target) with a metadata server: serve's default,
// <hostname>-<pid>-<8 random hex digits>, made here so that the initiator
// knows it. Each run's targets hold a key of their own, and a killed
// one's entry outlives it until its TTL: the random part keeps a later
// target given the same PID from finding its name held under another key.
func targetName() string { return defaultSegName() }

// start starts a target process on loopback with key and returns its
// segment's name; the first one's exit is what stepError reports.
func (t *target) start(ctx context.Context, key []byte, size int, meta string, useTLS, first bool) (string, error) {
	self, err := os.Executable()
	if err != nil {
		return "", err
	}
	cmd := exec.Command(self, "bench", "--mode", "target", "--buffer-size", strconv.Itoa(size))
	if t.mcArgs != nil {
		cmd.Args = append(cmd.Args, t.mcArgs...)
	} else {
		cmd.Args = append(cmd.Args, "--metadata", meta)
	}
	if t.ttl != 0 {
		cmd.Args = append(cmd.Args, "--ttl", t.ttl.String())
	}
	if useTLS {
		cmd.Args = append(cmd.Args, "--tls")
	}
	if t.huge {
		cmd.Args = append(cmd.Args, "--hugetlb")
	}
	// The key through the environment, which only this user can read
	// (/proc/PID/environ), not the command line, which anyone can.
	cmd.Env = append(slices.DeleteFunc(os.Environ(), func(v string) bool { return strings.HasPrefix(v, keyEnv+"=") }),
		keyEnv+"="+string(key))
	cmd.Stderr = os.Stderr
	// Its own process group: a Ctrl-C at the terminal ends the sweep,
	// and the sweep then ends the target (stdin), not the signal.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if targetStarted != nil {
		targetStarted(cmd, key)
	}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return "", err
	}
	line1 := &firstLine{line: make(chan string, 1)}
	cmd.Stdout = line1
	if err := cmd.Start(); err != nil {
		return "", fmt.Errorf("start the target: %w", err)
	}
	exited := make(chan struct{})
	var exit atomic.Pointer[error]
	go func() {
		err := cmd.Wait()
		exit.Store(&err)
		if first {
			t.exit.Store(&err)
		}
		close(exited)
	}()
	if first {
		t.exited = exited
		t.pid, t.started = cmd.Process.Pid, true
	}
	t.pids = append(t.pids, cmd.Process.Pid)
	t.closers = append(t.closers, func() { stdin.Close(); <-exited })
	var line string
	select {
	case line = <-line1.line:
	case <-exited:
	case <-ctx.Done():
	}
	f := strings.Fields(line)
	if len(f) < 3 || f[0] != "serving" || f[1] != "segment" {
		stdin.Close()
		<-exited
		if e := exit.Load(); e != nil {
			return "", fmt.Errorf("the target process (pid %d) did not start: it exited (%v)", cmd.Process.Pid, *e)
		}
		return "", fmt.Errorf("the target process (pid %d) did not start (it printed %q)", cmd.Process.Pid, line)
	}
	return strings.TrimSuffix(f[2], ":"), nil
}

// seed writes the model into the target's buffer, through the engine.
func (t *target) seed(ctx context.Context) error {
	buf, err := t.ini.Alloc(len(t.model), "cpu:0")
	if err != nil {
		return err
	}
	defer t.ini.Free(buf)
	copy(buf, t.model)
	if _, err := t.ini.RegisterLocalMemory(buf, "cpu:0", false); err != nil {
		return err
	}
	defer t.ini.UnregisterLocalMemory(context.Background(), buf)
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	return t.ini.Transfer(ctx, moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(buf), TargetID: t.seg, TargetOffset: t.base, Length: uint64(len(buf))})
}
