package metadata

import (
	"log"
	"net"
	"net/http"
	"time"

	"github.com/moonring/moonring/internal/ratelog"
)

// rateLog passes on at most one line per interval, and says how many it
// dropped meanwhile with the next one it passes. It is safe for concurrent
// use.
type rateLog struct {
	logf  func(string, ...any)
	limit ratelog.Limit
}

func newRateLog(logf func(string, ...any), interval time.Duration) *rateLog {
	l := &rateLog{logf: logf}
	l.limit.Every = interval
	return l
}

// printf logs the line unless another was logged less than an interval
// ago.
func (l *rateLog) printf(format string, args ...any) {
	ok, dropped := l.limit.Allow()
	if !ok {
		return
	}
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
// open at once, and MaxConnsPerHost from one source (an IPv6 one counted
// by its /64). A connection past either bound takes the place of the
// oldest connection in its way that is between requests, which is closed
// (ServerStats.ConnsEvicted); if every one is in a request, the new one is
// closed at once, before anything is read from it (ConnsRefused). Both are
// logged at most once a second. So idle connections held open, or slow
// headers, cannot lock peers out, and one source cannot take every place.
// Serve it with [Server.HTTPServer], whose ConnState hook tells it which
// connections are between requests.
//
// Each listener it returns keeps its own bounds. It is safe for concurrent
// use; closing it closes ln, and the connections it returned live until
// they are closed.
func (s *Server) LimitListener(ln net.Listener) net.Listener {
	l := &connLimiter{Listener: ln, max: s.maxConns, perHost: s.maxConnsPerHost, logf: s.cfg.Logf,
		what: "metadata server", byHost: map[string]int{}}
	s.limMu.Lock()
	s.lims = append(s.lims, l)
	s.limMu.Unlock()
	return l
}

// connStats adds up the limiters' counts: connections open, refused and
// evicted.
func (s *Server) connStats() (open int, refused, evicted uint64) {
	s.limMu.Lock()
	defer s.limMu.Unlock()
	for _, l := range s.lims {
		open += l.open()
		refused += l.refused.Load()
		evicted += l.evicted.Load()
	}
	return open, refused, evicted
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
		// Tells a LimitListener's limiter which connections are between
		// requests (any limiter can record it: it knows its own).
		ConnState: (*connLimiter)(nil).connState,
	}
}
