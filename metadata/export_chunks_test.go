package metadata

import "time"

// SetPendingTTL sets how long a server keeps chunks no header lists, for
// the tests of a package that run one at a time; it returns the undo.
func SetPendingTTL(d time.Duration) func() {
	old := serverPendingTTL
	serverPendingTTL = d
	return func() { serverPendingTTL = old }
}
