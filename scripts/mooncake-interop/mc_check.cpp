// mc_check: a data check through Mooncake's own Transfer Engine, for
// scripts/mooncake-interop.sh. It is moonring's code, compiled by that
// script against a Mooncake build outside this repository (the script adds
// it as a target to its copy of Mooncake's tree); nothing of Mooncake is
// kept here.
//
// Mooncake's transfer_engine_bench moves bytes without looking at them.
// mc_check opens a segment the way that bench does (the first buffer of
// the segment's descriptor, at its published address) and then:
//   --expect-seed=S  READs the first --bytes of the buffer and compares them
//                    with pattern(S): the target filled its buffer with it,
//                    so this checks the READ path one way;
//   --write-seed=S   WRITEs pattern(S) over the first --bytes, clears its own
//                    copy, READs the bytes back and compares: a round trip;
//                    a target that checks its buffer for pattern(S) after
//                    mc_check exits checks the WRITE path one way.
// With --mode=target it is a Mooncake target instead: it registers --bytes
// (default 64 MiB) as "cpu:0" filled with pattern(--fill-seed), prints
// "mc_check: target segment NAME" (with P2PHANDSHAKE, NAME is host:port),
// and on SIGINT or SIGTERM compares its buffer with pattern(--check-seed),
// when given, before it exits: the one-way check of a peer's WRITEs.
// pattern(S): the little-endian 64-bit word at byte offset 8*i of the buffer
// is (i+1)*0x9E3779B97F4A7C15 XOR S (multiplication modulo 2^64). Every word
// differs from its neighbours, so bytes that land at the wrong offset fail.
//
// Usage:
//   mc_check --metadata=P2PHANDSHAKE|http://HOST:PORT/metadata
//            --segment=NAME [--local=NAME] [--bytes=N] [--block=N]
//            [--expect-seed=S] [--write-seed=S] [--rdma=DEV]
//   mc_check --mode=target --metadata=M [--local=NAME] [--bytes=N]
//            [--fill-seed=S] [--check-seed=S] [--rdma=DEV]
// --rdma=DEV moves the bytes over Mooncake's RDMA transport on device DEV
// instead of its TCP.
// Exit status 0: every check asked for passed; 1: a check failed; 2: setup.
#include <glog/logging.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "transfer_engine.h"

using mooncake::BatchID;
using mooncake::SegmentID;
using mooncake::Status;
using mooncake::TransferEngine;
using mooncake::TransferRequest;
using mooncake::TransferStatus;
using mooncake::TransferStatusEnum;

