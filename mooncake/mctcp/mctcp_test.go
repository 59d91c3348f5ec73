package mctcp_test

import (
	"testing"

	"github.com/moonring/moonring/internal/leakcheck"
	"github.com/moonring/moonring/mooncake"
	"github.com/moonring/moonring/mooncake/mctcp"
	"github.com/moonring/moonring/transport"
	"github.com/moonring/moonring/transport/transporttest"
)

func TestMain(m *testing.M) { leakcheck.VerifyTestMain(m) }

func newT(t testing.TB, cfg mctcp.Config) *mctcp.Transport {
	t.Helper()
	tr, err := mctcp.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

var want = transporttest.Options{Want: []transporttest.Interface{transporttest.ContextUnregisterer}}

// The suite's descriptors carry only Endpoints[Name], so the initiator is
// told the version the target speaks (as the engine's published
// Endpoints["mooncake-tcp.version"] would).
func TestConformanceV2(t *testing.T) {
	transporttest.RunWith(t, want, func(t *testing.T) (transport.Transport, transport.Transport) {
		return newT(t, mctcp.Config{Version: 2}), newT(t, mctcp.Config{})
	})
}

// Version 1 acknowledges nothing: a WRITE completes once its bytes are in
// the initiator's socket, before they land, and a refused range only
// closes the connection, which the initiator cannot tell from a broken
// path. The subtests that check the target's memory right after a WRITE
// completes, or want a final error for a range only the target can
// refuse, do not apply; the rest hold (ranges outside the descriptor's
// buffers are refused by the initiator itself). golden_test.go checks
// version 1 exchanges byte by byte.
func TestConformanceV1(t *testing.T) {
	o := want
	const unacked = "Mooncake's protocol version 1 acknowledges no WRITE: it completes before its bytes land, and the subtest checks the target's memory at once"
	const norefusal = "Mooncake's protocol version 1 has no refusal: the target closes the connection, a path failure (ErrPeer) to the initiator"
	o.Skip = map[string]string{
		"ReadWriteSizes":    unacked,
		"Concurrent":        unacked,
		"PipelinedRefusals": unacked,
		"LocalOnlyDenied":   norefusal,
		"UnregisterTarget":  norefusal,
	}
	transporttest.RunWith(t, o, func(t *testing.T) (transport.Transport, transport.Transport) {
		return newT(t, mctcp.Config{Rails: 1, Depth: 4}), newT(t, mctcp.Config{})
	})
}

// The names are the ones mooncake's conversion uses.
func TestNames(t *testing.T) {
	if mctcp.Name != mooncake.TransportTCP || mctcp.VersionEndpoint != mooncake.EndpointTCPVersion {
		t.Fatalf("names %q, %q; mooncake converts with %q, %q", mctcp.Name, mctcp.VersionEndpoint, mooncake.TransportTCP, mooncake.EndpointTCPVersion)
	}
	tr := newT(t, mctcp.Config{})
	defer tr.Close()
	if got := tr.ExtraEndpoints()[mctcp.VersionEndpoint]; got != "2" {
		t.Fatalf("ExtraEndpoints()[%q] = %q, want 2", mctcp.VersionEndpoint, got)
	}
}

// Bad configurations are refused; zero fields take the defaults.
func TestConfig(t *testing.T) {
	for _, c := range []mctcp.Config{{Rails: 65}, {Rails: -1}, {Depth: 1 << 17}, {Version: 3}, {StatusTimeout: -1}, {FrameTimeout: -1}, {DialTimeout: -1}} {
		if _, err := c.Effective(); err == nil {
			t.Errorf("%+v accepted", c)
		}
	}
	c, err := mctcp.Config{}.Effective()
	if err != nil || c.Rails != mctcp.DefaultRails || c.Depth != mctcp.DefaultDepth || c.StatusTimeout != mctcp.DefaultStatusTimeout || c.MaxConns != mctcp.DefaultMaxConns {
		t.Fatalf("defaults: %+v, %v", c, err)
	}
}
