package mooncake

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"time"

	"github.com/moonring/moonring/metadata"
)

// HTTPConfig configures [NewHTTPStore] and [NewHTTPKV]. URL is required.
type HTTPConfig struct {
	// URL is the metadata endpoint exactly as Mooncake engines are given
	// it, path included: "http://10.0.0.1:8080/metadata". Requests go to
	// URL?key=<key>; it may carry no query of its own.
	URL string
	// Keys names the entries; its ClusterID must be the one the Mooncake
	// engines use (their MC_METADATA_CLUSTER_ID). Not used by NewHTTPKV.
	Keys Keys
	// Client makes the requests. Default: dials in 2s, waits 5s for
	// headers, gives up after 10s, follows no redirect, uses no proxy.
	Client *http.Client
	// PollInterval is how often a watch asks the server; default 1s. Not
	// used by NewHTTPKV.
	PollInterval time.Duration
}

// NewHTTPStore returns a [Store] on the Mooncake HTTP metadata server at
// cfg.URL. It sends no request.
func NewHTTPStore(cfg HTTPConfig) (*Store, error) {
	kv, err := NewHTTPKV(cfg)
	if err != nil {
		return nil, err
	}
	return NewStore(kv, StoreConfig{Keys: cfg.Keys, PollInterval: cfg.PollInterval}), nil
}

// HTTPKV is the [KV] of a Mooncake HTTP metadata server: GET, PUT and
// DELETE of URL?key=<key> (see FORMATS.md). It is safe for concurrent use.
type HTTPKV struct {
	base   url.URL
	str    string
	client *http.Client
	own    bool // the default client, whose idle connections Close closes
}

var _ KV = (*HTTPKV)(nil)

// NewHTTPKV returns the KV of the server at cfg.URL. It sends no request.
func NewHTTPKV(cfg HTTPConfig) (*HTTPKV, error) {
	u, err := url.Parse(cfg.URL)
	switch {
	case err != nil:
		return nil, fmt.Errorf("mooncake http: %w", err)
	case u.Scheme != "http" && u.Scheme != "https":
		return nil, fmt.Errorf("mooncake http: URL %q is not http or https", cfg.URL)
	case u.Host == "":
		return nil, fmt.Errorf("mooncake http: URL %q has no host", cfg.URL)
	case u.RawQuery != "" || u.Fragment != "":
		return nil, fmt.Errorf("mooncake http: URL %q has a query or fragment", cfg.URL)
	}
	h := &HTTPKV{base: *u, str: "mooncake-http " + cfg.URL, client: cfg.Client}
	if h.client == nil {
		h.own = true
		h.client = &http.Client{
			Timeout: 10 * time.Second,
			Transport: &http.Transport{
				DialContext:           (&net.Dialer{Timeout: 2 * time.Second}).DialContext,
				ResponseHeaderTimeout: 5 * time.Second,
				MaxIdleConnsPerHost:   4,
			},
			CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
		}
	}
	return h, nil
}

// String is "mooncake-http <URL>".
func (h *HTTPKV) String() string { return h.str }

// Close releases the default client's idle connections.
func (h *HTTPKV) Close() error {
	if h.own {
		h.client.CloseIdleConnections()
	}
	return nil
}

// do sends one request for key and reads up to max bytes of the answer.
func (h *HTTPKV) do(ctx context.Context, method, key string, body []byte, max int64) (int, []byte, error) {
	u := h.base
	u.RawQuery = url.Values{"key": {key}}.Encode()
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, u.String(), rd)
	if err != nil {
		return 0, nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := h.client.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return 0, nil, err // wraps the context's error
		}
		return 0, nil, fmt.Errorf("%w: %w", metadata.ErrUnreachable, err)
	}
	defer resp.Body.Close()
	if resp.ContentLength > max {
		return resp.StatusCode, nil, fmt.Errorf("%w: an answer of %d bytes", ErrBadDoc, resp.ContentLength)
	}
	b, err := io.ReadAll(io.LimitReader(resp.Body, max+1))
	if err != nil {
		return resp.StatusCode, nil, fmt.Errorf("%w: reading the answer: %w", metadata.ErrUnreachable, err)
	}
	if int64(len(b)) > max {
		return resp.StatusCode, nil, fmt.Errorf("%w: an answer of more than %d bytes", ErrBadDoc, max)
	}
	return resp.StatusCode, b, nil
}

// unexpected describes an answer the protocol does not have.
func unexpected(method, key string, code int, body []byte) error {
	if len(body) > 200 {
		body = body[:200]
	}
	return fmt.Errorf("%w: %s %s: status %d: %q", metadata.ErrUnreachable, method, key, code, body)
}

// Get returns the value of key: 200 is found, 404 absent.
func (h *HTTPKV) Get(ctx context.Context, key string, max int64) ([]byte, bool, error) {
	code, body, err := h.do(ctx, http.MethodGet, key, nil, max)
	switch {
	case err != nil:
		return nil, false, err
	case code == http.StatusNotFound:
		return nil, false, nil
	case code != http.StatusOK:
		return nil, false, unexpected("GET", key, code, body)
	}
	return body, true, nil
}

// Put stores value under key: 200 is done, 400 a refusal ([ErrRefused]).
func (h *HTTPKV) Put(ctx context.Context, key string, value []byte) error {
	code, ans, err := h.do(ctx, http.MethodPut, key, value, 4096)
	switch {
	case err != nil:
		return err
	case code == http.StatusBadRequest:
		return fmt.Errorf("%w: PUT %s: %.200q", ErrRefused, key, ans)
	case code != http.StatusOK:
		return unexpected("PUT", key, code, ans)
	}
	return nil
}

// Delete removes key: 200 is done (some servers answer 200 for a key
// they do not hold), 404 absent.
func (h *HTTPKV) Delete(ctx context.Context, key string) (bool, error) {
	code, ans, err := h.do(ctx, http.MethodDelete, key, nil, 4096)
	switch {
	case err != nil:
		return false, err
	case code == http.StatusNotFound:
		return false, nil
	case code != http.StatusOK:
		return false, unexpected("DELETE", key, code, ans)
	}
	return true, nil
}
