// mooncake.go holds the command's Mooncake mode (serve --mooncake, bench
// --mooncake): the flags, the Mooncake metadata store they name, and the
// engine configuration.

package main

import (
	"context"
	"encoding/binary"
	"flag"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/metadata/etcd"
	"github.com/moonring/moonring/mooncake"
	"github.com/moonring/moonring/mooncake/mcetcd"
	"github.com/moonring/moonring/mooncake/mctcp"
	"github.com/moonring/moonring/rdma"
)

// mooncakeHelp is the flags' story, for serve's and bench's -h.
const mooncakeHelp = `--mooncake speaks the Mooncake Transfer Engine's wire, so that Mooncake
engines (SGLang, vLLM, LMCache, transfer_engine_bench) and this one reach
each other unchanged: Mooncake's TCP data protocol (version 2, and 1 for
peers that publish none), its RPC port (metadata, notifications, probes)
and its descriptors, with --mooncake-metadata:
  p2p                       P2PHANDSHAKE: the segment is named by its RPC
                            port's ip:port (--mooncake-rpc), and peers are
                            asked on theirs
  http://HOST:PORT/metadata Mooncake's HTTP metadata server
  etcd://HOST:PORT[;...]    etcd, with Mooncake's keys
MC_METADATA_CLUSTER_ID sets the keys' cluster prefix, as for Mooncake.
Mooncake's protocols carry NO authentication: whoever reaches the RPC or
data port can read and write the served buffer.
`

// mooncakeFlags are the flags of Mooncake mode.
type mooncakeFlags struct {
	on       *bool
	metadata *string
	rpc      *string
	tcp      *string
	rdma     *bool
	rdmaDevs *string
}

func addMooncakeFlags(fs *flag.FlagSet, target bool) *mooncakeFlags {
	f := &mooncakeFlags{
		on:       fs.Bool("mooncake", false, "speak Mooncake's wire (see below); off by default: its protocols carry no authentication"),
		metadata: fs.String("mooncake-metadata", "p2p", "--mooncake: p2p (P2PHANDSHAKE), http://HOST:PORT/metadata (Mooncake's HTTP metadata server) or etcd://HOST:PORT[;HOST:PORT...]"),
		rpc:      fs.String("mooncake-rpc", "127.0.0.1:0", "--mooncake: the RPC port's address (with p2p, the segment's name)"),
		rdma:     fs.Bool("mooncake-rdma", false, "--mooncake: also speak Mooncake's RDMA transport (its handshake on the RPC port, the rkeys in the descriptor); the data then goes over RDMA (a build with the rdma tag and an RDMA device)"),
		rdmaDevs: fs.String("mooncake-rdma-devices", "", "--mooncake-rdma: the RDMA devices to use, comma-separated (default: every usable one)"),
	}
	if target {
		f.tcp = fs.String("mooncake-tcp", "", "--mooncake: Mooncake's TCP data port (default: the RPC port's host, any port)")
	}
	return f
}

// check refuses the Mooncake flags without --mooncake.
func (f *mooncakeFlags) check(set map[string]bool) error {
	if *f.on {
		return nil
	}
	for _, n := range []string{"mooncake-metadata", "mooncake-rpc", "mooncake-tcp", "mooncake-rdma", "mooncake-rdma-devices"} {
		if set[n] {
			return fmt.Errorf("--%s goes with --mooncake", n)
		}
	}
	return nil
}

// store returns the Mooncake metadata store --mooncake-metadata names, or
// nil for p2p (the engine makes its P2PHANDSHAKE store).
func (f *mooncakeFlags) store() (metadata.Store, error) {
	m := *f.metadata
	keys := mooncake.KeysFromEnv()
	switch {
	case m == "p2p":
		return nil, nil
	case strings.HasPrefix(m, "http://") || strings.HasPrefix(m, "https://"):
		return mooncake.NewHTTPStore(mooncake.HTTPConfig{URL: m, Keys: keys})
	case strings.HasPrefix(m, "etcd://"):
		return mcetcd.NewStore(etcd.Config{Endpoints: mcetcd.Endpoints(strings.TrimPrefix(m, "etcd://"))}, mooncake.StoreConfig{Keys: keys})
	}
	return nil, fmt.Errorf("--mooncake-metadata %q: want p2p, http://HOST:PORT/metadata or etcd://HOST:PORT", m)
}

