#!/bin/sh
# rdma-guest.sh SIZE...: run inside scripts/rdma-vm.sh's Soft-RoCE guest
# (busybox sh) by scripts/mooncake-interop.sh with MC_RDMA=1, over RDMA on
# the guest's rxe device with P2PHANDSHAKE, READ and WRITE at each SIZE:
#   mc-mc  Mooncake's transfer_engine_bench against its own target;
#   mc-mr  the same bench against moonring serve --mooncake --mooncake-rdma;
#   mr-mc  moonring bench --mooncake --mooncake-rdma against Mooncake's
#          target (its rows verified by bench itself);
# and the one-way data checks with moonring_mc_check (our program on
# Mooncake's engine, --rdma): Mooncake READs serve's --fill-seed pattern
# and WRITEs one that serve's --check-seed finds; moonring bench's
# --expect-seed READs mc_check's pattern and its --write-seed WRITE is
# found by mc_check's target. Without /opt/rdma-vm/bin/moonring (and
# moonring_mc_check) only mc-mc runs. One line per run:
#   RESULT DIR OP SIZE rc=N throughput X GB/s
#   CHECK DIR rc=N what
# The guest's CPUs are emulated (TCG) unless the host has KVM: its figures
# say that it works, not how fast.
B=/opt/rdma-vm/bin/transfer_engine_bench
MR=/opt/rdma-vm/bin/moonring
MCC=/opt/rdma-vm/bin/moonring_mc_check
DEV=$RDMA_VM_DEV
ADDR=$RDMA_VM_ADDR
DUR=${MC_GUEST_DURATION:-3}
CHK=4194304 # bytes of the one-way checks
S1=1311768467463790320
S2=8687463697196027922
export MC_GID_INDEX="$RDMA_VM_GID"
echo "guest: dev=$DEV gid=$RDMA_VM_GID addr=$ADDR"

# waitfor FILE PATTERN: up to 60 s for PATTERN in FILE.
waitfor() {
	i=0
	while [ $i -lt 60 ] && ! grep -q "$2" "$1"; do sleep 1; i=$((i + 1)); done
	grep -q "$2" "$1"
}

# mcbench DIR SEG OP SIZE: Mooncake's bench as initiator.
mcbench() {
	$B --mode=initiator --protocol=rdma --device_name="$DEV" --metadata_server=P2PHANDSHAKE \
		--local_server_name="$ADDR:0" --segment_id="$2" --operation="$3" --block_size="$4" \
		--batch_size=32 --threads=1 --duration="$DUR" --buffer_size=67108864 --report_precision=3 >/tmp/i.log 2>&1
	r=$?
	[ $r = 0 ] || rc=1
	echo "RESULT $1 $3 $4 rc=$r $(grep -o 'throughput.*' /tmp/i.log)"
	[ $r = 0 ] || tail -5 /tmp/i.log | cut -c1-300
}

# mrbench SEG OP SIZE: moonring's bench as initiator, 32 requests in
# flight as Mooncake's bench above.
mrbench() {
	$MR bench --mooncake --mooncake-rdma --mooncake-rpc "$ADDR:0" --segment "$1" --operation "$2" \
		--block-size "$3" --threads 1 --batch-size 32 --batches 1 --duration "${DUR}s" \
		--buffer-size 64M --json >/tmp/m.json 2>/tmp/m.err
	r=$?
	g=$(grep -o '"gb_per_s":[0-9.e+-]*' /tmp/m.json | head -1 | cut -d: -f2)
	if [ $r = 0 ] && ! grep -q '"verified":true' /tmp/m.json; then r=9; fi
	if [ $r = 0 ] && ! grep -q '"transport":"mooncake-rdma"' /tmp/m.json; then r=8; fi
	[ $r = 0 ] || rc=1
	echo "RESULT mr-mc $2 $3 rc=$r throughput ${g:-0} GB/s"
	[ $r = 0 ] || { cut -c1-300 /tmp/m.json; tail -5 /tmp/m.err | cut -c1-300; }
}

rc=0
$B --mode=target --protocol=rdma --device_name="$DEV" --metadata_server=P2PHANDSHAKE \
	--local_server_name="$ADDR:0" --buffer_size=67108864 >/tmp/t.log 2>&1 &
