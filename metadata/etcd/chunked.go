// chunked.go holds the per-chunk key layout: a descriptor whose buffers
// come as copy-on-write chunks (segtable.SegmentDesc.Chunked) is written
// as a header under the segment's key and one key per chunk, so that a
// republish after one registration writes the chunks it made and the
// header, not every buffer, and a watcher fetches only those.

package etcd

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/metadata/internal/chunkwire"
	"github.com/moonring/moonring/segtable"
)

const (
	maxChunks = chunkwire.MaxChunks
	// maxChunkBytes bounds the encoding of one chunk, written or read.
	maxChunkBytes = 1 << 20
	// maxTxnOps and maxTxnBytes bound one transaction of chunk writes,
	// deletions or reads: etcd refuses a transaction of more than 128
	// operations (--max-txn-ops) and a request over 1.5 MiB
	// (--max-request-bytes) by default.
	maxTxnOps   = 128
	maxTxnBytes = 1 << 20
	// rangeFetch is how many chunks a reader misses before it reads the
	// epoch's chunk keys as one range rather than key by key, and
	// rangeSlack how many keys it takes in that range beside those listed
	// (chunks written or not yet deleted by a publish under way) before it
	// falls back to reading the listed keys one by one.
	rangeFetch = 64
	rangeSlack = 1024
)

// errMissing reports a header that lists a chunk etcd does not hold at
// the header's revision.
var errMissing = errors.New("a chunk the header lists is missing")

// The layout's pieces (package chunkwire, shared with the HTTP server's
// format): a header under the segment's key, lists the chunks, each under
// a key of its own.
type (
	chunkHeader = chunkwire.Header
	headerChunk = chunkwire.Chunk
	readChunk   = chunkwire.Held
)

// isHeader reports whether value, read under a segment's key, is a header
// of the per-chunk layout.
func isHeader(value []byte) bool { return chunkwire.IsHeader(value) }

// chunkBase returns the prefix of every chunk key of name: a subtree of
// its own beside the segments' keys (a NUL no name starts with, see Put),
// with the name's length before it so that no name's subtree holds
// another's ("a" and "a/1").
func (e *Store) chunkBase(name string) string {
	return e.prefix + "\x00chunks/" + strconv.Itoa(len(name)) + "/" + name + "/"
}

// chunkDir returns the prefix of the chunk keys of name at epoch.
func (e *Store) chunkDir(name string, epoch uint64) string {
	return e.chunkBase(name) + strconv.FormatUint(epoch, 10) + "/"
}

func chunkKey(dir string, seq uint64) string { return dir + strconv.FormatUint(seq, 10) }

// chunkEntry is one chunk as a store writes it: its encoding, cached by
// seq for the publishes of an epoch, so that a republish encodes only the
// chunks it made.
type chunkEntry struct {
	seq uint64
	// first is &bufs[0] of the chunk it encodes: a chunk is immutable, so
	// the same pointer is the same content (seq alone is not: a flat
	// descriptor's chunks are numbered from 1 on every publish).
	first *segtable.BufferDesc
	n     int
	value []byte
	sum   uint64 // chunkwire.Sum(value)
	// lease is the lease the chunk was last written under, 0 when it is
	// not known to be in etcd. Guarded by the name's sem.
	lease clientv3.LeaseID
}

// publication is what a Put writes, and a lease restore writes again: the
// value of the segment's key (a whole descriptor, or a header) and, for
// a header, the chunks it lists, in order.
type publication struct {
	epoch  uint64
	value  []byte
	chunks []*chunkEntry // nil: flat
}

