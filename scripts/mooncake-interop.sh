#!/usr/bin/env bash
# mooncake-interop.sh: moonring against the real Mooncake Transfer Engine
# (issue 18). It builds Mooncake's transfer_engine_bench and
# transfer_engine_validator, with the TCP transport and the HTTP and
# P2PHANDSHAKE metadata modes, from a Mooncake source tree you point it at,
# into a build folder outside this repository, and runs over TCP on
# loopback:
#   (a) mooncake->mooncake   Mooncake's bench against Mooncake's target: the
#                            baseline, measured in the same run;
#   (b) mooncake->moonring   Mooncake's bench against moonring serve --mooncake;
#   (c) moonring->mooncake   moonring bench --mooncake against Mooncake's
#                            target;
# each with --metadata_server=P2PHANDSHAKE and with an HTTP metadata server,
# WRITE and READ at 4 KiB, 64 KiB and 1 MiB, and prints a table: direction,
# metadata mode, op, size, GB/s, pass/fail, how the data was checked; the
# Mooncake commit heads it. With MC_RDMA=1 the same three directions also
# run over RDMA (Mooncake's RDMA transport; serve and bench --mooncake
# --mooncake-rdma) inside scripts/rdma-vm.sh's Soft-RoCE guest, rows
# "rdma-guest" (scripts/mooncake-interop/rdma-guest.sh).
#
#   scripts/mooncake-interop.sh SRC
#
# SRC is a Mooncake checkout. Nothing of Mooncake is kept in this repository
# and this script downloads nothing; get the source with
#   git clone --recursive https://github.com/kvcache-ai/Mooncake
# (or, in a checkout without submodules,
#   git -C SRC submodule update --init extern/yalantinglibs).
# Of the submodules only extern/yalantinglibs is needed (the engine's
# headers use its coro_io, metrics and logging); YLT_SRC=DIR names another
# copy of it. extern/pybind11 may be empty: Debian's pybind11-dev stands in.
#
# What the data checks are (transfer_engine_bench checks nothing; it has no
# option to):
#   validator    Mooncake's transfer_engine_validator against the same
#                target, one run per size: each thread WRITEs blocks of a
#                random byte and READs them back, and exits non-zero on a
#                difference (a round trip; run for (a) and (b)).
#   mc_check     scripts/mooncake-interop/mc_check.cpp, our own program on
#                Mooncake's engine API (built here into the Mooncake build):
#                the target's buffer holds pattern(S1); mc_check READs it and
#                compares (READ, one way), WRITEs pattern(S2) and READs it
#                back (round trip), and the target, when it stops, compares
#                its buffer with pattern(S2) (WRITE, one way). For (a) its
#                own target mode is the target, which checks the checker;
#                for (b) moonring serve must take --fill-seed S1 and
#                --check-seed S2; for (c) moonring bench must take
#                --expect-seed S1 and --write-seed S2 (pattern(S): the
#                little-endian 64-bit word at byte offset 8*i of the buffer
#                is (i+1)*0x9E3779B97F4A7C15 XOR S). Without those flags the
#                one-way checks are skipped and say so.
#   bench-verify moonring bench's own --verify on each row of (c): the
#                blocks it WRITEs are READ back and compared.
#
# (b) and (c) need `moonring serve --mooncake` and `moonring bench
# --mooncake` (issue 18); with a moonring whose serve -h lacks --mooncake
# they are skipped, with a message, and (a) still runs. The moonring side
# of the interface:
#   moonring serve --mooncake --mooncake-metadata p2p|http://H:P/metadata
#       --mooncake-rpc 127.0.0.1:PORT --mooncake-tcp 127.0.0.1:PORT
#       --buffer-size N [--name NAME (http)] [--fill-seed S --check-seed S]
#     its first stdout line "serving segment ..." says it is ready; the
#     Mooncake segment is 127.0.0.1:RPCPORT with p2p, NAME with http; one
#     buffer named "cpu:0" of N bytes; SIGTERM stops it (exit 0, or non-zero
#     when --check-seed finds a difference).
#   moonring bench --mooncake --mooncake-metadata ... --segment SEG
#       --block-size B --operation read|write --threads T --batch-size 32
#       --batches 4 --duration Ds --json
#       [--expect-seed S --write-seed S]
#
# Environment (defaults in brackets):
#   MOONCAKE_BUILD  the build folder, reused when present [/tmp/mooncake-build]
#   MOONCAKE_COMMIT the commit, when SRC is not a git checkout [unknown]
#   YLT_SRC         yalantinglibs source [SRC/extern/yalantinglibs]
#   MC_JOBS         parallel compile jobs [2]; the build runs under nice 19
#   MC_SIZES        block sizes in bytes [4096 65536 1048576]
#   MC_OPS          [read write]
#   MC_META         [p2p http]
#   MC_THREADS      submitting threads on each initiator [2]
#   MC_BATCH        Mooncake bench's batch (requests in flight per thread) [128]
#   MC_DURATION     seconds per row [5]
#   MC_TCP_POOL     Mooncake initiators' MC_TCP_ENABLE_CONNECTION_POOL values
#                   to run (a) and (b) with: 0 is Mooncake's default, a new
#                   TCP connection per request (slice); 1, 4 lanes per peer,
#                   rows labelled METADATA+pool [0 1]
#   MC_REPEAT       runs per row; the table gives the median [1]
#   MC_VERIFY_SECS  seconds per validator run [2]
#   MOONRING        the moonring binary [built from this repository]
#   MR_BENCH_ARGS   replaces "--batch-size 32 --batches 4" for moonring bench
#   MC_RDMA         1: also over RDMA (P2PHANDSHAKE) inside scripts/rdma-vm.sh's
#                   Soft-RoCE guest (rdma-guest.sh): Mooncake->Mooncake, and,
#                   with a -tags rdma moonring (built here when libibverbs-dev
#                   is installed), Mooncake->moonring serve --mooncake
#                   --mooncake-rdma and moonring bench --mooncake
#                   --mooncake-rdma->Mooncake, with the one-way checks of
#                   moonring_mc_check --rdma (4 MiB each way) [0]
#   MC_TCP          0: skip the TCP rows (with MC_RDMA=1: RDMA only) [1]
#   MC_HTTP_SERVER  go: Mooncake's own HTTP metadata server when it builds;
#                   python: scripts/mooncake-interop/http_metadata_server.py [go]
#
# It installs the build's Debian packages when missing (root and apt-get
# needed, as scripts/ensure-deps.sh), and needs the Go toolchain (moonring;
# Mooncake's own HTTP metadata server, a Go module, when its modules can be
# fetched, else scripts/mooncake-interop/http_metadata_server.py stands in).
# Exit status: 0 when every row run passed, 1 when one failed, 2 on setup.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)

