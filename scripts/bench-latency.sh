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
command -v taskset >/dev/null 2>&1 || { echo "bench-latency: taskset (util-linux) is needed" >&2; exit 1; }
bin=${TMPDIR:-/tmp}/moonring-latency.test
go test -c -o "$bin" .
ncpu=$(nproc)
out=$(mktemp)
res=$(mktemp)
trap 'rm -f "$out" "$res"' EXIT
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
				-test.bench "^Benchmark$b\$" -test.benchtime "$bt" >"$out" 2>&1 || {
				echo "bench-latency: $place $b failed:" >&2
				cat "$out" >&2
				exit 1
			}
			# The figures are the fields before their units.
			awk -v p=$place '/^Benchmark/ {
				p50 = p99 = ""
				for (i = 2; i <= NF; i++) {
					if ($i == "p50-µs") p50 = $(i - 1)
					if ($i == "p99-µs") p99 = $(i - 1)
				}
				if (p50 != "") print p, $1, p50, "p50-µs", p99, "p99-µs"
			}' "$out" | tee -a "$res"
		done
		i=$((i + 1))
	done
done
awk '
	{ k = $1 " " $2; sub(/-[0-9]+$/, "", k); if (!(k in v)) order[++nk] = k; v[k] = v[k] " " $3 }
	END {
		print "\nmedians of the p50s:"
		for (o = 1; o <= nk; o++) {
			k = order[o]
			n = split(v[k], a, " ")
			for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] + 0 < a[i] + 0) { t = a[i]; a[i] = a[j]; a[j] = t }
			printf "  %-32s %s µs (%s)\n", k, (n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2), v[k]
		}
	}' "$res"
