package metadata

import "github.com/moonring/moonring/segtable"

// MemoryChunks returns the chunks m keeps for name, nil if it keeps a
// flat descriptor or none.
func MemoryChunks(m *Memory, name string) *segtable.BufferChunks {
	m.mu.Lock()
	defer m.mu.Unlock()
	if d := m.descs[name]; d != nil {
		return d.Chunked
	}
	return nil
}
