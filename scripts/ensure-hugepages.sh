#!/bin/sh
# ensure-hugepages.sh: reserve a few of the kernel's huge pages (hugetlbfs,
# vm.nr_hugepages) for the tests of Config.HugeTLB (internal/mem, and the
# engine's across two processes), when fewer are reserved and this runs as
# root: at least MOONRING_TEST_HUGEPAGES (default 32, 64 MiB of 2 MiB
# pages). Without root, or on a kernel without them, those tests say so
# and skip. It never lowers what is reserved.
#
#   scripts/ensure-hugepages.sh
set -eu
want=${MOONRING_TEST_HUGEPAGES:-32}
knob=/proc/sys/vm/nr_hugepages
[ -w "$knob" ] || {
	echo "ensure-hugepages: cannot reserve huge pages ($knob not writable: root needed); their tests will skip" >&2
	exit 0
}
have=$(cat "$knob")
[ "$have" -ge "$want" ] && exit 0
echo "$want" >"$knob" 2>/dev/null || true
echo "ensure-hugepages: vm.nr_hugepages $have -> $(cat "$knob") (wanted $want)" >&2
