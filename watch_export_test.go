package moonring

// PeerBuffers returns the number of buffers of the descriptor the open
// segment id of e last took (its watcher applied it: every path's
// Update, then the segment's), or -1: what BenchmarkPeerRepublish
// polls. Safe for concurrent use.
func PeerBuffers(e *Engine, id SegmentID) int {
	s := e.segments.Get(id)
	if s == nil {
		return -1
	}
	return s.Desc().NumBuffers()
}
