// p2p_fetch.go holds how a [P2P] store asks a peer for its descriptor: the
// HTTP client (shared with the [HTTP] store), the URL a segment's name
// (host:port) gives, and fetch with its answers (a descriptor, not
// modified, nothing published) under the store's lifetime.

package metadata

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/moonring/moonring/segtable"
)

func p2pClient(tlsConfig *tls.Config) *http.Client {
	tr := &http.Transport{
		DialContext:           (&net.Dialer{Timeout: 2 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		ForceAttemptHTTP2:     true,
		MaxIdleConns:          64,
		MaxIdleConnsPerHost:   4,
		IdleConnTimeout:       time.Minute,
		TLSHandshakeTimeout:   2 * time.Second,
		ResponseHeaderTimeout: 5 * time.Second,
	}
	if tlsConfig != nil {
		tr.TLSClientConfig = tlsConfig.Clone()
	}
	return &http.Client{
		Transport: tr,
		Timeout:   10 * time.Second,
		CheckRedirect: func(*http.Request, []*http.Request) error {
			return http.ErrUseLastResponse // a peer answers itself
		},
	}
}

// segmentURL returns the address of the descriptor served under name, or
// an error wrapping ErrNotFound when name is not a host:port: nothing can
// be published under such a name.
func (p *P2P) segmentURL(name string) (string, error) {
	host, port, err := net.SplitHostPort(name)
	if err == nil {
		if host == "" {
			err = errors.New("empty host")
		} else if n, perr := strconv.ParseUint(port, 10, 16); perr != nil || n == 0 {
			err = fmt.Errorf("bad port %q", port)
		} else if i := strings.IndexFunc(host, badHostRune); i >= 0 {
			err = fmt.Errorf("bad character %q in host", host[i])
		}
	}
	if err != nil {
		return "", fmt.Errorf("%w: a p2p segment name is a host:port (%v)", ErrNotFound, err)
	}
	u := url.URL{Scheme: p.scheme, Host: name, Path: p2pSegmentPath}
	return u.String(), nil
}

// badHostRune reports a rune that has no place in a host name or an IP
// address (with an IPv6 zone), so that a name cannot smuggle a path, user
// or query into the URL.
func badHostRune(r rune) bool {
	switch {
	case 'a' <= r && r <= 'z', 'A' <= r && r <= 'Z', '0' <= r && r <= '9':
		return false
	}
	return !strings.ContainsRune(".-_:%", r)
}

// join returns a context done when ctx is or the store closes.
func (p *P2P) join(ctx context.Context) (context.Context, context.CancelFunc) {
	c, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(p.ctx, cancel)
	return c, func() { stop(); cancel() }
}

// ctxErr returns the error of a fetch under p.join(ctx): ErrClosed when the
// store closed, ctx's error when ctx is done, else err.
func (p *P2P) ctxErr(ctx context.Context, err error) error {
	switch {
	case p.ctx.Err() != nil:
		return ErrClosed
	case ctx.Err() != nil:
		return ctx.Err()
	}
	return err
}

// peerAnswer is what a fetch learned: a descriptor (desc, its body and
// ETag), not-modified, or nothing published (desc nil, notModified false).
type peerAnswer struct {
	desc        *segtable.SegmentDesc
	body        []byte
	etag        string
	notModified bool
}

// fetch asks the peer at u for the descriptor of name, sending
// ifNoneMatch when not empty. It reads at most p2pMaxDesc bytes and
// returns a validated descriptor of that name or an error.
func (p *P2P) fetch(ctx context.Context, u, name, ifNoneMatch string) (peerAnswer, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return peerAnswer{}, fmt.Errorf("%w: %w", ErrUnreachable, err)
	}
	req.Header.Set("Accept", "application/json")
	if ifNoneMatch != "" {
		req.Header.Set("If-None-Match", ifNoneMatch)
	}
	resp, err := p.client.Do(req)
	if err != nil {
		return peerAnswer{}, fmt.Errorf("%w: %w", ErrUnreachable, err)
	}
	defer resp.Body.Close()
	switch {
	case resp.StatusCode == http.StatusOK:
	case resp.StatusCode == http.StatusNotModified && ifNoneMatch != "":
		return peerAnswer{notModified: true}, nil
	case resp.StatusCode == http.StatusNotFound:
		io.Copy(io.Discard, io.LimitReader(resp.Body, 4<<10)) // lets the connection be reused
		return peerAnswer{}, nil
	default:
		return peerAnswer{}, fmt.Errorf("%w: peer answered HTTP %s", ErrUnreachable, resp.Status)
	}
	return readDesc(resp, name, p2pMaxDesc, "peer")
}
