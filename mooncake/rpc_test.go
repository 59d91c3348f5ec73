package mooncake

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moonring/moonring/internal/leakcheck"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

func listenRPC(t testing.TB, cfg RPCConfig) *RPCServer {
	t.Helper()
	s, err := ListenRPC(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// rawExchange acts as a Mooncake requester over a plain socket: it writes
// req, then reads until the server closes its write side (as Mooncake's
// daemon does after its answer) or closes the connection.
func rawExchange(t testing.TB, addr string, req []byte) []byte {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write(req); err != nil {
		t.Fatal(err)
	}
	c.(*net.TCPConn).CloseWrite() // a request cut short ends here
	ans, err := io.ReadAll(c)
	if err != nil && !errors.Is(err, net.ErrClosed) && !strings.Contains(err.Error(), "reset") {
		t.Fatalf("reading the answer: %v", err)
	}
	return ans
}

func unhex(t testing.TB, s string) []byte {
	t.Helper()
	b, err := hex.DecodeString(strings.Join(strings.Fields(s), ""))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// The refusal Mooncake's writer would give a Connection frame without a
// handshake function: its members in jsoncpp's (sorted) order.
const refusedHandshake = `{"local_gid":"","local_lid":0,"local_nic_path":"","payload":"","peer_nic_path":"","qp_num":[],"reply_msg":"` + NoHandshakeReply + `"}` + "\n"

// TestRPCGoldenExchanges: requests as a Mooncake engine writes them
// (length, type byte, jsoncpp FastWriter's text with its newline; from
// transfer_metadata_plugin.cpp and common.h at 3b5a594), sent over a raw
// socket, get the bytes a Mooncake daemon would answer with.
func TestRPCGoldenExchanges(t *testing.T) {
	var got []transport.Notification
	var mu sync.Mutex
	s := listenRPC(t, RPCConfig{Notify: func(n *transport.Notification) error {
		mu.Lock()
		defer mu.Unlock()
		got = append(got, transport.Notification{From: n.From, Tag: n.Tag, Msg: bytes.Clone(n.Msg)})
		return nil
	}})
	frame := func(typ string, body string) string {
		n := len(body)
		if typ != "" {
			n++
		}
		var l [8]byte
		binary.LittleEndian.PutUint64(l[:], uint64(n))
		return hex.EncodeToString(l[:]) + typ + hex.EncodeToString([]byte(body))
	}
	for _, tc := range []struct{ what, req, ans string }{
		// sendProbe: an empty object; the answer {"status":"success"}.
		{"probe", "0400000000000000 03 7b7d0a", "1600000000000000 03" + hex.EncodeToString([]byte(`{"status":"success"}`+"\n"))},
		// exchangeMetadata from an engine: this daemon has no descriptor,
		// so the answer is null (Mooncake: the callback fails, the reply
		// stays a null value).
		{"metadata", "0600000000000000 01 6e756c6c0a", "0600000000000000 01 6e756c6c0a"},
		// sendNotify; receivePeerNotify's answer.
		{"notify", frame("02", `{"name":"10.1.0.8:15002","notify_msg":"kv-block 42 ready"}`+"\n"),
			"2400000000000000 02" + hex.EncodeToString([]byte(`{"name":"","notify_msg":"success"}`+"\n"))},
		// A handshake (the RDMA transport's document), refused.
		{"connection", frame("00", `{"local_gid":"00:00:00:00:00:00:00:00:00:00:ff:ff:c0:a8:64:08","local_lid":0,"local_nic_path":"10.1.0.8:15002@mlx5_0","payload":"","peer_nic_path":"10.1.0.7:15001@mlx5_1","qp_num":[281,282],"ready_ack":false,"reply_msg":""}`+"\n"),
			frame("00", refusedHandshake)},
		// The old protocol: no type byte either way.
		{"old", frame("", `{"local_nic_path":"a@b","qp_num":[1]}`+"\n"), frame("", refusedHandshake)},
	} {
		ans := rawExchange(t, s.Addr().String(), unhex(t, tc.req))
		if want := unhex(t, tc.ans); !bytes.Equal(ans, want) {
			t.Errorf("%s: answer\n%q\nwant\n%q", tc.what, ans, want)
		}
	}
	mu.Lock()
	if len(got) != 1 || got[0].From != "10.1.0.8:15002" || string(got[0].Msg) != "kv-block 42 ready" || got[0].Tag != 0 {
		t.Errorf("delivered %+v", got)
	}
	mu.Unlock()
	st := s.Stats()
	if st.Served != [4]uint64{2, 1, 1, 1} || st.Bad != 0 || st.Refused != 0 {
		t.Errorf("stats %+v", st)
	}
}

// TestRPCMetadataAnswer: the daemon serves the descriptor of its source in
// Mooncake's schema, re-encoding only when the source changes it.
func TestRPCMetadataAnswer(t *testing.T) {
	var mu sync.Mutex
	d := publishable()
	s := listenRPC(t, RPCConfig{Descriptor: func() *segtable.SegmentDesc { mu.Lock(); defer mu.Unlock(); return d }})
	req := AppendFrame(nil, FrameMetadata, []byte("null\n"))
	ans := rawExchange(t, s.Addr().String(), req)
	f, n, err := ParseFrame(ans, MaxFrameLimit)
	if err != nil || n != len(ans) || f.Type != FrameMetadata || !bytes.HasSuffix(f.Body, []byte("}\n")) {
		t.Fatalf("answer %q: %v", ans, err)
	}
	md, err := Decode(f.Body)
	if err != nil || md.Name != d.Name || md.Protocol != ProtoRDMA || md.Timestamp == "" {
		t.Fatalf("served %+v, %v", md, err)
	}
	if again := rawExchange(t, s.Addr().String(), req); !bytes.Equal(again, ans) {
		t.Error("the same descriptor encoded anew")
	}
	mu.Lock()
	d = d.Clone()
	d.Buffers = d.Buffers[:1]
	mu.Unlock()
	f, _, _ = ParseFrame(rawExchange(t, s.Addr().String(), req), MaxFrameLimit)
	if md, err := Decode(f.Body); err != nil || len(md.Buffers) != 1 {
		t.Fatalf("after a change: %+v, %v", md, err)
	}
	// A descriptor that does not convert is served as null.
	mu.Lock()
	d = &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "x", Endpoints: map[string]string{EndpointRPC: "nonsense"}}
	mu.Unlock()
	if ans := rawExchange(t, s.Addr().String(), req); !bytes.Equal(ans, AppendFrame(nil, FrameMetadata, nullBody)) {
		t.Errorf("unconvertible descriptor served as %q", ans)
	}
}

// TestRPCRefusesMalformed: what a hostile or broken peer sends closes the
// connection unanswered.
func TestRPCRefusesMalformed(t *testing.T) {
	var logs []string
	var mu sync.Mutex
	s := listenRPC(t, RPCConfig{Logf: func(f string, a ...any) { mu.Lock(); logs = append(logs, f); mu.Unlock() }})
	le := func(n uint64) []byte { return binary.LittleEndian.AppendUint64(nil, n) }
	for what, req := range map[string][]byte{
		"zero length":        le(0),
		"oversize length":    append(le(DefaultMaxFrame+1), 1),
		"huge length":        le(1 << 62),
		"type byte 0x80":     append(le(3), 0x80, '{', '}'),
		"not JSON":           append(le(4), 1, 'n', 'u', 'l'),
		"notify not object":  AppendFrame(nil, FrameNotify, []byte("[]")),
		"notify wrong types": AppendFrame(nil, FrameNotify, []byte(`{"name":1}`)),
		"handshake too many": AppendFrame(nil, FrameConnection, []byte(`{"qp_num":[`+strings.Repeat("1,", MaxQPs)+`1]}`)),
		"short body":         append(le(100), 3, '{'),
	} {
		if ans := rawExchange(t, s.Addr().String(), req); len(ans) != 0 {
			t.Errorf("%s: answered %q", what, ans)
		}
	}
	if st := s.Stats(); st.Bad != 9 || st.Served != [4]uint64{} {
		t.Errorf("stats %+v", st)
	}
	mu.Lock()
	if len(logs) == 0 || len(logs) > 2 {
		t.Errorf("%d log lines for 9 bad requests, want 1 (rate-limited)", len(logs))
	}
	mu.Unlock()
}

// TestRPCDeadline: a peer that sends part of a frame and stalls, or never
// closes after the answer, is cut off at the exchange's deadline.
func TestRPCDeadline(t *testing.T) {
	s := listenRPC(t, RPCConfig{Timeout: 200 * time.Millisecond})
	c, err := net.Dial("tcp", s.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write([]byte{4, 0, 0})
	c.SetDeadline(time.Now().Add(5 * time.Second))
	start := time.Now()
	if n, err := c.Read(make([]byte, 1)); n != 0 || err == nil {
		t.Fatalf("read %d, %v", n, err)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Fatalf("cut off after %v", d)
	}
	waitStat(t, func() bool { return s.Stats().Timeouts == 1 && s.Stats().Conns == 0 })

	// A peer that takes its answer but keeps the connection open.
	c2, err := net.Dial("tcp", s.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	WriteFrame(c2, FrameProbe, []byte("{}\n"))
	c2.SetDeadline(time.Now().Add(5 * time.Second))
	if f, err := ReadFrame(c2, 0); err != nil || f.Type != FrameProbe {
		t.Fatalf("probe answer %v, %v", f, err)
	}
	if _, err := c2.Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("after the answer: %v, want EOF (the server's write side shut)", err)
	}
	waitStat(t, func() bool { return s.Stats().Conns == 0 })
}

func waitStat(t *testing.T, ok func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !ok(); {
		if time.Now().After(deadline) {
			t.Fatal("condition not reached in 10s")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestRPCConnectionCap: connections past MaxConns, or past
// MaxConnsPerHost from one address, are closed at once; the ones within
// are served.
func TestRPCConnectionCap(t *testing.T) {
	for _, tc := range []struct {
		name             string
		max, perHost, ok int
	}{{"total", 2, 16, 2}, {"per host", 16, 3, 3}} {
		t.Run(tc.name, func(t *testing.T) {
			// The held connections idle through the whole test: a server
			// timeout shorter than a loaded machine's run of it would
			// close them under the test (a flake seen under load).
			s := listenRPC(t, RPCConfig{MaxConns: tc.max, MaxConnsPerHost: tc.perHost, Timeout: time.Minute})
			var held []net.Conn
			defer func() {
				for _, c := range held {
					c.Close()
				}
			}()
			for range tc.ok {
				c, err := net.Dial("tcp", s.Addr().String())
				if err != nil {
					t.Fatal(err)
				}
				held = append(held, c)
			}
			waitStat(t, func() bool { return s.Stats().Conns == tc.ok })
			if ans := rawExchange(t, s.Addr().String(), AppendFrame(nil, FrameProbe, []byte("{}"))); len(ans) != 0 {
				t.Fatalf("a connection past the cap answered %q", ans)
			}
			if st := s.Stats(); st.Refused != 1 {
				t.Fatalf("stats %+v", st)
			}
			// The held connections are still served.
			WriteFrame(held[0], FrameProbe, []byte("{}"))
			held[0].SetDeadline(time.Now().Add(5 * time.Second))
			if f, err := ReadFrame(held[0], 0); err != nil || f.Type != FrameProbe {
				t.Fatalf("held connection: %v, %v", f, err)
			}
			held[0].Close()
			held = held[1:]
			waitStat(t, func() bool { return s.Stats().Conns == tc.ok-1 })
			if ans := rawExchange(t, s.Addr().String(), AppendFrame(nil, FrameProbe, []byte("{}"))); len(ans) == 0 {
				t.Fatal("no answer once below the cap")
			}
		})
	}
}

// TestRPCClose: Close ends connections in progress, closes the listener
// and leaves no descriptor behind.
func TestRPCClose(t *testing.T) {
	before := len(leakcheck.FDs())
	s, err := ListenRPC(RPCConfig{})
	if err != nil {
		t.Fatal(err)
	}
	c, err := net.Dial("tcp", s.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write([]byte{9})
	waitStat(t, func() bool { return s.Stats().Conns == 1 })
	done := make(chan error)
	go func() { done <- s.Close() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close hangs on an open connection")
	}
	if err := s.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, err := net.DialTimeout("tcp", s.Addr().String(), time.Second); err == nil {
		t.Fatal("still listening")
	}
	c.Close()
	if fds := leakcheck.FDs(); fds != nil {
		waitStat(t, func() bool { return len(leakcheck.FDs()) <= before })
	}
}

// TestRPCAdvertise: the name is the listener's address, its unspecified
// host replaced by an interface's.
func TestRPCAdvertise(t *testing.T) {
	s := listenRPC(t, RPCConfig{Listen: "0.0.0.0:0"})
	host, port, ok := SplitServerName(s.Name())
	if !ok || port != uint16(s.Addr().(*net.TCPAddr).Port) || host == "0.0.0.0" || host == "" {
		t.Fatalf("name %q", s.Name())
	}
	s2 := listenRPC(t, RPCConfig{Advertise: "node7:0"})
	if _, p, _ := SplitServerName(s2.Name()); !strings.HasPrefix(s2.Name(), "node7:") || p == 0 {
		t.Fatalf("name %q", s2.Name())
	}
	if _, err := ListenRPC(RPCConfig{Advertise: "no-port"}); err == nil {
		t.Fatal("bad Advertise accepted")
	}
}
