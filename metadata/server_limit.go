package metadata

import (
	"log"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// rateLog passes on at most one line per interval, and says how many it
// dropped meanwhile with the next one it passes. It is safe for concurrent
// use.
type rateLog struct {
	logf     func(string, ...any)
	interval time.Duration

	mu      sync.Mutex
	last    time.Time
	dropped int
}

func newRateLog(logf func(string, ...any), interval time.Duration) *rateLog {
	return &rateLog{logf: logf, interval: interval}
}

// printf logs the line unless another was logged less than an interval
// ago.
func (l *rateLog) printf(format string, args ...any) {
	l.mu.Lock()
	now := time.Now()
	if !l.last.IsZero() && now.Sub(l.last) < l.interval {
		l.dropped++
		l.mu.Unlock()
		return
	}
	l.last = now
	dropped := l.dropped
	l.dropped = 0
	l.mu.Unlock()
	if dropped > 0 {
		format += " (and %d more like it since the last such line)"
		args = append(args, dropped)
	}
	l.logf(format, args...)
}

// Write makes a rateLog the writer of a [log.Logger]: http.Server's
// messages (TLS handshakes that fail, say) are a stranger's to provoke.
func (l *rateLog) Write(p []byte) (int, error) {
	s := string(p)
	if n := len(s); n > 0 && s[n-1] == '\n' {
		s = s[:n-1]
	}
	l.printf("%s", s)
	return len(p), nil
}

// LimitListener returns ln limited to ServerConfig.MaxConns connections
// open at once: a connection accepted past the cap is closed at once,
// before anything is read from it, counted (ServerStats.ConnsRefused) and
// logged at most once every ten seconds. Connections count from their
// accept until their Close; an idle one is closed by the http.Server of
// [Server.HTTPServer] after its ReadHeaderTimeout (before its first request)
// or IdleTimeout (between requests), giving its place back.
//
// The cap is the server's, shared by every listener it limits. The returned
// listener is safe for concurrent use; closing it closes ln, and the
// connections it returned live until they are closed.
func (s *Server) LimitListener(ln net.Listener) net.Listener {
	return &serverListener{Listener: ln, s: s}
}

type serverListener struct {
	net.Listener
	s *Server
}

func (l *serverListener) Accept() (net.Conn, error) {
	s := l.s
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if s.conns.Add(1) > int64(s.maxConns) {
			s.conns.Add(-1)
			c.Close()
			s.stats.connsRefused.Add(1)
			s.connLog.printf("refused a connection from %s: %d connections open, the most this server keeps (MaxConns)", c.RemoteAddr(), s.maxConns)
			continue
		}
		return &serverConn{Conn: c, open: &s.conns}, nil
	}
}

// serverConn gives its place back once, at its first Close.
type serverConn struct {
	net.Conn
	open   *atomic.Int64
	closed atomic.Bool
}

func (c *serverConn) Close() error {
	if c.closed.CompareAndSwap(false, true) {
		c.open.Add(-1)
	}
	return c.Conn.Close()
}

// HTTPServer returns an [http.Server] that serves s with the limits of its
// configuration: MaxHeaderBytes, ReadHeaderTimeout, ReadTimeout,
// WriteTimeout and IdleTimeout, and its error log passed to
// ServerConfig.Logf at most once every ten seconds. Serve it on a listener
// from [Server.LimitListener], so that connections are capped too. Each
// call returns a new http.Server, which the caller serves, shuts down and
// closes; s must outlive it.
func (s *Server) HTTPServer() *http.Server {
	return &http.Server{
		Handler:           s,
		MaxHeaderBytes:    s.cfg.MaxHeaderBytes,
		ReadHeaderTimeout: s.cfg.ReadHeaderTimeout,
		ReadTimeout:       s.cfg.ReadTimeout,
		WriteTimeout:      s.cfg.WriteTimeout,
		IdleTimeout:       s.cfg.IdleTimeout,
		ErrorLog:          log.New(s.httpLog, "", 0),
	}
}
