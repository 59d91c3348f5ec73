# moonring: build, test, bench, fuzz, cover.
#
#   make test    vet, the whole suite with -race (property tests included),
#                and a short run of every fuzz target
#   make bench   the benchmarks whose figures BENCHMARKS.md records
#   make fuzz    every fuzz target for FUZZTIME each (default 1m)

GO        ?= go
PKGS      ?= ./...
FUZZSHORT ?= 8s
FUZZTIME  ?= 1m
BENCHTIME ?= 1s
BENCHCOUNT ?= 5

.PHONY: all build deps test vet race fuzz-short fuzz bench cover clean

all: build

build:
	CGO_ENABLED=0 $(GO) build ./...
	CGO_ENABLED=0 $(GO) build -o bin/moonring ./cmd/moonring

vet:
	@unformatted="$$(gofmt -l $$(git ls-files '*.go'))"; \
	if [ -n "$$unformatted" ]; then echo "gofmt needed:"; echo "$$unformatted"; exit 1; fi
	$(GO) vet $(PKGS)
	CGO_ENABLED=0 $(GO) vet $(PKGS)

race:
	$(GO) test -race -count=1 -timeout 15m $(PKGS)

# Every Fuzz target in the module, each for FUZZSHORT.
fuzz-short:
	@scripts/fuzz.sh $(FUZZSHORT)

# System tools of the end-to-end tests (iproute2, nftables), installed when
# missing and possible; the tests say loudly what they lack otherwise.
deps:
	-@scripts/ensure-deps.sh

test: deps vet race fuzz-short

fuzz:
	@scripts/fuzz.sh $(FUZZTIME)

bench:
	$(GO) test -run '^$$' -bench 'RingNop|ChanBaseline|LocalWrite|CopyBaseline|TCP|UringNop' \
		-benchtime $(BENCHTIME) -count $(BENCHCOUNT) . ./internal/uring | tee bench.out
	$(GO) run golang.org/x/perf/cmd/benchstat@v0.0.0-20260908200009-22c9c6c9d4da bench.out
	@scripts/uring-baseline.sh || true

cover:
	$(GO) test -count=1 -coverprofile=cover.out $(PKGS)
	$(GO) tool cover -func=cover.out | tail -1

clean:
	rm -rf bin cover.out bench.out
