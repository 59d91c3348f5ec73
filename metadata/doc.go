// Package metadata holds segment descriptors: the record, published by each
// engine, of its name, epoch, endpoints per transport and remote-accessible
// buffers ([segtable.SegmentDesc]). Engines publish their own descriptor with
// [Store.Put] and resolve a peer's with [Store.Get] when they open its
// segment; [Store.Watch] tells them when a peer restarts or goes away.
//
// [Store] is the contract; [Memory] is the in-process store used by tests and
// by engines that share one process. [P2P] is the default of a deployment:
// each engine serves its own descriptor on a small HTTP endpoint whose
// host:port is the segment's name, and fetches and polls its peers'. [HTTP]
// is the client of a shared metadata server ([Server], `moonring
// metadata-server`): entries carry a TTL that the owning client renews, so a
// crashed engine's segment disappears, and the server keeps them in a
// directory, a file per entry, across its restarts. The etcd store, in
// package [github.com/moonring/moonring/metadata/etcd] (apart, so that
// importing this package pulls in neither etcd's client nor gRPC), keeps
// them in an etcd cluster under a key prefix, each written under a lease
// that its store keeps alive, so a crashed engine's segment disappears when
// its lease expires. [Signed] wraps any store: it signs what it publishes
// and hands on only descriptors that verify under the deployment's key.
// An engine publishes its buffers as copy-on-write chunks
// ([segtable.SegmentDesc.Chunked]); [Memory] keeps them by pointer and
// [Signed] signs only the chunks a republish changed, so a publish after
// one registration costs the same with one buffer or many. The etcd store,
// the [HTTP] store with its [Server], and [P2P] peers' watches move only
// the chunks a republish made and a header.
// Stores that span machines (p2p, HTTP, etcd) implement the same interface
// and must keep the same semantics;
// [github.com/moonring/moonring/metadata/storetest] checks them. Where a
// store cannot, the difference is documented on the store and declared to
// the suite through
// [github.com/moonring/moonring/metadata/storetest.Options]: a P2P store
// publishes only its own name ([ErrNotOwner] for any other), and its
// watches of a peer report Deleted when the peer stops answering as well as
// when it deletes.
//
// # Ownership of a name
//
// A name belongs to one engine instance at a time, identified by the
// descriptor's Epoch. Put under a name held with another epoch fails with
// [ErrExists]; the owner republishes (after registering a buffer, say) with
// its own epoch, and gives the name up with Delete. An engine that restarts
// under the same name gets a new epoch, so peers that cached the old
// descriptor can tell that the keys and addresses they hold are dead.
//
// # Concurrency
//
// Every Store is safe for concurrent use by any number of goroutines. The
// descriptors a Store hands out are copies owned by the receiver.
//
// # Lifetimes
//
// A Store lives until Close. Close ends every Watch (their channels are
// closed) and makes later calls fail with [ErrClosed]. A P2P store serves its
// endpoint from NewP2P until Close, and runs one goroutine per watch of a
// peer; Close shuts the endpoint down and waits for those goroutines. A Watch channel is
// closed when the watch's context is done or the store is closed, whichever
// comes first; nothing else needs releasing.
//
// # Errors
//
// Errors are wrapped once with the store and the name, as in
// `metadata memory: get "node-a": metadata: segment not found`, and match
// their sentinel with errors.Is: [ErrNotFound], [ErrExists], [ErrEpoch],
// [ErrClosed], [segtable.ErrBadDesc] for a descriptor that fails
// Validate, and the context's error when the context is done. A P2P store
// adds [ErrNotOwner] (a Put or Delete of another engine's name; no retry
// helps) and [ErrUnreachable] (a peer that did not answer properly; a retry
// can help), and reports a peer's malformed, oversized or misnamed answer
// as [segtable.ErrBadDesc].
package metadata
