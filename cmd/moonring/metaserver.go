package main

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/moonring/moonring/metadata"
)

// metaServerCtx is the context metadata-server serves under: it stops, as
// on SIGINT or SIGTERM, when the context is done. Tests replace it with one
// they cancel.
var metaServerCtx = ctxMain

// metaServerGrace bounds how long a stopping metadata-server waits for the
// requests in flight.
const metaServerGrace = 5 * time.Second

const metaServerHelp = `usage: moonring metadata-server [flags]

Serve segment descriptors to the engines' http metadata stores
(--metadata http://HOST:PORT on serve and bench). Descriptors expire
unless their owners renew them; --dir keeps them across restarts, a file
each.

What it holds. A descriptor says where a segment's engine listens and,
for each of its buffers, the address, length and buffer keys that its
transports check. The server hands any descriptor to anyone who asks for
its name: reading one opens nothing by itself, since a peer must still
prove the segment key in the transport's hello before it reaches any
buffer (and the engines sign descriptors under that key, so a changed one
is refused). A segment served --insecure has no segment key: its
descriptor then publishes what opens it, and anyone who can read it here
and reach the segment's endpoint can read and write its buffers.

Owners. With the deployment's segment key (--key-file FILE, or the
environment variable ` + keyEnv + `; never on the command line), every PUT
and DELETE must carry the owner token that the key derives for its name:
nobody without the key can create, replace, renew or delete a name.
Without a key, the server binds each name to the token of its creator
(trust on first use) and refuses changes by anyone else until the entry
goes; names created without a token stay open to anyone unless
--require-owner. Tokens travel in the clear over http: beyond a trusted
network, serve https (--tls-cert and --tls-key) and give the engines an
https:// URL.

Limits: descriptors over --max-descriptor are refused (413), and so are
an engine's descriptor sent as chunks (a header and a chunk per 32
buffers, so that a republish moves one chunk) whose header or a chunk is
over it, or whose chunks add up to more than --max-chunked; a PUT past
--max-names names or --max-bytes bytes of descriptors is refused (429);
connections past --max-conns are closed at once. Refusals are logged on
stderr at most once every ten seconds per kind.

Listing: GET /moonring/v1/segments answers the names the server holds,
one a line (JSON with Accept: application/json); --list --dir DIR prints
the segments kept in a directory (name, epoch, time to live, owner,
buffers), whether a server runs on it or not.

`

