#!/bin/sh
# bench-rate.sh: the small-request rate of `moonring bench` at its defaults
# beside ucx_perftest's put over TCP (Debian ucx-utils), interleaved, on
# loopback: issue 21's second target (4 KiB at the command's default at
# least 2x UCX's put rate, the batch API within 10 % of the Ring API).
#
#   scripts/bench-rate.sh [rounds [size]]
#
# Each round runs, for one block size (default 4096 bytes): ucx_perftest
# -t ucp_put_bw over UCX_TLS=tcp (one thread, its default window), then
# `moonring bench` WRITE and READ with the batch API at its defaults
# (--batches 4 of --batch-size 32 in flight), with the Ring API at the
# same depth, and with one batch in flight (--batches 1: Mooncake's
# transfer_engine_bench's way, a batch submitted and waited for). It prints
# every figure in requests per second, then the median of each and the
# ratios of the medians. It installs ucx-utils when missing (root and
# apt-get needed). MOONRING_BIN names a moonring binary to measure instead
# of building this tree's.
set -eu
rounds=${1:-3}
size=${2:-4096}
cd "$(dirname "$0")/.."
if ! command -v ucx_perftest >/dev/null 2>&1; then
	if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends ucx-utils >&2 ||
			{ apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends ucx-utils >&2; }
	else
		echo "bench-rate: ucx_perftest missing and cannot install ucx-utils" >&2
		exit 1
	fi
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [ -n "${MOONRING_BIN:-}" ]; then
	cp "$MOONRING_BIN" "$tmp/moonring"
else
	go build -o "$tmp/moonring" ./cmd/moonring
fi
port=13341

ucx() { # prints the overall message rate of one put_bw run
	UCX_TLS=tcp ucx_perftest -p $port -t ucp_put_bw -s "$size" -n 300000 -w 1000 >/dev/null 2>&1 &
	srv=$!
	sleep 0.5
	UCX_TLS=tcp ucx_perftest 127.0.0.1 -p $port -t ucp_put_bw -s "$size" -n 300000 -w 1000 2>/dev/null |
		awk '/^ *Final:/ { print int($NF) }'
	wait $srv 2>/dev/null || true
}
mr() { # label, then bench flags; prints "label-op rate" per row
	label=$1
	shift
	"$tmp/moonring" bench --json --block-size "$size" --operation write,read "$@" 2>/dev/null |
		python3 -c 'import json,sys
for r in json.load(sys.stdin): print(sys.argv[1] + "-" + r["op"], int(r["req_per_s"]))' "$label"
}
for i in $(seq "$rounds"); do
	echo "ucx-put $(ucx)" >>"$tmp/all"
	mr batch >>"$tmp/all"
	mr ring --ring >>"$tmp/all"
	mr batch1 --batches 1 >>"$tmp/all"
	echo "round $i of $rounds done" >&2
done
cat "$tmp/all"
python3 - "$tmp/all" <<'EOF'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    k, v = line.split()
    rows.setdefault(k, []).append(int(v))
med = {k: statistics.median(v) for k, v in rows.items()}
print("\nmedians (req/s):")
for k in sorted(med):
    print(f"  {k:14s} {med[k]:>10.0f}  ({min(rows[k])}-{max(rows[k])})")
u = med.get("ucx-put")
for op in ("write", "read"):
    b, r, b1 = med.get("batch-" + op), med.get("ring-" + op), med.get("batch1-" + op)
    if u and b and r:
        print(f"{op}: batch/ucx-put {b/u:.2f}x, ring/ucx-put {r/u:.2f}x, batch/ring {b/r:.2f}, one batch in flight/ucx-put {b1/u:.2f}x")
EOF
