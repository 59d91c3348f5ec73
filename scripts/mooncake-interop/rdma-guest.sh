#!/bin/sh
# rdma-guest.sh SIZE...: run inside scripts/rdma-vm.sh's Soft-RoCE guest
# (busybox sh) by scripts/mooncake-interop.sh with MC_RDMA=1: Mooncake's
# transfer_engine_bench as target and initiator over RDMA on the guest's
# rxe device, P2PHANDSHAKE, READ and WRITE at each SIZE; one line
# "RESULT rdma OP SIZE rc=N throughput X GB/s" per run. The guest's CPUs
# are emulated (TCG) unless the host has KVM: its figures say that it
# works, not how fast.
B=/opt/rdma-vm/bin/transfer_engine_bench
export MC_GID_INDEX="$RDMA_VM_GID"
echo "guest: dev=$RDMA_VM_DEV gid=$RDMA_VM_GID addr=$RDMA_VM_ADDR"
$B --mode=target --protocol=rdma --device_name="$RDMA_VM_DEV" --metadata_server=P2PHANDSHAKE \
	--local_server_name="$RDMA_VM_ADDR:0" --buffer_size=67108864 >/tmp/t.log 2>&1 &
T=$!
i=0
while [ $i -lt 60 ] && ! grep -q "numa node num" /tmp/t.log; do sleep 1; i=$((i + 1)); done
sleep 2
SEG=$(grep -o 'listening on [0-9.:]*' /tmp/t.log | awk '{print $3}')
echo "target segment $SEG"
tail -4 /tmp/t.log | cut -c1-200
rc=0
for op in read write; do
	for bs in "$@"; do
		$B --mode=initiator --protocol=rdma --device_name="$RDMA_VM_DEV" --metadata_server=P2PHANDSHAKE \
			--local_server_name="$RDMA_VM_ADDR:0" --segment_id="$SEG" --operation=$op --block_size="$bs" \
			--batch_size=32 --threads=1 --duration=3 --buffer_size=67108864 --report_precision=3 >/tmp/i.log 2>&1
		r=$?
		[ $r = 0 ] || rc=1
		echo "RESULT rdma $op $bs rc=$r $(grep -o 'throughput.*' /tmp/i.log)"
		[ $r = 0 ] || tail -5 /tmp/i.log | cut -c1-200
	done
done
kill $T
exit $rc