// metaServer runs `moonring metadata-server`: it serves a metadata.Server
// on --listen until SIGINT, SIGTERM or the end of metaServerCtx, then shuts
// down gracefully. It prints one line, "metadata-server listening on
// http://ADDR" (https with --tls-cert) with the bound address, once it
// accepts connections; what the server logs (expiries, refusals) goes to
// stderr.
func metaServer(args []string, out io.Writer) error {
	fs := flag.NewFlagSet("metadata-server", flag.ContinueOnError)
	fs.SetOutput(io.Discard) // errors are reported once, by main
	listen := fs.String("listen", "127.0.0.1:8470", "the address to serve on (host:port; :0 picks a port)")
	dir := fs.String("dir", "", "the directory that keeps the descriptors across restarts, a file each (default: memory only)")
	maxTTL := fs.Duration("max-ttl", metadata.DefaultMaxTTL, "the longest time to live a client may ask for")
	keyFile := fs.String("key-file", "", "the file holding the segment key (mode 0600; default: $"+keyEnv+", else no key: names bound on first use)")
	requireOwner := fs.Bool("require-owner", false, "without a key, refuse names created without an owner token")
	maxDesc := fs.String("max-descriptor", "1M", "the largest descriptor a PUT may send (bytes, or K, M, G suffixes in either case)")
	maxNames := fs.Int("max-names", metadata.DefaultMaxNames, "the most names the server holds")
	maxBytes := fs.String("max-bytes", "256M", "the most bytes of descriptors the server holds (K, M, G suffixes in either case)")
	maxChunked := fs.String("max-chunked", "64M", "the most bytes one descriptor sent as chunks may hold, header and chunks (K, M, G suffixes in either case)")
	maxConns := fs.Int("max-conns", metadata.DefaultMaxConns, "the most connections open at once")
	tlsCert := fs.String("tls-cert", "", "serve https with this certificate (PEM; with --tls-key)")
	tlsKey := fs.String("tls-key", "", "the private key of --tls-cert (PEM)")
	list := fs.Bool("list", false, "list the segments kept in --dir (name, epoch, time to live, owner, size) and exit; a running server lists its own at GET /moonring/v1/segments")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprint(out, metaServerHelp)
			fs.SetOutput(out)
			fs.PrintDefaults()
			return nil
		}
		return fmt.Errorf("metadata-server: %w", err)
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("metadata-server: unexpected argument %q", fs.Arg(0))
	}
	if *list {
		if *dir == "" {
			return errors.New("metadata-server: --list reads the directory of --dir; a server without one keeps its segments in memory: ask it, GET http://ADDR/moonring/v1/segments")
		}
		return listDir(*dir, out)
	}
	if (*tlsCert == "") != (*tlsKey == "") {
		return errors.New("metadata-server: --tls-cert and --tls-key go together")
	}
	if *maxNames <= 0 || *maxConns <= 0 {
		return errors.New("metadata-server: --max-names and --max-conns must be positive")
	}
	var sizes [3]int
	for i, s := range []string{*maxDesc, *maxBytes, *maxChunked} {
		v, err := parseSize(s)
		if err != nil {
			return fmt.Errorf("metadata-server: %w", err)
		}
		sizes[i] = v
	}
	key, err := loadKey(*keyFile)
	if err != nil {
		return fmt.Errorf("metadata-server: %w", err)
	}
	logger := log.New(os.Stderr, "metadata-server: ", log.LstdFlags)
	srv, err := metadata.NewServer(metadata.ServerConfig{
		Dir:           *dir,
		MaxTTL:        *maxTTL,
		Key:           key,
		RequireOwner:  *requireOwner,
		MaxDescriptor: sizes[0],
		MaxBytes:      int64(sizes[1]),
		MaxChunked:    int64(sizes[2]),
		MaxNames:      *maxNames,
		MaxConns:      *maxConns,
		Logf:          logger.Printf,
	})
	if err != nil {
		return err
	}
	defer srv.Close()
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		return fmt.Errorf("metadata-server: %w", err)
	}
	hs := srv.HTTPServer()
	hs.Handler = withList(srv, hs.Handler)
	served := make(chan error, 1)
	scheme := "http"
	if *tlsCert != "" {
		cert, err := tls.LoadX509KeyPair(*tlsCert, *tlsKey)
		if err != nil {
			ln.Close()
			return fmt.Errorf("metadata-server: TLS certificate: %w", err)
		}
		hs.TLSConfig = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
		scheme = "https"
		go func() { served <- hs.ServeTLS(srv.LimitListener(ln), "", "") }()
	} else {
		go func() { served <- hs.Serve(srv.LimitListener(ln)) }()
	}
	switch {
	case key == nil && *requireOwner:
		logger.Printf("no segment key: each name is bound to the owner token that created it (trust on first use); names without one are refused")
	case key == nil:
		logger.Printf("no segment key: each name is bound to the owner token that created it (trust on first use); names created without one are open to anyone")
	}
	if key != nil && scheme == "http" && !loopback(ln.Addr().String()) {
		logger.Printf("serving plain http beyond loopback: owner tokens travel in the clear, and an observer on the path can replay them (--tls-cert, --tls-key)")
	}
	fmt.Fprintf(out, "metadata-server listening on %s://%s\n", scheme, ln.Addr())

	ctx, stop := signal.NotifyContext(metaServerCtx, syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	select {
	case <-ctx.Done():
	case err := <-served:
		return fmt.Errorf("metadata-server: %w", err)
	}
	sctx, cancel := context.WithTimeout(context.Background(), metaServerGrace)
	defer cancel()
	if err := hs.Shutdown(sctx); err != nil {
		hs.Close()
	}
	<-served
	return nil
}

