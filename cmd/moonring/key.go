package main

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
)

// keyEnv names the environment variable that may hold the segment key.
const keyEnv = "MOONRING_KEY"

// maxKeyFile bounds what a key file may hold: a key is a passphrase, not
// a document, and a file name that points at a device must not be read
// for ever.
const maxKeyFile = 4 << 10

// Errors of the key's sources.
var (
	// errBadKey: the key given is unusable (empty, too long, or in a file
	// that others may read).
	errBadKey = errors.New("bad segment key")
	// errNeedKey: serve was asked to listen beyond loopback with no key.
	errNeedKey = errors.New("a segment key is needed")
)

// keyHelp is the part of serve's and bench's -h text about the key.
const keyHelp = `The segment key: every engine of a deployment holds the same one, and a
peer must prove it before any buffer is reached (TCP and shm). It is the
content of the file given with --key-file (one trailing newline ignored;
the file must be a regular file readable by its owner only, mode 0600 or
0400), or else the value of the environment variable ` + keyEnv + `.
Giving both, or an empty key, is an error. Never put a key on a command
line: other users of the host can read it there.
`

// loadKey returns the segment key from file (when not empty) or from
// MOONRING_KEY, or nil when neither gives one. The key is the file's
// content with one trailing newline ("\n" or "\r\n") removed.
func loadKey(file string) ([]byte, error) {
	env, envSet := os.LookupEnv(keyEnv)
	if file == "" {
		if !envSet {
			return nil, nil
		}
		if env == "" {
			return nil, fmt.Errorf("%w: %s is set but empty", errBadKey, keyEnv)
		}
		return []byte(env), nil
	}
	if envSet {
		return nil, fmt.Errorf("%w: both --key-file and %s are set; give one", errBadKey, keyEnv)
	}
	f, err := os.Open(file)
	if err != nil {
		return nil, fmt.Errorf("key file: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("key file: %w", err)
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("%w: key file %s is not a regular file", errBadKey, file)
	}
	if perm := st.Mode().Perm(); perm&0o077 != 0 {
		return nil, fmt.Errorf("%w: key file %s has mode %04o: group or others may read or change it (chmod 600 %s)", errBadKey, file, perm, file)
	}
	b, err := io.ReadAll(io.LimitReader(f, maxKeyFile+1))
	if err != nil {
		return nil, fmt.Errorf("key file: %w", err)
	}
	if len(b) > maxKeyFile {
		return nil, fmt.Errorf("%w: key file %s holds more than %d bytes", errBadKey, file, maxKeyFile)
	}
	k := strings.TrimSuffix(strings.TrimSuffix(string(b), "\n"), "\r")
	if k == "" {
		return nil, fmt.Errorf("%w: key file %s is empty", errBadKey, file)
	}
	return []byte(k), nil
}

// newKey returns a fresh key of 32 random bytes, written as 64 hex digits
// so that it passes through a file, an environment variable and a
// terminal unchanged.
func newKey() []byte {
	var b [32]byte
	rand.Read(b[:])
	return []byte(hex.EncodeToString(b[:]))
}

// writeKeyFile writes key and a newline to a new file of mode 0600 in the
// temporary directory and returns its name.
func writeKeyFile(key []byte) (string, error) {
	f, err := os.CreateTemp("", "moonring-key-*") // mode 0600, never an existing file
	if err != nil {
		return "", fmt.Errorf("key file: %w", err)
	}
	_, werr := f.Write(append(append([]byte(nil), key...), '\n'))
	cerr := f.Close()
	if err := errors.Join(werr, cerr); err != nil {
		os.Remove(f.Name())
		return "", fmt.Errorf("key file: %w", err)
	}
	return f.Name(), nil
}

// loopback reports whether the host of a host:port address is loopback:
// "localhost" or a loopback IP. Any other name, and an empty or
// unspecified host (every interface), is not.
func loopback(hostport string) bool {
	host, _, err := net.SplitHostPort(hostport)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
