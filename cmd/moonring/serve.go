package main

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/metadata/etcd"
	"github.com/moonring/moonring/mooncake"
	"github.com/moonring/moonring/mooncake/mctcp"
	"github.com/moonring/moonring/rdma"
	"github.com/moonring/moonring/shm"
	"github.com/moonring/moonring/tcp"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// stderr takes serve's and bench's warnings; tests replace it.
var stderr io.Writer = os.Stderr

const serveHelp = `usage: moonring serve [flags]

A standing target: serve a buffer over TCP (and shm to peers of this host)
until SIGINT or SIGTERM. The first line on stdout is
"serving segment NAME: ...", NAME being what peers open (with p2p, the
host:port of --listen).

--listen also serves /metrics (Prometheus: the engine's requests, bytes
and latency per ring and peer, refused connections and descriptors in
moonring_refused_total, Go runtime and process metrics) and /healthz
(200 and a JSON object with the segment, pid, host and version while the
buffer is served; 503 before and after).

` + keyHelp + `
Without a key, serve makes a random one for this run when it listens on
loopback only: it writes it to a new file of mode 0600 in the temporary
directory, names that file on its second line of stdout ("key: FILE ..."),
and removes it when it stops; a peer then runs
  moonring bench --segment NAME --key-file FILE
(or MOONRING_KEY=$(cat FILE) moonring bench --segment NAME). Listening
beyond loopback (--listen or --tcp-listen on 0.0.0.0, ::, a name or a
host's address) needs a key, or --insecure: then the segment has no key,
the descriptor publishes what opens it, and anyone who can reach
--listen can read and write the buffer.

--tls: the TCP transport serves TLS 1.3 with a certificate it makes at
start (ECDSA P-256, in memory only) and refuses plain connections; the
descriptor, signed under the segment key, pins the certificate's SHA-256,
so a peer dials TLS and accepts only that certificate. Without it the
hello still proves the key, but the frames after it (payloads, addresses,
buffer keys) cross the network in the clear, and a relay on the path can
read and change them. TLS protects those frames; it needs the key to
mean anything (an unsigned descriptor's pin can be swapped on its way),
and it costs CPU per byte (see BENCHMARKS.md). shm peers on this host are
not affected.

` + ttlHelp + `
On SIGINT or SIGTERM serve withdraws the buffer, giving the requests of
peers in flight up to --grace (a second signal ends the grace). Past it,
it cuts the peers still using the buffer and exits with status 3, within
a few seconds whatever the peers do; status 2 is any other failure.

` + mooncakeHelp + `With --mooncake the segment is published through --mooncake-metadata
(not --metadata), --listen serves /metrics and /healthz alone, and the
first line of stdout names the Mooncake RPC and TCP data ports too.
Moonring peers still reach the buffer over moonring's TCP and shm, with
the key; Mooncake peers over Mooncake's TCP, without one.

flags:
`

// defaultSegName is serve's segment name with a metadata server when
// --name is not given: <hostname>-<pid>-<8 random hex digits>. A killed
// target's entry outlives it until its TTL, held under its owner token: a
// later one given the same pid (a busy host reuses them within seconds, a
// container's process is often pid 1) and another key must not find its
// name taken, nor may two containers on the host's network share one.
func defaultSegName() string {
	hn, _ := os.Hostname()
	var r [4]byte
	rand.Read(r[:])
	return fmt.Sprintf("%s-%d-%x", hn, os.Getpid(), r)
}

