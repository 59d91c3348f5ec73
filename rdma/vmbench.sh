#!/bin/sh
# vmbench.sh: runs inside the rdma VM (scripts/rdma-vm.sh, busybox sh):
# perftest's ib_write_bw and ib_read_bw at the sizes of the rdma
# benchmarks, then the benchmarks themselves, on the same rxe device in the
# same guest. make bench-rdma runs it:
#
#   scripts/rdma-vm.sh --add bin/rdma.test=/opt/rdma-vm/bin/rdma.test rdma/vmbench.sh
set -u
T=/opt/rdma-vm/bin/rdma.test
for op in write read; do
	for size in 4096 65536 1048576; do
		iters=2000
		[ "$size" -ge 1048576 ] && iters=200
		ib_${op}_bw -d "$RDMA_VM_DEV" -x "$RDMA_VM_GID" -s $size -n $iters -F >/tmp/srv.log 2>&1 &
		srv=$!
		i=0
		while [ $i -lt 200 ] && ! netstat -ltn 2>/dev/null | grep -q ':18515 '; do sleep 0.05; i=$((i + 1)); done
		ib_${op}_bw -d "$RDMA_VM_DEV" -x "$RDMA_VM_GID" -s $size -n $iters -F 127.0.0.1 >/tmp/cli.log 2>&1
		wait $srv
		line=$(grep -E "^ *$size " /tmp/cli.log | tail -n1)
		echo "perftest ib_${op}_bw size=$size: $line"
	done
done
exec "$T" -test.run '^$' -test.bench 'RDMA' -test.benchtime "${BENCHTIME:-2s}" -test.count "${BENCHCOUNT:-1}"