namespace {

uint64_t word(uint64_t i, uint64_t seed) {
    return (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
}

void fill(uint8_t* p, size_t n, uint64_t seed) {
    for (size_t i = 0; i < n / 8; ++i) {
        uint64_t w = word(i, seed);
        std::memcpy(p + 8 * i, &w, 8);  // little-endian hosts only
    }
}

// firstDiff returns the byte offset of the first word that differs from
// pattern(seed), or -1.
long long firstDiff(const uint8_t* p, size_t n, uint64_t seed) {
    for (size_t i = 0; i < n / 8; ++i) {
        uint64_t w;
        std::memcpy(&w, p + 8 * i, 8);
        if (w != word(i, seed)) return (long long)(8 * i);
    }
    return -1;
}

std::string arg(int argc, char** argv, const char* name,
                const std::string& def) {
    std::string prefix = std::string("--") + name + "=";
    for (int i = 1; i < argc; ++i)
        if (std::strncmp(argv[i], prefix.c_str(), prefix.size()) == 0)
            return argv[i] + prefix.size();
    return def;
}

// install installs the transport: Mooncake's RDMA on the device --rdma=DEV
// names (buffers of location cpu:0 prefer it), else its TCP.
bool install(TransferEngine& e, int argc, char** argv) {
    std::string dev = arg(argc, argv, "rdma", "");
    if (dev.empty()) {
        if (e.installTransport("tcp", nullptr)) return true;
        std::fprintf(stderr, "mc_check: installTransport(tcp) failed\n");
        return false;
    }
    std::string matrix = "{\"cpu:0\": [[\"" + dev + "\"], []]}";
    void* args[2] = {const_cast<char*>(matrix.c_str()), nullptr};
    if (e.installTransport("rdma", args)) return true;
    std::fprintf(stderr, "mc_check: installTransport(rdma, %s) failed\n",
                 dev.c_str());
    return false;
}

// move runs one op over [0, n) of the remote buffer at base, in blocks of
// block bytes, up to 128 requests a batch; false on a failed request.
bool move(TransferEngine& e, SegmentID seg, TransferRequest::OpCode op,
          uint8_t* local, uint64_t base, size_t n, size_t block) {
    const size_t per = 128;
    for (size_t off = 0; off < n; off += per * block) {
        std::vector<TransferRequest> reqs;
        for (size_t o = off; o < n && o < off + per * block; o += block) {
            TransferRequest r{};
            r.opcode = op;
            r.source = local + o;
            r.target_id = seg;
            r.target_offset = base + o;
            r.length = std::min(block, n - o);
            reqs.push_back(r);
        }
        BatchID id = e.allocateBatchID(reqs.size());
        Status s = e.submitTransfer(id, reqs);
        if (!s.ok()) {
            std::fprintf(stderr, "mc_check: submitTransfer: %s\n",
                         s.ToString().c_str());
            return false;
        }
        bool ok = true;
        for (size_t t = 0; t < reqs.size(); ++t) {
            TransferStatus st{};
            for (;;) {
                s = e.getTransferStatus(id, t, st);
                if (!s.ok()) {
                    std::fprintf(stderr, "mc_check: getTransferStatus: %s\n",
                                 s.ToString().c_str());
                    return false;
                }
                if (st.s == TransferStatusEnum::COMPLETED) break;
                if (st.s == TransferStatusEnum::FAILED ||
                    st.s == TransferStatusEnum::CANCELED ||
                    st.s == TransferStatusEnum::TIMEOUT) {
                    std::fprintf(stderr,
                                 "mc_check: %s of %zu bytes at +%zu: status "
                                 "%d\n",
                                 op == TransferRequest::READ ? "READ" : "WRITE",
                                 reqs[t].length, off + t * block, (int)st.s);
                    ok = false;
                    break;
                }
            }
        }
        e.freeBatchID(id);
        if (!ok) return false;
    }
    return true;
}

volatile sig_atomic_t stopping = 0;
void onSignal(int) { stopping = 1; }

int target(int argc, char** argv) {
    std::string meta = arg(argc, argv, "metadata", "P2PHANDSHAKE");
    std::string local = arg(argc, argv, "local", "127.0.0.1:0");
    size_t bytes =
        std::strtoull(arg(argc, argv, "bytes", "67108864").c_str(), 0, 0) &
        ~size_t(7);
    std::string fillSeed = arg(argc, argv, "fill-seed", "");
    std::string check = arg(argc, argv, "check-seed", "");
    struct sigaction sa {};
    sa.sa_handler = onSignal;
    sigaction(SIGINT, &sa, nullptr);
    sigaction(SIGTERM, &sa, nullptr);

    TransferEngine e(false);
    auto hp = mooncake::parseHostNameWithPort(local);
    if (e.init(meta, local, hp.first, hp.second) != 0) {
        std::fprintf(stderr, "mc_check: init failed\n");
        return 2;
    }
    if (!install(e, argc, argv)) return 2;
    void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) {
        std::perror("mc_check: mmap");
        return 2;
    }
    uint8_t* buf = static_cast<uint8_t*>(mem);
    if (!fillSeed.empty())
        fill(buf, bytes, std::strtoull(fillSeed.c_str(), 0, 0));
    if (e.registerLocalMemory(buf, bytes, "cpu:0") != 0) {
        std::fprintf(stderr, "mc_check: registerLocalMemory failed\n");
        return 2;
    }
    std::string name = meta == "P2PHANDSHAKE" ? e.getLocalIpAndPort() : local;
    std::printf("mc_check: target segment %s: %zu bytes at %p\n",
                name.c_str(), bytes, mem);
    std::fflush(stdout);
    while (!stopping) usleep(100000);
    int rc = 0;
    if (!check.empty()) {
        long long d =
            firstDiff(buf, bytes, std::strtoull(check.c_str(), 0, 0));
        if (d >= 0) {
            std::printf("mc_check: target holds pattern %s: FAIL, differs at "
                        "+%lld\n",
                        check.c_str(), d);
            rc = 1;
        } else {
            std::printf("mc_check: target holds pattern %s: ok\n",
                        check.c_str());
        }
    }
    std::fflush(stdout);
    e.unregisterLocalMemory(buf);
    return rc;
}

}  // namespace