// serve runs a standing target: it registers a buffer remote-accessible,
// publishes its segment through its own p2p endpoint (the segment's name),
// serves /metrics there, and runs until SIGINT or SIGTERM (or until stop is
// closed, for tests). It then stops taking requests and gives those in
// flight up to --grace to finish before it closes.
func serve(args []string, out io.Writer, stop <-chan struct{}) (retErr error) {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	listen := fs.String("listen", "127.0.0.1:7000", "the p2p metadata endpoint (the segment's name) and /metrics")
	keyFile := fs.String("key-file", "", "read the segment key from this file (mode 0600; default: $"+keyEnv+")")
	insecure := fs.Bool("insecure", false, "with no key, serve beyond loopback anyway: anyone who reaches --listen can read and write the buffer")
	tcpListen := fs.String("tcp-listen", "", "the TCP transport's address (default: the endpoint's host, any port)")
	bufSize := fs.String("buffer-size", "64M", "the buffer to serve (K, M, G suffixes in either case; at most 64G)")
	nbufs := fs.Int("buffers", 1, "serve this many buffers of --buffer-size, each filled and registered alike (Mooncake's transfer_engine_bench uses the target's buffer [thread % its NUMA nodes]: give it as many as the initiator host has NUMA nodes); --check-seed checks the first")
	noSHM := fs.Bool("no-shm", false, "serve over TCP only, without the same-host shm transport")
	hugeTLB := fs.Bool("hugetlb", false, "take the buffer from the kernel's reserved huge pages (vm.nr_hugepages) when enough are free and its size is a multiple of 2 MiB (Config.HugeTLB): shared memory gets 2 MiB pages whatever the kernel's shmem_enabled")
	grace := fs.Duration("grace", 5*time.Second, "how long peers' requests in flight get at shutdown (a second signal ends it); then the peers still using the buffer are cut and serve exits with status 3")
	meta := fs.String("metadata", "p2p", "p2p (the segment is named by --listen), http://HOST:PORT of a metadata-server, or etcd://HOST:PORT[,...]")
	name := fs.String("name", "", "the segment's name with an http metadata server (default <hostname>-<pid>-<8 random hex digits>)")
	ttl := addTTLFlag(fs)
	useTLS := fs.Bool("tls", false, "serve TCP as TLS 1.3 with a certificate made at start, whose SHA-256 the signed descriptor pins: peers' frames (payloads, addresses, buffer keys) can be neither read nor changed on the path; plain hellos are refused")
	mc := addMooncakeFlags(fs, true)
	fillSeed := fs.Uint64("fill-seed", 0, "fill the buffer with the seeded pattern S instead of the default one (the 64-bit word at byte 8i is (i+1)*0x9E3779B97F4A7C15 XOR S), for a peer that checks what it READs")
	checkSeed := fs.Uint64("check-seed", 0, "at shutdown, check that the buffer holds the seeded pattern S (what a peer WROTE); exit 2 when it does not")
	if err := parseFlags(fs, args, out, serveHelp); err != nil {
		return err
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if err := mc.check(set); err != nil {
		return fmt.Errorf("serve: %w", err)
	}
	if *mc.on && set["metadata"] {
		return errors.New("serve: --metadata is moonring's store; with --mooncake the segment is published through --mooncake-metadata")
	}
	if err := checkTTL(*ttl, set["ttl"], *meta, *mc.on); err != nil {
		return fmt.Errorf("serve: %w", err)
	}
	sizes, err := parseSizes(*bufSize)
	if err == nil && len(sizes) != 1 {
		err = fmt.Errorf("bad size %q: one size, not a list", *bufSize)
	}
	if err != nil {
		return fmt.Errorf("serve: --buffer-size: %w", err)
	}
	if *nbufs < 1 || *nbufs > maxServeBuffers {
		return fmt.Errorf("serve: --buffers %d: want 1 to %d", *nbufs, maxServeBuffers)
	}
	if *grace < 0 {
		return fmt.Errorf("serve: --grace %v: want 0 or more (0: cut the peers in flight at once)", *grace)
	}
	key, err := loadKey(*keyFile)
	if err != nil {
		return fmt.Errorf("serve: %w", err)
	}
	keyNote := ""
	switch {
	case key != nil:
	case !loopback(*listen) || (*tcpListen != "" && !loopback(*tcpListen)):
		if !*insecure {
			return fmt.Errorf("serve: %w: --listen %s / --tcp-listen %q reach beyond loopback; give the key with --key-file FILE or %s (or --insecure to let anyone who reaches the port read and write the buffer)", errNeedKey, *listen, *tcpListen, keyEnv)
		}
		fmt.Fprintf(stderr, "moonring serve: WARNING: --insecure and no segment key: the segment's descriptor publishes what opens it, so ANYONE who can reach %s can read and write the served buffer\n", *listen)
	case *insecure:
		fmt.Fprintf(stderr, "moonring serve: WARNING: --insecure and no segment key: anyone on this host who can reach %s can read and write the served buffer\n", *listen)
	default:
		key = newKey()
		file, err := writeKeyFile(key)
		if err != nil {
			return fmt.Errorf("serve: %w", err)
		}
		defer os.Remove(file)
		keyNote = fmt.Sprintf("key: %s (made for this run, mode 0600, removed at exit); peers: moonring bench --key-file %s, or %s=$(cat %s)\n", file, file, keyEnv, file)
	}
	if *useTLS && key == nil {
		// The pin protects only in a descriptor signed under the key.
		fmt.Fprintf(stderr, "moonring serve: WARNING: --tls without a segment key: the descriptor is not signed, so whoever can change it on its way can change the certificate it pins; TLS then keeps out only passive observers\n")
	}
	var metrics atomic.Pointer[http.Handler] // set once the engine exists
	var health atomic.Pointer[healthInfo]    // set once the buffer is served, cleared at shutdown
	metricsHandler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/metrics":
			if h := metrics.Load(); h != nil {
				(*h).ServeHTTP(w, r)
				return
			}
		case "/healthz":
			serveHealth(w, health.Load())
			return
		}
		http.NotFound(w, r)
	})
	// Warnings (peers refused or cut by the limits, failed proofs of the
	// key) go to stderr, each kind a line a second at most.
	logger := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	var store metadata.Store
	var p2p *metadata.P2P      // the p2p endpoint, with --metadata p2p
	var metricsLn *capListener // serve's own /metrics listener, with a metadata server
	segName := *name
	host := "127.0.0.1"
	var closers []func() // run at return, last first
	defer func() {
		for _, c := range slices.Backward(closers) {
			c()
		}
	}()
	// metricsOnListen serves /metrics and /healthz on --listen alone, when
	// no p2p endpoint hosts them, and takes the host for the transports.
	metricsOnListen := func() error {
		ln, err := net.Listen("tcp", *listen)
		if err != nil {
			return fmt.Errorf("metrics endpoint: %w", err)
		}
		srv := &http.Server{Handler: metricsHandler, ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 10 * time.Second,
			WriteTimeout: 10 * time.Second, IdleTimeout: 30 * time.Second, MaxHeaderBytes: 16 << 10}
		metricsLn = &capListener{Listener: ln, max: maxMetricsConns, log: logger}
		go srv.Serve(metricsLn)
		closers = append(closers, func() { srv.Close() })
		// A listener on all interfaces gives an unspecified host: the TCP
		// transport listens there too and advertises an interface's.
		host, _, err = net.SplitHostPort(ln.Addr().String())
		return err
	}
	switch {
	case *mc.on:
		var err error
		if store, err = mc.store(); err != nil {
			return fmt.Errorf("serve: %w", err)
		}
		if store != nil {
			closers = append(closers, func() { store.Close() })
			if segName == "" {
				segName = defaultSegName()
			}
		}
		if err := metricsOnListen(); err != nil {
			return err
		}
	case *meta == "p2p":
		p, err := metadata.NewP2P(metadata.P2PConfig{Listen: *listen, Handler: metricsHandler, Logf: func(f string, a ...any) { logger.Warn(fmt.Sprintf(f, a...)) }})
		if err != nil {
			return err
		}
		defer p.Close()
		store, segName = p, p.Name()
		p2p = p
		if host, _, err = net.SplitHostPort(p.Name()); err != nil {
			return err
		}
	case strings.HasPrefix(*meta, "http://") || strings.HasPrefix(*meta, "https://") || strings.HasPrefix(*meta, "etcd://"):
		var err error
		if strings.HasPrefix(*meta, "etcd://") {
			var ec etcd.Config
			if ec, err = etcd.ParseURL(*meta); err == nil {
				ec.TTL = *ttl
				store, err = etcd.New(ec)
			}
		} else {
			// The key proves the segment's name to the metadata server.
			store, err = metadata.NewHTTP(metadata.HTTPConfig{URL: *meta, Key: key, Logger: logger, TTL: *ttl})
		}
		if err != nil {
			return err
		}
		defer store.Close()
		if segName == "" {
			segName = defaultSegName()
		}
		// No p2p endpoint to host /metrics: serve it on --listen alone.
		if err := metricsOnListen(); err != nil {
			return err
		}
	default:
		return fmt.Errorf("bad metadata %q (want p2p, http://host:port or etcd://host:port)", *meta)
	}
	if *tcpListen == "" {
		*tcpListen = net.JoinHostPort(host, "0")
	}
	// The TCP transport logs the connections it refuses (wrong key, bad
	// hello, handshake timeout, ...) at info, a line a second per reason
	// at most: serve shows those beside the warnings.
	tcpLogger := slog.New(refusalsHandler{slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelInfo})})
	cfg := moonring.Config{Name: segName, Metadata: store, Logger: logger, TCP: &tcp.Config{Listen: *tcpListen, Key: key, Logger: tcpLogger, AutoTLS: *useTLS}, HugeTLB: *hugeTLB}
	if !*noSHM {
		cfg.SHM = &shm.Config{Logger: logger}
	}
	if *mc.on {
		cfg.Mooncake = mc.config()
	}
	e, err := moonring.New(cfg)
	if err != nil {
		return err
	}
	var bufs [][]byte
	defer func() {
		// Close unpublishes the segment (a failure leaves it in the
		// store) and ends every peer's use of the buffers: only then
		// may their memory go.
		if err := e.Close(); err != nil && retErr == nil {
			retErr = fmt.Errorf("shutdown: %w", err)
		}
		for _, b := range bufs {
			e.Free(b)
		}
	}()
	h := metricsFor(e, p2p, metricsLn)
	metrics.Store(&h)
	for range *nbufs {
		b, err := e.Alloc(sizes[0], "cpu:0")
		if err != nil {
			return err
		}
		bufs = append(bufs, b)
		if set["fill-seed"] {
			seedPattern(b, *fillSeed)
		} else {
			fillPattern(b)
		}
		if _, err := e.RegisterLocalMemory(b, "cpu:0", true); err != nil {
			return err
		}
	}
	buf := bufs[0]
	hostname, _ := os.Hostname()
	health.Store(&healthInfo{Status: "ok", Segment: e.Name(), PID: os.Getpid(), Host: hostname, Version: version(), Buffer: len(buf)})
	tlsNote := ""
	if t, ok := e.Transport(tcp.Name).(*tcp.Transport); ok && t.Fingerprint() != "" {
		tlsNote = ", tcp TLS 1.3 certificate sha256 " + t.Fingerprint()
	}
	if *mc.on {
		tlsNote += fmt.Sprintf(", mooncake rpc %s tcp %s", e.MooncakeRPC(), e.Transport(mctcp.Name).Endpoint())
		if t, ok := e.Transport(rdma.MooncakeName).(*rdma.Transport); ok {
			tlsNote += fmt.Sprintf(" rdma %s", t.ExtraEndpoints()[mooncake.EndpointRDMANICs])
		}
		tlsNote += " (no authentication)"
	}
	more := ""
	for _, b := range bufs[1:] {
		more += fmt.Sprintf(", %#x", moonring.AddressOf(b))
	}
	fmt.Fprintf(out, "serving segment %s: %d bytes at %#x%s, metadata %s%s\n", e.Name(), len(buf), moonring.AddressOf(buf), more, e.Config().Metadata, tlsNote)
	fmt.Fprint(out, keyNote)
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	defer signal.Stop(sig)
	select {
	case <-sig:
	case <-stop:
	}
	health.Store(nil) // stopping: /healthz answers 503
	// Graceful: unregistering waits for the requests that use the buffer,
	// up to the grace period (or a second signal); peers then find no
	// buffer and get errors. Past it, the peers still in the buffer are
	// cut: the transports give up on them when ctx ends, and Close (the
	// deferred one) closes every connection.
	ctx, cancel := context.WithTimeout(context.Background(), *grace)
	defer cancel()
	go func() {
		select {
		case <-sig:
			cancel()
		case <-ctx.Done():
		}
	}()
	if err := e.UnregisterLocalMemoryBatch(ctx, bufs); err != nil {
		if ctx.Err() != nil {
			return &exitError{code: exitGraceOut, err: fmt.Errorf("shutdown: %w: peers still used the buffer after %v, so they were cut: %w", errGraceOut, *grace, err)}
		}
		return fmt.Errorf("shutdown: %w", err)
	}
	if set["check-seed"] {
		if off := seedDiff(buf, *checkSeed); off >= 0 {
			return fmt.Errorf("serve --check-seed: the buffer differs from pattern %d at byte %d", *checkSeed, off)
		}
		fmt.Fprintf(out, "the buffer holds pattern %d: ok\n", *checkSeed)
	}
	return nil
}

