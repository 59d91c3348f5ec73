#!/usr/bin/env bash
# soak.sh: a soak (issue 19). Mixed sizes and ops over TCP and shm against
# standing moonring serve processes, for DURATION, while peers come and go:
#
#   metadata   one moonring metadata-server (long-lived), with the key
#   long-lived serves L-tcp, L-shm, L-kv: never restarted
#   peers      serves P-tcp, P-shm, P-kv: restarted every --restart (60s),
#              each time under a new name (a kill -9 every other time, a
#              SIGTERM the others), so names and connections come and go
#   initiators three loops of moonring bench runs, back to back, each run
#              against the long-lived serve or the peer of its loop in turn:
#                tcp  --protocol tcp, 4K,64K,1M, write,read,mix
#                shm  --protocol shm, 4K,64K,1M, write,read,mix
#                kv   --pattern kv over tcp, both targets (L-kv and P-kv)
#              every other run through the Ring API (--ring), kv's
#              requests every other pair of runs as prepared lists
#              (--lists 64); every step's
#              bytes checked by bench
#
# RSS and descriptors of the long-lived processes (the metadata server and
# the L serves) are sampled from /proc, goroutines from the serves'
# /metrics, twice a second, and plotted (soak.svg). It fails on growth:
# for each long-lived process and figure, the median over the last third
# of the run may exceed the median over the first third (after a warm-up of
# a tenth of the run) by at most 20% plus a slack (10 goroutines, 10
# descriptors, 32 MiB of RSS). It fails too on a bench run that hangs
# (killed 90 s after it started), crashes, finds a byte wrong, or fails
# without a peer restart during it.
#
#   scripts/soak.sh [DURATION] [--restart D] [--out DIR]
#
#   DURATION   default 10m ("60s", "10m" or seconds)
#   --restart  how often each peer restarts (default 60s)
#
# It runs on loopback in the current network namespace and needs no root.
# The binary is $MOONRING_BIN, or bin/moonring built from this checkout.
# Every process it starts is killed on exit, Ctrl-C included.
set -u

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
lib="$here/cluster_lib.py"

DURATION=600
RESTART=60
OUT=
secs() {
	case "$1" in
	*m) echo $(( ${1%m} * 60 )) ;;
	*s) echo "${1%s}" ;;
	*) echo "$1" ;;
	esac
}
while [ $# -gt 0 ]; do
	case "$1" in
	--restart) RESTART=$(secs "$2"); shift 2 ;;
	--out) OUT=$2; shift 2 ;;
	-h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
	-*) echo "soak.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
	*) DURATION=$(secs "$1"); shift ;;
	esac
done

log() { printf '%s soak: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

if ! command -v python3 >/dev/null 2>&1; then
	if [ "${MOONRING_CI:-}" = 1 ]; then echo "soak.sh: FAIL: no python3" >&2; exit 1; fi
	printf '\n*** soak.sh: SKIP: no python3 (the sampler and the analysis) ***\n\n' >&2
	exit 0
fi

BIN=${MOONRING_BIN:-}
if [ -z "$BIN" ]; then
	BIN="$repo/bin/moonring"
	log "building $BIN"
	(cd "$repo" && CGO_ENABLED=0 go build -o bin/moonring ./cmd/moonring) || { echo "soak.sh: FAIL: go build" >&2; exit 1; }
fi

OUT=${OUT:-$(mktemp -d /tmp/moonring-soak.XXXXXX)}
RUN=$OUT
mkdir -p "$RUN"
rm -rf "$RUN/bench" "$RUN/logs" "$RUN/stop"
mkdir -p "$RUN/bench" "$RUN/logs"
: >"$RUN/events.jsonl"
: >"$RUN/procs.tsv"
: >"$RUN/scrape.tsv"
: >"$RUN/pids"
: >"$RUN/names"

cleaned=0
cleanup() {
	[ $cleaned = 1 ] && return
	cleaned=1
	touch "$RUN/stop"
	while read -r p; do kill -9 "$p" 2>/dev/null; done <"$RUN/pids"
	wait 2>/dev/null
	rm -f "$RUN/key"
}
trap cleanup EXIT
trap 'log interrupted; exit 130' INT TERM HUP

event() { printf '{"t":%s,%s}\n' "$(date +%s.%N)" "$1" >>"$RUN/events.jsonl"; }

freeport() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }

head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$RUN/key"
chmod 600 "$RUN/key"

mport=$(freeport)
META="http://127.0.0.1:$mport"
"$BIN" metadata-server --listen "127.0.0.1:$mport" --key-file "$RUN/key" --max-ttl 1m >>"$RUN/logs/metadata.log" 2>&1 &
disown $!
echo $! >>"$RUN/pids"
echo "metadata $!" >>"$RUN/procs.tsv"
python3 "$lib" wait-http "$META/moonring/v1/segments" 30 || { echo "soak.sh: FAIL: the metadata server did not come up" >&2; exit 1; }

