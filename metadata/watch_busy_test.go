// The watch of a publisher that republishes faster than a reader's round
// trips, through the P2P and HTTP stores.

package metadata_test

import (
	"context"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/segtable"
)

// rtFunc is an http.RoundTripper of a function.
type rtFunc func(*http.Request) (*http.Response, error)

func (f rtFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// TestP2PWatchBusyPublisher: a publisher that republishes before each
// header a peer's watch reads and between it and the chunks it then asks
// for (here on cue, as one that republishes faster than a round trip
// does) is read whole, one answer that cannot be torn: the watch delivers
// its newer descriptors, every one as published, and never reports it
// gone.
func TestP2PWatchBusyPublisher(t *testing.T) {
	a := newP2P(t, metadata.P2PConfig{})
	testWatchBusyPublisher(t, a, a.Name(), func(c *http.Client) metadata.Store {
		return newP2P(t, metadata.P2PConfig{Client: c})
	})
}

// TestHTTPWatchBusyPublisher: the same through a metadata server, whose
// chunks a header that replaced another no longer lists may be gone.
func TestHTTPWatchBusyPublisher(t *testing.T) {
	_, url := startServer(t, metadata.ServerConfig{})
	testWatchBusyPublisher(t, newHTTP(t, url, 0), "busy", func(c *http.Client) metadata.Store {
		h, err := metadata.NewHTTP(metadata.HTTPConfig{URL: url, PollInterval: testPoll, Client: c})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { h.Close() })
		return h
	})
}

// testWatchBusyPublisher publishes name through pub, republishing (one
// more buffer) whenever the watch of the store newWatcher makes with the
// given client GETs a header or chunks, and checks five events of that
// watch: each newer than the one before, each equal to a descriptor
// published, none a deletion; and that the watch read the whole
// descriptor at least once (the answer to a torn read).
func testWatchBusyPublisher(t *testing.T, pub metadata.Store, name string, newWatcher func(*http.Client) metadata.Store) {
	ctx := t.Context()
	l := chList(t, 100)
	n := 100
	var mu sync.Mutex
	published := map[int]*segtable.SegmentDesc{} // by buffer count
	republish := func() {
		mu.Lock()
		defer mu.Unlock()
		if err := l.Insert(chBuffer(n)); err != nil {
			t.Error(err)
			return
		}
		n++
		d := chDesc(name, 1, l)
		// The watch may poll once more as the test ends: not t's context.
		if err := pub.Put(context.Background(), d); err != nil {
			t.Error(err)
		}
		published[n] = d
	}
	wholes := 0
	client := &http.Client{Transport: rtFunc(func(r *http.Request) (*http.Response, error) {
		switch p := r.URL.Path; {
		case r.Method != http.MethodGet:
		case strings.HasSuffix(p, "/chunks"), strings.HasSuffix(p, "/header"):
			republish()
		case strings.HasSuffix(p, "/"+name), strings.HasSuffix(p, "/segment"):
			mu.Lock()
			wholes++
			mu.Unlock()
		}
		return http.DefaultTransport.RoundTrip(r)
	})}
	t.Cleanup(client.CloseIdleConnections)
	w := newWatcher(client)
	d := chDesc(name, 1, l)
	if err := pub.Put(ctx, d); err != nil {
		t.Fatal(err)
	}
	published[n] = d
	ch, err := w.Watch(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	last := 0
	for range 5 {
		ev := next(t, ch)
		if ev.Deleted {
			t.Fatalf("a busy publisher reported gone after %d buffers", last)
		}
		got := ev.Desc.NumBuffers()
		if got <= last {
			t.Fatalf("an event of %d buffers after one of %d", got, last)
		}
		mu.Lock()
		want := published[got]
		mu.Unlock()
		if want == nil {
			t.Fatalf("an event of %d buffers, never published", got)
		}
		sameJSON(t, "event", ev.Desc, want)
		last = got
	}
	mu.Lock()
	defer mu.Unlock()
	if wholes == 0 {
		t.Fatal("the watch never read the whole descriptor")
	}
	t.Logf("%d events up to %d buffers, %d whole reads", 5, last, wholes)
}