// maxServeBuffers bounds serve --buffers.
const maxServeBuffers = 64

// errGraceOut reports a shutdown whose grace ran out.
var errGraceOut = errors.New("the grace ran out")

// exitGraceOut is serve's exit status when its grace ran out and it cut
// the peers still using its buffer.
const exitGraceOut = 3

// exitError is an error that asks for an exit status other than 2.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

// exitCode returns the exit status for err: 0 for nil and -h, the code of
// an exitError, else 2.
func exitCode(err error) int {
	var ee *exitError
	switch {
	case err == nil, errors.Is(err, flag.ErrHelp):
		return 0
	case errors.As(err, &ee):
		return ee.code
	}
	return 2
}

// refusalsHandler passes on warnings and errors, and of the records below
// them only the TCP transport's refusals ("tcp: connection refused",
// rate-limited by the transport), not its connection events.
type refusalsHandler struct{ slog.Handler }

func (h refusalsHandler) Handle(ctx context.Context, r slog.Record) error {
	if r.Level < slog.LevelWarn && !strings.HasPrefix(r.Message, "tcp: connection refused") {
		return nil
	}
	return h.Handler.Handle(ctx, r)
}

func (h refusalsHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return refusalsHandler{h.Handler.WithAttrs(as)}
}

func (h refusalsHandler) WithGroup(name string) slog.Handler {
	return refusalsHandler{h.Handler.WithGroup(name)}
}

