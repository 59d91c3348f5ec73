package netaddr

import (
	"net"
	"testing"
)

// Source counts IPv4 peers by address and IPv6 ones by /64; anything but
// TCP counts under the zero Addr.
func TestSource(t *testing.T) {
	for _, c := range []struct {
		addr net.Addr
		want string
	}{
		{&net.TCPAddr{IP: net.ParseIP("10.0.0.7"), Port: 1}, "10.0.0.7"},
		{&net.TCPAddr{IP: net.ParseIP("::ffff:10.0.0.7"), Port: 1}, "10.0.0.7"},
		{&net.TCPAddr{IP: net.ParseIP("2001:db8:1:2:aaaa::1"), Port: 1}, "2001:db8:1:2::"},
		{&net.UnixAddr{Name: "x", Net: "unix"}, "invalid IP"},
	} {
		if got := Source(c.addr).String(); got != c.want {
			t.Errorf("Source(%v) = %s, want %s", c.addr, got, c.want)
		}
	}
}

// Advertise takes what the advertised address gives and fills the rest
// from the listener; a malformed one is an error.
func TestAdvertise(t *testing.T) {
	ln := &net.TCPAddr{IP: net.ParseIP("127.0.0.1"), Port: 4000}
	for adv, want := range map[string]string{"": "127.0.0.1:4000", "10.1.1.1:0": "10.1.1.1:4000", ":5000": "127.0.0.1:5000", "h:6000": "h:6000"} {
		if got, err := Advertise(adv, ln); err != nil || got != want {
			t.Errorf("Advertise(%q) = %q, %v; want %q", adv, got, err, want)
		}
	}
	if _, err := Advertise("no-port", ln); err == nil {
		t.Error("Advertise of an address without a port: no error")
	}
}