// config is the engine's Mooncake configuration.
func (f *mooncakeFlags) config() *moonring.MooncakeConfig {
	c := &moonring.MooncakeConfig{RPC: mooncake.RPCConfig{Listen: *f.rpc}}
	if f.tcp != nil {
		c.TCP = mctcp.Config{Listen: *f.tcp}
	}
	if *f.rdma {
		c.RDMA = &rdma.Config{}
		if *f.rdmaDevs != "" {
			c.RDMA.Devices = strings.Split(*f.rdmaDevs, ",")
		}
	}
	return c
}

// dataTransport is the transport the initiator's bytes go over in
// Mooncake mode: Mooncake's RDMA with --mooncake-rdma, else its TCP.
func (f *mooncakeFlags) dataTransport() string {
	if *f.rdma {
		return rdma.MooncakeName
	}
	return mctcp.Name
}

// args are the flags that start a target process like this one.
func (f *mooncakeFlags) args() []string {
	a := []string{"--mooncake", "--mooncake-metadata", *f.metadata}
	if *f.rdma {
		a = append(a, "--mooncake-rdma")
		if *f.rdmaDevs != "" {
			a = append(a, "--mooncake-rdma-devices", *f.rdmaDevs)
		}
	}
	return a
}

// The seeded pattern of serve --fill-seed/--check-seed and bench
// --expect-seed/--write-seed, for one-way checks with other programs
// (scripts/mooncake-interop.sh's mc_check): the little-endian 64-bit word
// at byte offset 8*i is (i+1)*0x9E3779B97F4A7C15 XOR seed; a tail shorter
// than a word holds that word's first bytes.

func seedWord(i int, seed uint64) uint64 { return uint64(i+1)*0x9E3779B97F4A7C15 ^ seed }

// seedPattern fills b with the pattern of seed.
func seedPattern(b []byte, seed uint64) {
	var w [8]byte
	for i := 0; i*8 < len(b); i++ {
		binary.LittleEndian.PutUint64(w[:], seedWord(i, seed))
		copy(b[i*8:], w[:])
	}
}

// seedDiff returns the offset of the first byte of b that differs from the
// pattern of seed, or -1.
func seedDiff(b []byte, seed uint64) int {
	var w [8]byte
	for i := 0; i*8 < len(b); i++ {
		binary.LittleEndian.PutUint64(w[:], seedWord(i, seed))
		chunk := b[i*8 : min(len(b), i*8+8)]
		for j := range chunk {
			if chunk[j] != w[j] {
				return i*8 + j
			}
		}
	}
	return -1
}

// seedCheck is bench --expect-seed/--write-seed: READ the target's first
// size bytes and check them against expect's pattern, then WRITE write's
// pattern over them; each step says its result on out.
func seedCheck(ctx context.Context, t *target, size int, expect, write *uint64, out io.Writer) error {
	buf, err := t.ini.Alloc(size, "cpu:0")
	if err != nil {
		return err
	}
	defer t.ini.Free(buf)
	if _, err := t.ini.RegisterLocalMemory(buf, "cpu:0", false); err != nil {
		return err
	}
	defer t.ini.UnregisterLocalMemory(context.Background(), buf)
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	req := moonring.TransferRequest{Opcode: moonring.Read, Source: moonring.AddressOf(buf), TargetID: t.seg, TargetOffset: t.base, Length: uint64(size)}
	if expect != nil {
		if err := t.ini.Transfer(ctx, req); err != nil {
			return fmt.Errorf("bench --expect-seed: READ of %s: %w", t.name, err)
		}
		if off := seedDiff(buf, *expect); off >= 0 {
			return fmt.Errorf("bench --expect-seed: %s's buffer differs from pattern %d at byte %d", t.name, *expect, off)
		}
		fmt.Fprintf(out, "READ %s of %s: holds pattern %d: ok\n", fmtSize(size), t.name, *expect)
	}
	if write != nil {
		seedPattern(buf, *write)
		req.Opcode = moonring.Write
		if err := t.ini.Transfer(ctx, req); err != nil {
			return fmt.Errorf("bench --write-seed: WRITE to %s: %w", t.name, err)
		}
		fmt.Fprintf(out, "WRITE %s of pattern %d to %s: done\n", fmtSize(size), *write, t.name)
	}
	return nil
}
