package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
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

// metaServer runs `moonring metadata-server`: it serves a metadata.Server
// on --listen until SIGINT, SIGTERM or the end of metaServerCtx, then shuts
// down gracefully. It prints one line, "metadata-server listening on
// http://ADDR" with the bound address, once it accepts connections; what
// the server logs (expiries) goes to stderr.
func metaServer(args []string, out io.Writer) error {
	fs := flag.NewFlagSet("metadata-server", flag.ContinueOnError)
	fs.SetOutput(io.Discard) // errors are reported once, by main
	listen := fs.String("listen", "127.0.0.1:8470", "the address to serve on (host:port; :0 picks a port)")
	dir := fs.String("dir", "", "the directory that keeps the descriptors across restarts (default: memory only)")
	maxTTL := fs.Duration("max-ttl", metadata.DefaultMaxTTL, "the longest time to live a client may ask for")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprint(out, "usage: moonring metadata-server [--listen ADDR] [--dir DIR] [--max-ttl D]\n\n")
			fs.SetOutput(out)
			fs.PrintDefaults()
			return nil
		}
		return fmt.Errorf("metadata-server: %w", err)
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("metadata-server: unexpected argument %q", fs.Arg(0))
	}
	logger := log.New(os.Stderr, "metadata-server: ", log.LstdFlags)
	srv, err := metadata.NewServer(metadata.ServerConfig{Dir: *dir, MaxTTL: *maxTTL, Logf: logger.Printf})
	if err != nil {
		return err
	}
	defer srv.Close()
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		return fmt.Errorf("metadata-server: %w", err)
	}
	hs := &http.Server{
		Handler:           srv,
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       30 * time.Second,
		WriteTimeout:      30 * time.Second,
		IdleTimeout:       2 * time.Minute,
		MaxHeaderBytes:    64 << 10,
		ErrorLog:          logger,
	}
	served := make(chan error, 1)
	go func() { served <- hs.Serve(ln) }()
	fmt.Fprintf(out, "metadata-server listening on http://%s\n", ln.Addr())

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
