package moonring_test

// End-to-end tests across a network namespace: the target child runs
// inside a namespace of its own, joined to this one by a veth pair, and the
// tests break the link between them: loss and delay, link down and up, the
// target killed. They need root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and ip
// from iproute2; where namespaces cannot be made they skip, loudly, unless
// MOONRING_CI=1, where they fail. scripts/ensure-deps.sh installs what is
// missing; the tests run it themselves when a tool is missing.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/shm"
	"github.com/moonring/moonring/tcp"
)

// netns is a network namespace and the veth pair that joins it to this
// process's namespace: hostIf with hostIP here, nsIf with nsIP there, one
// /24 between them.
type netns struct {
	name         string
	hostIf, nsIf string
	hostIP, nsIP string
}

// netnsUnavailable skips the test, loudly, because namespaces cannot be
// used here; with MOONRING_CI=1 it fails it instead: CI must run them.
func netnsUnavailable(t *testing.T, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	if os.Getenv("MOONRING_CI") == "1" {
		t.Fatalf("netns: %s (MOONRING_CI=1: the network-namespace tests must run)", msg)
	}
	fmt.Fprintf(os.Stderr, "\n*** %s: SKIP netns: %s ***\n\n", t.Name(), msg)
	t.Skipf("SKIP netns: %s", msg)
}

// netnsEnsureTool returns whether the command name is there, running
// scripts/ensure-deps.sh once when it is not.
func netnsEnsureTool(t *testing.T, name string) bool {
	t.Helper()
	if _, err := exec.LookPath(name); err == nil {
		return true
	}
	out, err := exec.Command("scripts/ensure-deps.sh").CombinedOutput()
	t.Logf("%s missing: scripts/ensure-deps.sh: %v\n%s", name, err, out)
	_, err = exec.LookPath(name)
	return err == nil
}

