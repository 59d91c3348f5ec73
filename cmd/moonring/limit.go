package main

import (
	"log/slog"
	"net"
	"sync"
	"sync/atomic"

	"github.com/moonring/moonring/internal/ratelog"
)

// maxMetricsConns bounds the connections of serve's own /metrics endpoint
// (with a metadata server; with p2p, the p2p endpoint serves it under its
// own bounds).
const maxMetricsConns = 64

// capListener closes at once every connection accepted while max are
// open, counting them and logging a line a second at most. Its Accept is
// for one goroutine (http.Server's); the connections it returns may be
// closed from any.
type capListener struct {
	net.Listener
	max     int64
	log     *slog.Logger
	open    atomic.Int64
	refused atomic.Uint64
	logs    ratelog.Limit
}

// Accept returns the next connection under the cap.
func (l *capListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if l.open.Add(1) > l.max {
			l.open.Add(-1)
			c.Close()
			n := l.refused.Add(1)
			if ok, _ := l.logs.Allow(); ok {
				l.log.Warn("metrics endpoint: connection refused: too many open", "max", l.max, "refused_in_all", n)
			}
			continue
		}
		return &capConn{Conn: c, l: l}, nil
	}
}

// capConn gives its place back when closed.
type capConn struct {
	net.Conn
	l    *capListener
	once sync.Once
}

func (c *capConn) Close() error {
	c.once.Do(func() { c.l.open.Add(-1) })
	return c.Conn.Close()
}
