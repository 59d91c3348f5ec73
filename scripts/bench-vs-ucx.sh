#!/bin/sh
# bench-vs-ucx.sh: UCX's own put and get bandwidth over its posix
# shared-memory transport (ucx_perftest, Debian ucx-utils) beside moonring's
# shm benchmarks, interleaved, at 4 KiB, 64 KiB, 1 MiB and 64 MiB.
#
# ucx_perftest puts and gets one buffer over and over; BenchmarkShmWriteSame
# and BenchmarkShmReadSame do the same (the other benchmarks spread the
# requests in flight over their own blocks, a working set 8-64 times
# larger). Each round runs, for one size: UCX's put, moonring's WRITE on two
# Ps (the poller and a spinning reaper on their own cores) and on one P (a
# reaper blocking in CQ().Wait, sharing the poller's core as ucx_perftest's
# one thread does), then the same for get and READ. Interleaving matters:
# on a shared VM either side moves by 10-30 % from one minute to the next,
# so a ratio is only worth something between runs made side by side.
#
#   scripts/bench-vs-ucx.sh [count [size ...]]
#
# count rounds per size (default 3); sizes in bytes (default 4096 65536
# 1048576 67108864; others are not offered by the Go benchmarks).
#
# It prints every figure, then per size the median of each and the ratios
# of the medians. The spread benchmarks and copy() of the same memory
# follow, count runs each. It installs ucx-utils when missing (root and
# apt-get needed). UCX prints MB/s where MB = 2^20 bytes; this script
# converts to GB/s (10^9 bytes), the unit of the Go benchmarks.
set -eu
count=${1:-3}
[ $# -gt 0 ] && shift
sizes=${*:-4096 65536 1048576 67108864}
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
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
go test -c -o "$tmp/moonring.test" .

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
mr() { # benchmark name, then environment assignments
	name=$1
	shift
	env "$@" "$tmp/moonring.test" -test.run '^$' -test.bench "$name" |
		awk '/^Benchmark/ { for (i = 1; i < NF; i++) if ($(i+1) == "GB/s") print $i }'
}

for size in $sizes; do
	case $size in
	4096) n=2000000 name=4KiB ;;
	65536) n=200000 name=64KiB ;;
	1048576) n=20000 name=1MiB ;;
	67108864) n=300 name=64MiB ;;
	*)
		echo "bench-vs-ucx: no Go benchmark of $size bytes" >&2
		exit 2
		;;
	esac
	for i in $(seq "$count"); do
		for pair in "ucp_put_bw ShmWriteSame" "ucp_get ShmReadSame"; do
			set -- $pair
			echo "$name ucx-$1 $(ucx "$1" $size $n)"
			echo "$name $2-twoP $(mr "$2\$/size=$name\$")"
			echo "$name $2-oneP $(mr "$2\$/size=$name\$" MOONRING_BENCH_WAIT=1 GOMAXPROCS=1)"
		done
	done
done | tee "$tmp/runs"

echo
echo "medians of $count interleaved rounds, GB/s; ratio: moonring / UCX"
awk '
	{ v[$1 " " $2] = v[$1 " " $2] " " $3; sizes[$1] = 1 }
	function median(s,   a, n, i, j, t) {
		n = split(s, a, " ")
		for (i = 2; i <= n; i++) for (j = i; j > 1 && a[j-1] + 0 > a[j] + 0; j--) { t = a[j]; a[j] = a[j-1]; a[j-1] = t }
		return n % 2 ? a[(n+1)/2] : (a[n/2] + a[n/2+1]) / 2
	}
	END {
		split("4KiB 64KiB 1MiB 64MiB", order, " ")
		for (k = 1; k <= 4; k++) {
			s = order[k]
			if (!(s in sizes)) continue
			up = median(v[s " ucx-ucp_put_bw"]); ug = median(v[s " ucx-ucp_get"])
			w2 = median(v[s " ShmWriteSame-twoP"]); w1 = median(v[s " ShmWriteSame-oneP"])
			r2 = median(v[s " ShmReadSame-twoP"]); r1 = median(v[s " ShmReadSame-oneP"])
			printf "%-6s put %6.1f  WRITE two Ps %6.1f (%.2fx)  one P %6.1f (%.2fx)\n", s, up, w2, w2 / up, w1, w1 / up
			printf "%-6s get %6.1f  READ  two Ps %6.1f (%.2fx)  one P %6.1f (%.2fx)\n", s, ug, r2, r2 / ug, r1, r1 / ug
		}
	}' "$tmp/runs"

echo
"$tmp/moonring.test" -test.run '^$' -test.bench 'Shm(Write|Read)$|ShmCopyBaseline' -test.count "$count" |
	awk '/^Benchmark/ { for (i = 1; i < NF; i++) if ($(i+1) == "GB/s") print $1, "GB/s", $i }'