// healthInfo is what serve's /healthz answers while it serves its buffer.
type healthInfo struct {
	Status  string `json:"status"`
	Segment string `json:"segment"`
	PID     int    `json:"pid"`
	Host    string `json:"host"`
	Version string `json:"version"`
	Buffer  int    `json:"buffer_size"`
}

// serveHealth answers /healthz: 200 and h as JSON while the buffer is
// served, 503 before (starting) and after (stopping).
func serveHealth(w http.ResponseWriter, h *healthInfo) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	if h == nil {
		w.WriteHeader(http.StatusServiceUnavailable)
		io.WriteString(w, `{"status":"unavailable"}`+"\n")
		return
	}
	json.NewEncoder(w).Encode(h)
}

// metricsFor is serve's /metrics: the engine's collector (requests and
// bytes per ring and peer, refusals in moonring_refused_total, ...), the
// Go runtime's and the process's collectors, and the connections of the
// endpoint that serves it.
func metricsFor(e *moonring.Engine, p2p *metadata.P2P, ln *capListener) http.Handler {
	reg := prometheus.NewRegistry()
	reg.MustRegister(e.Collector(), collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		endpointCollector{p2p: p2p, ln: ln})
	return promhttp.HandlerFor(reg, promhttp.HandlerOpts{})
}

