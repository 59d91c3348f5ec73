package mctcp

// Inside reports whether ep, an Endpoint of this package, holds [addr,
// addr+n) wholly in one buffer of its descriptor (the check Post makes
// before a slice goes out).
func Inside(ep any, addr, n uint64) bool { return ep.(*Endpoint).inside(addr, n) }
