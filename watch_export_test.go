package moonring

// PeerRev returns the Rev of the descriptor the open segment id of e last
// took (its watcher applied it: every path's Update, then the segment's),
// or 0: what BenchmarkPeerRepublish polls. Safe for concurrent use.
func PeerRev(e *Engine, id SegmentID) uint64 {
	s := e.segments.Get(id)
	if s == nil {
		return 0
	}
	return s.Desc().Rev
}
