# moonring: build, test, bench, fuzz, cover.
#
#   make test    vet, the whole suite with -race (property tests included;
#                fastcopy, local and shm again without it, for the assembly,
#                and tcp's allocation counts),
#                a short run of every fuzz target, and the short forms of
#                the cluster in a box and the soak (scripts/cluster.sh,
#                scripts/soak.sh)
#   make bench   the benchmarks whose figures BENCHMARKS.md records
#   make fuzz    every fuzz target for FUZZTIME each (default 1m)

GO        ?= go
PKGS      ?= ./...
FUZZSHORT ?= 8s
FUZZTIME  ?= 1m
BENCHTIME ?= 1s
BENCHCOUNT ?= 5

.PHONY: all build deps test vet race fuzz-short fuzz bench cover clean test-rdma bench-rdma test-efa bench-efa test-cluster test-soak cluster soak

all: build

# bin/moonring: with the rdma transport (cgo, linked to libibverbs) where
# the libibverbs headers are; else static and pure Go.
build:
	CGO_ENABLED=0 $(GO) build ./...
	@tags=; \
	if [ -f /usr/include/infiniband/verbs.h ]; then tags="rdma"; \
	else echo "build: no libibverbs headers (libibverbs-dev): bin/moonring without the rdma transport"; fi; \
	if [ -f /usr/include/rdma/fabric.h ]; then tags="$${tags:+$$tags,}efa"; \
	else echo "build: no libfabric headers (libfabric-dev): bin/moonring without the efa transport"; fi; \
	if [ -n "$$tags" ]; then echo "$(GO) build -tags $$tags -o bin/moonring ./cmd/moonring"; $(GO) build -tags $$tags -o bin/moonring ./cmd/moonring; \
	else CGO_ENABLED=0 $(GO) build -o bin/moonring ./cmd/moonring; fi

vet:
	@unformatted="$$(gofmt -l $$(git ls-files '*.go'))"; \
	if [ -n "$$unformatted" ]; then echo "gofmt needed:"; echo "$$unformatted"; exit 1; fi
	$(GO) vet $(PKGS)
	CGO_ENABLED=0 $(GO) vet $(PKGS)
	@if [ -f /usr/include/infiniband/verbs.h ]; then echo "$(GO) vet -tags rdma ./rdma/"; $(GO) vet -tags rdma ./rdma/; fi

# The race detector turns fastcopy's assembly off (Copy is copy() there),
# so the packages that copy with it run once more without it; and its
# sync.Pool drops items at random, so tcp's allocation counts (its target's
# pooled buffers), and the engine's through tcp, are asserted without it.
race:
	$(GO) test -race -count=1 -timeout 15m $(PKGS)
	$(GO) test -count=1 -timeout 5m ./internal/fastcopy ./local ./shm
	$(GO) test -count=1 -timeout 5m -run 'Allocs' ./tcp
	$(GO) test -count=1 -timeout 5m -run 'TestSubmitAndWaitTCP' .

# Every Fuzz target in the module, each for FUZZSHORT.
fuzz-short:
	@scripts/fuzz.sh $(FUZZSHORT)

# System tools of the end-to-end tests (iproute2, nftables), installed when
# missing and possible, and a few reserved huge pages for Config.HugeTLB's
# tests; the tests say loudly what they lack otherwise.
deps:
	-@scripts/ensure-deps.sh
	-@scripts/ensure-hugepages.sh

test: deps vet race fuzz-short test-rdma test-efa test-cluster test-soak

fuzz:
	@scripts/fuzz.sh $(FUZZTIME)

bench:
	$(GO) test -run '^$$' -bench 'RingNop|ChanBaseline|LocalWrite|CopyBaseline|^Benchmark(Raw)?TCP|UringNop' \
		-benchtime $(BENCHTIME) -count $(BENCHCOUNT) . ./internal/uring | tee bench.out
	$(GO) test -run '^$$' -bench . -benchtime $(BENCHTIME) -count $(BENCHCOUNT) ./internal/fastcopy | tee -a bench.out
	$(GO) run golang.org/x/perf/cmd/benchstat@v0.0.0-20260908200009-22c9c6c9d4da bench.out
	@scripts/uring-baseline.sh || true

cover:
	$(GO) test -count=1 -coverprofile=cover.out $(PKGS)
	$(GO) tool cover -func=cover.out | tail -1

clean:
	rm -rf bin cover.out bench.out

# The rdma transport (build tag rdma): its device-less tests with -race on
# the host (handshake, GID choice, the C work-request chain), then the whole
# package against real verbs on Soft-RoCE in a qemu guest (scripts/rdma-vm.sh;
# about 30 s under TCG; RDMA_RACE=-race builds the guest's binary with the
# race detector, 3-4 minutes).
RDMA_RACE ?=
test-rdma:
	$(GO) test -race -count=1 -tags rdma ./rdma/
	$(GO) test -c $(RDMA_RACE) -tags rdma -o bin/rdma.test ./rdma/
	scripts/rdma-vm.sh --timeout 480 --env MOONRING_RDMA_REQUIRE=1 bin/rdma.test -test.v -test.timeout 400s

# The rdma benchmarks in the guest, beside perftest's ib_write_bw and
# ib_read_bw on the same device (rdma/vmbench.sh); figures in BENCHMARKS.md.
bench-rdma:
	$(GO) test -c -tags rdma -o bin/rdma.test ./rdma/
	scripts/rdma-vm.sh --timeout 540 --add bin/rdma.test=/opt/rdma-vm/bin/rdma.test rdma/vmbench.sh

# The efa transport (cgo, build tag efa) on libfabric's software providers
# (tcp;ofi_rxm and shm; libfabric-dev from scripts/ensure-deps.sh): the
# conformance suite, two processes, vet. About 2 minutes with -race.
test-efa:
	@if [ ! -f /usr/include/rdma/fabric.h ] && [ "$${MOONRING_CI:-}" != 1 ]; then \
		echo "test-efa: SKIP: no libfabric headers (libfabric-dev; scripts/ensure-deps.sh installs it)"; exit 0; fi; \
	set -x; $(GO) vet -tags efa ./efa/ && $(GO) test -race -count=1 -timeout 10m -tags efa ./efa/

# The efa benchmarks beside a raw libfabric program of our own
# (efa/testdata/fi_bw.c) and the TCP transport, in the same run.
bench-efa:
	$(GO) test -run '^$$' -bench 'EFA' -benchtime $(BENCHTIME) -count $(BENCHCOUNT) -tags efa ./efa/ | tee bench-efa.out

# The cluster in a box (scripts/cluster.sh, issue 19), short: 4
# network-namespace hosts, a three-member etcd, serves and KV initiators
# with every byte checked, one fault of each kind (kill -9, partition,
# delay and loss, etcd leader killed); about 2 minutes, half a minute of it
# the killed serves waiting for their names' etcd leases to expire (30 s,
# metadata.DefaultTTL) before they can publish again. It needs root, ip, nft,
# tc and etcd: without them it says SKIP loudly, and fails under
# MOONRING_CI=1. Its results stay in the directory it names.
test-cluster:
	scripts/cluster.sh --short

# The soak (scripts/soak.sh), short: 60 s of mixed sizes and ops over TCP
# and shm with peers restarting every 15 s; fails on growth of the
# long-lived processes. On loopback; needs no root.
test-soak:
	scripts/soak.sh 60s --restart 15s

# The long forms, whose figures BENCHMARKS.md records.
cluster:
	scripts/cluster.sh --hosts 8 --duration 150s

soak:
	scripts/soak.sh 10m