die() {
	echo "mooncake-interop: $*" >&2
	exit 2
}
log() { echo "mooncake-interop: $*" >&2; }

if [ $# -ne 1 ] || [ "$1" = -h ] || [ "$1" = --help ]; then
	sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
	exit 2
fi
SRC=$(cd "$1" 2>/dev/null && pwd) || die "no such folder: $1"
if [ ! -f "$SRC/mooncake-transfer-engine/example/transfer_engine_bench.cpp" ]; then
	die "$SRC is not a Mooncake source tree (no mooncake-transfer-engine/example/transfer_engine_bench.cpp).
Nothing of Mooncake is kept in moonring and this script downloads nothing; get it with
  git clone --recursive https://github.com/kvcache-ai/Mooncake"
fi

BUILD=${MOONCAKE_BUILD:-/tmp/mooncake-build}
case "$BUILD/" in "$repo"/*) die "MOONCAKE_BUILD must be outside the repository" ;; esac
YLT_SRC=${YLT_SRC:-$SRC/extern/yalantinglibs}
JOBS=${MC_JOBS:-2}
SIZES=${MC_SIZES:-4096 65536 1048576}
OPS=${MC_OPS:-read write}
METAS=${MC_META:-p2p http}
THREADS=${MC_THREADS:-2}
BATCH=${MC_BATCH:-128}
DUR=${MC_DURATION:-5}
POOLS=${MC_TCP_POOL:-0 1}
REPEAT=${MC_REPEAT:-1}
VSECS=${MC_VERIFY_SECS:-2}
MR_BENCH_ARGS=${MR_BENCH_ARGS:---batch-size 32 --batches 4}
[ "${MC_TCP:-1}" = 0 ] && METAS=""
mkdir -p "$BUILD/bin" "$BUILD/logs"

if commit=$(git -C "$SRC" rev-parse HEAD 2>/dev/null); then
	if [ -n "$(git -C "$SRC" status --porcelain --untracked-files=no 2>/dev/null)" ]; then
		commit="$commit (with local changes)"
	fi
else
	commit=${MOONCAKE_COMMIT:-unknown}
fi
log "Mooncake source $SRC, commit $commit; build folder $BUILD"

# --- Debian packages --------------------------------------------------------
pkgs="cmake make g++ pkg-config libgoogle-glog-dev libgflags-dev libjsoncpp-dev
libnuma-dev libibverbs-dev libcurl4-openssl-dev libasio-dev libyaml-cpp-dev
pybind11-dev python3-dev curl"
need=""
for p in $pkgs; do
	[ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)" = "install ok installed" ] || need="$need $p"
done
if [ -n "$need" ]; then
	[ "$(id -u)" = 0 ] || die "need Debian packages$need; installing them needs root"
	command -v apt-get >/dev/null 2>&1 || die "need packages$need, but there is no apt-get here"
	log "installing$need"
	export DEBIAN_FRONTEND=noninteractive
	# shellcheck disable=SC2086 # one word per package
	apt-get install -y -q --no-install-recommends $need >&2 ||
		{ apt-get update -q >&2 && apt-get install -y -q --no-install-recommends $need >&2; }
fi
command -v go >/dev/null 2>&1 || die "the Go toolchain (go) is needed"
# A pyenv or other shim first on PATH confuses pybind11's CMake lookup.
PY=/usr/bin/python3

# --- yalantinglibs (headers, installed into the build folder) ---------------
prefix=$BUILD/prefix
if [ ! -f "$YLT_SRC/CMakeLists.txt" ]; then
	die "yalantinglibs is missing ($YLT_SRC is empty): Mooncake's engine needs it.
Run: git -C $SRC submodule update --init extern/yalantinglibs
or set YLT_SRC to a yalantinglibs source tree (Mooncake pins the commit in its extern/yalantinglibs gitlink)"
fi
ylt_id=$(git -C "$YLT_SRC" rev-parse HEAD 2>/dev/null || echo "$YLT_SRC")
if [ "$(cat "$BUILD/ylt.stamp" 2>/dev/null)" != "$ylt_id" ]; then
	log "installing yalantinglibs ($ylt_id) headers into $prefix"
	rm -rf "$BUILD/ylt-build" "$prefix"
	cmake -S "$YLT_SRC" -B "$BUILD/ylt-build" -DBUILD_EXAMPLES=OFF -DBUILD_BENCHMARK=OFF \
		-DBUILD_UNIT_TESTS=OFF -DCMAKE_INSTALL_PREFIX="$prefix" >"$BUILD/logs/ylt-configure.log" 2>&1 ||
		die "yalantinglibs configure failed: $BUILD/logs/ylt-configure.log"
	cmake --install "$BUILD/ylt-build" >"$BUILD/logs/ylt-install.log" 2>&1 ||
		die "yalantinglibs install failed: $BUILD/logs/ylt-install.log"
	echo "$ylt_id" >"$BUILD/ylt.stamp"
fi

# --- Mooncake's tree, copied and patched -------------------------------------
# Only the transfer engine is built, as its own CMake project
# (mooncake-transfer-engine/CMakeLists.txt), which leaves out the store,
# its Rust bindings and the Python packaging the top level brings in. The
# copy gets two changes: Debian's pybind11 when extern/pybind11 is empty
# (the engine's rpc_communicator includes pybind11 headers), and our
# mc_check as one more example target.
# The stamp: the commit and the version of the changes below (bump it when
# they change). A tree that is not a git checkout is copied once; remove
# $BUILD/src.stamp to copy it again.
stamp="$commit patches-1"
if [ "$(cat "$BUILD/src.stamp" 2>/dev/null)" != "$stamp" ]; then
	log "copying the Mooncake tree into $BUILD/src"
	rm -rf "$BUILD/src" "$BUILD/te-build"
	mkdir -p "$BUILD/src"
	for d in CMakeLists.txt cmake mooncake-common mooncake-transfer-engine extern; do
		[ -e "$SRC/$d" ] && cp -a "$SRC/$d" "$BUILD/src/"
	done
	if [ ! -f "$SRC/extern/pybind11/CMakeLists.txt" ]; then
		"$PY" - "$BUILD/src/mooncake-transfer-engine/CMakeLists.txt" <<-'EOF' || die "cannot patch the pybind11 lookup"
			import re, sys
			p = sys.argv[1]
			s = open(p).read()
			s2 = re.sub(r"add_subdirectory\(\s*\.\./extern/pybind11[^)]*\)",
			            "find_package(pybind11 CONFIG REQUIRED)", s)
			if s2 == s and "extern/pybind11" in s:
			    sys.exit("the extern/pybind11 line changed shape")
			open(p, "w").write(s2)
		EOF
	fi
	mkdir -p "$BUILD/src/moonring-check"
	cat >>"$BUILD/src/mooncake-transfer-engine/example/CMakeLists.txt" <<-EOF

		# Added by moonring's scripts/mooncake-interop.sh (its copy only).
		add_executable(moonring_mc_check $BUILD/src/moonring-check/mc_check.cpp)
		target_link_libraries(moonring_mc_check PUBLIC transfer_engine)
	EOF
	echo "$stamp" >"$BUILD/src.stamp"
fi
cmp -s "$here/mooncake-interop/mc_check.cpp" "$BUILD/src/moonring-check/mc_check.cpp" ||
	cp "$here/mooncake-interop/mc_check.cpp" "$BUILD/src/moonring-check/mc_check.cpp"
if [ ! -f "$BUILD/te-build/CMakeCache.txt" ]; then
	log "configuring (log: $BUILD/logs/te-configure.log)"
	nice -n 19 cmake -S "$BUILD/src/mooncake-transfer-engine" -B "$BUILD/te-build" \
		-DCMAKE_BUILD_TYPE=Release -DENABLE_DEBUG_SYMBOLS=OFF \
		-DBUILD_UNIT_TESTS=OFF -DBUILD_BENCHMARK=OFF -DBUILD_EXAMPLES=ON \
		-DUSE_TCP=ON -DUSE_HTTP=ON -DUSE_ETCD=OFF -DUSE_REDIS=OFF -DUSE_CUDA=OFF \
		-DWITH_METRICS=ON -DCMAKE_PREFIX_PATH="$prefix" \
		-DPYTHON_EXECUTABLE="$PY" -DPython3_EXECUTABLE="$PY" \
		>"$BUILD/logs/te-configure.log" 2>&1 ||
		{ rm -f "$BUILD/te-build/CMakeCache.txt"; die "configure failed: $BUILD/logs/te-configure.log"; }
fi
log "building transfer_engine_bench, transfer_engine_validator, moonring_mc_check (-j$JOBS, nice 19; log: $BUILD/logs/te-build.log)"
nice -n 19 cmake --build "$BUILD/te-build" -j"$JOBS" \
	--target transfer_engine_bench transfer_engine_validator moonring_mc_check \
	>"$BUILD/logs/te-build.log" 2>&1 || die "build failed: $BUILD/logs/te-build.log"
MCB=$BUILD/te-build/example/transfer_engine_bench
MCV=$BUILD/te-build/example/transfer_engine_validator
MCC=$BUILD/te-build/example/moonring_mc_check
# (Help texts are read whole before grep: with pipefail a grep -q that
# stops reading early can fail the pipeline through the writer's SIGPIPE.)
vram=""
mcb_help=$("$MCB" --help 2>&1 || true)
grep -q -- "-use_vram" <<<"$mcb_help" && vram="--use_vram=false"

# --- HTTP metadata server ------------------------------------------------------
mds_cmd=()
mds_src="$SRC/mooncake-transfer-engine/example/http-metadata-server"
if [ -f "$mds_src/main.go" ]; then
	if [ ! -x "$BUILD/bin/http-metadata-server" ]; then
		rm -rf "$BUILD/http-metadata-server"
		cp -a "$mds_src" "$BUILD/http-metadata-server"
		(cd "$BUILD/http-metadata-server" && GOFLAGS=-mod=mod nice -n 19 go build -o "$BUILD/bin/http-metadata-server" .) \
			>"$BUILD/logs/http-metadata-server-build.log" 2>&1 ||
			log "Mooncake's Go http-metadata-server did not build ($BUILD/logs/http-metadata-server-build.log): using scripts/mooncake-interop/http_metadata_server.py"
	fi
fi
if [ -x "$BUILD/bin/http-metadata-server" ] && [ "${MC_HTTP_SERVER:-go}" = go ]; then
	mds_kind="Mooncake's example/http-metadata-server (Go)"
	mds_cmd=("$BUILD/bin/http-metadata-server" -addr)
else
	mds_kind="scripts/mooncake-interop/http_metadata_server.py"
	mds_cmd=("$PY" "$here/mooncake-interop/http_metadata_server.py")
fi

# --- moonring ---------------------------------------------------------------------
if [ -n "${MOONRING:-}" ]; then
	MR=$MOONRING
else
	MR=$BUILD/bin/moonring
	(cd "$repo" && go build -o "$MR" ./cmd/moonring) || die "go build ./cmd/moonring failed"
fi
if [ -n "${MOONRING:-}" ]; then
	mr_desc=$MR
else
	mr_desc="$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)"
	[ -n "$(git -C "$repo" status --porcelain --untracked-files=no 2>/dev/null)" ] && mr_desc="$mr_desc with uncommitted changes"
	mr_desc="$mr_desc (built from $repo)"
fi
serve_help=$("$MR" serve -h 2>&1 || true)
bench_help=$("$MR" bench -h 2>&1 || true)
have_mr=1
if ! grep -q -- "-mooncake" <<<"$serve_help"; then
	have_mr=0
	log "SKIP (b) and (c): this moonring's serve -h has no --mooncake (issue 18 not in yet); only (a) runs"
fi
serve_seeds=0
bench_seeds=0
if [ $have_mr = 1 ]; then
	grep -q -- "-check-seed" <<<"$serve_help" && serve_seeds=1
	grep -q -- "-expect-seed" <<<"$bench_help" && bench_seeds=1
fi

RUNLOGS=$BUILD/logs/run-$(date -u +%Y%m%d-%H%M%S)
mkdir -p "$RUNLOGS"
log "logs of this run: $RUNLOGS"

# --- processes, ports, waiting ------------------------------------------------
pids=()
cleanup() {
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM
free_port() {
	"$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
# wait_for FILE REGEX PID SECONDS: until FILE matches, PID dies, or time is up.
wait_for() {
	local i=0
	while [ $i -lt $(($4 * 10)) ]; do
		grep -Eq "$2" "$1" 2>/dev/null && return 0
		kill -0 "$3" 2>/dev/null || return 1
		sleep 0.1
		i=$((i + 1))
	done
	return 1
}
# stop PID: SIGTERM, then its exit status.
stop() {
	kill "$1" 2>/dev/null || true
	local rc=0
	wait "$1" 2>/dev/null || rc=$?
	local q=()
	for p in "${pids[@]}"; do [ "$p" != "$1" ] && q+=("$p"); done
	pids=("${q[@]+"${q[@]}"}")
	return $rc
}
n=0
# next: a new number for a process's log and Mooncake name (unique in
# command substitutions too, whose increments the shell forgets).
next() { n=$((n + 1)); u=$BASHPID-$n; }
human() {
	case $1 in
	*[!0-9]*) echo "$1" ;;
	*) if [ $(($1 % 1048576)) = 0 ]; then echo "$(($1 / 1048576))M"; elif [ $(($1 % 1024)) = 0 ]; then echo "$(($1 / 1024))K"; else echo "$1"; fi ;;
	esac
}
# median: of the numbers among its words (FAIL and the like left out); "-"
# when there are none.
median() { tr ' ' '\n' | { grep -E '^[0-9.]+$' || true; } | sort -g | awk '{a[NR]=$1} END {if (NR==0) print "-"; else if (NR%2) printf "%.3f\n", a[(NR+1)/2]; else printf "%.3f\n", (a[NR/2]+a[NR/2+1])/2}'; }

maxsize=0
for s in $SIZES; do [ "$s" -gt $maxsize ] && maxsize=$s; done
BUF=$((maxsize * BATCH * THREADS))
mrspan=$((maxsize * THREADS * 128)) # moonring bench: threads x batch x batches blocks
[ $mrspan -gt $BUF ] && BUF=$mrspan
[ $BUF -lt 67108864 ] && BUF=67108864

rows=$RUNLOGS/rows.tsv
: >"$rows"
fails=0
# row DIRECTION META OP SIZE GBPS RESULT CHECK
row() {
	printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$(human "$4")" "$5" "$6" "$7" >>"$rows"
	[ "$6" = FAIL ] && fails=$((fails + 1))
	log "$(printf '%-18s %-5s %-6s %-5s %8s GB/s  %-5s %s' "$1" "$2" "$3" "$(human "$4")" "$5" "$6" "$7")"
}

# mc_meta META: the Mooncake --metadata_server value.
mc_meta() { if [ "$1" = p2p ]; then echo P2PHANDSHAKE; else echo "$MDS_URL"; fi; }
# mc_env META: environment for a Mooncake process: keep its RPC and TCP on
# loopback (with a metadata server Mooncake otherwise publishes its first
# LAN address).
mc_local() { if [ "$1" = p2p ]; then echo 127.0.0.1:0; else echo "mc-$2-$u"; fi; }

# start_mc_target META: a transfer_engine_bench target; sets TPID and TSEG.
start_mc_target() {
	next
	local log=$RUNLOGS/mc-target-$1-$u.log
	MC_TCP_BIND_ADDRESS=127.0.0.1 "$MCB" --mode=target --protocol=tcp $vram \
		--metadata_server="$(mc_meta "$1")" --local_server_name="$(mc_local "$1" target)" \
		--buffer_size=$BUF --block_size=$maxsize --batch_size=$BATCH --threads=$THREADS \
		>"$log" 2>&1 &
	TPID=$!
	pids+=("$TPID")
	wait_for "$log" "numa node num|VRAM is used" $TPID 30 || { tail -5 "$log" >&2; return 1; }
	if [ "$1" = p2p ]; then
		TSEG=$(grep -Eo 'listening on [^ ,]+' "$log" | head -1 | awk '{print $3}')
	else
		TSEG=mc-target-$u
		local i=0
		# Its descriptor lists the buffer once registered (over TCP a
		# buffer's "name" is the segment's, not the location "cpu:0").
		until grep -q '"buffers" *: *\[ *{' <<<"$(curl -sf "$MDS_URL?key=mooncake/ram/$TSEG" || true)"; do
			i=$((i + 1))
			[ $i -gt 100 ] && { log "the target's descriptor never showed its buffer"; return 1; }
			sleep 0.1
		done
	fi
	sleep 0.5 # registerLocalMemory prints nothing; give it a moment
}

# start_mc_check_target META S1 S2: mc_check as the target; sets TPID, TSEG, TLOG.
start_mc_check_target() {
	next
	TLOG=$RUNLOGS/mc-check-target-$1-$u.log
	MC_TCP_BIND_ADDRESS=127.0.0.1 "$MCC" --mode=target --metadata="$(mc_meta "$1")" \
		--local="$(mc_local "$1" check)" --bytes=$((64 << 20)) --fill-seed="$2" --check-seed="$3" \
		>"$TLOG" 2>&1 &
	TPID=$!
	pids+=("$TPID")
	wait_for "$TLOG" "target segment" $TPID 30 || { tail -5 "$TLOG" >&2; return 1; }
	TSEG=$(grep -o 'target segment [^:]*:[^:]*' "$TLOG" | head -1 | awk '{print $3}')
	[ "$1" = p2p ] || TSEG=$(grep -o 'target segment [^:]*' "$TLOG" | head -1 | awk '{print $3}')
}

# start_mr_target META [serve flags...]: moonring serve --mooncake; sets TPID, TSEG, TLOG.
start_mr_target() {
	local meta=$1
	shift
	next
	TLOG=$RUNLOGS/mr-serve-$meta-$u.log
	local rpc tcp lis args
	rpc=$(free_port)
	tcp=$(free_port)
	lis=$(free_port)
	args=(serve --mooncake --mooncake-rpc "127.0.0.1:$rpc" --mooncake-tcp "127.0.0.1:$tcp"
		--listen "127.0.0.1:$lis" --buffer-size "$BUF")
	if [ "$meta" = p2p ]; then
		args+=(--mooncake-metadata p2p)
		TSEG=127.0.0.1:$rpc
	else
		TSEG=mr-target-$u
		args+=(--mooncake-metadata "$MDS_URL" --name "$TSEG")
	fi
	"$MR" "${args[@]}" "$@" >"$TLOG" 2>&1 &
	TPID=$!
	pids+=("$TPID")
	wait_for "$TLOG" "^serving segment" $TPID 30 || { tail -5 "$TLOG" >&2; return 1; }
}

# mc_init META SEG OP SIZE: one transfer_engine_bench initiator run; prints GB/s.
mc_init() {
	next
	local log=$RUNLOGS/mc-init-$1-$3-$4-$u.log
	MC_TCP_BIND_ADDRESS=127.0.0.1 timeout $((DUR + 60)) "$MCB" --mode=initiator --protocol=tcp $vram \
		--metadata_server="$(mc_meta "$1")" --local_server_name="$(mc_local "$1" init)" \
		--segment_id="$2" --operation="$3" --block_size="$4" --batch_size=$BATCH \
		--threads=$THREADS --duration="$DUR" --buffer_size=$BUF --report_precision=3 >"$log" 2>&1 || { tail -3 "$log" >&2; return 1; }
	grep -Eo 'throughput [0-9.]+ GB/s' "$log" | awk '{print $2}' | tail -1 | grep . || return 1
}

# mc_validate META SEG SIZE: transfer_engine_validator; 0 when the data held.
mc_validate() {
	next
	local log=$RUNLOGS/mc-validate-$1-$3-$u.log
	MC_TCP_BIND_ADDRESS=127.0.0.1 timeout $((VSECS + 60)) "$MCV" --mode=initiator --protocol=tcp \
		--metadata_server="$(mc_meta "$1")" --local_server_name="$(mc_local "$1" val)" \
		--segment_id="$2" --block_size="$3" --batch_size=$BATCH --threads=$THREADS \
		--duration="$VSECS" --buffer_size=$BUF >"$log" 2>&1 || { tail -3 "$log" >&2; return 1; }
	! grep -q "integrity problem" "$log" && grep -q "Data validation passed" "$log"
}

# mc_checker META SEG S1 S2: mc_check initiator (READ of pattern S1, WRITE
# then READ of pattern S2). S1 empty: no READ check.
mc_checker() {
	next
	local log=$RUNLOGS/mc-check-$1-$u.log
	local a=(--metadata="$(mc_meta "$1")" --local="$(mc_local "$1" chk)" --segment="$2"
		--bytes=$((64 << 20)) --block=65536 --write-seed="$4")
	[ -n "$3" ] && a+=(--expect-seed="$3")
	MC_TCP_BIND_ADDRESS=127.0.0.1 timeout 120 "$MCC" "${a[@]}" >"$log" 2>&1 || { grep -E "mc_check|Error|ERROR" "$log" | tail -3 >&2; return 1; }
}

# mr_init META SEG OP SIZE: one moonring bench row; prints "GBPS VERIFIED".
mr_init() {
	next
	local log=$RUNLOGS/mr-bench-$1-$3-$4-$u.log
	local a=(bench --mooncake --segment "$2" --block-size "$4" --operation "$3"
		--threads "$THREADS" --duration "${DUR}s" --json)
	# shellcheck disable=SC2206 # words on purpose
	a+=($MR_BENCH_ARGS)
	if [ "$1" = p2p ]; then
		a+=(--mooncake-metadata p2p)
	else
		a+=(--mooncake-metadata "$MDS_URL")
	fi
	timeout $((DUR * 3 + 60)) "$MR" "${a[@]}" >"$log" 2>"$log.err" || { tail -3 "$log.err" >&2; return 1; }
	"$PY" - "$log" <<-'EOF'
		import json, sys
		text = open(sys.argv[1]).read()
		try:
		    rows = json.loads(text)
		except ValueError:
		    rows = [json.loads(l.strip().rstrip(",")) for l in text.splitlines() if l.strip().startswith("{")]
		rows = [r for r in rows if "gb_per_s" in r]
		if not rows:
		    sys.exit(1)
		r = rows[-1]
		print("%.2f %s" % (r["gb_per_s"], "verified" if r.get("verified") else "unverified"))
	EOF
}

# --- the runs ----------------------------------------------------------------------
S1=$((0x5eed0001))
S2=$((0x5eed0002))
for meta in $METAS; do
	case $meta in
	p2p) MDS_URL="" ;;
	http)
		port=$(free_port)
		"${mds_cmd[@]}" "$( [ "${mds_cmd[0]}" = "$PY" ] && echo "$port" || echo "127.0.0.1:$port")" \
			>"$RUNLOGS/http-metadata-server.log" 2>&1 &
		MDS_PID=$!
		pids+=("$MDS_PID")
		MDS_URL=http://127.0.0.1:$port/metadata
		i=0
		until curl -s -o /dev/null "$MDS_URL?key=probe"; do
			i=$((i + 1))
			[ $i -gt 100 ] && die "the HTTP metadata server did not start ($RUNLOGS/http-metadata-server.log)"
			sleep 0.1
		done
		log "HTTP metadata server: $mds_kind at $MDS_URL"
		;;
	*) die "MC_META: p2p or http, not $meta" ;;
	esac

	# Targets for the bandwidth rows: one Mooncake target serves (a) and
	# (c), one moonring serve (b); the rows of the three directions run
	# back to back per size and op, so that they see the same load.
	start_mc_target "$meta" || die "Mooncake target ($meta) did not start"
	MC_TPID=$TPID MC_TSEG=$TSEG
	log "[$meta] Mooncake target: segment $MC_TSEG"
	MR_TPID="" MR_TSEG=""
	if [ $have_mr = 1 ]; then
		if start_mr_target "$meta"; then
			MR_TPID=$TPID MR_TSEG=$TSEG
			log "[$meta] moonring serve: Mooncake segment $MR_TSEG"
		else
			log "[$meta] moonring serve --mooncake did not start ($TLOG)"
		fi
	fi

	res() { # GBPS-LIST CHECK: pass unless either says FAIL
		case "$1 $2" in
		*FAIL*) echo FAIL ;;
		*) echo pass ;;
		esac
	}
	for size in $SIZES; do
		# Round trips of the data, once per size and pool setting, for (a)
		# and (b).
		declare -A va vb
		for pool in $POOLS; do
			if MC_TCP_ENABLE_CONNECTION_POOL=$pool mc_validate "$meta" "$MC_TSEG" "$size"; then va[$pool]="validator ok"; else va[$pool]="validator FAIL"; fi
			vb[$pool]="-"
			if [ -n "$MR_TPID" ]; then
				if MC_TCP_ENABLE_CONNECTION_POOL=$pool mc_validate "$meta" "$MR_TSEG" "$size"; then vb[$pool]="validator ok"; else vb[$pool]="validator FAIL"; fi
			fi
		done
		for op in $OPS; do
			declare -A ga gb
			for pool in $POOLS; do ga[$pool]="" gb[$pool]=""; done
			gc="" okc=1 vc=verified
			for _ in $(seq "$REPEAT"); do
				for pool in $POOLS; do
					export MC_TCP_ENABLE_CONNECTION_POOL=$pool
					g=$(mc_init "$meta" "$MC_TSEG" "$op" "$size") && ga[$pool]="${ga[$pool]} $g" || ga[$pool]="${ga[$pool]} FAIL"
					if [ -n "$MR_TPID" ]; then
						g=$(mc_init "$meta" "$MR_TSEG" "$op" "$size") && gb[$pool]="${gb[$pool]} $g" || gb[$pool]="${gb[$pool]} FAIL"
					fi
					unset MC_TCP_ENABLE_CONNECTION_POOL
				done
				if [ $have_mr = 1 ]; then
					if out=$(mr_init "$meta" "$MC_TSEG" "$op" "$size"); then
						gc="$gc ${out% *}"
						[ "${out#* }" = verified ] || vc=unverified
					else
						gc="$gc FAIL"
						okc=0
					fi
				fi
			done
			for pool in $POOLS; do
				m=$meta
				[ "$pool" = 1 ] && m=$meta+pool
				row mooncake-\>mooncake "$m" "$op" "$size" "$(echo "${ga[$pool]}" | median)" "$(res "${ga[$pool]}" "${va[$pool]}")" "${va[$pool]}"
				if [ $have_mr = 1 ]; then
					if [ -n "$MR_TPID" ]; then
						row mooncake-\>moonring "$m" "$op" "$size" "$(echo "${gb[$pool]}" | median)" "$(res "${gb[$pool]}" "${vb[$pool]}")" "${vb[$pool]}"
					else
						row mooncake-\>moonring "$m" "$op" "$size" - FAIL "serve did not start"
					fi
				fi
			done
			if [ $have_mr = 1 ]; then
				c="bench-verify $vc"
				[ $okc = 0 ] && c="bench failed"
				r=$(res "$gc" "")
				[ "$vc" = unverified ] && [ "$r" = pass ] && r="pass?"
				row moonring-\>mooncake "$meta" "$op" "$size" "$(echo "$gc" | median)" "$r" "$c"
			fi
		done
	done
	stop "$MC_TPID" || true
	[ -n "$MR_TPID" ] && { stop "$MR_TPID" || true; }

	# One-way checks with mc_check, 64 MiB in 64 KiB requests.
	# (a): mc_check's own target, which checks the checker.
	if start_mc_check_target "$meta" $S1 $S2; then
		if mc_checker "$meta" "$TSEG" $S1 $S2; then c1=ok; else c1=FAIL; fi
		if stop "$TPID" && grep -q "holds pattern .*: ok" "$TLOG"; then c2=ok; else c2=FAIL; fi
		r=pass
		[ "$c1$c2" = okok ] || r=FAIL
		row mooncake-\>mooncake "$meta" check 65536 - $r "mc_check: READ 1-way $c1, WRITE 1-way $c2"
	else
		row mooncake-\>mooncake "$meta" check 65536 - FAIL "mc_check target did not start"
	fi
	if [ $have_mr = 1 ]; then
		# (b): moonring serve holds pattern S1 and checks for S2 at exit;
		# mc_check with each of Mooncake's TCP client settings.
		for pool in $POOLS; do
			m=$meta
			[ "$pool" = 1 ] && m=$meta+pool
			export MC_TCP_ENABLE_CONNECTION_POOL=$pool
			if [ $serve_seeds = 1 ]; then
				# A buffer of the 64 MiB mc_check moves: serve --check-seed
				# checks the whole buffer.
				if start_mr_target "$meta" --buffer-size $((64 << 20)) --fill-seed $S1 --check-seed $S2; then
					if mc_checker "$meta" "$TSEG" $S1 $S2; then c1=ok; else c1=FAIL; fi
					if stop "$TPID"; then c2=ok; else c2=FAIL; fi
					r=pass
					[ "$c1$c2" = okok ] || r=FAIL
					row mooncake-\>moonring "$m" check 65536 - $r "mc_check: READ 1-way + round trip $c1, WRITE 1-way (serve --check-seed) $c2"
				else
					row mooncake-\>moonring "$m" check 65536 - FAIL "serve --fill-seed did not start"
				fi
			else
				if start_mr_target "$meta"; then
					if mc_checker "$meta" "$TSEG" "" $S2; then r=pass; else r=FAIL; fi
					stop "$TPID" || true
					row mooncake-\>moonring "$m" check 65536 - $r "mc_check round trip only (serve lacks --fill-seed/--check-seed: no 1-way checks)"
				else
					row mooncake-\>moonring "$m" check 65536 - FAIL "serve did not start"
				fi
			fi
			unset MC_TCP_ENABLE_CONNECTION_POOL
		done
		# (c): mc_check's target holds S1 and checks for S2 at exit.
		if [ $bench_seeds = 1 ]; then
			if start_mc_check_target "$meta" $S1 $S2; then
				next
				a=(bench --mooncake --segment "$TSEG" --expect-seed "$S1" --write-seed "$S2")
				if [ "$meta" = p2p ]; then a+=(--mooncake-metadata p2p); else a+=(--mooncake-metadata "$MDS_URL"); fi
				if timeout 120 "$MR" "${a[@]}" >"$RUNLOGS/mr-check-$meta-$u.log" 2>&1; then c1=ok; else c1=FAIL; fi
				if stop "$TPID" && grep -q "holds pattern .*: ok" "$TLOG"; then c2=ok; else c2=FAIL; fi
				r=pass
				[ "$c1$c2" = okok ] || r=FAIL
				row moonring-\>mooncake "$meta" check 65536 - $r "bench --expect-seed READ 1-way $c1, WRITE 1-way (mc_check target) $c2"
			fi
		else
			row moonring-\>mooncake "$meta" check - - skip "bench lacks --expect-seed/--write-seed: no 1-way checks"
		fi
	fi
	if [ "$meta" = http ]; then stop "$MDS_PID" || true; fi
done

# --- RDMA, Mooncake to Mooncake, in the Soft-RoCE guest (MC_RDMA=1) ---------------
if [ "${MC_RDMA:-0}" = 1 ]; then
	# moonring's side needs a -tags rdma build (cgo, libibverbs-dev), as
	# `make build` makes where the headers are.
	mr_rdma=()
	if [ -f /usr/include/infiniband/verbs.h ] && (cd "$repo" && go build -tags rdma -o "$BUILD/bin/moonring-rdma" ./cmd/moonring); then
		mr_rdma=(--add "$BUILD/bin/moonring-rdma=/opt/rdma-vm/bin/moonring" --add "$MCC=/opt/rdma-vm/bin/moonring_mc_check")
		log "RDMA: Mooncake->Mooncake, Mooncake->moonring, moonring->Mooncake in scripts/rdma-vm.sh's Soft-RoCE guest (log: $RUNLOGS/rdma-vm.log)"
	else
		log "RDMA: no -tags rdma moonring (libibverbs-dev?): Mooncake->Mooncake only, in the Soft-RoCE guest (log: $RUNLOGS/rdma-vm.log)"
		row moonring rdma-guest - - - skip "no -tags rdma build of moonring (libibverbs-dev): only Mooncake->Mooncake over RDMA"
	fi
	"$here/rdma-vm.sh" --timeout 600 --selftest basic \
		--add "$BUILD/te-build/mooncake-common/libasio.so=/usr/lib/x86_64-linux-gnu/libasio.so" \
		--add "$MCB=/opt/rdma-vm/bin/transfer_engine_bench" "${mr_rdma[@]}" \
		"$here/mooncake-interop/rdma-guest.sh" $SIZES >"$RUNLOGS/rdma-vm.log" 2>&1 || true
	got=0
	declare -A dirs=([mc-mc]=mooncake-\>mooncake [mc-mr]=mooncake-\>moonring [mr-mc]=moonring-\>mooncake)
	declare -A how=([mc-mc]="none (bench); emulated guest CPUs" [mc-mr]="none (bench; see check); emulated guest CPUs"
		[mr-mc]="bench's own verification; emulated guest CPUs")
	while read -r _ dir op size rcf _ gbps _; do
		got=1
		if [ "$rcf" = rc=0 ]; then
			row "${dirs[$dir]:-$dir}" rdma-guest "$op" "$size" "$(printf %.3f "$gbps")" pass "${how[$dir]:-}"
		else
			row "${dirs[$dir]:-$dir}" rdma-guest "$op" "$size" - FAIL "$rcf"
		fi
	done < <(grep '^RESULT ' "$RUNLOGS/rdma-vm.log")
	while read -r _ dir rcf what; do
		got=1
		if [ "$rcf" = rc=00 ]; then r=pass; else r=FAIL; fi
		row "${dirs[$dir]:-$dir}" rdma-guest check 4194304 - $r "$what"
	done < <(grep '^CHECK ' "$RUNLOGS/rdma-vm.log")
	[ $got = 1 ] || row mooncake-\>mooncake rdma-guest - - - FAIL "the guest gave no result ($RUNLOGS/rdma-vm.log)"
fi

# --- the table -------------------------------------------------------------------
echo
echo "Mooncake commit: $commit"
echo "Mooncake build: transfer engine alone (TCP; HTTP and P2PHANDSHAKE metadata), $BUILD"
echo "HTTP metadata server: $mds_kind"
echo "moonring: $mr_desc"
echo "Mooncake bench: --threads=$THREADS --batch_size=$BATCH --duration=$DUR, buffer $BUF bytes each side, MC_TCP_ENABLE_CONNECTION_POOL in ($POOLS) (METADATA+pool: 1); moonring bench: --threads $THREADS $MR_BENCH_ARGS; median of $REPEAT run(s) per row"
echo "Host: $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)"
[ $have_mr = 1 ] || echo "(b) mooncake->moonring and (c) moonring->mooncake: SKIPPED, moonring serve has no --mooncake"
printf '%-18s %-8s %-6s %-5s %8s  %-6s %s\n' direction metadata op size GB/s result check
awk -F'\t' '{printf "%-18s %-8s %-6s %-5s %8s  %-6s %s\n", $1, $2, $3, $4, $5, $6, $7}' "$rows"
cp "$rows" "$BUILD/results.tsv"
[ $fails = 0 ] || exit 1
