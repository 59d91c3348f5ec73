#!/usr/bin/env bash
# cluster.sh: a cluster in a box (issue 19). N hosts, each a network
# namespace on one bridge, a three-member etcd cluster in namespaces of its
# own (Debian's etcd-server), moonring serve engines on every host and a
# KV-cache initiator per host (moonring bench --pattern kv, every other run
# with its requests as prepared lists: --lists) driving two
# other hosts at once, every byte checked by bench; then faults, each in a
# phase of its own, while it runs:
#
#   kill       kill -9 of every serve of one host; restarted after the hold
#   partition  one host cut off (nftables drop in its namespace), healed
#   netem      delay and 2% loss on one host's link (netem where the kernel
#              has it; else nftables loss and a tbf queue, as netns_test.go)
#   etcd       the etcd leader killed -9, restarted after the hold
#
# It prints a table per phase (throughput of the survivors, bench runs and
# failed requests by status, the initiators' and the targets' requests by
# status, time to recover), writes a plot (cluster.svg) and exits non-zero
# when a rule is broken: a bench run that hangs past its deadline (a
# request with no terminal status), a bench row whose counts do not put
# every request it submitted in exactly one terminal status (bench runs
# --keep-going, so a step that meets a fault runs to its end and prints
# its counts), any byte check that fails, a bench run failing where no
# fault touched it, throughput not back within --recover seconds of the
# heal, goroutine/descriptor/RSS growth of the long-lived serves.
#
# Engines publish under etcd leases of TTL seconds (--ttl 5s), so a
# serve killed with -9 holds its name that long: its successor, started
# under the same name, exits until then and is started again.
#
#   scripts/cluster.sh [--hosts N] [--duration D] [--short] [--out DIR]
#
#   --hosts N      hosts (default 8; at least 3)
#   --duration D   the whole run's nominal length: a baseline and four fault
#                  phases of D/5 each (default 150s; "30s", "2m" or seconds)
#   --short        --hosts 4 --duration 30s: the form make test-cluster runs
#   --recover S    the most seconds after a heal before every initiator moves
#                  bytes again at 30% of its pre-fault rate (default 10)
#   --out DIR      keep results here (default: a new /tmp/moonring-cluster.*)
#
# Needs root, ip (iproute2), nft, tc, etcd (scripts/ensure-deps.sh installs
# what is missing) and python3. Where one is missing it says SKIP loudly and
# exits 0, unless MOONRING_CI=1: then it fails. The binary is $MOONRING_BIN,
# or bin/moonring built from this checkout. Everything it creates
# (namespaces, bridge, veths, nft tables, etcd and moonring processes) is
# removed on exit, Ctrl-C included.
set -u

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
lib="$here/cluster_lib.py"

HOSTS=8
DURATION=150
RECOVER=10
OUT=
while [ $# -gt 0 ]; do
	case "$1" in
	--hosts) HOSTS=$2; shift 2 ;;
	--duration) DURATION=$2; shift 2 ;;
	--recover) RECOVER=$2; shift 2 ;;
	--out) OUT=$2; shift 2 ;;
	--short) HOSTS=4; DURATION=30; shift ;;
	-h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
	*) echo "cluster.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
	esac
done
secs() { # 30s, 2m, 90 -> seconds
	case "$1" in
	*m) echo $(( ${1%m} * 60 )) ;;
	*s) echo "${1%s}" ;;
	*) echo "$1" ;;
	esac
}
DURATION=$(secs "$DURATION")
if [ "$HOSTS" -lt 3 ] || [ "$HOSTS" -gt 60 ]; then
	echo "cluster.sh: --hosts $HOSTS: want 3 to 60" >&2
	exit 2
fi