// netnsCmd runs a command and returns its error with its output.
func netnsCmd(args ...string) error {
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// netnsSetup makes a namespace mr-<random> and a veth pair into it, and
// removes both when the test ends, whatever happened. It skips the test
// (see netnsUnavailable) where that cannot be done.
func netnsSetup(t *testing.T) *netns {
	t.Helper()
	if os.Geteuid() != 0 {
		netnsUnavailable(t, "not root (uid %d): making namespaces and veth pairs needs CAP_SYS_ADMIN and CAP_NET_ADMIN", os.Geteuid())
	}
	if !netnsEnsureTool(t, "ip") {
		netnsUnavailable(t, "no ip command (iproute2), and scripts/ensure-deps.sh could not install it")
	}
	id := fmt.Sprintf("%06x", rand.Uint32()&0xffffff)
	n := &netns{name: "mr-" + id, hostIf: "mr" + id + "h", nsIf: "mr" + id + "n"}
	// A /24 in 10.200.0.0/13 that no interface here uses yet.
	used := map[string]bool{}
	if addrs, err := net.InterfaceAddrs(); err == nil {
		for _, a := range addrs {
			if ipn, ok := a.(*net.IPNet); ok && ipn.IP.To4() != nil {
				used[ipn.IP.Mask(net.CIDRMask(24, 32)).String()] = true
			}
		}
	}
	for {
		net24 := fmt.Sprintf("10.%d.%d.", 200+rand.IntN(8), rand.IntN(256))
		if !used[net24+"0"] {
			n.hostIP, n.nsIP = net24+"1", net24+"2"
			break
		}
	}
	if err := netnsCmd("ip", "netns", "add", n.name); err != nil {
		netnsUnavailable(t, "the kernel refuses a network namespace: %v", err)
	}
	t.Cleanup(func() {
		// Deleting one end of the pair deletes both at once; the
		// namespace's own removal would do it too, but asynchronously.
		netnsCmd("ip", "link", "del", n.hostIf)
		if err := netnsCmd("ip", "netns", "del", n.name); err != nil {
			t.Errorf("remove namespace: %v", err)
		}
	})
	if err := netnsCmd("ip", "link", "add", n.hostIf, "type", "veth", "peer", "name", n.nsIf); err != nil {
		netnsUnavailable(t, "the kernel refuses a veth pair: %v", err)
	}
	steps := [][]string{
		{"ip", "link", "set", n.nsIf, "netns", n.name},
		{"ip", "addr", "add", n.hostIP + "/24", "dev", n.hostIf},
		{"ip", "link", "set", n.hostIf, "up"},
		{"ip", "-n", n.name, "addr", "add", n.nsIP + "/24", "dev", n.nsIf},
		{"ip", "-n", n.name, "link", "set", n.nsIf, "up"},
		{"ip", "-n", n.name, "link", "set", "lo", "up"},
	}
	for _, s := range steps {
		if err := netnsCmd(s...); err != nil {
			t.Fatalf("netns setup: %v", err)
		}
	}
	t.Logf("namespace %s: %s %s here, %s %s there", n.name, n.hostIf, n.hostIP, n.nsIf, n.nsIP)
	return n
}

// startTarget starts a target child inside the namespace, serving size
// bytes on the namespace's address.
func (n *netns) startTarget(t *testing.T, size int) *child {
	t.Helper()
	return startChildVia(t, []string{"ip", "netns", "exec", n.name}, "target",
		"MOONRING_SIZE="+strconv.Itoa(size), "MOONRING_LISTEN="+net.JoinHostPort(n.nsIP, "0"))
}

// link sets the host side of the veth pair up or down.
func (n *netns) link(t *testing.T, state string) {
	t.Helper()
	if err := netnsCmd("ip", "link", "set", "dev", n.hostIf, state); err != nil {
		t.Fatal(err)
	}
}

// netnsRig starts a target of size bytes in a new namespace and an
// initiator on it; it checks that the segment is reached over the veth.
func netnsRig(t *testing.T, size int, cfg moonring.Config, localSize int, seed uint64) (*netns, *child, *e2eRig) {
	t.Helper()
	n := netnsSetup(t)
	c := n.startTarget(t, size)
	r := newRig(t, c, cfg, localSize, seed)
	d := c.targetDesc(t)
	if ep := d.Endpoints["tcp"]; !strings.HasPrefix(ep, n.nsIP+":") {
		t.Fatalf("the target's tcp endpoint is %q, want one on %s", ep, n.nsIP)
	}
	return n, c, r
}

// TestNetnsTransfer: random READs and WRITEs over the veth pair, data
// checked against the model, and the whole buffer read back.
func TestNetnsTransfer(t *testing.T) {
	e2eLeaks(t)
	const size = 4 << 20
	_, _, r := netnsRig(t, size, moonring.Config{}, 2*size, 11)
	r.rounds(1000, 0, size, 0, 2*size, 1<<20)
	r.readBack(0, size, 0)
}

// TestNetnsSHMFallsBack: a target with shm in another network namespace
// shares the host's boot id, but its abstract socket is out of reach: the
// initiator, which has shm too, finds that out and uses TCP.
func TestNetnsSHMFallsBack(t *testing.T) {
	e2eLeaks(t)
	const size = 1 << 20
	n := netnsSetup(t)
	c := startChildVia(t, []string{"ip", "netns", "exec", n.name}, "target",
		"MOONRING_SIZE="+strconv.Itoa(size), "MOONRING_LISTEN="+net.JoinHostPort(n.nsIP, "0"), "MOONRING_SHM=1")
	if _, ok := c.targetDesc(t).Endpoints["shm"]; !ok {
		t.Fatal("the target publishes no shm endpoint")
	}
	r := newRig(t, c, moonring.Config{SHM: &shm.Config{}}, 2*size, 12)
	if name, err := r.e.SegmentTransport(r.seg); err != nil || name != "tcp" {
		t.Fatalf("segment in another namespace opened over %q (%v), want tcp", name, err)
	}
	r.rounds(200, 0, size, 0, 2*size, 256<<10)
}

// netnsImpair makes the link lose 2% of packets each way and delay them:
// netem where the kernel has it; else nftables drops inside the namespace
// and a token bucket (200 Mbit/s, up to 10 ms of queue) on both ends as
// the delay. It returns what it did and a function that counts the
// packets dropped so far.
func netnsImpair(t *testing.T, n *netns) (string, func() int) {
	t.Helper()
	inNS := []string{"ip", "netns", "exec", n.name}
	if !netnsEnsureTool(t, "tc") {
		netnsUnavailable(t, "no tc command (iproute2), and scripts/ensure-deps.sh could not install it")
	}
	dropped := func(re *regexp.Regexp, cmds ...[]string) int {
		sum := 0
		for _, c := range cmds {
			out, err := exec.Command(c[0], c[1:]...).CombinedOutput()
			if err != nil {
				t.Errorf("%s: %v: %s", strings.Join(c, " "), err, out)
			}
			for _, m := range re.FindAllStringSubmatch(string(out), -1) {
				k, _ := strconv.Atoi(m[1])
				sum += k
			}
		}
		return sum
	}
	netem := []string{"netem", "delay", "5ms", "loss", "2%"}
	err := netnsCmd(append([]string{"tc", "qdisc", "add", "dev", n.hostIf, "root"}, netem...)...)
	if err == nil {
		if err := netnsCmd(append(append(inNS, "tc", "qdisc", "add", "dev", n.nsIf, "root"), netem...)...); err != nil {
			t.Fatal(err)
		}
		re := regexp.MustCompile(`dropped (\d+)`)
		return "netem delay 5ms loss 2% on both ends", func() int {
			return dropped(re, []string{"tc", "-s", "qdisc", "show", "dev", n.hostIf}, append(inNS, "tc", "-s", "qdisc", "show", "dev", n.nsIf))
		}
	}
	// Debian's cloud kernels, among others, are built without sch_netem.
	t.Logf("no netem here (%v): loss through nftables, delay through a token bucket instead", err)
	if !netnsEnsureTool(t, "nft") {
		netnsUnavailable(t, "the kernel has no netem and there is no nft (nftables) to drop packets with")
	}
	rules := `table inet mrloss {
	chain in { type filter hook input priority 0; policy accept; numgen random mod 100 < 2 counter drop; }
	chain out { type filter hook output priority 0; policy accept; numgen random mod 100 < 2 counter drop; }
}
`
	cmd := exec.Command(inNS[0], append(inNS[1:], "nft", "-f", "-")...)
	cmd.Stdin = strings.NewReader(rules)
	if out, err := cmd.CombinedOutput(); err != nil {
		netnsUnavailable(t, "the kernel has no netem, and nftables refuses the loss rules: %v: %s", err, out)
	}
	tbf := []string{"tbf", "rate", "200mbit", "burst", "64kb", "latency", "10ms"}
	if err := netnsCmd(append([]string{"tc", "qdisc", "add", "dev", n.hostIf, "root"}, tbf...)...); err != nil {
		t.Fatal(err)
	}
	if err := netnsCmd(append(append(inNS, "tc", "qdisc", "add", "dev", n.nsIf, "root"), tbf...)...); err != nil {
		t.Fatal(err)
	}
	re := regexp.MustCompile(`counter packets (\d+)`)
	return "nftables loss 2% each way in the namespace, tbf 200mbit with up to 10ms of queue on both ends (no netem in this kernel)", func() int {
		return dropped(re, append(inNS, "nft", "list", "table", "inet", "mrloss"))
	}
}

// TestNetnsLossDelay: with packets lost and delayed on the link, transfers
// still complete (TCP retransmits) with their data checked, and the link
// did drop packets meanwhile.
func TestNetnsLossDelay(t *testing.T) {
	e2eLeaks(t)
	const size = 2 << 20
	n, _, r := netnsRig(t, size, moonring.Config{}, 2*size, 12)
	what, dropped := netnsImpair(t, n)
	start := time.Now()
	r.rounds(300, 0, size, 0, 2*size, 256<<10)
	r.readBack(0, size, 0)
	d := dropped()
	t.Logf("%s: %d packets dropped, transfers done in %v", what, d, time.Since(start))
	if d == 0 {
		t.Errorf("%s: no packet was dropped: the link was not impaired", what)
	}
}

// netnsProbe submits 1 KiB READs of the target's second half, one at a
// time with the engine's deadline, until one completes, and checks its
// data. The requests that fail meanwhile are expected: the link has only
// just come back, TCP retransmits on its own schedule, and broken rails
// are redialed with backoff (up to a second apart).
func (r *e2eRig) netnsProbe(size int) int {
	t := r.t
	t.Helper()
	deadline := time.Now().Add(e2eHang)
	lo := len(r.local) - e2eProbeTail
	for attempt := 0; ; attempt++ {
		q := e2eReq{op: moonring.Read, off: size / 2, loc: lo + attempt*1024, n: 1024, batch: attempt%2 == 1}
		if q.loc+q.n > len(r.local)-e2eSlotsTail {
			t.Fatalf("hang: the segment is still unusable after %d requests since the link came back", attempt)
		}
		res := r.run([]e2eReq{q}, r.e.Config().Timeout+e2eHang, nil)
		if res[0].st == moonring.COMPLETED {
			r.compare("probe after the link came back", r.local[q.loc:q.loc+q.n], q.off)
			return attempt + 1
		}
		if time.Now().After(deadline) {
			t.Fatalf("hang: the segment is still unusable %v after the link came back: %v (%v)", e2eHang, res[0].st, res[0].code.Err())
		}
		time.Sleep(50 * time.Millisecond) // a pace, not a bound: 1024 probes outlast the hang limit
	}
}

// netnsSlots runs, on a ring of n slots, 2n READs of 4 KiB of the
// target's second half while the link is down. Requests that time out
// keep their slots while their slices are out on a connection that cannot
// deliver them; the second n wait for slots. All must end FAILED or
// TIMEOUT: at the latest once the rails give up on the silent peer
// (tcp.Config.PeerTimeout), not when the kernel does, 15 minutes on.
func (r *e2eRig) netnsSlots(n int) {
	t := r.t
	t.Helper()
	ring, err := r.e.NewRing(moonring.RingConfig{Entries: n})
	if err != nil {
		t.Fatal(err)
	}
	defer ring.Close()
	lo := len(r.local) - e2eSlotsTail
	es := make([]moonring.Entry, 2*n)
	for i := range es {
		es[i] = moonring.Entry{Op: moonring.OpRead, Segment: r.seg, Buffer: r.localID, Local: uint64(lo + i*4096),
			Remote: r.remote + uint64(len(r.model)/2+i*4096), Length: 4096, UserData: uint64(i)}
	}
	limit := r.e.Config().Timeout + tcp.DefaultPeerTimeout + e2eHang
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	seen := make([]int, len(es))
	counts := map[moonring.Status]int{}
	got := 0
	cqes := make([]moonring.Completion, 2*n)
	reap := func() {
		k := ring.PeekBatch(cqes)
		for _, c := range cqes[:k] {
			if c.UserData >= uint64(len(es)) {
				t.Errorf("completion for UserData %d: no such request", c.UserData)
				continue
			}
			seen[c.UserData]++
			got++
			counts[c.Status]++
			if c.Status != moonring.FAILED && c.Status != moonring.TIMEOUT {
				t.Errorf("request %d, submitted with the link down: %v (%v), want FAILED or TIMEOUT", c.UserData, c.Status, c.Err())
			}
		}
		ring.Advance(k)
	}
	start := time.Now()
	for rest := es; len(rest) > 0; {
		k, err := ring.Submit(rest)
		rest = rest[k:]
		if err == moonring.ErrSQFull {
			if err := ring.CQ().Wait(ctx, 1); err != nil {
				t.Fatalf("hang: %d requests of a full ring still wait for a slot after %v", len(rest), limit)
			}
			reap()
		} else if err != nil {
			t.Fatal(err)
		}
	}
	for got < len(es) {
		if err := ring.CQ().Wait(ctx, 1); err != nil {
			t.Fatalf("hang: %d of %d requests of a ring whose slots timed-out requests hold are not terminal after %v", len(es)-got, len(es), limit)
		}
		reap()
	}
	for i, k := range seen {
		if k != 1 {
			t.Errorf("request %d: %d completions", i, k)
		}
	}
	t.Logf("a ring of %d slots, %d requests with the link down: %d FAILED, %d TIMEOUT, all in %v", n, len(es), counts[moonring.FAILED], counts[moonring.TIMEOUT], time.Since(start))
}

// TestNetnsLinkDownUp: the link goes down with requests in flight; every
// request ends FAILED or TIMEOUT within its deadline, none started while
// it is down completes, and a ring whose slots timed-out requests hold
// does not hang either. Once the link is up again, new requests to the
// same SegmentID succeed, with no reopen and no new initiator: the rails
// that broke (tcp.Config.PeerTimeout) are redialed.
func TestNetnsLinkDownUp(t *testing.T) {
	e2eLeaks(t)
	const size = 8 << 20
	// After the outage a rail may sit in TCP's retransmission backoff for
	// seconds; a response timeout shorter than the requests' deadline makes
	// such a rail fail its slices (retried on another rail) and redial,
	// instead of timing out the requests that landed on it. (It also makes
	// rails fail during the outage, so the ring-full-of-stuck-slots case is
	// left to ring.TestBlockedHeadTimesOut.)
	n, _, r := netnsRig(t, size, moonring.Config{Timeout: e2eFaultTimeout,
		TCP: &tcp.Config{Key: childKey, ResponseTimeout: e2eFaultTimeout / 4}}, 40<<20, 13)
	down := false
	t.Cleanup(func() {
		if down { // the test failed midway: let the engine close on a live link
			n.link(t, "up")
		}
	})
	r.e2eFault(size, func() { n.link(t, "down"); down = true })
	r.netnsSlots(16)
	n.link(t, "up")
	down = false
	attempts := r.netnsProbe(size)
	t.Logf("the segment answered again after %d probe(s)", attempts)
	half := size / 2
	lo := len(r.local) - e2eRecoveryTail
	r.rounds(200, half, half, lo, e2eRecoveryTail, 1<<20)
	r.readBack(half, half, lo)
}

// TestNetnsTargetKilled: the target is killed inside its namespace with
// requests in flight: every request ends within its deadline, none started
// after the kill completes, and the segment closes.
func TestNetnsTargetKilled(t *testing.T) {
	e2eLeaks(t)
	const size = 8 << 20
	_, c, r := netnsRig(t, size, moonring.Config{Timeout: e2eFaultTimeout}, 40<<20, 14)
	r.e2eFault(size, c.KillWait)
	ctx, cancel := context.WithTimeout(context.Background(), e2eHang)
	defer cancel()
	if err := r.e.CloseSegment(ctx, r.seg); err != nil {
		t.Errorf("CloseSegment of the dead target: %v", err)
	}
}
