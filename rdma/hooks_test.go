//go:build rdma && cgo

package rdma

// The tests' fault injections. They live here, not in the transport: its
// testHooks stay nil outside the tests.

// setFailAnswers makes the target fail every notification's answer (v
// true), as if posting it had, or answer them again (v false).
func (t *Transport) setFailAnswers(v bool) {
	t.hooks.CompareAndSwap(nil, new(testHooks))
	t.hooks.Load().failAnswers.Store(v)
}

// stallPeers moves every queue pair peers connected to this transport to
// the error state without telling the peers: their requests go unanswered
// until they time out. It returns how many.
func (t *Transport) stallPeers() int {
	t.qpMu.RLock()
	defer t.qpMu.RUnlock()
	for _, p := range t.peers {
		toErr(p.q)
	}
	return len(t.peers)
}
