// Package mctcp is Mooncake's TCP data protocol as a moonring transport,
// named "mooncake-tcp": the target serves Mooncake initiators (and
// moonring ones) the buffers registered with it, and the initiator reads
// and writes the registered memory of Mooncake targets (and moonring
// ones), so that a moonring engine can join a Mooncake cluster over plain
// TCP without changing the Mooncake side.
//
// # The protocol
//
// A Mooncake engine listens on its tcp_data_port. A request is a 24-byte
// header (length and address, 8 bytes little-endian each, an opcode byte:
// 0 READ, 1 WRITE, with 0x80 set for version 2; 7 bytes the receiver
// ignores), followed by a WRITE's bytes; a READ is answered with the
// bytes. A connection carries one request after another. Version 2, which
// a target's descriptor announces (tcp_proto_version, here
// Endpoints["mooncake-tcp.version"]), adds an 8-byte status word (the
// magic 0x4D435456 in the top 32 bits, 0 for success or 1 for a refused
// range in the low 32): before a READ's bytes, after a WRITE's last byte
// has landed, and instead of anything else when the range is refused,
// after which the target closes the connection. Version 1 has no status:
// a WRITE is reported done once sent, and a refused range just closes the
// connection. ../FORMATS.md has the details and the Mooncake commit they
// were read from; no Mooncake code is kept here.
//
// # The target
//
// One goroutine per connection reads a header, finds the one registered,
// remote-accessible buffer that holds the whole range (the table is sorted
// by address, read lock-free), holds its reference while the bytes move
// straight between the socket and the buffer, and answers. It speaks both
// versions, each request as its opcode asks. The protocol authenticates
// nothing, so everything a peer can make the target do is bounded: the
// connections, per source and in all (Config.MaxConnsPerSource, MaxConns;
// at a bound the connection idle longest is closed, or the new one when
// every connection is busy), the time a connection may wait between
// requests (IdleTimeout), the length of a request (MaxLength, and the
// buffer), the time a payload may take (FrameTimeout plus the length at
// MinRate: a stalled peer cannot hold a buffer's Unregister longer), and
// nothing is allocated per request or in proportion to a length the peer
// sent. An opcode other than READ and WRITE closes the connection
// (Mooncake's target would take it for a READ). Refusals are counted
// (Refusals) and logged at most once a second per reason. A refused version
// 2 WRITE has a bounded part of its payload read and dropped before the
// close, so that the refusal is not lost to a connection reset.
//
// # The initiator
//
// An Endpoint holds Config.Rails connections (4 by default; Mooncake's
// target serves one request at a time per connection, so connections are
// what runs in parallel). Each has a sender goroutine, which gathers
// queued requests into one writev and sends up to Config.Depth of them
// ahead of their answers, and a receiver goroutine, which reads the
// answers in order: a version 2 status word (bounded by StatusTimeout), a
// READ's bytes. While nothing awaits an answer the receiver watches the
// socket, so a target that closes an idle connection is seen at once and
// the rail redialed. A slice whose range lies in no buffer of the descriptor
// completes at once with transport.ErrRange. A peer that speaks version 1
// gets a warning logged once per address: its WRITEs complete when their
// last byte is in the socket, before it lands, and a range it refuses
// shows only as a closed connection.
//
// A Notify slice goes to the segment's RPC port as Mooncake's notify frame
// (notify.go, on a goroutine of its own, bounded by 5 s): Mooncake carries
// notifications there, not on the data port, and without a tag. A refusal
// completes it with transport.ErrNotifyFull (retried as a full queue).
//
// # Concurrency
//
// Transport and Endpoint are safe for concurrent use. Post does not block
// and, in steady state, does not allocate; completions come from the
// connections' goroutines.
//
// # Lifetimes
//
// A Transport lives until Close, which closes its listener, its
// connections and its endpoints and waits for every goroutine. An Endpoint
// lives until its Close or the transport's; every slice Post accepted is
// completed exactly once, and its local memory is no longer touched when
// it is. Unregister returns once no request moves the buffer's bytes.
//
// # Errors
//
// A broken or silent connection fails its slices with errors wrapping
// transport.ErrPeer (and ErrTimeout or ErrBadStatus where that is why), so
// the engine retries them on another rail; the connection is redialed in
// the background. A version 2 refusal fails the slice with ErrRefused and
// transport.ErrDenied (final). Close fails what is in flight with
// transport.ErrClosed.
package mctcp
