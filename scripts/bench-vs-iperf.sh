#!/bin/sh
# bench-vs-iperf.sh: moonring's TCP transport beside iperf3 on loopback, in
# the same run (issue 4's comparison). Installs iperf3 (Debian) when missing.
#
#   scripts/bench-vs-iperf.sh [seconds per step, default 3]
#
# CPU per GB at 1 MiB (issue 19's target: at most 1.2x iperf3's), rounds
# interleaved, medians at the end: moonring bench --cpu (WRITE and READ,
# both processes' CPU) beside iperf3 -l 1M, one stream (-J: each side's
# CPU share x seconds / GB). MOONRING_BASELINE=path runs another moonring
# binary in each round too.
#
#   scripts/bench-vs-iperf.sh --cpu [rounds, default 5] [seconds, default 3]
set -eu
cd "$(dirname "$0")/.."
mode=bw
if [ "${1:-}" = "--cpu" ]; then
	mode=cpu
	shift
fi
if ! command -v iperf3 >/dev/null 2>&1; then
	if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q iperf3 >/dev/null 2>&1 ||
			{ apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q iperf3 >/dev/null; }
	fi
fi
bin=${TMPDIR:-/tmp}/moonring-bench
go build -o "$bin" ./cmd/moonring

if [ $mode = cpu ]; then
	rounds=${1:-5}
	secs=${2:-3}
	command -v iperf3 >/dev/null 2>&1 || {
		echo "bench-vs-iperf: iperf3 is needed" >&2
		exit 1
	}
	res=$(mktemp)
	trap 'rm -f "$res"' EXIT
	r=1
	while [ $r -le "$rounds" ]; do
		for b in "$bin" ${MOONRING_BASELINE:-}; do
			name=moonring
			[ "$b" = "$bin" ] || name=baseline
			# Columns after "verified": cpu s/GB (this side), tgt s/GB.
			"$b" bench --cpu --operation write,read --block-size 1M --duration "${secs}s" 2>/dev/null |
				awk -v n=$name '$1 == "tcp" { for (i = 1; i <= NF; i++) if ($i == "true") print n "-" $3, $7, $(i + 1), $(i + 2), $(i + 1) + $(i + 2) }' |
				tee -a "$res"
		done
		iperf3 -s -1 -p 5299 >/dev/null 2>&1 &
		sleep 0.5
		iperf3 -c 127.0.0.1 -p 5299 -l 1M -t "$secs" -J >"$res.json"
		wait
		python3 - "$res.json" <<'PY' | tee -a "$res"
import json, sys
j = json.load(open(sys.argv[1]))
e = j["end"]; gb = e["sum_received"]["bytes"] / 1e9; t = e["sum_received"]["seconds"]
c = e["cpu_utilization_percent"]
snd, rcv = c["host_total"] / 100 * t / gb, c["remote_total"] / 100 * t / gb
print("iperf3", round(gb / t, 2), round(snd, 3), round(rcv, 3), round(snd + rcv, 3))
PY
		r=$((r + 1))
	done
	rm -f "$res.json"
	echo
	echo "CPU s/GB at 1 MiB, medians over $rounds rounds: moonring's initiator and target (this process and the one it started), iperf3's sender and receiver"
	printf '  %-18s %6s %10s %10s %8s %9s\n' what GB/s "initiator" "target" both "/ iperf3"
	median() { sort -g | awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }
	ip=$(awk '$1 == "iperf3" { print $5 }' "$res" | median)
	for k in moonring-write moonring-read baseline-write baseline-read iperf3; do
		grep -q "^$k " "$res" || continue
		set --
		for c in 2 3 4 5; do
			set -- "$@" "$(awk -v k=$k -v c=$c '$1 == k { print $c }' "$res" | median)"
		done
		printf '  %-18s %6.2f %10.3f %10.3f %8.3f %8.2fx\n' "$k" "$1" "$2" "$3" "$4" "$(echo "$4 $ip" | awk '{ print $1 / $2 }')"
	done
	exit 0
fi
secs=${1:-3}
echo "== moonring bench (TCP, loopback, 2 processes) =="
"$bin" bench --operation write,read --block-size 64K,1M,16M --duration "${secs}s" 2>/dev/null
if command -v iperf3 >/dev/null 2>&1; then
	echo "== iperf3, one stream, loopback =="
	iperf3 -s -1 -p 5299 >/dev/null 2>&1 &
	sleep 0.5
	iperf3 -c 127.0.0.1 -p 5299 -t "$secs" -f G | grep -E 'sender|receiver'
	wait
	echo "== iperf3, two streams (as moonring's two rails) =="
	iperf3 -s -1 -p 5299 >/dev/null 2>&1 &
	sleep 0.5
	iperf3 -c 127.0.0.1 -p 5299 -P 2 -t "$secs" -f G | grep -E 'SUM.*(sender|receiver)'
	wait
else
	echo "iperf3 is not installed and could not be installed here" >&2
fi
