package rdma

// Stats counts what the transport did, for benchmarks and metrics: cgo
// calls on the data path against slices moved.
type Stats struct {
	// Slices is the number of slices posted to the hardware.
	Slices uint64
	// PostCalls is the number of cgo calls that posted work requests.
	PostCalls uint64
	// PollCalls is the number of cgo calls that polled a completion queue
	// and found at least one completion.
	PollCalls uint64
	// EmptyPolls is the number of polls that found nothing.
	EmptyPolls uint64
	// Reconnects is the number of queue pairs connected after the first
	// of their rail.
	Reconnects uint64
	// ConnectFailures is the number of connects that failed, at Open or
	// on a reconnect: a queue pair's (in Mooncake mode, a device's set's)
	// dial, handshake, or move to RTR or RTS, each ended by
	// Config.ConnectTimeout at the latest. A rail whose connects keep
	// failing carries nothing while the other rails take its slices;
	// this count is where it shows.
	ConnectFailures uint64
	// Evictions is the number of idle queue pairs closed to stay within
	// Config.MaxQPs.
	Evictions uint64
	// QPs is the number of the initiator's queue pairs now connected or
	// being connected (a reconnect under way counts against MaxQPs).
	QPs int
	// PeerQPs is, in Mooncake mode, the number of queue pairs Mooncake
	// peers hold here (their handshakes made them).
	PeerQPs int
	// PeerEvictions is, in Mooncake mode, the number of peers' sets of
	// queue pairs destroyed to stay within Config.MaxPeerQPs.
	PeerEvictions uint64
}
