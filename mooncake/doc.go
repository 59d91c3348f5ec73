// Package mooncake speaks the metadata side of the Mooncake Transfer Engine
// (kvcache-ai/Mooncake, mooncake-transfer-engine), so that a moonring engine
// can read what a Mooncake engine publishes, publish what a Mooncake
// engine can read, and answer on a Mooncake engine's RPC port. It is off
// by default: nothing in the engine imports it yet.
//
// What it holds:
//
//   - [SegmentDesc]: a segment descriptor in Mooncake's JSON schema, with a
//     strict, bounded decoder ([Decode]) and an encoder ([SegmentDesc.Encode])
//     that writes the fields Mooncake's own encoder writes for each protocol.
//   - [ToSegtable] and [FromSegtable]: the conversion to and from moonring's
//     [segtable.SegmentDesc], under the transport names [TransportTCP] and
//     [TransportRDMA]; see FORMATS.md for what does not map.
//   - [Keys]: the key names Mooncake uses in its metadata stores
//     (mooncake/ram/<name>, mooncake/rpc_meta/<name>, the cluster prefix).
//   - [RPCMeta]: the document under mooncake/rpc_meta/<name>.
//   - [Store]: a [metadata.Store] over any [KV] that holds Mooncake's
//     keys; [HTTPKV] speaks Mooncake's HTTP metadata server protocol
//     (GET/PUT/DELETE <url>?key=<key>) and [NewHTTPStore] puts the two
//     together. An etcd or redis KV is an adapter away.
//   - [ReadFrame], [AppendFrame] and the documents of the RPC port
//     ([HandshakeDesc], [NotifyDesc], [ProbeReply]), with bounded decoding;
//     [HandshakeDesc.RDMA] checks a handshake for Mooncake's RDMA transport
//     ([RDMAHandshake], whose Answer and CheckAnswer the rdma package's
//     Mooncake mode uses).
//   - [RPCServer] ([ListenRPC]): the daemon on the engine's RPC port. It
//     answers metadata requests with the engine's descriptor (a
//     Descriptor function), probes, notifications (delivered as
//     [transport.Notification]s through a Notify function) and transport
//     handshakes (a [HandshakeFunc], refused without one), one exchange
//     per connection, bounded in size, time and connections.
//   - [RPCClient]: fetches a peer's descriptor, sends notifications,
//     probes and handshakes; [SendNotification] sends a notification to a
//     Mooncake segment's RPC endpoint.
//   - [P2PStore] ([NewP2PStore]): Mooncake's P2PHANDSHAKE mode as a
//     [metadata.Store]: segments named "ip:rpc_port", fetched from the
//     peer's daemon; it runs the engine's own daemon.
//   - Mooncake's etcd mode is the [Store] over the KV of the
//     mooncake/mcetcd package, kept apart so that only its users depend on
//     etcd's client.
//
// The formats, in our own words and with the Mooncake commit they were read
// from, are in FORMATS.md beside this file. No Mooncake code is kept here.
//
// # Safety
//
// Mooncake's metadata and RPC carry no authentication: whoever can write the
// metadata server or reach the RPC port can publish any descriptor. Every
// decoder here is bounded (document size, counts, string lengths), checks
// the invariants Mooncake's own decoder checks and a few more (no address
// overflow, no overlapping buffers after conversion), and never panics.
//
// # Concurrency
//
// The types are plain values. [Store], [HTTPKV], [RPCServer],
// [RPCClient] and [P2PStore] are safe for concurrent use.
//
// # Lifetimes
//
// An [RPCServer] serves from [ListenRPC] until Close, which closes its
// connections and waits for their goroutines; a [P2PStore] holds its
// daemon and its watches' goroutines until Close. [Store] holds its
// watches until Close, which also closes its KV. An [RPCClient] holds
// nothing between calls.
package mooncake
