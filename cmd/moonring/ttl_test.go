package main

import (
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/moonring/moonring/internal/childproc"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/metadata/etcd"
	"github.com/moonring/moonring/metadata/etcdtest"
)

// serve --ttl is the lease of its segment in etcd; after a kill -9 the
// same name comes back once that lease expires, each earlier try refused
// because the dead one's epoch still holds the name.
func TestServeTTL(t *testing.T) {
	t.Setenv(keyEnv, "a key of the deployment") // the child's too
	srv := etcdtest.Start(t)
	spec := "etcd://" + strings.TrimPrefix(srv.Endpoint(), "http://")
	args := []string{"serve", "--listen", "127.0.0.1:0", "--buffer-size", "1M", "--metadata", spec, "--name", "ttl-a", "--ttl", "2s"}
	p := childproc.Start(t, childproc.Config{Args: args, Name: "serve"})
	if !strings.HasPrefix(p.Line, "serving segment ttl-a") {
		t.Fatalf("serve printed %q", p.Line)
	}
	raw, err := clientv3.New(clientv3.Config{Endpoints: []string{srv.Endpoint()}, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	ctx := t.Context()
	resp, err := raw.Get(ctx, etcd.DefaultPrefix+"ttl-a")
	if err != nil || len(resp.Kvs) != 1 || resp.Kvs[0].Lease == 0 {
		t.Fatalf("etcd holds %+v (%v); want the segment under a lease", resp, err)
	}
	lease, err := raw.TimeToLive(ctx, clientv3.LeaseID(resp.Kvs[0].Lease))
	if err != nil || lease.GrantedTTL != 2 {
		t.Fatalf("the segment's lease: %+v, %v; want a TTL of 2 s (--ttl 2s)", lease, err)
	}

	p.KillWait()
	killed := time.Now()
	for tries := 1; ; tries++ {
		lines, stop, err := tryServe(args[1:])
		if err == nil {
			t.Logf("the name served again %v after the kill, at try %d", time.Since(killed).Round(10*time.Millisecond), tries)
			if !strings.HasPrefix(lines[0], "serving segment ttl-a") {
				t.Errorf("serve printed %q", lines[0])
			}
			if err := stop(); err != nil {
				t.Errorf("serve: %v", err)
			}
			break
		}
		if !errors.Is(err, metadata.ErrExists) {
			t.Fatalf("serve under the killed one's name: %v; want the name held by its epoch until its lease expires", err)
		}
		if time.Since(killed) > 30*time.Second {
			t.Fatalf("the name still held %v after the kill, with --ttl 2s: %v", time.Since(killed), err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// tryServe runs serve in this process until its first line, or until it
// fails: its lines, the function that stops it, or serve's error.
func tryServe(args []string) ([]string, func() error, error) {
	stop := make(chan struct{})
	pr, pw := io.Pipe()
	done := make(chan error, 1)
	go func() {
		err := serve(args, pw, stop)
		pw.CloseWithError(io.EOF)
		done <- err
	}()
	buf := make([]byte, 4096)
	n, _ := pr.Read(buf)
	if n == 0 {
		return nil, nil, <-done
	}
	go io.Copy(io.Discard, pr)
	return strings.Split(strings.TrimSpace(string(buf[:n])), "\n"), func() error { close(stop); return <-done }, nil
}

// --ttl is refused where it means nothing, or below a second.
func TestTTLRefused(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"serve", "--metadata", "etcd://127.0.0.1:1", "--ttl", "500ms"}, "--ttl 500ms: want at least 1s"},
		{[]string{"serve", "--metadata", "http://127.0.0.1:1", "--ttl", "0s"}, "--ttl 0s: want at least 1s"},
		{[]string{"serve", "--ttl", "5s"}, "--ttl goes with --metadata http://... or etcd://..."},
		{[]string{"serve", "--mooncake", "--ttl", "5s"}, "not --mooncake"},
		{[]string{"bench", "--ttl", "5s"}, "--ttl goes with --metadata http://... or etcd://..."},
		{[]string{"bench", "--metadata", "etcd://127.0.0.1:1", "--ttl", "-1s"}, "--ttl -1s: want at least 1s"},
		{[]string{"bench", "--mode", "target", "--metadata", "etcd://127.0.0.1:1", "--ttl", "10ms"}, "--ttl 10ms: want at least 1s"},
	} {
		err := run(c.args, io.Discard)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("moonring %q: %v; want an error with %q", c.args, err, c.want)
		}
	}
}
