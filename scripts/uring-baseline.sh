#!/bin/sh
# uring-baseline.sh: the kernel's io_uring NOP rate at batch 1 and 32 on this
# machine, the baseline BenchmarkRingNop is compared with. Installs
# liburing-dev when missing (Debian).
set -eu
cd "$(dirname "$0")/.."
if [ ! -f /usr/include/liburing.h ]; then
	if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
		DEBIAN_FRONTEND=noninteractive apt-get install -y liburing-dev >/dev/null
	else
		echo "uring-baseline: liburing-dev missing and cannot be installed here" >&2
		exit 1
	fi
fi
out=${TMPDIR:-/tmp}/moonring-uring-nop
gcc -O2 -o "$out" bench/uring_nop.c -luring
"$out" "${1:-7}" "${2:-0.4}"
