package nvlink

import (
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// grantKey is what a target publishes for one exported buffer: the IPC
// handle of the allocation that holds it, where the buffer lies in that
// allocation, the grant-table slot and generation that say whether it is
// still registered, and the PCI bus id of its GPU (device ordinals differ
// between processes; bus ids do not).
//
// Encoded as 256 lowercase hex digits of 128 bytes, little-endian:
//
//	0    4   magic "nvk1"
//	4    4   slot
//	8    4   generation (non-zero)
//	12   4   reserved, zero
//	16   64  CUipcMemHandle
//	80   8   allocation base (the target's address)
//	88   8   allocation size
//	96   8   buffer address (the target's address, as in the descriptor)
//	104  8   buffer length
//	112  16  PCI bus id, ASCII, zero-padded
type grantKey struct {
	slot   uint32
	gen    uint32
	handle ipcHandle
	base   uint64
	size   uint64
	addr   uint64
	length uint64
	bus    string
}

const (
	keyMagic = "nvk1"
	keyBytes = 128
	busBytes = 16
)

// errBadKey reports a key that is not one this package wrote.
var errBadKey = errors.New("nvlink: malformed key")

func (k *grantKey) encode() string {
	var b [keyBytes]byte
	copy(b[0:], keyMagic)
	binary.LittleEndian.PutUint32(b[4:], k.slot)
	binary.LittleEndian.PutUint32(b[8:], k.gen)
	copy(b[16:80], k.handle.Reserved[:])
	binary.LittleEndian.PutUint64(b[80:], k.base)
	binary.LittleEndian.PutUint64(b[88:], k.size)
	binary.LittleEndian.PutUint64(b[96:], k.addr)
	binary.LittleEndian.PutUint64(b[104:], k.length)
	copy(b[112:], k.bus)
	return hex.EncodeToString(b[:])
}

// parseKey decodes a key and checks it is self-consistent: the buffer lies
// inside the allocation, nothing wraps around, the reserved bytes are zero
// and the bus id is printable. It accepts exactly what encode writes.
func parseKey(s string) (grantKey, error) {
	var k grantKey
	if len(s) != 2*keyBytes {
		return k, fmt.Errorf("%w: %d characters, want %d", errBadKey, len(s), 2*keyBytes)
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return k, fmt.Errorf("%w: character %d is not a lowercase hex digit", errBadKey, i)
		}
	}
	var b [keyBytes]byte
	if _, err := hex.Decode(b[:], []byte(s)); err != nil {
		return k, fmt.Errorf("%w: %v", errBadKey, err)
	}
	if string(b[0:4]) != keyMagic {
		return k, fmt.Errorf("%w: bad magic", errBadKey)
	}
	if binary.LittleEndian.Uint32(b[12:]) != 0 {
		return k, fmt.Errorf("%w: reserved bytes set", errBadKey)
	}
	k.slot = binary.LittleEndian.Uint32(b[4:])
	k.gen = binary.LittleEndian.Uint32(b[8:])
	copy(k.handle.Reserved[:], b[16:80])
	k.base = binary.LittleEndian.Uint64(b[80:])
	k.size = binary.LittleEndian.Uint64(b[88:])
	k.addr = binary.LittleEndian.Uint64(b[96:])
	k.length = binary.LittleEndian.Uint64(b[104:])
	bus := b[112:]
	n := 0
	for n < busBytes && bus[n] != 0 {
		if bus[n] < 0x21 || bus[n] > 0x7e {
			return k, fmt.Errorf("%w: bus id not printable", errBadKey)
		}
		n++
	}
	for _, c := range bus[n:] {
		if c != 0 {
			return k, fmt.Errorf("%w: bus id not zero-padded", errBadKey)
		}
	}
	k.bus = string(bus[:n])
	switch {
	case k.gen == 0:
		return k, fmt.Errorf("%w: generation 0", errBadKey)
	case k.slot >= maxSlots:
		return k, fmt.Errorf("%w: slot %d", errBadKey, k.slot)
	case k.bus == "":
		return k, fmt.Errorf("%w: no bus id", errBadKey)
	case k.length == 0 || k.size == 0:
		return k, fmt.Errorf("%w: empty buffer or allocation", errBadKey)
	case k.base+k.size < k.base || k.addr+k.length < k.addr:
		return k, fmt.Errorf("%w: range wraps around", errBadKey)
	case k.addr < k.base || k.addr+k.length > k.base+k.size:
		return k, fmt.Errorf("%w: buffer outside its allocation", errBadKey)
	}
	return k, nil
}

// peerAddr is what a target publishes as its Endpoint: the boot id of its
// host (only peers of the same boot may open its IPC handles), its pid,
// and the path of its grant table:
//
//	nvl1;<boot id>;<pid>;<table path>
type peerAddr struct {
	boot  string
	pid   int
	table string
}

const addrMagic = "nvl1"

func (a peerAddr) String() string {
	return addrMagic + ";" + a.boot + ";" + strconv.Itoa(a.pid) + ";" + a.table
}

// errBadAddr reports an endpoint address this package did not write.
var errBadAddr = errors.New("nvlink: malformed endpoint address")

func parseAddr(s string) (peerAddr, error) {
	parts := strings.Split(s, ";")
	if len(parts) != 4 || parts[0] != addrMagic {
		return peerAddr{}, fmt.Errorf("%w: %q", errBadAddr, s)
	}
	pid, err := strconv.Atoi(parts[2])
	if err != nil || pid <= 0 || strconv.Itoa(pid) != parts[2] {
		return peerAddr{}, fmt.Errorf("%w: bad pid in %q", errBadAddr, s)
	}
	if parts[1] == "" || parts[3] == "" {
		return peerAddr{}, fmt.Errorf("%w: %q", errBadAddr, s)
	}
	return peerAddr{boot: parts[1], pid: pid, table: parts[3]}, nil
}

// bootID returns the host's boot id: processes that see the same one run
// on the same kernel, hence may share CUDA IPC handles.
func bootID() (string, error) {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return "", fmt.Errorf("nvlink: boot id: %w", err)
	}
	id := strings.TrimSpace(string(b))
	if id == "" || strings.ContainsAny(id, "; \n") {
		return "", fmt.Errorf("nvlink: boot id %q", id)
	}
	return id, nil
}
