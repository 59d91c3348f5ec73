#!/bin/sh
# gpu-check.sh: the NVLink transport (nvlink/) on a real GPU, in one short run.
#
# There is no GPU on the development machine; sessions lent one through the
# device tool run this script in two steps. The binaries are built here and
# carried (nothing binary is committed: bin/ is git-ignored):
#
#   1. On the development machine (no GPU needed):
#
#        scripts/gpu-check.sh build
#
#      builds bin/gpu-check/nvlink.test (the nvlink package's tests and
#      benchmarks) with CGO_ENABLED=0 GOOS=linux GOARCH=amd64. The binary
#      cannot be fully static: it dlopens libcuda.so.1, so it links libc and
#      libdl dynamically (purego's fakecgo), which any glibc host has.
#
#   2. On the lent machine, with the device tool, in ONE call:
#
#        run(command="scripts/gpu-check.sh run", carry=["bin/gpu-check"], timeout_s=420)
#
#      It prints the GPU, runs every test of the package (the GPU ones must
#      PASS, not skip: two processes on GPU 0 with WRITE and READ checked
#      byte for byte, device and host memory as the local side, GPU memory
#      staged over the TCP transport on loopback, by itself and through
#      two engines), then the benchmarks
#      at 64 MiB: NVLinkWrite and NVLinkRead through CUDA IPC against
#      RawDtoD (cuMemcpyDtoDAsync in one process), each at depth 1 and 4,
#      and the ratio against the 90 % target; EngineNVLink: the same
#      64 MiB requests between two engines in two processes, through a
#      ring at depth 1 and 4 and through the batch API's Transfer, each
#      against RawDtoD at its depth (Transfer: 1); then
#      StagedTCP: 64 MiB
#      requests between two engines over TCP on loopback from GPU memory
#      (staged) beside the same from host memory; then the KV workload:
#      KVNVLink, a request's 16,384 scattered 32 KiB blocks between two
#      engines (the gather kernel, the default; copy engines batched and a
#      call each) beside the same bytes as contiguous 1 MiB blocks (the
#      kernel; copy engines), and RawKV, the same copies in one process
#      (the kernel in one launch or in launches of 64 or 256 slices, with
#      other block sizes and blocks a slice: its geometry). It takes
#      about three minutes.
#      The log comes back as $OUT/gpu-check.log (and on stdout); put the
#      figures in BENCHMARKS.md (nvlink section) with the date.
#
#   scripts/gpu-check.sh (no argument) builds, then runs: for a machine
#   that has both Go and a GPU.
#
# Exit status: 0 when every test passed (the bandwidth target is reported,
# not enforced: a figure is a measurement, not a test), 1 otherwise.
set -eu
cd "$(dirname "$0")/.."
bin=bin/gpu-check

build() {
	mkdir -p "$bin"
	CGO_ENABLED=0 GOOS=linux GOARCH=amd64 go test -c -o "$bin/nvlink.test" ./nvlink
	ls -l "$bin"
}

