#!/bin/sh
# bench-vs-ucx.sh: UCX's own put and get bandwidth over its posix
# shared-memory transport (ucx_perftest, Debian ucx-utils) beside moonring's
# shm benchmarks, in one run, at 4 KiB, 64 KiB, 1 MiB and 64 MiB.
# ucx_perftest puts and gets one buffer over and over; BenchmarkShmWriteSame
# and BenchmarkShmReadSame do the same (the other benchmarks spread the
# requests in flight over their own blocks, a working set 8-64 times larger).
#
#   scripts/bench-vs-ucx.sh [count]    count runs of each (default 3)
#
# It installs ucx-utils when missing (root and apt-get needed). Figures:
# UCX prints MB/s where MB = 2^20 bytes; this script converts to GB/s
# (10^9 bytes), the unit of the Go benchmarks.
set -eu
count=${1:-3}
cd "$(dirname "$0")/.."
if ! command -v ucx_perftest >/dev/null 2>&1; then
	if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends ucx-utils >&2 ||
			{ apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends ucx-utils >&2; }
	else
		echo "bench-vs-ucx: ucx_perftest missing and cannot install ucx-utils" >&2
		exit 1
	fi
fi
export UCX_TLS=posix
port=13337
ucx() { # test size iters
	ucx_perftest -p $port -t "$1" -s "$2" -n "$3" -w 1000 >/dev/null 2>&1 &
	srv=$!
	sleep 0.5
	# The last line of the table holds the overall average bandwidth
	# (MB/s) in its sixth-from-last column.
	ucx_perftest 127.0.0.1 -p $port -t "$1" -s "$2" -n "$3" -w 1000 2>/dev/null |
		awk '/^ *Final:/ { printf "%.2f\n", $(NF-2) * 1048576 / 1e9 }'
	wait $srv 2>/dev/null || true
}
for size in 4096 65536 1048576 67108864; do
	case $size in
	4096) n=2000000 ;;
	65536) n=200000 ;;
	1048576) n=20000 ;;
	*) n=300 ;;
	esac
	for t in ucp_put_bw ucp_get; do
		for i in $(seq "$count"); do
			printf 'ucx %s size=%d run=%d GB/s %s\n' "$t" "$size" "$i" "$(ucx $t $size $n)"
		done
	done
done
go test -run '^$' -bench 'Shm(Write|Read)(Same)?$|ShmCopyBaseline' -count "$count" . |
	awk '/^Benchmark/ { for (i = 1; i < NF; i++) if ($(i+1) == "GB/s") print $1, "GB/s", $i }'
# The one-block benchmarks again on one P (the engine's poller and the
# reaper on one core, handing over without crossing cores, as
# ucx_perftest's single thread): the names lose their "-2" suffix.
MOONRING_BENCH_WAIT=1 GOMAXPROCS=1 go test -run '^$' -bench 'Shm(Write|Read)Same$' -count "$count" . |
	awk '/^Benchmark/ { for (i = 1; i < NF; i++) if ($(i+1) == "GB/s") print $1, "GB/s", $i }'
