// Package mooncake speaks the metadata side of the Mooncake Transfer Engine
// (kvcache-ai/Mooncake, mooncake-transfer-engine), so that a moonring engine
// can read what a Mooncake engine publishes and publish what a Mooncake
// engine can read. It is off by default: nothing in the engine imports it
// yet.
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
//   - [ReadFrame], [AppendFrame] and the documents of the P2PHANDSHAKE RPC
//     port ([HandshakeDesc], [NotifyDesc], [ProbeReply]): types and bounded
//     decoding only, no daemon.
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
// The types are plain values. [Store] and [HTTPKV] are safe for
// concurrent use.
package mooncake
