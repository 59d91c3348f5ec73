package testpattern

import (
	"bytes"
	"strings"
	"testing"
)

// The pattern is a function of seed and position: windows filled apart,
// at any alignment, agree with the whole; At agrees with Fill.
func TestFillAt(t *testing.T) {
	whole := Bytes(7, 1000)
	for i := range whole {
		if whole[i] != At(7, uint64(i)) {
			t.Fatalf("byte %d: Fill %#x, At %#x", i, whole[i], At(7, uint64(i)))
		}
	}
	for _, w := range [][2]int{{0, 1000}, {1, 9}, {3, 500}, {8, 16}, {13, 1}, {999, 1}, {5, 0}} {
		b := make([]byte, w[1])
		FillAt(b, 7, uint64(w[0]))
		if !bytes.Equal(b, whole[w[0]:w[0]+w[1]]) {
			t.Fatalf("window [%d, +%d) differs from the whole", w[0], w[1])
		}
		if err := Check(b, 7, uint64(w[0])); err != nil {
			t.Fatalf("Check of window [%d, +%d): %v", w[0], w[1], err)
		}
	}
	if !bytes.Equal(Bytes(7, 100), whole[:100]) {
		t.Fatal("a shorter pattern is not a prefix of the longer")
	}
}

// Seeds and positions give different bytes: no two seeds' patterns, and
// no two words of one, look alike (the tests rely on a stale or misplaced
// byte being visible).
func TestDistinct(t *testing.T) {
	a, b := Bytes(1, 1<<16), Bytes(2, 1<<16)
	same := 0
	for i := range a {
		if a[i] == b[i] {
			same++
		}
	}
	if same > len(a)/128 { // 1/256 expected
		t.Fatalf("seeds 1 and 2 agree on %d of %d bytes", same, len(a))
	}
	words := map[string]bool{}
	for i := 0; i+8 <= len(a); i += 8 {
		if words[string(a[i:i+8])] {
			t.Fatalf("word at %d repeats", i)
		}
		words[string(a[i:i+8])] = true
	}
	if bytes.Equal(Bytes(0, 64), make([]byte, 64)) {
		t.Fatal("seed 0 is zeros")
	}
}

func TestFirstDiffCheck(t *testing.T) {
	for _, c := range []struct {
		a, b string
		want int
	}{{"", "", -1}, {"abc", "abc", -1}, {"abc", "abd", 2}, {"ab", "abc", 2}, {"abc", "ab", 2}, {"x", "y", 0}} {
		if got := FirstDiff([]byte(c.a), []byte(c.b)); got != c.want {
			t.Errorf("FirstDiff(%q, %q) = %d, want %d", c.a, c.b, got, c.want)
		}
	}
	b := Bytes(3, 100)[10:]
	b[5] ^= 1
	err := Check(b, 3, 10)
	if err == nil || !strings.HasPrefix(err.Error(), "byte 15 is ") {
		t.Fatalf("Check of a changed byte: %v", err)
	}
}

func BenchmarkFill(b *testing.B) {
	buf := make([]byte, 1<<20)
	b.SetBytes(int64(len(buf)))
	for b.Loop() {
		Fill(buf, 1)
	}
}
