// ttl.go holds --ttl of serve and bench: how long the segment an engine
// publishes through a metadata server or etcd outlives the engine's last
// renewal, that is how soon a killed engine's name is free again.

package main

import (
	"flag"
	"fmt"
	"strings"
	"time"

	"github.com/moonring/moonring/metadata"
)

// minTTL is the shortest --ttl: etcd leases last whole seconds (and etcd
// raises a shorter one to its minimum, a few seconds with its default
// timings), and a store renews every TTL/3.
const minTTL = time.Second

// ttlHelp is the part of serve's and bench's help on --ttl.
const ttlHelp = `--ttl D (with --metadata http://... or etcd://...) is how long the
segment's descriptor outlives the engine's last renewal (a store renews
every D/3): a process killed with -9 leaves its name held that long, and
the same name cannot be published again by its successor until it
expires. The default is 30s; at least 1s (etcd rounds it up to whole
seconds and to its own minimum lease, a few seconds with its default
timings). A short TTL frees a dead engine's name sooner; it also drops a
live one's descriptor when the engine cannot renew it for that long (a
process stalled, or cut off from the store).
`

// addTTLFlag adds --ttl to fs.
func addTTLFlag(fs *flag.FlagSet) *time.Duration {
	return fs.Duration("ttl", metadata.DefaultTTL, "with --metadata http://... or etcd://...: how long the published segment outlives the last renewal (renewed every TTL/3), so how soon a killed engine's name is free again; at least 1s (etcd: whole seconds)")
}

// checkTTL refuses --ttl where it means nothing (p2p, whose segment lives
// as long as its endpoint answers; --mooncake, whose store is Mooncake's)
// or is too short. set says whether --ttl was given.
func checkTTL(ttl time.Duration, set bool, meta string, mooncake bool) error {
	if !set {
		return nil
	}
	switch {
	case mooncake:
		return fmt.Errorf("--ttl goes with --metadata http://... or etcd://..., not --mooncake (Mooncake's store keeps its own lease)")
	case !strings.HasPrefix(meta, "http://") && !strings.HasPrefix(meta, "https://") && !strings.HasPrefix(meta, "etcd://"):
		return fmt.Errorf("--ttl goes with --metadata http://... or etcd://... (the metadata is %q: a p2p segment lives as long as its endpoint answers)", meta)
	case ttl < minTTL:
		return fmt.Errorf("--ttl %v: want at least %v (etcd leases last whole seconds; a store renews every TTL/3)", ttl, minTTL)
	}
	return nil
}
