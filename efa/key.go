package efa

import (
	"encoding/hex"
	"errors"
	"strconv"
	"strings"
)

// What the transport publishes, as strings in the segment descriptor:
//
//	endpoint  "fi1/" + provider + "/" + hex(fi_getname bytes)
//	key       hex(MR key) + "." + hex(buffer address) + "." + hex(length)
//
// The key names the buffer it was issued for, so that an initiator refuses
// a key published for another buffer before the target's provider does;
// the address is also the base of offsets for providers without
// FI_MR_VIRT_ADDR. Both parsers accept exactly what the formatters write.

// errBadDesc reports a malformed endpoint or key in a descriptor.
var errBadDesc = errors.New("efa: malformed descriptor entry")

const (
	endpointPrefix = "fi1/"
	// maxAddrLen bounds a provider address (fi_getname): EFA's is 32
	// bytes, a socket address at most 128, shm's a short string.
	maxAddrLen = 256
	maxProvLen = 64
)

func formatEndpoint(prov string, addr []byte) string {
	return endpointPrefix + prov + "/" + hex.EncodeToString(addr)
}

// parseEndpoint splits an endpoint string into the provider name and the
// address bytes.
func parseEndpoint(s string) (prov string, addr []byte, err error) {
	rest, ok := strings.CutPrefix(s, endpointPrefix)
	if !ok {
		return "", nil, errBadDesc
	}
	prov, h, ok := strings.Cut(rest, "/")
	if !ok || prov == "" || len(prov) > maxProvLen || len(h) == 0 || len(h) > 2*maxAddrLen {
		return "", nil, errBadDesc
	}
	for i := 0; i < len(prov); i++ {
		if c := prov[i]; c <= ' ' || c > '~' {
			return "", nil, errBadDesc
		}
	}
	addr, err = hex.DecodeString(h)
	if err != nil || hex.EncodeToString(addr) != h { // lower case only
		return "", nil, errBadDesc
	}
	return prov, addr, nil
}

// remoteKey is what a peer needs to reach one registered buffer.
type remoteKey struct {
	key    uint64 // the MR key
	base   uint64 // the buffer's address
	length uint64 // the buffer's length
}

func (k remoteKey) String() string {
	b := make([]byte, 0, 50)
	b = strconv.AppendUint(b, k.key, 16)
	b = append(b, '.')
	b = strconv.AppendUint(b, k.base, 16)
	b = append(b, '.')
	b = strconv.AppendUint(b, k.length, 16)
	return string(b)
}

// parseKey reads a key that String wrote; anything else is refused.
func parseKey(s string) (remoteKey, error) {
	if len(s) > 3*16+2 {
		return remoteKey{}, errBadDesc
	}
	orig := s
	var v [3]uint64
	for i := range v {
		field := s
		if i < 2 {
			var ok bool
			field, s, ok = strings.Cut(s, ".")
			if !ok {
				return remoteKey{}, errBadDesc
			}
		}
		x, err := strconv.ParseUint(field, 16, 64)
		if err != nil {
			return remoteKey{}, errBadDesc
		}
		v[i] = x
	}
	k := remoteKey{key: v[0], base: v[1], length: v[2]}
	if k.length == 0 || k.base+k.length < k.base || k.String() != orig {
		return remoteKey{}, errBadDesc
	}
	return k, nil
}