// chunkedPub returns d, a Chunked descriptor, as a header and its chunks,
// taking the encodings of the chunks cached in n from the last publishes
// of the epoch. n.sem is held.
func (e *Store) chunkedPub(n *etcdName, d *segtable.SegmentDesc) (*publication, error) {
	cs := d.Chunked
	if c := cs.Count(); c > maxChunks {
		return nil, fmt.Errorf("%w: %d chunks, more than the %d etcd's layout takes", segtable.ErrBadDesc, c, maxChunks)
	}
	h := chunkwire.NewHeader(d)
	cache := n.cache
	if n.cacheEpoch != d.Epoch {
		cache = nil
	}
	pub := &publication{epoch: d.Epoch, chunks: make([]*chunkEntry, 0, cs.Count())}
	var err error
	cs.EachChunk(func(info segtable.ChunkInfo, bufs []segtable.BufferDesc) bool {
		c := cache[info.Seq]
		if c == nil || c.first != &bufs[0] || c.n != len(bufs) || c.value == nil {
			var v []byte
			if v, err = chunkwire.Encode(bufs); err != nil {
				return false
			}
			if len(v) > maxChunkBytes {
				err = fmt.Errorf("%w: chunk %d encodes to %d bytes, over %d", segtable.ErrBadDesc, info.Seq, len(v), maxChunkBytes)
				return false
			}
			c = &chunkEntry{seq: info.Seq, first: &bufs[0], n: len(bufs), value: v, sum: chunkwire.Sum(v)}
		}
		h.Chunks = append(h.Chunks, headerChunk{Seq: info.Seq, N: info.N, Sum: c.sum, MAC: info.MAC})
		pub.chunks = append(pub.chunks, c)
		return true
	})
	if err != nil {
		return nil, err
	}
	if pub.value, err = json.Marshal(&h); err != nil {
		return nil, fmt.Errorf("%w: %v", segtable.ErrBadDesc, err)
	}
	return pub, nil
}

// settle updates n's cache of chunk encodings after a publish of pub:
// when it succeeded (ok), the cache becomes pub's chunks, and the chunks
// the cache held that pub does not list are deleted from etcd (best
// effort: those not deleted stay in the cache, to be deleted after the
// next publish); when it failed, pub's chunks join the cache, so that what
// was written is known. n.sem is held.
func (e *Store) settle(ctx context.Context, n *etcdName, pub *publication, ok bool) {
	if pub.chunks == nil && !ok {
		return
	}
	if n.cacheEpoch != pub.epoch {
		n.cache, n.cacheEpoch = nil, pub.epoch
	}
	if !ok {
		if n.cache == nil {
			n.cache = make(map[uint64]*chunkEntry, len(pub.chunks))
		}
		for _, c := range pub.chunks {
			n.cache[c.seq] = c
		}
		return
	}
	next := make(map[uint64]*chunkEntry, len(pub.chunks))
	for _, c := range pub.chunks {
		next[c.seq] = c
	}
	var stale []*chunkEntry
	for seq, c := range n.cache {
		if next[seq] == nil && c.lease != 0 {
			stale = append(stale, c)
		}
	}
	dir := e.chunkDir(n.name, pub.epoch)
	for len(stale) > 0 {
		batch := stale[:min(len(stale), maxTxnOps)]
		ops := make([]clientv3.Op, len(batch))
		for i, c := range batch {
			ops[i] = clientv3.OpDelete(chunkKey(dir, c.seq))
		}
		if _, err := e.do(ctx, func(ctx context.Context) error {
			_, err := e.cli.Txn(ctx).Then(ops...).Commit()
			return err
		}); err != nil {
			break
		}
		stale = stale[len(batch):]
	}
	for _, c := range stale {
		if next[c.seq] == nil {
			c.value = nil // only its deletion is left to do
			next[c.seq] = c
		}
	}
	if pub.chunks == nil && len(next) == 0 {
		next = nil
	}
	n.cache = next
}

