package main

import (
	"runtime/debug"
	"strings"
)

// version says which moonring this is: the module's version (a tag, or a
// pseudo-version, or "(devel)" for a build in the repository) and the VCS
// revision and time it was built from, with "+dirty" when the tree had
// changes.
func version() string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "unknown (no build information)"
	}
	v := bi.Main.Version
	if v == "" {
		v = "(devel)"
	}
	var rev, at, dirty string
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.time":
			at = s.Value
		case "vcs.modified":
			if s.Value == "true" {
				dirty = "+dirty"
			}
		}
	}
	var extra []string
	if rev != "" {
		if len(rev) > 12 {
			rev = rev[:12]
		}
		extra = append(extra, "rev "+rev+dirty)
	}
	if at != "" {
		extra = append(extra, at)
	}
	extra = append(extra, bi.GoVersion)
	return v + " (" + strings.Join(extra, ", ") + ")"
}
