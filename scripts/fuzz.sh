#!/bin/sh
# fuzz.sh DURATION: runs every Go fuzz target of the module for DURATION.
#
# Go's fuzzer sometimes fails a clean run with "context deadline exceeded"
# when its time is up while a worker is still starting or stopping (seen on
# a loaded 2-core machine, with no failing input written).
# Such a run is tried up to three times; a run that writes a failing input
# fails at once.
set -eu
cd "$(dirname "$0")/.."
t=${1:-10s}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
run() { go test -run '^$' -fuzz "^$2\$" -fuzztime "$t" "$1" >"$log" 2>&1; }
for f in $(grep -rl --include='*_test.go' '^func Fuzz' . | sort); do
	dir=$(dirname "$f")
	for name in $(sed -n 's/^func \(Fuzz[A-Za-z0-9_]*\)(.*/\1/p' "$f"); do
		echo "fuzz $dir $name for $t"
		ok=0
		for attempt in 1 2 3; do
			if run "$dir" "$name"; then
				ok=1
				break
			fi
			if ! grep -q 'context deadline exceeded' "$log" || grep -q 'Failing input written' "$log"; then
				break
			fi
			echo "fuzz $dir $name: the fuzzer's own deadline error, no failing input (attempt $attempt)"
		done
		if [ "$ok" = 0 ]; then
			cat "$log"
			exit 1
		fi
	done
done