// write publishes pub under n's name with lease: the chunks not yet
// written under lease, then the value of the name's key, in one
// transaction when they fit in etcd's limits (maxTxnOps operations,
// maxTxnBytes), else in transactions of chunks that do and a last one
// with the rest and the value; the last one also deletes the chunk keys
// of stale that fit (the chunks the cache holds that pub does not list,
// which readers of the value it replaces may still read at its
// revision), marking those deleted. Every transaction is conditional on
// the key's revision being the one last checked, so nothing is written
// while another epoch holds the name: then write fails with [ErrExists]
// and returns that epoch (0 for a value that is not a descriptor). A key
// changed by another writer makes it check the epoch again and write
// every chunk again (a Delete removed them); a key that holds pub's value
// under lease already is written (an attempt whose answer was lost
// committed: the value's transaction wrote, or came after, every chunk it
// lists). It returns the revision of
// the key it wrote and whether it wrote any chunk. n.sem is held.
func (e *Store) write(ctx context.Context, n *etcdName, pub *publication, stale []*chunkEntry, lease clientv3.LeaseID) (held uint64, rev int64, wrote bool, err error) {
	key := e.key(n.name)
	// What the key holds as far as this store knows: its last write of
	// the epoch under lease, or nothing. A wrong guess costs the first
	// transaction, which then reads the key.
	trusted := n.pub != nil && n.pub.epoch == pub.epoch && n.lease == lease && n.modRev > 0
	if trusted {
		rev = n.modRev
	}
	distrust := func() {
		for _, c := range pub.chunks {
			c.lease = 0
		}
	}
	if !trusted {
		distrust()
	}
	dir := e.chunkDir(n.name, pub.epoch)
	// check reads what the else branch of a transaction returned; done
	// reports that the key holds pub's value under lease already (an
	// attempt whose answer was lost wrote it, with every chunk it lists).
	done := false
	check := func(resp *clientv3.TxnResponse) error {
		kvs := resp.Responses[0].GetResponseRange().GetKvs()
		if len(kvs) == 1 && clientv3.LeaseID(kvs[0].Lease) == lease && bytes.Equal(kvs[0].Value, pub.value) {
			rev, done = kvs[0].ModRevision, true
			for _, c := range pub.chunks {
				c.lease = lease
			}
			return nil
		}
		if len(kvs) == 0 {
			rev = 0
		} else {
			epoch, err := valueEpoch(kvs[0].Value)
			switch {
			case err != nil:
				return fmt.Errorf("%w: etcd holds a value that is not a descriptor (%v)", metadata.ErrExists, err)
			case epoch != pub.epoch:
				held = epoch
				return fmt.Errorf("%w: held by epoch %d, not %d", metadata.ErrExists, epoch, pub.epoch)
			}
			rev = kvs[0].ModRevision
		}
		distrust()
		return nil
	}
	put := func(c *chunkEntry) (clientv3.Op, int) {
		k := chunkKey(dir, c.seq)
		return clientv3.OpPut(k, string(c.value), clientv3.WithLease(lease)), len(k) + len(c.value)
	}
	valueSize := len(key) + len(pub.value)
	for {
		var pend []*chunkEntry
		size := 0
		for _, c := range pub.chunks {
			if c.lease != lease {
				pend = append(pend, c)
				size += len(dir) + 20 + len(c.value)
			}
		}
		// Chunks alone while the rest does not fit beside the value.
		retry := false
		for len(pend) > 0 && (len(pend)+1 > maxTxnOps || size+valueSize > maxTxnBytes) {
			var ops []clientv3.Op
			txnSize := 0
			for _, c := range pend[:min(len(pend), maxTxnOps)] {
				op, sz := put(c)
				if len(ops) > 0 && txnSize+sz > maxTxnBytes {
					break
				}
				ops, txnSize = append(ops, op), txnSize+sz
			}
			resp, _, err := e.txnOps(ctx, clientv3.Compare(clientv3.ModRevision(key), "=", rev), ops, clientv3.OpGet(key))
			if err != nil {
				return 0, 0, wrote, err
			}
			if !resp.Succeeded {
				if err := check(resp); err != nil {
					return held, 0, wrote, err
				}
				if done {
					return 0, rev, wrote, nil
				}
				retry = true
				break
			}
			wrote = true
			for _, c := range pend[:len(ops)] {
				c.lease = lease
				size -= len(dir) + 20 + len(c.value)
			}
			pend = pend[len(ops):]
		}
		if retry {
			continue
		}
		// The rest, the value, and the deletions that fit.
		ops := make([]clientv3.Op, 0, len(pend)+1)
		txnSize := valueSize
		for _, c := range pend {
			op, sz := put(c)
			ops, txnSize = append(ops, op), txnSize+sz
		}
		ops = append(ops, clientv3.OpPut(key, string(pub.value), clientv3.WithLease(lease)))
		var gone []*chunkEntry
		for _, c := range stale {
			k := chunkKey(dir, c.seq)
			if c.lease == 0 || len(ops) >= maxTxnOps || txnSize+len(k) > maxTxnBytes {
				continue
			}
			ops, txnSize = append(ops, clientv3.OpDelete(k)), txnSize+len(k)
			gone = append(gone, c)
		}
		resp, _, err := e.txnOps(ctx, clientv3.Compare(clientv3.ModRevision(key), "=", rev), ops, clientv3.OpGet(key))
		if err != nil {
			return 0, 0, wrote, err
		}
		if resp.Succeeded {
			for _, c := range pend {
				c.lease = lease
			}
			for _, c := range gone {
				c.lease = 0
			}
			return 0, resp.Header.Revision, wrote || len(pend) > 0, nil
		}
		if err := check(resp); err != nil {
			return held, 0, wrote, err
		}
		if done {
			// This transaction's lost attempt: its deletions too.
			for _, c := range gone {
				c.lease = 0
			}
			return 0, rev, true, nil
		}
	}
}