T=$!
waitfor /tmp/t.log "numa node num"
sleep 2
SEG=$(grep -o 'listening on [0-9.:]*' /tmp/t.log | awk '{print $3}')
echo "Mooncake target segment $SEG"
tail -4 /tmp/t.log | cut -c1-200
for op in read write; do
	for bs in "$@"; do
		mcbench mc-mc "$SEG" $op "$bs"
		[ -x "$MR" ] && mrbench "$SEG" $op "$bs"
	done
done
kill $T
wait $T 2>/dev/null
[ -x "$MR" ] || exit $rc

# mc-mr: Mooncake's bench against moonring serve.
$MR serve --mooncake --mooncake-rdma --mooncake-rpc "$ADDR:0" --listen 127.0.0.1:0 --no-shm \
	--buffer-size 64M >/tmp/s.log 2>&1 &
S=$!
if waitfor /tmp/s.log "serving segment"; then
	MSEG=$(grep -o 'serving segment [^:]*:[0-9]*' /tmp/s.log | awk '{print $3}')
	echo "moonring segment $MSEG"
	head -1 /tmp/s.log | cut -c1-300
	for op in read write; do
		for bs in "$@"; do
			mcbench mc-mr "$MSEG" $op "$bs"
		done
	done
else
	rc=1
	echo "RESULT mc-mr - - rc=7 serve did not start"
	tail -5 /tmp/s.log | cut -c1-300
fi
kill $S
wait $S 2>/dev/null
[ -x "$MCC" ] || exit $rc

# One-way checks, mc-mr: mc_check READs serve's pattern S1, WRITEs S2 and
# READs it back; serve finds S2 when it stops.
$MR serve --mooncake --mooncake-rdma --mooncake-rpc "$ADDR:0" --listen 127.0.0.1:0 --no-shm \
	--buffer-size $CHK --fill-seed $S1 --check-seed $S2 >/tmp/s.log 2>&1 &
S=$!
if waitfor /tmp/s.log "serving segment"; then
	MSEG=$(grep -o 'serving segment [^:]*:[0-9]*' /tmp/s.log | awk '{print $3}')
	$MCC --metadata=P2PHANDSHAKE --segment="$MSEG" --local="$ADDR:0" --bytes=$CHK --rdma="$DEV" \
		--expect-seed=$S1 --write-seed=$S2 >/tmp/c.log 2>&1
	r=$?
	kill $S
	wait $S
	s=$?
	grep "mc_check: READ\|mc_check: WRITE" /tmp/c.log | cut -c1-200
	grep "holds pattern" /tmp/s.log
	grep -q "holds pattern $S2: ok" /tmp/s.log || s=1
	[ $r = 0 ] && [ $s = 0 ] || { rc=1; tail -5 /tmp/c.log | cut -c1-300; tail -3 /tmp/s.log | cut -c1-300; }
	echo "CHECK mc-mr rc=$r$s mc_check READ of serve's pattern and WRITE round trip rc=$r; serve --check-seed rc=$s"
else
	rc=1
	kill $S
	echo "CHECK mc-mr rc=7 serve did not start"
fi

# One-way checks, mr-mc: moonring bench READs mc_check's pattern S1 and
# WRITEs S2, which mc_check's target finds when it stops.
$MCC --mode=target --metadata=P2PHANDSHAKE --local="$ADDR:0" --bytes=$CHK --rdma="$DEV" \
	--fill-seed=$S1 --check-seed=$S2 >/tmp/ct.log 2>&1 &
C=$!
if waitfor /tmp/ct.log "target segment"; then
	CSEG=$(grep -o 'target segment [^:]*:[0-9]*' /tmp/ct.log | awk '{print $3}')
	$MR bench --mooncake --mooncake-rdma --mooncake-rpc "$ADDR:0" --segment "$CSEG" \
		--buffer-size $CHK --expect-seed $S1 --write-seed $S2 >/tmp/b.log 2>&1
	r=$?
	kill $C
	wait $C
	s=$?
	grep "holds pattern" /tmp/ct.log
	[ $r = 0 ] && [ $s = 0 ] || { rc=1; tail -5 /tmp/b.log | cut -c1-300; tail -3 /tmp/ct.log | cut -c1-300; }
	echo "CHECK mr-mc rc=$r$s bench --expect-seed READ and --write-seed WRITE rc=$r; mc_check target's check rc=$s"
else
	rc=1
	kill $C
	echo "CHECK mr-mc rc=7 mc_check's target did not start"
	tail -5 /tmp/ct.log | cut -c1-300
fi
exit $rc