int main(int argc, char** argv) {
    FLAGS_logtostderr = true;
    google::InitGoogleLogging(argv[0]);
    if (arg(argc, argv, "mode", "initiator") == "target")
        return target(argc, argv);
    std::string meta = arg(argc, argv, "metadata", "P2PHANDSHAKE");
    std::string segment = arg(argc, argv, "segment", "");
    std::string local = arg(argc, argv, "local", "127.0.0.1:0");
    size_t bytes = std::strtoull(arg(argc, argv, "bytes", "0").c_str(), 0, 0);
    size_t block =
        std::strtoull(arg(argc, argv, "block", "65536").c_str(), 0, 0);
    std::string expect = arg(argc, argv, "expect-seed", "");
    std::string write = arg(argc, argv, "write-seed", "");
    if (segment.empty() || block == 0 || (expect.empty() && write.empty())) {
        std::fprintf(stderr,
                     "usage: mc_check --metadata=M --segment=NAME "
                     "[--local=NAME] [--bytes=N] [--block=N] "
                     "[--expect-seed=S] [--write-seed=S]\n");
        return 2;
    }

    TransferEngine e(false);
    auto hp = mooncake::parseHostNameWithPort(local);
    if (e.init(meta, local, hp.first, hp.second) != 0) {
        std::fprintf(stderr, "mc_check: init failed\n");
        return 2;
    }
    if (!install(e, argc, argv)) return 2;
    SegmentID seg = e.openSegment(segment);
    auto desc = e.getMetadata()->getSegmentDescByID(seg);
    if (!desc || desc->buffers.empty()) {
        std::fprintf(stderr, "mc_check: segment %s: no descriptor or buffers\n",
                     segment.c_str());
        return 2;
    }
    const auto& b0 = desc->buffers[0];
    if (bytes == 0 || bytes > b0.length) bytes = b0.length;
    bytes &= ~size_t(7);
    std::printf(
        "mc_check: segment %s: %zu buffer(s); buffer 0 \"%s\" at 0x%" PRIx64
        ", %" PRIu64 " bytes; checking %zu bytes in blocks of %zu\n",
        segment.c_str(), desc->buffers.size(), b0.name.c_str(), b0.addr,
        b0.length, bytes, block);

    void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) {
        std::perror("mc_check: mmap");
        return 2;
    }
    uint8_t* buf = static_cast<uint8_t*>(mem);
    if (e.registerLocalMemory(buf, bytes, "cpu:0") != 0) {
        std::fprintf(stderr, "mc_check: registerLocalMemory failed\n");
        return 2;
    }

    int rc = 0;
    if (!expect.empty()) {
        uint64_t seed = std::strtoull(expect.c_str(), 0, 0);
        std::memset(buf, 0, bytes);
        if (!move(e, seg, TransferRequest::READ, buf, b0.addr, bytes, block)) {
            rc = 1;
        } else if (long long d = firstDiff(buf, bytes, seed); d >= 0) {
            std::printf("mc_check: READ of the target's pattern %s: FAIL, "
                        "differs at +%lld\n",
                        expect.c_str(), d);
            rc = 1;
        } else {
            std::printf("mc_check: READ of the target's pattern %s: ok\n",
                        expect.c_str());
        }
    }
    if (rc == 0 && !write.empty()) {
        uint64_t seed = std::strtoull(write.c_str(), 0, 0);
        fill(buf, bytes, seed);
        if (!move(e, seg, TransferRequest::WRITE, buf, b0.addr, bytes, block)) {
            rc = 1;
        } else {
            std::memset(buf, 0, bytes);
            if (!move(e, seg, TransferRequest::READ, buf, b0.addr, bytes,
                      block)) {
                rc = 1;
            } else if (long long d = firstDiff(buf, bytes, seed); d >= 0) {
                std::printf("mc_check: WRITE then READ of pattern %s: FAIL, "
                            "differs at +%lld\n",
                            write.c_str(), d);
                rc = 1;
            } else {
                std::printf("mc_check: WRITE then READ of pattern %s: ok\n",
                            write.c_str());
            }
        }
    }
    e.unregisterLocalMemory(buf);
    munmap(mem, bytes);
    return rc;
}