// stale returns the chunks n's cache holds, written, that pub does not
// list: what to delete once pub is written. n.sem is held.
func (n *etcdName) stale(pub *publication) []*chunkEntry {
	if n.cacheEpoch != pub.epoch || len(n.cache) == 0 {
		return nil
	}
	listed := make(map[uint64]*chunkEntry, len(pub.chunks))
	for _, c := range pub.chunks {
		listed[c.seq] = c
	}
	var out []*chunkEntry
	for seq, c := range n.cache {
		// A seq listed again with other content is written over, not
		// deleted (a transaction may not touch a key twice).
		if listed[seq] == nil && c.lease != 0 {
			out = append(out, c)
		}
	}
	return out
}

// dropChunks deletes the chunk keys of name at epoch, best effort: what a
// publish that lost the name to another epoch wrote.
func (e *Store) dropChunks(ctx context.Context, name string, epoch uint64) {
	e.do(ctx, func(ctx context.Context) error { //nolint:errcheck // best effort: they expire with their lease
		_, err := e.cli.Delete(ctx, e.chunkDir(name, epoch), clientv3.WithPrefix())
		return err
	})
}

// valueEpoch returns the epoch of the descriptor value holds, a whole one
// or a header.
func valueEpoch(value []byte) (uint64, error) {
	if !isHeader(value) {
		d, err := segtable.UnmarshalDesc(value)
		if err != nil {
			return 0, err
		}
		return d.Epoch, nil
	}
	var h struct {
		Desc struct {
			Epoch uint64 `json:"epoch"`
		} `json:"desc"`
	}
	if err := json.Unmarshal(value, &h); err != nil {
		return 0, fmt.Errorf("%w: header: %v", segtable.ErrBadDesc, err)
	}
	return h.Desc.Epoch, nil
}

// parseHeader decodes and checks a header read under name's key
// (chunkwire.ParseHeader).
func parseHeader(name string, value []byte) (*chunkHeader, error) {
	return chunkwire.ParseHeader(name, value)
}

// decodeChunk decodes the value of the chunk key of c
// (chunkwire.DecodeListed), at most maxChunkBytes.
func decodeChunk(c headerChunk, value []byte) (readChunk, error) {
	if len(value) > maxChunkBytes {
		return readChunk{}, fmt.Errorf("%w: chunk %d of %d bytes", segtable.ErrBadDesc, c.Seq, len(value))
	}
	return chunkwire.DecodeListed(c, value)
}

