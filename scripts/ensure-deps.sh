#!/bin/sh
# ensure-deps.sh: install the system tools the network-namespace tests
# (netns_test.go) use, when they are missing: ip and tc (iproute2), and nft
# (nftables), which emulates packet loss on kernels built without netem;
# the etcd server (etcd-server) that the etcd store's tests
# (metadata/etcd_test.go) and scripts/cluster.sh start; python3, which
# scripts/cluster.sh and scripts/soak.sh sample and analyze with; and libfabric (libfabric-dev,
# libfabric-bin) for the efa transport's tests (make test-efa); sockperf
# and qperf for scripts/bench-latency.sh. It
# installs with apt-get and so needs root; it does nothing when every
# tool is there. netns_test.go and the etcd tests run it themselves when a
# tool is missing; it may also be run by hand or from CI before the tests.
#
#   scripts/ensure-deps.sh          install what is missing
#   scripts/ensure-deps.sh --check  only report what is missing (exit 1)
set -eu

need=""
add() {
	case " $need " in
	*" $1 "*) ;;
	*) need="$need $1" ;;
	esac
}
command -v ip >/dev/null 2>&1 || add iproute2
command -v tc >/dev/null 2>&1 || add iproute2
command -v nft >/dev/null 2>&1 || add nftables
# The rdma transport's cgo build (tag rdma) and make test-rdma: the verbs
# headers and library (scripts/rdma-vm.sh installs what its VM needs).
[ -f /usr/include/infiniband/verbs.h ] || add libibverbs-dev
# Debian's etcd-server installs /usr/bin/etcd, which may not be on PATH.
command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ] || add etcd-server
# The efa transport's cgo build (tag efa) and its tests on libfabric's
# software providers (tcp;ofi_rxm, shm): headers, library and fi_info.
[ -f /usr/include/rdma/fabric.h ] || add libfabric-dev
command -v fi_info >/dev/null 2>&1 || add libfabric-bin
# scripts/bench-latency.sh: the raw TCP ping-pongs moonring's latency is
# measured against.
command -v sockperf >/dev/null 2>&1 || add sockperf
command -v qperf >/dev/null 2>&1 || add qperf
# scripts/cluster.sh and scripts/soak.sh (make test-cluster, test-soak):
# their sampler, tables, checks and plots (the standard library only).
command -v python3 >/dev/null 2>&1 || add python3

if [ -z "$need" ]; then
	exit 0
fi
if [ "${1:-}" = "--check" ]; then
	echo "ensure-deps: missing packages:$need" >&2
	exit 1
fi
if [ "$(id -u)" != 0 ]; then
	echo "ensure-deps: need packages$need, but installing them needs root" >&2
	exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
	echo "ensure-deps: need packages$need, but there is no apt-get here" >&2
	exit 1
fi
echo "ensure-deps: installing$need" >&2
export DEBIAN_FRONTEND=noninteractive
# shellcheck disable=SC2086 # one word per package
apt-get install -y -q --no-install-recommends $need >&2 ||
	{ apt-get update -q >&2 && apt-get install -y -q --no-install-recommends $need >&2; }
