// p2p.go holds the P2PHANDSHAKE store: a metadata.Store whose segments are
// named by their RPC address and fetched from the peer's RPC daemon. Its
// watches are in p2p_watch.go.

package mooncake

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/segtable"
)

var _ metadata.Store = (*P2PStore)(nil)

// p2pGoneAfter is how many polls in a row a watch of a peer tolerates
// failing before it reports the segment Deleted, as metadata.P2P does: a
// dead engine cannot withdraw its segment.
const p2pGoneAfter = 3

// P2PConfig configures [NewP2PStore].
type P2PConfig struct {
	// RPC configures the daemon the store starts (its listener, bounds,
	// notification and handshake functions); its Descriptor is the
	// store's own, whatever is set here.
	RPC RPCConfig
	// Client asks peers; nil: the zero RPCClient.
	Client *RPCClient
	// PollInterval is how often a watch asks a peer; default 1s.
	PollInterval time.Duration
}

// P2PStore is Mooncake's P2PHANDSHAKE metadata mode as a
// [metadata.Store]: there is no shared store; every engine serves its own
// descriptor on its RPC port, and a segment's name is the "ip:rpc_port"
// of that port ([P2PStore.Name]). The store runs the engine's RPC daemon
// ([RPCServer]), so the same port takes Mooncake's notifications and
// handshakes.
//
// Put and Delete keep this engine's own descriptor, the one the daemon
// serves (converted by [FromSegtable]); they refuse any other name with
// [metadata.ErrNotOwner] and follow the epoch rules of [metadata.Store].
// Get and Watch of the own name answer locally, as [metadata.Memory] does.
// Get of another name sends a metadata frame to that address (carrying
// this engine's descriptor, or null, as a Mooncake requester does) and
// converts the answer with [ToSegtable]: a peer that answers null holds
// nothing ([metadata.ErrNotFound]), one that cannot be reached or answers
// garbage is [metadata.ErrUnreachable] or [segtable.ErrBadDesc], a
// descriptor of another name is [segtable.ErrBadDesc]. A name that is not
// host:port holds nothing.
//
// Where it differs from the [metadata.Store] contract, because Mooncake's
// RPC port has no versions and no change notification:
//
//   - Watch of a peer polls every PollInterval: changes between two polls
//     coalesce, a Put of the same descriptor again is not seen, and a
//     Delete followed by a Put between two polls shows only as the new
//     descriptor. It fetches once before it returns, so the current
//     descriptor is the first event.
//   - A peer that fails three polls in a row is reported Deleted (a dead
//     engine cannot withdraw its segment); one that comes back is
//     delivered again. A Mooncake peer's descriptor carries a timestamp
//     that changes with each encoding; only changes of what converts to
//     moonring's form are delivered.
//   - A Mooncake engine's descriptor reads with epoch 0.
//
// A P2PStore is safe for concurrent use; it serves from NewP2PStore until
// Close, which stops the daemon, ends every watch and waits for their
// goroutines.
type P2PStore struct {
	srv    *RPCServer
	name   string
	str    string
	client *RPCClient
	poll   time.Duration

	ctx    context.Context // canceled by Close
	cancel context.CancelFunc
	// remote counts remote watch goroutines and Watch calls setting one
	// up; Add happens under mu while open.
	remote sync.WaitGroup

	mu      sync.Mutex
	closed  bool
	desc    *segtable.SegmentDesc // own, never modified: Put replaces it
	ownBody []byte                // desc in Mooncake's schema, sent with requests
	watches map[*localWatch]struct{}
}

// localWatch is a watch of the store's own name.
type localWatch struct {
	ch   chan metadata.Event
	stop func() bool
}

// NewP2PStore starts the RPC daemon of cfg.RPC and returns the store
// whose own segment is the daemon's name.
func NewP2PStore(cfg P2PConfig) (*P2PStore, error) {
	p := &P2PStore{client: cfg.Client, poll: cfg.PollInterval, watches: map[*localWatch]struct{}{}}
	if p.client == nil {
		p.client = &RPCClient{}
	}
	if p.poll <= 0 {
		p.poll = time.Second
	}
	rc := cfg.RPC
	rc.Descriptor = p.Local
	srv, err := ListenRPC(rc)
	if err != nil {
		return nil, err
	}
	p.srv, p.name, p.str = srv, srv.Name(), "mooncake-p2p "+srv.Name()
	p.ctx, p.cancel = context.WithCancel(context.Background())
	return p, nil
}

// Name returns the store's own segment name: the daemon's "ip:rpc_port".
func (p *P2PStore) Name() string { return p.name }

// String returns "mooncake-p2p " and the store's name.
func (p *P2PStore) String() string { return p.str }

// Server returns the store's RPC daemon, e.g. to set its notification
// or handshake function. It lives until the store's Close.
func (p *P2PStore) Server() *RPCServer { return p.srv }

// Local returns the descriptor the store publishes, nil when none: the
// daemon's source. The caller must not modify it.
func (p *P2PStore) Local() *segtable.SegmentDesc {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.desc
}

func (p *P2PStore) errorf(op, name string, err error) error {
	return fmt.Errorf("%s: %s %q: %w", p.str, op, name, err)
}