// fetch reads, at revision rev, the chunks h lists that have holds not
// (nil: none), and returns them by seq: as one range of the epoch's chunk
// keys when it misses many, else key by key, in transactions of at most
// maxTxnOps reads. A listed chunk etcd does not hold at rev is
// errMissing.
func (e *Store) fetch(ctx context.Context, name string, h *chunkHeader, rev int64, have func(headerChunk) bool) (map[uint64]readChunk, error) {
	want := make(map[uint64]headerChunk)
	for _, c := range h.Chunks {
		if have == nil || !have(c) {
			want[c.Seq] = c
		}
	}
	got := make(map[uint64]readChunk, len(want))
	if len(want) == 0 {
		return got, nil
	}
	dir := e.chunkDir(name, h.Desc.Epoch)
	if len(want) > rangeFetch {
		var resp *clientv3.GetResponse
		if _, err := e.do(ctx, func(ctx context.Context) (err error) {
			resp, err = e.cli.Get(ctx, dir, clientv3.WithPrefix(), clientv3.WithRev(rev), clientv3.WithLimit(int64(len(h.Chunks)+rangeSlack)))
			return err
		}); err != nil {
			return nil, err
		}
		if !resp.More {
			for _, kv := range resp.Kvs {
				seq, err := strconv.ParseUint(strings.TrimPrefix(string(kv.Key), dir), 10, 64)
				if err != nil {
					continue // not a chunk key: nothing of this layout's
				}
				c, ok := want[seq]
				if !ok {
					continue
				}
				rc, err := decodeChunk(c, kv.Value)
				if err != nil {
					return nil, err
				}
				got[seq] = rc
			}
			if len(got) != len(want) {
				return nil, fmt.Errorf("%w: %d of %d", errMissing, len(want)-len(got), len(want))
			}
			return got, nil
		}
	}
	seqs := make([]uint64, 0, len(want))
	for seq := range want {
		seqs = append(seqs, seq)
	}
	slices.Sort(seqs)
	for len(seqs) > 0 {
		batch := seqs[:min(len(seqs), maxTxnOps)]
		seqs = seqs[len(batch):]
		ops := make([]clientv3.Op, len(batch))
		for i, seq := range batch {
			ops[i] = clientv3.OpGet(chunkKey(dir, seq), clientv3.WithRev(rev))
		}
		var resp *clientv3.TxnResponse
		if _, err := e.do(ctx, func(ctx context.Context) (err error) {
			resp, err = e.cli.Txn(ctx).Then(ops...).Commit()
			return err
		}); err != nil {
			return nil, err
		}
		for i, r := range resp.Responses {
			kvs := r.GetResponseRange().GetKvs()
			if len(kvs) == 0 {
				return nil, fmt.Errorf("%w: chunk %d", errMissing, batch[i])
			}
			rc, err := decodeChunk(want[batch[i]], kvs[0].Value)
			if err != nil {
				return nil, err
			}
			got[batch[i]] = rc
		}
	}
	return got, nil
}

// assemble returns the descriptor of h, a header of name read at rev:
// Chunked, sharing the chunks base holds (chunkwire.AssembleChunked),
// with the others read at rev (fetch), and the Set the next read of the
// name takes, which the store's cache holds from then on for its Gets
// and watches.
func (e *Store) assemble(ctx context.Context, name string, h *chunkHeader, rev int64, base *chunkwire.Set) (*segtable.SegmentDesc, *chunkwire.Set, error) {
	got, err := e.fetch(ctx, name, h, rev, func(c headerChunk) bool { return base.Has(h.Desc.Epoch, c) })
	if err != nil {
		return nil, nil, err
	}
	d, next, err := chunkwire.AssembleChunked(h, base, got)
	if err != nil {
		return nil, nil, err
	}
	e.chunks.Store(name, next)
	return d, next, nil
}
