#!/bin/sh
# fuzz.sh DURATION: runs every Go fuzz target of the module for DURATION.
set -eu
cd "$(dirname "$0")/.."
t=${1:-10s}
grep -rl --include='*_test.go' '^func Fuzz' . | sort | while read -r f; do
	dir=$(dirname "$f")
	for name in $(sed -n 's/^func \(Fuzz[A-Za-z0-9_]*\)(.*/\1/p' "$f"); do
		echo "fuzz $dir $name for $t"
		go test -run '^$' -fuzz "^${name}\$" -fuzztime "$t" "$dir" >/tmp/fuzz.$$.log 2>&1 || {
			cat /tmp/fuzz.$$.log; rm -f /tmp/fuzz.$$.log; exit 1; }
	done
done
rm -f /tmp/fuzz.$$.log