// segmentsPath lists the server's segments (GET); the metadata protocol
// has each one under it, segmentsPath + "/" + name.
const segmentsPath = "/moonring/v1/segments"

// segmentNames is what a metadata.Server needs to list its segments.
type segmentNames interface{ Names() []string }

// withList serves GET segmentsPath, the server's names one a line (JSON
// with Accept: application/json), before the metadata protocol's paths.
// The names are no secret: anyone may GET a descriptor by name.
func withList(srv *metadata.Server, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != segmentsPath && r.URL.Path != segmentsPath+"/" {
			next.ServeHTTP(w, r)
			return
		}
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			w.Header().Set("Allow", "GET, HEAD")
			http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
			return
		}
		lister, ok := any(srv).(segmentNames)
		if !ok {
			http.Error(w, fmt.Sprintf("this build's metadata server cannot list its names (it holds %d); with --dir, moonring metadata-server --list --dir DIR does", srv.Stats().Names), http.StatusNotImplemented)
			return
		}
		names := lister.Names()
		slices.Sort(names)
		if strings.Contains(r.Header.Get("Accept"), "application/json") {
			w.Header().Set("Content-Type", "application/json")
			json.NewEncoder(w).Encode(map[string]any{"segments": names})
			return
		}
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		for _, n := range names {
			fmt.Fprintln(w, n)
		}
	})
}

// dirEntry is what --list reads of a file of the server's directory: the
// fields it prints, ignoring the rest.
type dirEntry struct {
	Name  string `json:"name"`
	Rev   uint64 `json:"rev"`
	TTL   string `json:"ttl"`
	Owner string `json:"owner"`
	Desc  struct {
		Epoch   uint64            `json:"epoch"`
		Buffers []json.RawMessage `json:"buffers"`
	} `json:"desc"`
	// Header is, instead of Desc, the header of a descriptor sent as
	// chunks (its chunks are files of their own).
	Header *struct {
		Desc struct {
			Epoch uint64 `json:"epoch"`
		} `json:"desc"`
		Chunks []struct {
			N int `json:"n"`
		} `json:"chunks"`
	} `json:"header"`
}

// epochBuffers returns the epoch and the number of buffers of e.
func (e *dirEntry) epochBuffers() (uint64, int) {
	if e.Header == nil {
		return e.Desc.Epoch, len(e.Desc.Buffers)
	}
	n := 0
	for _, c := range e.Header.Chunks {
		n += c.N
	}
	return e.Header.Desc.Epoch, n
}

// listDir prints the segments kept in dir, one a line, sorted by name.
// It reads the files as they are: a server running on dir writes each
// change to its file before answering, and removes the file of a name
// that expired or was deleted.
func listDir(dir string, out io.Writer) error {
	files, err := filepath.Glob(filepath.Join(dir, "seg-*.json"))
	if err != nil {
		return fmt.Errorf("metadata-server: --list: %w", err)
	}
	if _, err := os.Stat(dir); err != nil {
		return fmt.Errorf("metadata-server: --list: %w", err)
	}
	var ents []dirEntry
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			fmt.Fprintf(stderr, "metadata-server: --list: %v\n", err)
			continue
		}
		var e dirEntry
		if err := json.Unmarshal(b, &e); err != nil || e.Name == "" {
			fmt.Fprintf(stderr, "metadata-server: --list: %s: not an entry of the server (%v)\n", f, err)
			continue
		}
		ents = append(ents, e)
	}
	slices.SortFunc(ents, func(a, b dirEntry) int { return strings.Compare(a.Name, b.Name) })
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "segment\tepoch\tttl\towner\tbuffers\t")
	for _, e := range ents {
		owner := "none (open to anyone without a key)"
		if e.Owner != "" {
			owner = "bound"
		}
		epoch, bufs := e.epochBuffers()
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%d\t\n", e.Name, epoch, e.TTL, owner, bufs)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(out, "%d segments in %s\n", len(ents), dir)
	return nil
}
