#!/bin/sh
# bench-vs-iperf.sh: moonring's TCP transport beside iperf3 on loopback, in
# the same run (issue 4's comparison). Installs iperf3 (Debian) when missing.
#
#   scripts/bench-vs-iperf.sh [seconds per step, default 3]
set -eu
cd "$(dirname "$0")/.."
secs=${1:-3}
if ! command -v iperf3 >/dev/null 2>&1; then
	if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q iperf3 >/dev/null 2>&1 ||
			{ apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q iperf3 >/dev/null; }
	fi
fi
bin=${TMPDIR:-/tmp}/moonring-bench
go build -o "$bin" ./cmd/moonring
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
