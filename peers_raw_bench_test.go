package moonring_test

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
)

// BenchmarkScalePeersRaw is BenchmarkScalePeers' baseline: the same rounds
// with no engine. n pairs of loopback TCP connections in this process,
// each served by a goroutine that answers 32-byte requests with 4 KiB
// each, the answers to the requests already read in one write;
// rounds of 64 requests spread over the next 64 pairs in turn (with one
// pair, 64 on it, written at once), every answer read. ns/op is per
// request, both sides' work. What it shows growing with n is the cost of
// the shape (64 requests on 64 sockets pay 64 writes, 64 wake-ups and 64
// reads where one socket's 64 share one of each), which no engine avoids.
func BenchmarkScalePeersRaw(b *testing.B) { scalePeersRaw(b, true) }

// BenchmarkScalePeersTurnRaw is BenchmarkScalePeersTurn's baseline: n
// pairs connected, each round's 64 requests on one pair, the next in turn.
func BenchmarkScalePeersTurnRaw(b *testing.B) { scalePeersRaw(b, false) }

// scalePeersRaw runs BenchmarkScalePeersRaw (spread: a round over the
// next pairs) or BenchmarkScalePeersTurnRaw (a round on the next pair).
func scalePeersRaw(b *testing.B, spread bool) {
	for _, n := range scaleCounts(b, 1, 10, 100, 1000) {
		b.Run(fmt.Sprintf("peers=%d", n), func(b *testing.B) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				b.Fatal(err)
			}
			var wg sync.WaitGroup
			defer wg.Wait()
			defer ln.Close()
			answer := rawAnswerBuffer()
			conns := make([]net.Conn, n)
			for i := range conns {
				c, s := dialPair(b, ln)
				wg.Add(1)
				go func() {
					defer wg.Done()
					rawAnswer(s, answer)
				}()
				conns[i] = c
				defer c.Close()
			}
			rawRounds(b, warmRounds(n, spread), conns, spread) // accepted, warm
			b.SetBytes(4096)
			b.ReportAllocs()
			b.ResetTimer()
			rawRounds(b, b.N, conns, spread)
		})
	}
}

// rawAnswerBuffer is the one answer buffer every raw pair is answered
// from, as the engine's target answers every peer from its one buffer: a
// buffer per pair would put 1,000 pairs' 256 KiB each out of the caches,
// which is the program's cost, not the connections'.
func rawAnswerBuffer() []byte { return make([]byte, 4096*64) }

// rawAnswer serves the raw baseline's far end of c until it fails: it
// answers 32-byte requests with 4 KiB each of answer, every request
// already read answered in one write, as the engine's target gathers its
// answers. It closes c.
func rawAnswer(c net.Conn, answer []byte) {
	defer c.Close()
	br := bufio.NewReaderSize(c, 4096)
	var req [32]byte
	for {
		if _, err := io.ReadFull(br, req[:]); err != nil {
			return
		}
		k := 1
		for ; k < 64 && br.Buffered() >= len(req); k++ {
			br.Discard(len(req))
		}
		if _, err := c.Write(answer[:4096*k]); err != nil {
			return
		}
	}
}

// rawRounds sends total 32-byte requests over conns in rounds of 64
// (roundShape: spread over the next conns, or on one, the next in turn)
// and reads every 4 KiB answer.
func rawRounds(b *testing.B, total int, conns []net.Conn, spread bool) {
	n := len(conns)
	per, width := roundShape(n, spread)
	reqs := make([]byte, 32*per)
	resp := make([]byte, 4096*per)
	used := make([]int, 0, 128)
	next := 0
	for done := 0; done < total; {
		used = used[:0]
		k := min(per*width, total-done)
		for j := 0; j < k; {
			i := next % n
			next++
			m := min(per, k-j)
			if _, err := conns[i].Write(reqs[:32*m]); err != nil {
				b.Fatal(err)
			}
			used = append(used, i, m)
			j += m
		}
		for u := 0; u < len(used); u += 2 {
			if _, err := io.ReadFull(conns[used[u]], resp[:4096*used[u+1]]); err != nil {
				b.Fatal(err)
			}
		}
		done += k
	}
}

// dialPair returns both ends of a new loopback TCP connection to ln; the
// caller closes them.
func dialPair(b *testing.B, ln net.Listener) (client, server *net.TCPConn) {
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		b.Fatal(err)
	}
	s, err := ln.Accept()
	if err != nil {
		c.Close()
		b.Fatal(err)
	}
	return c.(*net.TCPConn), s.(*net.TCPConn)
}
