#!/bin/sh
# bench-kv.sh: issue 19's KV-cache workload and CPU per byte, in one run,
# interleaved round by round, over loopback:
#
#   kv    moonring bench --pattern kv at its defaults (a Llama-3-8B-like
#         pool of 2 GiB per side, 4k-token requests of 16,384 scattered
#         32 KiB transfers, 2 in flight, one target), WRITE and READ,
#         over TCP, shm and in-process, through the batch API and --ring;
#         each kv row beside its contig row (the same bytes per request as
#         1 MiB transfers, same run) and their ratio
#   cpu   moonring bench --cpu at 1 MiB over TCP (batch 32), WRITE and
#         READ, then iperf3 -l 1M one stream with -J (its
#         cpu_utilization_percent, host and remote), the same seconds
#
# Each round prints its rows; at the end come the medians over the rounds:
# GB/s of kv and contig and their ratio (the target: kv at least 0.8 of
# contig), and CPU seconds per GB on each side beside iperf3's (the target:
# moonring's at most 1.2x iperf3's).
#
#   scripts/bench-kv.sh [rounds, default 3] [duration per step, default 3s] [extra kv flags...]
#
# Needs jq and iperf3 (installed from Debian when missing and root).
set -eu
cd "$(dirname "$0")/.."
rounds=${1:-3}
dur=${2:-3s}
[ $# -ge 2 ] && shift 2 || shift $#
extra="$*"
secs=${dur%s}
for tool in jq iperf3; do
	if ! command -v $tool >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q $tool >/dev/null 2>&1 ||
			{ apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $tool >/dev/null; }
	fi
done
command -v jq >/dev/null 2>&1 || {
	echo "bench-kv: jq is needed" >&2
	exit 1
}

median() { # the median of the numbers on stdin
	sort -g | awk '{ a[NR] = $1 } END { if (NR == 0) print "-"; else if (NR % 2) printf "%.4g\n", a[(NR + 1) / 2]; else printf "%.4g\n", (a[NR / 2] + a[NR / 2 + 1]) / 2 }'
}

bin=${TMPDIR:-/tmp}/moonring-kv
go build -o "$bin" ./cmd/moonring
kv=$(mktemp)
cpu=$(mktemp)
js=$(mktemp)
trap 'rm -f "$kv" "$cpu" "$js"' EXIT
for r in $(seq "$rounds"); do
	echo "== round $r =="
	for proto in tcp shm local; do
		for api in batch ring; do
			flag=""
			[ $api = ring ] && flag="--ring"
			# shellcheck disable=SC2086
			"$bin" bench --pattern kv --protocol $proto $flag --duration "$dur" --json $extra >"$js" 2>/dev/null || {
				echo "kv $proto $api: failed" >&2
				continue
			}
			jq -r --arg p $proto --arg a $api '.[] | "\($p) \($a) \(.op) \(.pattern) \(.gb_per_s) \(.kv_over_contig // 0) \(.p50_us / 1000) \(.p99_us / 1000) \(.p999_us / 1000) \(.verified) \(.requests)"' "$js" | tee -a "$kv"
		done
	done
	"$bin" bench --cpu --block-size 1M --operation write,read --duration "$dur" --json 2>/dev/null >"$js"
	jq -r '.[] | "moonring \(.op) \(.gb_per_s) \(.cpu_s_per_gb_initiator) \(.cpu_s_per_gb_target)"' "$js" | tee -a "$cpu"
	if command -v iperf3 >/dev/null 2>&1; then
		iperf3 -s -1 -p 5299 >/dev/null 2>&1 &
		sleep 0.5
		iperf3 -c 127.0.0.1 -p 5299 -l 1M -t "$secs" -J >"$js" 2>/dev/null || true
		wait
		# CPU s/GB: a side's utilisation (its process's user+system time
		# over the wall time, in %) times the seconds, over the GB sent.
		jq -r '.end as $e | ($e.sum_sent.bytes / 1e9) as $gb | $e.sum_sent.seconds as $s |
			"iperf3 send \($gb / $s) \($e.cpu_utilization_percent.host_total / 100 * $s / $gb) \($e.cpu_utilization_percent.remote_total / 100 * $s / $gb)"' "$js" | tee -a "$cpu"
	fi
done
echo
echo "== medians over $rounds rounds: kv =="
printf '%-6s %-5s %-5s %-6s %8s %7s %8s %8s %8s %s\n' transport api op pattern GB/s kv/ctg "p50 ms" "p99 ms" "p999 ms" requests
for key in $(awk '{ print $1 "," $2 "," $3 "," $4 }' "$kv" | sort -u); do
	set -- $(echo "$key" | tr , ' ')
	sel() { awk -v p="$1" -v a="$2" -v o="$3" -v t="$4" -v c="$5" '$1 == p && $2 == a && $3 == o && $4 == t { print $c }' "$kv" | median; }
	printf '%-6s %-5s %-5s %-6s %8s %7s %8s %8s %8s %s\n' "$1" "$2" "$3" "$4" "$(sel "$@" 5)" "$(sel "$@" 6)" "$(sel "$@" 7)" "$(sel "$@" 8)" "$(sel "$@" 9)" "$(awk -v p="$1" -v a="$2" -v o="$3" -v t="$4" '$1 == p && $2 == a && $3 == o && $4 == t { s = s $11 " " } END { print s }' "$kv")"
done
echo "verified: $(awk '{ print $10 }' "$kv" | sort | uniq -c | tr '\n' ' ')"
echo
echo "== medians over $rounds rounds: CPU s/GB at 1 MiB over TCP =="
printf '%-9s %-6s %8s %10s %10s %10s\n' who op GB/s "sender" "receiver" "total"
for who in "moonring write" "moonring read" "iperf3 send"; do
	set -- $who
	m() { awk -v w="$1" -v o="$2" -v c="$3" '$1 == w && $2 == o { print $c }' "$cpu" | median; }
	# moonring WRITE: the initiator sends; READ: the target sends.
	a=$(m "$1" "$2" 4)
	b=$(m "$1" "$2" 5)
	if [ "$2" = read ]; then
		t=$a
		a=$b
		b=$t
	fi
	tot=$(awk -v w="$1" -v o="$2" '$1 == w && $2 == o { print $4 + $5 }' "$cpu" | median)
	printf '%-9s %-6s %8s %10s %10s %10s\n' "$1" "$2" "$(m "$1" "$2" 3)" "$a" "$b" "$tot"
done