SIZE=32M
# serve_start ROLE: (re)start the serve of role L-tcp, P-kv, ...; peers get
# a new name each generation.
serve_start() {
	local role=$1 gen name port
	gen=$(($(grep -c "^$role " "$RUN/names") + 0))
	name="$role"
	case $role in P-*) name="$role-g$gen" ;; esac
	port=$(freeport)
	"$BIN" serve --listen "127.0.0.1:$port" --metadata "$META" --name "$name" --key-file "$RUN/key" \
		--buffer-size $SIZE --grace 1s >>"$RUN/logs/serve-$role.log" 2>&1 &
	local p=$!
	disown $p
	echo $p >>"$RUN/pids"
	echo "$p" >"$RUN/logs/$role.pid"
	python3 "$lib" wait-http "http://127.0.0.1:$port/healthz" 30 '"status"' ||
		{ echo "soak.sh: FAIL: serve $name did not come up:" >&2; tail -5 "$RUN/logs/serve-$role.log" >&2; exit 1; }
	echo "$role $name" >>"$RUN/names"
	echo "$name" >"$RUN/logs/$role.name"
	sed -i "/^serve-$role /d" "$RUN/procs.tsv" "$RUN/scrape.tsv"
	echo "serve-$role $p" >>"$RUN/procs.tsv"
	echo "serve-$role http://127.0.0.1:$port/metrics" >>"$RUN/scrape.tsv"
}
for r in L-tcp L-shm L-kv P-tcp P-shm P-kv; do serve_start $r; done
log "metadata server and 6 serves up; results in $RUN"

python3 "$lib" sample "$RUN" 0.5 >>"$RUN/logs/sampler.log" 2>&1 &
sampler=$!
echo $sampler >>"$RUN/pids"

HANG=90
bench_loop() { # kind
	local kind=$1 seq=0 t0 t1 rc f target args ring
	while [ ! -e "$RUN/stop" ]; do
		ring=""
		[ $((seq % 2)) = 1 ] && ring="--ring"
		[ "$kind" = kv ] && [ $((seq / 2 % 2)) = 1 ] && ring="$ring --lists 64"
		case $kind in
		kv)
			target="$(cat "$RUN/logs/L-kv.name"),$(cat "$RUN/logs/P-kv.name")"
			args="--pattern kv --targets 2 --pool $SIZE --layers 8 --block-size 16K --tokens 512 --inflight 2 --operation write,read --duration 1s --baseline=false"
			;;
		*)
			if [ $((seq / 2 % 2)) = 0 ]; then target=$(cat "$RUN/logs/L-$kind.name"); else target=$(cat "$RUN/logs/P-$kind.name"); fi
			args="--protocol $kind --buffer-size $SIZE --block-size 4K,64K,1M --operation write,read,mix --duration 0.4s"
			;;
		esac
		f="$RUN/bench/$kind-$seq"
		t0=$(date +%s.%N)
		# shellcheck disable=SC2086 # args are words
		timeout -s KILL $HANG "$BIN" bench --metadata "$META" --segment "$target" --key-file "$RUN/key" $args $ring --json \
			>"$f.json" 2>"$f.err" </dev/null
		rc=$?
		t1=$(date +%s.%N)
		printf '{"kind":"%s","seq":%d,"t0":%s,"t1":%s,"rc":%d,"segments":"%s","file":"%s"}\n' \
			"$kind" "$seq" "$t0" "$t1" "$rc" "$target" "$f" >>"$RUN/bench/runs.jsonl"
		seq=$((seq + 1))
		[ $rc = 0 ] || sleep 1
	done
}
loops=""
for k in tcp shm kv; do
	bench_loop $k &
	echo $! >>"$RUN/pids"
	loops="$loops $!"
done

event "\"ev\":\"start\",\"duration\":$DURATION,\"restart\":$RESTART,\"hang\":$HANG"
start=$(date +%s)
# Peers restart in turn, one every RESTART/3 seconds, so that each restarts
# every RESTART seconds.
n=0
step=$((RESTART / 3))
[ $step -ge 1 ] || step=1
while :; do
	next=$((start + (n + 1) * step))
	[ "$next" -lt $((start + DURATION)) ] || break
	sleep $((next - $(date +%s) > 0 ? next - $(date +%s) : 0))
	role=$(echo "P-tcp P-shm P-kv" | cut -d' ' -f$((n % 3 + 1)))
	sig=TERM
	[ $((n / 3 % 2)) = 1 ] && sig=KILL
	old=$(cat "$RUN/logs/$role.pid")
	oldname=$(cat "$RUN/logs/$role.name")
	event "\"ev\":\"restart\",\"role\":\"$role\",\"name\":\"$oldname\",\"signal\":\"$sig\""
	kill -$sig "$old" 2>/dev/null
	for _ in $(seq 1 100); do kill -0 "$old" 2>/dev/null || break; sleep 0.1; done
	kill -9 "$old" 2>/dev/null
	serve_start "$role"
	event "\"ev\":\"restarted\",\"role\":\"$role\",\"name\":\"$(cat "$RUN/logs/$role.name")\",\"old\":\"$oldname\""
	log "restarted $role ($sig): $oldname -> $(cat "$RUN/logs/$role.name")"
	n=$((n + 1))
done
sleep $((start + DURATION - $(date +%s) > 0 ? start + DURATION - $(date +%s) : 0))
event '"ev":"end"'
log "stopping the initiators (runs in flight end first, up to ${HANG}s)"
touch "$RUN/stop"
# shellcheck disable=SC2086
wait $loops $sampler 2>/dev/null
python3 "$lib" soak "$RUN"
rc=$?
log "results in $RUN (tables: $RUN/tables.txt, plot: $RUN/soak.svg)"
exit $rc