// check returns the error that stops an operation before it starts; p.mu
// is held.
func (p *P2PStore) check(ctx context.Context, op, name string) error {
	if p.closed {
		return p.errorf(op, name, metadata.ErrClosed)
	}
	if err := ctx.Err(); err != nil {
		return p.errorf(op, name, err)
	}
	return nil
}

// join returns a context that ends with ctx or with the store.
func (p *P2PStore) join(ctx context.Context) (context.Context, func()) {
	c, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(p.ctx, cancel)
	return c, func() { stop(); cancel() }
}

// ctxErr turns a failure under join(ctx) into ErrClosed when the store
// closed meanwhile.
func (p *P2PStore) ctxErr(ctx context.Context, err error) error {
	if p.ctx.Err() != nil && ctx.Err() == nil {
		return metadata.ErrClosed
	}
	return err
}

// peerAddr returns the RPC address of a peer's name, false when the name
// is no host:port.
func peerAddr(name string) (string, bool) {
	host, port, ok := SplitServerName(name)
	return name, ok && host != "" && port != 0
}

// fetch asks the peer name for its descriptor.
func (p *P2PStore) fetch(ctx context.Context, name string) (*segtable.SegmentDesc, error) {
	p.mu.Lock()
	own := p.ownBody
	p.mu.Unlock()
	return p.client.fetchSegtable(ctx, name, own)
}

// Get returns a copy of the descriptor under name: the store's own, or
// the one the peer at name serves; see [P2PStore].
func (p *P2PStore) Get(ctx context.Context, name string) (*segtable.SegmentDesc, error) {
	p.mu.Lock()
	if err := p.check(ctx, "get", name); err != nil {
		p.mu.Unlock()
		return nil, err
	}
	if name == p.name {
		defer p.mu.Unlock()
		if p.desc == nil {
			return nil, p.errorf("get", name, metadata.ErrNotFound)
		}
		return p.desc.Clone(), nil
	}
	p.mu.Unlock()
	if _, ok := peerAddr(name); !ok {
		return nil, p.errorf("get", name, metadata.ErrNotFound)
	}
	fctx, done := p.join(ctx)
	defer done()
	d, err := p.fetch(fctx, name)
	switch {
	case err != nil:
		return nil, p.errorf("get", name, p.ctxErr(ctx, err))
	case d == nil:
		return nil, p.errorf("get", name, metadata.ErrNotFound)
	}
	return d, nil
}

// Put publishes a copy of d, which must carry the store's name, unless
// another epoch holds it; see [P2PStore].
func (p *P2PStore) Put(ctx context.Context, d *segtable.SegmentDesc) error {
	if d == nil {
		return p.errorf("put", "", fmt.Errorf("%w: nil descriptor", segtable.ErrBadDesc))
	}
	md, _, err := FromSegtable(d)
	if err != nil {
		return p.errorf("put", d.Name, err)
	}
	md.Timestamp = TimestampNow()
	body, err := md.Encode()
	if err != nil {
		return p.errorf("put", d.Name, err)
	}
	d = d.Clone()
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.check(ctx, "put", d.Name); err != nil {
		return err
	}
	if d.Name != p.name {
		return p.errorf("put", d.Name, fmt.Errorf("%w: a p2p store publishes only its own segment, %q", metadata.ErrNotOwner, p.name))
	}
	if p.desc != nil && p.desc.Epoch != d.Epoch {
		return p.errorf("put", d.Name, fmt.Errorf("%w: held by epoch %d, not %d", metadata.ErrExists, p.desc.Epoch, d.Epoch))
	}
	p.desc, p.ownBody = d, append(body, '\n')
	p.notify(d, false)
	return nil
}

// Delete withdraws the store's descriptor if its epoch matches (0 matches
// any); see [P2PStore].
func (p *P2PStore) Delete(ctx context.Context, name string, epoch uint64) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.check(ctx, "delete", name); err != nil {
		return err
	}
	if name != p.name {
		return p.errorf("delete", name, fmt.Errorf("%w: a p2p store publishes only its own segment, %q", metadata.ErrNotOwner, p.name))
	}
	old := p.desc
	switch {
	case old == nil:
		return p.errorf("delete", name, metadata.ErrNotFound)
	case epoch != 0 && old.Epoch != epoch:
		return p.errorf("delete", name, fmt.Errorf("%w: held by epoch %d, not %d", metadata.ErrEpoch, old.Epoch, epoch))
	}
	p.desc, p.ownBody = nil, nil
	p.notify(old, true)
	return nil
}

// notify hands every local watcher its own copy of the event; p.mu is
// held, and only holders of p.mu send to local watches.
func (p *P2PStore) notify(d *segtable.SegmentDesc, deleted bool) {
	for w := range p.watches {
		metadata.SendLatest(w.ch, metadata.Event{Desc: d.Clone(), Deleted: deleted})
	}
}

// Close stops the daemon, ends every watch and waits for the watches'
// goroutines; later calls fail with [metadata.ErrClosed]. It is
// idempotent and returns the daemon's Close error, if any.
func (p *P2PStore) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	for w := range p.watches {
		w.stop()
		close(w.ch)
	}
	p.watches = nil
	p.desc, p.ownBody = nil, nil
	p.mu.Unlock()
	p.cancel()
	p.remote.Wait()
	return p.srv.Close()
}