var (
	mEndpointConns   = prometheus.NewDesc("moonring_serve_endpoint_connections", "Connections open to serve's HTTP endpoint (the p2p metadata endpoint, or /metrics alone with a metadata server).", []string{"endpoint"}, nil)
	mEndpointRefused = prometheus.NewDesc("moonring_serve_endpoint_refused_total", "Connections to serve's HTTP endpoint closed by its bounds, by reason.", []string{"endpoint", "reason"}, nil)
)

// endpointCollector counts the connections of serve's HTTP endpoint.
type endpointCollector struct {
	p2p *metadata.P2P
	ln  *capListener
}

func (c endpointCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- mEndpointConns
	ch <- mEndpointRefused
}

func (c endpointCollector) Collect(ch chan<- prometheus.Metric) {
	if c.p2p != nil {
		st := c.p2p.Stats()
		ch <- prometheus.MustNewConstMetric(mEndpointConns, prometheus.GaugeValue, float64(st.Conns), "p2p")
		ch <- prometheus.MustNewConstMetric(mEndpointRefused, prometheus.CounterValue, float64(st.Evicted), "p2p", "evicted")
		ch <- prometheus.MustNewConstMetric(mEndpointRefused, prometheus.CounterValue, float64(st.Refused), "p2p", "conn_cap")
	}
	if c.ln != nil {
		ch <- prometheus.MustNewConstMetric(mEndpointConns, prometheus.GaugeValue, float64(c.ln.open.Load()), "metrics")
		ch <- prometheus.MustNewConstMetric(mEndpointRefused, prometheus.CounterValue, float64(c.ln.refused.Load()), "metrics", "conn_cap")
	}
}
