// loopback.go holds the send buffer of a connection whose two ends are on
// one host (Config.LoopbackSendBuffer).
//
// Between two processes of one host, a payload a writev copies into the
// socket is copied out again by the peer's read, and on loopback nothing
// limits what waits between the two copies but the send buffer, which
// the kernel's autotuning grows to net.ipv4.tcp_wmem's maximum (4 MiB by
// default) within a second of a bulk stream. With megabytes queued, the
// socket's pages have left the cache by the time the peer reads them, and
// the pages the writev fills next were cold too. A send buffer of 512 KiB
// (1 MiB as the kernel counts it) keeps both copies in cache, and bounds
// nothing that matters: the bytes in flight on loopback need cover only
// the peer's scheduling delay. `moonring bench --cpu --block-size 1M`,
// both processes' CPU per GB, medians of 6 interleaved rounds on a
// 2-vCPU VM: READ 0.289 s/GB autotuned, 0.207 at 512 KiB (1.18 and 0.84
// times iperf3's in the same rounds), WRITE 0.297 and 0.251 (1.16 and
// 0.97 times); READ 3.1 GB/s and 5.1, WRITE 3.0 and 4.5. Across a
// network the autotuning stays: a fixed buffer would bound the bytes in
// flight below the path's bandwidth-delay product.

package tcp

import "net"

// DefaultLoopbackSendBuffer is Config.LoopbackSendBuffer's default.
const DefaultLoopbackSendBuffer = 512 << 10

// sameHost reports whether the peer of a connection between local and
// remote is on this host: at a loopback address, or at the connection's
// own local address (the kernel routes both through the loopback
// device).
func sameHost(local, remote net.Addr) bool {
	l, lok := local.(*net.TCPAddr)
	r, rok := remote.(*net.TCPAddr)
	return lok && rok && (r.IP.IsLoopback() || r.IP.Equal(l.IP))
}

// setLoopbackSendBuffer sets c's send buffer (SO_SNDBUF) to n bytes when
// its peer is on this host and n > 0; elsewhere the kernel's autotuning
// stays. A failure leaves the autotuned buffer, which only costs CPU.
func setLoopbackSendBuffer(c *net.TCPConn, n int) {
	if n > 0 && sameHost(c.LocalAddr(), c.RemoteAddr()) {
		c.SetWriteBuffer(n)
	}
}
