#!/bin/sh
# bench-latency.sh: the 8-byte READ latency (BenchmarkTCPReadLatency) beside
# the raw ping-pong (BenchmarkRawTCPPingPong), both two processes over
# loopback, in three placements of the two processes:
#
#   same    both on CPU 0 (taskset; GOMAXPROCS 1 each)
#   cross   the initiator on CPU 0, the target on CPU 1 (GOMAXPROCS 1 each)
#   free    no pinning (the scheduler decides, run by run)
#
# On a VM a wake-up across vCPUs costs tens of µs (the woken vCPU was
# halted), so where the scheduler happens to put the two processes decides
# the figure: unpinned, the ping-pong gives ~17 µs in one run and ~60 µs in
# the next. Pinned placements compare like with like.
#
#   scripts/bench-latency.sh [runs per placement, default 5] [benchtime, default 1s]
set -eu
cd "$(dirname "$0")/.."
runs=${1:-5}
bt=${2:-1s}
bin=${TMPDIR:-/tmp}/moonring-latency.test
go test -c -o "$bin" .
ncpu=$(nproc)
for place in same cross free; do
	case $place in
	same) pin="taskset -c 0" child=0 ;;
	cross)
		if [ "$ncpu" -lt 2 ]; then
			echo "cross: skipped, one CPU" >&2
			continue
		fi
		pin="taskset -c 0" child=1
		;;
	free) pin="" child="" ;;
	esac
	i=0
	while [ $i -lt "$runs" ]; do
		for b in TCPReadLatency RawTCPPingPong; do
			MOONRING_BENCH_CHILD_CPUS=$child $pin "$bin" -test.run '^$' \
				-test.bench "^Benchmark$b\$" -test.benchtime "$bt" 2>&1 |
				awk -v p=$place '/^Benchmark/ { print p, $1, $5, "p50-µs", $7, "p99-µs" }'
		done
		i=$((i + 1))
	done
done | awk '
	{ print; k = $1 " " $2; sub(/-[0-9]+$/, "", k); if (!(k in v)) order[++nk] = k; v[k] = v[k] " " $3 }
	END {
		print "\nmedians of the p50s:"
		for (o = 1; o <= nk; o++) {
			k = order[o]
			n = split(v[k], a, " ")
			for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] + 0 < a[i] + 0) { t = a[i]; a[i] = a[j]; a[j] = t }
			printf "  %-32s %s µs (%s)\n", k, (n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2), v[k]
		}
	}'
