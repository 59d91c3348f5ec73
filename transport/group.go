// group.go holds CopyGroup: a BatchCopier's large copies that move
// together (fastcopy.Group), with the references they need until they do.

package transport

import (
	"github.com/moonring/moonring/internal/fastcopy"
	"github.com/moonring/moonring/segtable"
)

// CopyGroup gathers the large copies of a BatchCopier's batch (those
// CopyGroups says gain) so that up to four move at once (fastcopy.Group),
// with the references on the target's memory that a Holds could not keep
// for them (Holds.Take's release), released once they have moved. Its
// zero value is empty and ready. It is owned by one goroutine; Flush it
// before releasing the Holds its copies took references in, and before
// any copy that must land after its copies (a smaller copy, a
// notification, a process_vm call).
type CopyGroup struct {
	g    fastcopy.Group
	refs [fastcopy.GroupMax]*segtable.Ref
	n    int
}

// CopyGroups reports whether a copy of n bytes gains from a CopyGroup;
// a smaller one goes alone (after a Flush). Safe for concurrent use.
func CopyGroups(n uint64) bool { return fastcopy.Groups(uintptr(n)) }

// Add adds a copy of src to dst, for which the caller took r (Holds.Take):
// release, Take's, says the group releases r once the copy has moved. A
// fourth copy moves the four at once.
func (c *CopyGroup) Add(dst, src []byte, r *segtable.Ref, release bool) {
	if release {
		c.refs[c.n] = r
		c.n++
	}
	if c.g.Add(dst, src) {
		c.Flush()
	}
}

// Flush moves the copies the group holds and releases the references it
// holds for them.
func (c *CopyGroup) Flush() {
	c.g.Copy()
	for i := range c.n {
		c.refs[i].Release()
		c.refs[i] = nil
	}
	c.n = 0
}