log() { printf '%s cluster: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

# unavailable: SKIP loudly, or FAIL under MOONRING_CI=1.
unavailable() {
	if [ "${MOONRING_CI:-}" = 1 ]; then
		echo "cluster.sh: FAIL: $* (MOONRING_CI=1: the cluster must run)" >&2
		exit 1
	fi
	printf '\n*** cluster.sh: SKIP: %s ***\n\n' "$*" >&2
	exit 0
}

[ "$(id -u)" = 0 ] || unavailable "not root (uid $(id -u)): namespaces, bridges and nftables need CAP_SYS_ADMIN and CAP_NET_ADMIN"
for tool in ip nft tc; do
	command -v $tool >/dev/null 2>&1 || "$repo/scripts/ensure-deps.sh" >&2 || true
	command -v $tool >/dev/null 2>&1 || unavailable "no $tool, and scripts/ensure-deps.sh could not install it"
done
ETCD=$(command -v etcd 2>/dev/null || true)
[ -n "$ETCD" ] || [ ! -x /usr/bin/etcd ] || ETCD=/usr/bin/etcd
if [ -z "$ETCD" ]; then
	"$repo/scripts/ensure-deps.sh" >&2 || true
	ETCD=$(command -v etcd 2>/dev/null || true)
	[ -n "$ETCD" ] || [ ! -x /usr/bin/etcd ] || ETCD=/usr/bin/etcd
	[ -n "$ETCD" ] || unavailable "no etcd (Debian's etcd-server), and scripts/ensure-deps.sh could not install it"
fi
command -v python3 >/dev/null 2>&1 || unavailable "no python3 (the sampler and the analysis)"
command -v timeout >/dev/null 2>&1 || unavailable "no timeout (coreutils)"

BIN=${MOONRING_BIN:-}
if [ -z "$BIN" ]; then
	BIN="$repo/bin/moonring"
	log "building $BIN"
	(cd "$repo" && CGO_ENABLED=0 go build -o bin/moonring ./cmd/moonring) || { echo "cluster.sh: FAIL: go build" >&2; exit 1; }
fi
[ -x "$BIN" ] || { echo "cluster.sh: FAIL: $BIN is not an executable" >&2; exit 1; }

OUT=${OUT:-$(mktemp -d /tmp/moonring-cluster.XXXXXX)}
mkdir -p "$OUT"
RUN=$OUT
rm -rf "$RUN/bench" "$RUN/logs" "$RUN/etcd" "$RUN/stop"
mkdir -p "$RUN/bench" "$RUN/logs" "$RUN/etcd"
: >"$RUN/events.jsonl"
: >"$RUN/procs.tsv"  # label pid, for the sampler (/proc)
: >"$RUN/scrape.tsv" # label url, for the sampler (/metrics)
: >"$RUN/pids"       # every process started, for the cleanup

id=$(od -An -N2 -tx1 /dev/urandom | tr -d ' \n')
pfx="mrc$id"
BR="${pfx}br"
# A /24 in 10.208.0.0/13 that no interface here uses yet.
while :; do
	net="10.$((208 + $(od -An -N1 -tu1 /dev/urandom) % 8)).$(( $(od -An -N1 -tu1 /dev/urandom) ))"
	ip -4 addr | grep -q " $net\." || break
done

nsname() { echo "${pfx}$1"; } # h3, e1
hostip() { echo "$net.$((10 + $1))"; }
etcdip() { echo "$net.$((2 + $1))"; }

cleaned=0
cleanup() {
	[ $cleaned = 1 ] && return
	cleaned=1
	touch "$RUN/stop"
	# Our processes, by the pids we recorded, then whatever still runs in
	# our namespaces (started by us: nobody else knows their names).
	while read -r p; do kill -9 "$p" 2>/dev/null; done <"$RUN/pids"
	for ns in $(ip netns list | awk '{print $1}' | grep "^$pfx" || true); do
		for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
	done
	for p in $(jobs -p); do kill -9 "$p" 2>/dev/null; done
	wait 2>/dev/null
	for ns in $(ip netns list | awk '{print $1}' | grep "^$pfx" || true); do
		ip netns del "$ns" 2>/dev/null
	done
	for l in $(ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//' | grep "^$pfx" || true); do
		ip link del "$l" 2>/dev/null
	done
	rm -f "$RUN/key"
}
trap cleanup EXIT
trap 'log interrupted; exit 130' INT TERM HUP

event() { # JSON fields after the time
	printf '{"t":%s,%s}\n' "$(date +%s.%N)" "$1" >>"$RUN/events.jsonl"
}

# --- network -----------------------------------------------------------
ip link add "$BR" type bridge 2>/dev/null || unavailable "the kernel refuses a bridge"
ip addr add "$net.1/24" dev "$BR"
ip link set "$BR" up
mkns() { # name ip
	local ns=$1 addr=$2 v="${1}"
	ip netns add "$ns" || unavailable "the kernel refuses a network namespace"
	ip link add "$v" type veth peer name "${v}p" || unavailable "the kernel refuses a veth pair"
	ip link set "${v}p" netns "$ns"
	ip -n "$ns" link set "${v}p" name eth0
	ip link set "$v" master "$BR"
	ip link set "$v" up
	ip -n "$ns" addr add "$addr/24" dev eth0
	ip -n "$ns" link set eth0 up
	ip -n "$ns" link set lo up
}
for j in 0 1 2; do mkns "$(nsname e$j)" "$(etcdip $j)"; done
for i in $(seq 0 $((HOSTS - 1))); do mkns "$(nsname h$i)" "$(hostip $i)"; done
# The faults need nftables in a namespace and a tbf qdisc: find out now.
probe="$(nsname h0)"
ip netns exec "$probe" nft add table inet mrcprobe 2>/dev/null && ip netns exec "$probe" nft delete table inet mrcprobe ||
	unavailable "the kernel refuses nftables tables in a namespace (the partition and loss faults need them)"
ip netns exec "$probe" tc qdisc add dev eth0 root tbf rate 200mbit burst 64kb latency 10ms 2>/dev/null &&
	ip netns exec "$probe" tc qdisc del dev eth0 root || unavailable "the kernel refuses a tbf qdisc"
# fault_failed: a fault that could not be injected fails the run: a phase
# without its fault would pass for nothing.
fault_failed() { echo "cluster.sh: FAIL: could not inject the fault: $*" >&2; exit 1; }
log "net $net.0/24, bridge $BR, $HOSTS hosts ${pfx}h0..h$((HOSTS - 1)), etcd ${pfx}e0..e2; results in $RUN"

# --- etcd ----------------------------------------------------------------
cluster=""
for j in 0 1 2; do cluster="${cluster:+$cluster,}e$j=http://$(etcdip $j):2380"; done
ETCDS=""
for j in 0 1 2; do ETCDS="${ETCDS:+$ETCDS,}$(etcdip $j):2379"; done
META="etcd://$ETCDS"
etcd_start() {
	local j=$1 a
	a=$(etcdip $j)
	ip netns exec "$(nsname e$j)" "$ETCD" --name "e$j" --data-dir "$RUN/etcd/e$j" \
		--listen-client-urls "http://$a:2379" --advertise-client-urls "http://$a:2379" \
		--listen-peer-urls "http://$a:2380" --initial-advertise-peer-urls "http://$a:2380" \
		--initial-cluster "$cluster" --initial-cluster-state new --initial-cluster-token "$pfx" \
		--heartbeat-interval 100 --election-timeout 1000 >>"$RUN/logs/etcd-e$j.log" 2>&1 &
	disown $! # its kill is ours to report, not the shell's
	echo $! >>"$RUN/pids"
	echo $! >"$RUN/etcd/e$j.pid"
	sed -i "/^etcd-e$j /d" "$RUN/procs.tsv"
	echo "etcd-e$j $!" >>"$RUN/procs.tsv"
}
for j in 0 1 2; do etcd_start $j; done
for j in 0 1 2; do
	python3 "$lib" wait-http "http://$(etcdip $j):2379/health" 60 '"health":"true"' ||
		{ echo "cluster.sh: FAIL: etcd e$j did not become healthy; $RUN/logs/etcd-e$j.log:" >&2; tail -20 "$RUN/logs/etcd-e$j.log" >&2; exit 1; }
done
log "etcd up: $META"

# --- engines -------------------------------------------------------------
# Initiator i drives hosts i+1 and i+2. bench assumes it owns the whole
# buffer of each segment it is given (it fills it and checks every slot), so
# every (target, initiator) pair has a serve of its own: host t runs a serve
# for each of the two initiators that drive it, on port 7100+initiator.
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$RUN/key"
chmod 600 "$RUN/key"
FAN=2
targets_of() { local k; for k in $(seq 1 $FAN); do echo $(( ($1 + k) % HOSTS )); done; }
POOL=32M
TTL=5s # the etcd lease of every engine's segment (serve --ttl, bench --ttl)
serve_name() { echo "h$1-for-h$2"; } # target initiator
serve_start() { # target initiator
	local t=$1 i=$2 name
	name=$(serve_name "$t" "$i")
	ip netns exec "$(nsname h$t)" "$BIN" serve --listen "$(hostip "$t"):$((7100 + i))" --metadata "$META" \
		--name "$name" --key-file "$RUN/key" --buffer-size $POOL --no-shm --grace 1s --ttl $TTL \
		>>"$RUN/logs/serve-$name.log" 2>&1 &
	local p=$!
	disown $p
	echo $p >>"$RUN/pids"
	echo $p >"$RUN/logs/serve-$name.pid"
	sed -i "/^serve-$name /d" "$RUN/procs.tsv" "$RUN/scrape.tsv"
	echo "serve-$name $p" >>"$RUN/procs.tsv"
	echo "serve-$name http://$(hostip "$t"):$((7100 + i))/metrics" >>"$RUN/scrape.tsv"
}
serve_wait() { # target initiator timeout
	python3 "$lib" wait-http "http://$(hostip "$1"):$((7100 + $2))/healthz" "$3" '"status"' 2>>"$RUN/logs/waits.log"
}
for i in $(seq 0 $((HOSTS - 1))); do
	for t in $(targets_of "$i"); do serve_start "$t" "$i"; done
done
for i in $(seq 0 $((HOSTS - 1))); do
	for t in $(targets_of "$i"); do
		serve_wait "$t" "$i" 60 || { echo "cluster.sh: FAIL: serve $(serve_name "$t" "$i") did not come up:" >&2; tail -5 "$RUN/logs/serve-$(serve_name "$t" "$i").log" >&2; exit 1; }
	done
done
log "$((HOSTS * FAN)) serves up"

# The sampler: every serve's /metrics and every long-lived process's /proc,
# twice a second.
python3 "$lib" sample "$RUN" 0.5 >>"$RUN/logs/sampler.log" 2>&1 &
sampler=$!
echo $sampler >>"$RUN/pids"

# Initiators: bench runs back to back, each a WRITE step and a READ step of
# STEP seconds (a fifth more of warm-up each) against its two serves; every
# run's exit status, output and times are kept. With --keep-going a step
# whose requests fail runs to its end and prints its row, whose counts say
# how every request it submitted ended. A run still going HANG
# seconds after it started is killed and counted as a hang: its requests
# did not end within their deadline (30 s, the engine's default).
STEP=1s
HANG=90
bench_loop() {
	local i=$1 seq=0 segs t0 t1 rc f lists
	while [ ! -e "$RUN/stop" ]; do
		# Every other run moves each request as prepared lists of 64
		# blocks a task (bench --lists): a fault then fails whole runs.
		lists=0
		[ $((seq % 2)) = 1 ] && lists=64
		segs=""
		for t in $(targets_of "$i"); do segs="${segs:+$segs,}$(serve_name "$t" "$i")"; done
		f="$RUN/bench/h$i-$seq"
		t0=$(date +%s.%N)
		timeout -s KILL $HANG ip netns exec "$(nsname h$i)" "$BIN" bench --pattern kv --metadata "$META" --ttl $TTL \
			--segment "$segs" --targets $FAN --key-file "$RUN/key" --pool $POOL --layers 8 --block-size 16K \
			--tokens 512 --inflight 2 --operation write,read --duration $STEP --baseline=false --json --keep-going --lists $lists \
			>"$f.json" 2>"$f.err" </dev/null
		rc=$?
		t1=$(date +%s.%N)
		printf '{"host":%d,"seq":%d,"t0":%s,"t1":%s,"rc":%d,"segments":"%s","file":"%s"}\n' \
			"$i" "$seq" "$t0" "$t1" "$rc" "$segs" "$f" >>"$RUN/bench/runs.jsonl"
		seq=$((seq + 1))
		[ $rc = 0 ] || sleep 1
	done
}
loops=""
for i in $(seq 0 $((HOSTS - 1))); do
	bench_loop "$i" &
	echo $! >>"$RUN/pids"
	loops="$loops $!"
done

# --- phases --------------------------------------------------------------
PHASE=$((DURATION / 5))
[ $PHASE -ge 6 ] || PHASE=6
HOLD=$((PHASE / 2))
[ $HOLD -ge 3 ] || HOLD=3
json_list() { local s="" x; for x in "$@"; do s="${s:+$s,}$x"; done; echo "[$s]"; }
drivers_of() { # the initiators that drive host t
	local i; for i in $(seq 0 $((HOSTS - 1))); do targets_of "$i" | grep -qx "$1" && echo "$i"; done
}
fanjson=""
# shellcheck disable=SC2046 # host numbers, a word each
for i in $(seq 0 $((HOSTS - 1))); do fanjson="${fanjson:+$fanjson,}\"$i\":$(json_list $(targets_of "$i"))"; done
event "\"ev\":\"setup\",\"hosts\":$HOSTS,\"targets\":{$fanjson},\"recover\":$RECOVER,\"hang\":$HANG,\"bin\":\"$BIN\""

# wait_recovered: after a heal, until every initiator has moved bytes
# again at 30% of its rate before the fault, or until RECOVER+PHASE
# seconds have passed; then the rest of the phase.
wait_recovered() { # phase
	python3 "$lib" wait-recovered "$RUN" "$1" $((RECOVER + PHASE)) >>"$RUN/logs/waits.log" 2>&1
	sleep $((PHASE - HOLD > 2 ? PHASE - HOLD : 2))
}

log "warming up"
sleep 5 # the first runs fill their pools
event '"ev":"phase","phase":"baseline"'
log "phase baseline: ${PHASE}s"
sleep $PHASE

victim=1
# kill: every serve of the victim host, kill -9; restarted after the hold.
event '"ev":"phase","phase":"kill"'
sleep 1
log "phase kill: kill -9 the serves of h$victim"
# shellcheck disable=SC2046 # host numbers, a word each
event "\"ev\":\"fault\",\"phase\":\"kill\",\"victim\":$victim,\"affected\":$(json_list $(drivers_of $victim))"
for i in $(drivers_of $victim); do kill -9 "$(cat "$RUN/logs/serve-$(serve_name $victim "$i").pid")" || fault_failed "kill -9 of serve $(serve_name $victim "$i")"; done
sleep $HOLD
rs0=$(date +%s.%N)
for i in $(drivers_of $victim); do serve_start $victim "$i"; done
ok=1
# A serve that cannot publish (its name still held by the dead one's lease,
# up to TTL) exits: start it again until it serves. Both serves are tended
# in one loop, so that one's wait does not hold up the other's restart.
pending=$(drivers_of $victim)
deadline=$(( $(date +%s) + 90 ))
while [ -n "$pending" ]; do
	left=""
	for i in $pending; do
		serve_wait $victim "$i" 0.5 && continue
		kill -0 "$(cat "$RUN/logs/serve-$(serve_name $victim "$i").pid")" 2>/dev/null || serve_start $victim "$i"
		left="$left $i"
	done
	pending=$left
	[ -z "$pending" ] || [ "$(date +%s)" -lt $deadline ] || { ok=0; break; }
done
event "\"ev\":\"heal\",\"phase\":\"kill\",\"restart_s\":$(python3 -c "import time;print(round(time.time()-$rs0,2))"),\"restarted\":$ok"
log "phase kill: serves of h$victim restarted"
wait_recovered kill

victim=$((2 % HOSTS))
event '"ev":"phase","phase":"partition"'
sleep 1
log "phase partition: h$victim cut off"
# shellcheck disable=SC2046 # host numbers, a word each
event "\"ev\":\"fault\",\"phase\":\"partition\",\"victim\":$victim,\"affected\":$(json_list $(drivers_of $victim) $victim)"
# Held at least past tcp.DefaultPeerTimeout (10 s), so that the rails to
# and from the host give up on it rather than wait out a short cut.
PHOLD=$((HOLD > 12 ? HOLD : 12))
ip netns exec "$(nsname h$victim)" nft -f - <<'EOF' || fault_failed "nftables partition of h$victim"
table inet mrcpart {
	chain in { type filter hook input priority 0; policy drop; iifname "lo" accept; }
	chain out { type filter hook output priority 0; policy drop; oifname "lo" accept; }
}
EOF
sleep $PHOLD
ip netns exec "$(nsname h$victim)" nft delete table inet mrcpart
event "\"ev\":\"heal\",\"phase\":\"partition\""
log "phase partition: healed"
wait_recovered partition

victim=$((3 % HOSTS))
event '"ev":"phase","phase":"netem"'
sleep 1
v="$(nsname h$victim)"
if tc qdisc add dev "$v" root netem delay 20ms loss 2% 2>/dev/null; then
	ip netns exec "$v" tc qdisc add dev eth0 root netem delay 20ms loss 2% || fault_failed "netem in h$victim"
	how="netem delay 20ms loss 2% on both ends of h$victim's link"
	heal_netem() { tc qdisc del dev "$v" root; ip netns exec "$v" tc qdisc del dev eth0 root; }
else
	# Debian's cloud kernels, among others, have no sch_netem.
	ip netns exec "$v" nft -f - <<'EOF' || fault_failed "nftables loss in h$victim"
table inet mrcloss {
	chain in { type filter hook input priority 0; policy accept; iifname "lo" accept; numgen random mod 100 < 2 counter drop; }
	chain out { type filter hook output priority 0; policy accept; oifname "lo" accept; numgen random mod 100 < 2 counter drop; }
}
EOF
	tc qdisc add dev "$v" root tbf rate 200mbit burst 64kb latency 10ms || fault_failed "tbf on h$victim's link"
	ip netns exec "$v" tc qdisc add dev eth0 root tbf rate 200mbit burst 64kb latency 10ms || fault_failed "tbf in h$victim"
	how="no netem in this kernel: nftables loss 2% each way in h$victim, tbf 200mbit with up to 10ms of queue on both ends of its link"
	heal_netem() {
		ip netns exec "$v" nft list table inet mrcloss >"$RUN/logs/netem-drops.txt" 2>&1
		ip netns exec "$v" nft delete table inet mrcloss
		tc qdisc del dev "$v" root; ip netns exec "$v" tc qdisc del dev eth0 root
	}
fi
log "phase netem: $how"
# shellcheck disable=SC2046 # host numbers, a word each
event "\"ev\":\"fault\",\"phase\":\"netem\",\"victim\":$victim,\"affected\":$(json_list $(drivers_of $victim) $victim),\"how\":\"$how\""
sleep $HOLD
heal_netem
event "\"ev\":\"heal\",\"phase\":\"netem\""
log "phase netem: healed"
wait_recovered netem

event '"ev":"phase","phase":"etcd"'
sleep 1
leader=$(python3 "$lib" etcd-leader "http://$(etcdip 0):2379" "http://$(etcdip 1):2379" "http://$(etcdip 2):2379")
[ "$leader" != none ] || fault_failed "no etcd member says it leads"
log "phase etcd: kill -9 the leader e$leader"
event "\"ev\":\"fault\",\"phase\":\"etcd\",\"victim\":\"e$leader\",\"affected\":[]"
kill -9 "$(cat "$RUN/etcd/e$leader.pid")" || fault_failed "kill -9 of etcd e$leader"
sleep $HOLD
etcd_start "$leader"
python3 "$lib" wait-http "http://$(etcdip "$leader"):2379/health" 60 '"health":"true"' || log "etcd e$leader did not come back healthy"
event "\"ev\":\"heal\",\"phase\":\"etcd\",\"new_leader\":\"e$(python3 "$lib" etcd-leader "http://$(etcdip 0):2379" "http://$(etcdip 1):2379" "http://$(etcdip 2):2379")\""
log "phase etcd: e$leader restarted"
wait_recovered etcd

event '"ev":"end"'
log "stopping the initiators (runs in flight end first, up to ${HANG}s)"
touch "$RUN/stop"
sleep 0.5
# shellcheck disable=SC2086 # one pid a word
wait $loops $sampler 2>/dev/null # the sampler stops on $RUN/stop too
python3 "$lib" analyze "$RUN"
rc=$?
log "results in $RUN (tables: $RUN/tables.txt, plot: $RUN/cluster.svg)"
exit $rc