run() {
	if [ ! -x "$bin/nvlink.test" ]; then
		echo "gpu-check: no $bin/nvlink.test: run 'scripts/gpu-check.sh build' on the development machine and carry $bin" >&2
		exit 1
	fi
	out=${OUT:-$(mktemp -d)}
	mkdir -p "$out"
	log=$out/gpu-check.log
	{
		echo "gpu-check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n)"
		nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv 2>&1 || echo "no nvidia-smi"
		ldconfig -p 2>/dev/null | grep libcuda.so || echo "ldconfig lists no libcuda.so"
	} 2>&1 | tee "$log"
	status=0
	# Tests run from the package directory (testdata/ paths).
	(cd nvlink && timeout 150 "../$bin/nvlink.test" -test.v -test.count=1 -test.timeout 140s) >"$out/tests.log" 2>&1 || status=1
	grep -E '^(--- |ok|FAIL|PASS)|^\s+gpu_test.go|^\s+kv_test.go|^\s+mock_test.go' "$out/tests.log" | tee -a "$log"
	if grep -q -- '--- SKIP: TestGPU' "$out/tests.log"; then
		echo "gpu-check: GPU tests SKIPPED on the GPU machine:" | tee -a "$log"
		grep -A2 -- '--- SKIP: TestGPU' "$out/tests.log" | tee -a "$log"
		status=1
	fi
	if [ "$status" != 0 ]; then
		echo "gpu-check: tests FAILED; the full log follows" | tee -a "$log"
		tail -n 200 "$out/tests.log" | tee -a "$log"
	fi
	(cd nvlink && timeout 150 "../$bin/nvlink.test" -test.run '^$' -test.bench 'NVLinkWrite|NVLinkRead|RawDtoD|EngineNVLink|StagedTCP' \
		-test.benchtime 1s -test.count 3 -test.timeout 140s) >"$out/bench.log" 2>&1 || status=1
	# The KV workload: a request's 16,384 scattered 32 KiB blocks between
	# two engines (batched copies and a call each) beside the same bytes
	# as contiguous 1 MiB blocks, and the raw copies in one process.
	(cd nvlink && timeout 200 "../$bin/nvlink.test" -test.run '^$' -test.bench 'KVNVLink|RawKV' \
		-test.benchtime 1s -test.count 3 -test.timeout 190s) >>"$out/bench.log" 2>&1 || status=1
	grep -E '^Benchmark|^(ok|FAIL|PASS)|Error|error' "$out/bench.log" | tee -a "$log"
	# Mean MB/s per benchmark, and each NVLink figure against the raw copy
	# at the same depth.
	awk '/^Benchmark/ {
		name = $1; sub(/-[0-9]+$/, "", name)
		for (i = 2; i <= NF; i++) if ($(i+1) == "MB/s") { sum[name] += $i; n[name]++ }
	}
	END {
		for (k in sum) mean[k] = sum[k] / n[k]
		for (k in mean) printf "%-36s %10.0f MB/s (mean of %d)\n", k, mean[k], n[k]
		for (k in mean) {
			if (k ~ /StagedTCP\/gpu\//) {
				raw = k; sub(/\/gpu\//, "/host/", raw)
				if (raw in mean && mean[raw] > 0)
					printf "%-36s %5.1f %% of %s (staging through pinned host memory)\n", k, 100 * mean[k] / mean[raw], raw
				continue
			}
			if (k ~ /KVNVLink\/[a-z]+\/kv/) {
				c = k; sub(/kv$/, "contiguous", c); sub(/kv-(copyengine|percopy)$/, "contiguous-copyengine", c)
				if (c in mean && mean[c] > 0)
					printf "%-36s %5.1f %% of %s (scattered 32 KiB blocks against 1 MiB ones)\n", k, 100 * mean[k] / mean[c], c
				continue
			}
			if (k ~ /RawKV\/(kernel|percopy|batch)/ && ("BenchmarkRawKV/contiguous" in mean) && mean["BenchmarkRawKV/contiguous"] > 0) {
				printf "%-36s %5.1f %% of BenchmarkRawKV/contiguous\n", k, 100 * mean[k] / mean["BenchmarkRawKV/contiguous"]
				continue
			}
			if (k !~ /NVLink/ || k ~ /KV/) continue
			raw = k; sub(/NVLink(Write|Read)/, "RawDtoD", raw)
			if (k ~ /EngineNVLink/) raw = (k ~ /depth=4/ ? "BenchmarkRawDtoD/depth=4" : "BenchmarkRawDtoD/depth=1")
			if (!(raw in mean) || mean[raw] == 0) continue
			r = 100 * mean[k] / mean[raw]
			printf "%-36s %5.1f %% of %s %s\n", k, r, raw, (r >= 90 ? "(target 90 %: met)" : "(target 90 %: NOT met)")
		}
	}' "$out/bench.log" | sort | tee -a "$log"
	echo "gpu-check: exit $status" | tee -a "$log"
	exit "$status"
}

# kernel: the gather kernel alone, for a short run: its tests, the launch
# geometry sweep (BenchmarkRawKV's kernel rows beside contiguous 1 MiB
# copies), the engines' kv through it (one ring, a prepared list of 256
# blocks an entry, and four rings on four pollers) beside contiguous, and a CPU profile of the initiator moving
# kv through four rings ($OUT/kv.prof; read
# it here with go tool pprof bin/gpu-check/nvlink.test FILE). About a
# minute and a half.
kernel() {
	out=${OUT:-$(mktemp -d)}
	mkdir -p "$out"
	log=$out/gpu-check.log
	nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | tee "$log"
	status=0
	(cd nvlink && timeout 100 "../$bin/nvlink.test" -test.v -test.count=1 -test.run 'GPUScattered|GatherPTX|GPUTwoProcesses' -test.timeout 90s) >"$out/tests.log" 2>&1 || status=1
	grep -E '^(--- |ok|FAIL|PASS)|^\s+(kv|kernel|gpu)_test.go' "$out/tests.log" | tee -a "$log"
	(cd nvlink && timeout 150 "../$bin/nvlink.test" -test.run '^$' -test.bench 'RawKV/(kernel|contiguous)|KVNVLink/(write|read)/^(kv|kv-lists|kv-rings4.*|contiguous|contiguous-copyengine)$' \
		-test.benchtime 1s -test.count 3 -test.timeout 140s) >"$out/bench.log" 2>&1 || status=1
	(cd nvlink && timeout 60 "../$bin/nvlink.test" -test.run '^$' -test.bench 'KVNVLink/write/^kv-rings4$' \
		-test.benchtime 5s -test.count 1 -test.timeout 50s -test.cpuprofile "$out/kv.prof") >>"$out/bench.log" 2>&1 || status=1
	grep -E '^Benchmark|^(ok|FAIL|PASS)|Error|error' "$out/bench.log" | tee -a "$log"
	echo "gpu-check: exit $status" | tee -a "$log"
	exit "$status"
}

case "${1:-all}" in
build) build ;;
run) run ;;
kernel) kernel ;;
all) build && run ;;
*) echo "usage: $0 [build|run|kernel]" >&2; exit 2 ;;
esac
