#!/bin/sh
# bench-curves.sh: issue 19's cost-growth curves, each as a table and a
# plot: the per-request cost (in-process engines, ring API, 4 KiB WRITEs,
# 64 in flight unless the curve is the depth) against registered buffers
# (to the last buffer: BenchmarkScaleBuffersWaiting, a caller that waits
# on the CQ, and BenchmarkScaleBuffers, one that spins), open segments
# (BenchmarkScaleSegments), distinct peers over loopback TCP
# (BenchmarkScalePeers, beside BenchmarkScalePeersRaw: the same rounds
# over raw TCP pairs with no engine; and BenchmarkScalePeersTurn beside
# BenchmarkScalePeersTurnRaw, the shape held: each round's 64 on one peer,
# the next in turn; BenchmarkScalePeersApart, the shape held with the
# target in a process of its own, its CPU per request apart, beside
# BenchmarkScalePeersApartRaw; BenchmarkScalePeersProcs, the peers spread
# over up to 4 processes as well), requests in flight
# (BenchmarkScaleDepth), batch size through the batch API
# (BenchmarkScaleBatch, per task), and a register/unregister cycle against
# the buffers held (BenchmarkScaleChurn at its defaults, CPU time per
# cycle).
#
#   scripts/bench-curves.sh [rounds [dir]]
#
# It builds the package's test binary once, then runs every curve's
# benchmark once per round (default 3 rounds; the curves interleaved, so
# a burst of load elsewhere hits one round, not one curve), takes each
# point's median over the rounds, normalizes each curve to its first point
# (depth also to 64 in flight, batch also to 32 tasks) and prints a table
# per curve. Into dir (default: a new directory under /tmp, named on the
# last line) it writes raw.txt (every benchmark line), curves.md (the
# tables) and curve-NAME.svg per curve: log x, the cost ratio on y, the
# issue's 1.2x target as a dashed line. On the 2-vCPU development VM the
# default run takes about 4 minutes (5 rounds: 7).
#
# Knobs (environment):
#   CURVES               which curves (default: buffers segments peers peers-turn peers-apart peers-procs depth batch churn)
#   BENCHTIME            -benchtime of the in-process ring curves (default 1s)
#   PEERS_BENCHTIME      -benchtime of the peers curve (default 20000x; it sets up
#                        its engines again for each b.N tried, so a count)
#   TURN_BENCHTIME       -benchtime of the peers-turn, -apart and -procs curves
#                        (default 640000x: every one of 1,000 peers takes 10
#                        rounds)
#   MOONRING_SCALE_MAX   leaves out every point above this count (buffers,
#                        segments, peers, depth, batch size), e.g. 1000 for a
#                        quick run
#   MOONRING_CHURN_CYCLES  cycles of the churn curve (default 100,000;
#                        10,000 for remote beside many buffers)
set -eu
rounds=${1:-3}
dir=${2:-$(mktemp -d /tmp/bench-curves.XXXXXX)}
curves=${CURVES:-buffers segments peers peers-turn peers-apart peers-procs depth batch churn}
benchtime=${BENCHTIME:-1s}
cd "$(dirname "$0")/.."
mkdir -p "$dir"
: >"$dir/raw.txt"
go test -c -o "$dir/curves.test" .
{
	echo "# $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null || echo '?') rounds=$rounds curves=$curves"
	echo "# $(uname -srm), $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)"
	echo "# MOONRING_SCALE_MAX=${MOONRING_SCALE_MAX:-} MOONRING_CHURN_CYCLES=${MOONRING_CHURN_CYCLES:-} BENCHTIME=$benchtime"
} >>"$dir/raw.txt"
run() { # pattern, benchtime
	echo "# $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg): $1" >>"$dir/raw.txt"
	"$dir/curves.test" -test.run '^$' -test.bench "$1" -test.benchtime "$2" 2>&1 |
		tee -a "$dir/raw.txt" | grep -E '^(Benchmark|FAIL|panic|--- )' >&2 || true
}
for i in $(seq "$rounds"); do
	echo "bench-curves: round $i of $rounds" >&2
	for c in $curves; do
		case $c in
		buffers)
			run '^BenchmarkScaleBuffersWaiting$' "$benchtime"
			run '^BenchmarkScaleBuffers$/buffers/to=last' "$benchtime"
			;;
		segments) run '^BenchmarkScaleSegments$' "$benchtime" ;;
		peers) run '^BenchmarkScalePeers(Raw)?$' "${PEERS_BENCHTIME:-20000x}" ;;
		peers-turn) run '^BenchmarkScalePeersTurn(Raw)?$' "${TURN_BENCHTIME:-640000x}" ;;
		peers-apart) run '^BenchmarkScalePeersApart(Raw)?$' "${TURN_BENCHTIME:-640000x}" ;;
		peers-procs) run '^BenchmarkScalePeersProcs$' "${TURN_BENCHTIME:-640000x}" ;;
		depth) run '^BenchmarkScaleDepth$' "$benchtime" ;;
		batch) run '^BenchmarkScaleBatch$' "$benchtime" ;;
		churn) run '^BenchmarkScaleChurn$' 1x ;;
		*)
			echo "bench-curves: unknown curve $c" >&2
			exit 2
			;;
		esac
	done
done
echo "# $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg): end" >>"$dir/raw.txt"
if grep -qE '^(FAIL|panic)' "$dir/raw.txt"; then
	echo "bench-curves: a benchmark failed, see $dir/raw.txt" >&2
	exit 1
fi
rm -f "$dir/curves.test"
python3 scripts/bench_curves.py "$dir"
echo "bench-curves: $dir"
