// size.go holds the sizes the flags take and print (4K, 64M, 2G; bench's
// blocks and buffers, serve's buffer, metadata-server's limits): parsing
// them, writing them back, and their limit.

package main

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
)

func parseSizes(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		n, err := parseSize(f)
		if err != nil {
			return nil, err
		}
		out = append(out, n)
	}
	return out, nil
}

// sizeUnits are the suffixes a size may have, in either case, with or
// without "iB": K, M, G, T (powers of 1024).
var sizeUnits = []struct {
	suffix string
	shift  uint
}{{"t", 40}, {"g", 30}, {"m", 20}, {"k", 10}}

// parseSize reads one size: a whole number of bytes, or of KiB, MiB, GiB
// or TiB with a K, M, G or T suffix in either case (4K, 4k, 4KiB), from 1
// byte to 64G. Its error quotes the size as given.
func parseSize(given string) (int, error) {
	f := strings.TrimSpace(given)
	num, mult := f, 1
	low := strings.ToLower(f)
unit:
	for _, u := range sizeUnits {
		for _, form := range []string{u.suffix + "ib", u.suffix} {
			if strings.HasSuffix(low, form) {
				num, mult = f[:len(f)-len(form)], 1<<u.shift
				break unit
			}
		}
	}
	n, err := strconv.ParseInt(num, 10, 64)
	switch {
	case err != nil && !errors.Is(err, strconv.ErrRange):
		return 0, fmt.Errorf("bad size %q: want a whole number of bytes, or of KiB, MiB, GiB or TiB with a K, M, G or T suffix (either case), from 1 to 64G", given)
	case n <= 0 && err == nil:
		return 0, fmt.Errorf("bad size %q: want at least 1 (sizes go from 1 to 64G)", given)
	case err != nil || n > int64(maxSize/mult):
		if strings.HasPrefix(num, "-") {
			return 0, fmt.Errorf("bad size %q: want at least 1 (sizes go from 1 to 64G)", given)
		}
		return 0, fmt.Errorf("bad size %q: above the limit of 64G", given)
	}
	return int(n) * mult, nil
}

// fmtSize writes a size as the flags take it: 4K, 64K, 1M, 16M, 2G, or
// bytes when it is no whole number of KiB.
func fmtSize(n int) string {
	for _, u := range []struct {
		shift  uint
		suffix string
	}{{40, "T"}, {30, "G"}, {20, "M"}, {10, "K"}} {
		if n >= 1<<u.shift && n%(1<<u.shift) == 0 {
			return strconv.Itoa(n>>u.shift) + u.suffix
		}
	}
	return strconv.Itoa(n)
}

// maxSize bounds a block or buffer size.
const maxSize = 64 << 30
