package moonring

import (
	"errors"
	"fmt"
	"maps"
	"net"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/mooncake"
	"github.com/moonring/moonring/mooncake/mctcp"
	"github.com/moonring/moonring/rdma"
)

// The engine's Mooncake mode (Config.Mooncake): the RPC port, the
// P2PHANDSHAKE store when no other is given, and Mooncake's TCP data
// transport beside moonring's own.

// MooncakeConfig makes an engine speak the Mooncake Transfer Engine's wire
// beside its own, so that it joins a Mooncake cluster unchanged: Mooncake
// engines read and write its remote-accessible buffers over Mooncake's TCP
// data protocol, it reads and writes theirs, it reads and publishes
// descriptors in Mooncake's schema and keys, and notifications travel
// Mooncake's RPC port both ways.
//
// Mooncake's protocols carry no authentication: whoever reaches the RPC or
// data port may read and write every remote-accessible buffer, and whoever
// can write the metadata store may publish a descriptor. The mode is off
// unless set, New logs its addresses, and moonring's own transports keep
// their keys beside it: with Config.Key, descriptors without a signature
// (every Mooncake engine's) are taken only as far as Mooncake's transport
// goes (metadata.Signed.AllowUnsigned), so they can never point moonring's
// authenticated transports anywhere.
//
// The metadata store: with Config.Metadata nil, the engine runs Mooncake's
// P2PHANDSHAKE mode (mooncake.P2PStore): its segment is named by its RPC
// port's "ip:port", and peers are looked up by asking theirs. Otherwise
// give a store over Mooncake's keys (mooncake.NewHTTPStore for its HTTP
// metadata server, mooncake/mcetcd for etcd); the engine then runs an RPC
// port of its own, published in its rpc_meta entry.
type MooncakeConfig struct {
	// RPC configures the RPC port: its listener (default 127.0.0.1:0),
	// the address it advertises, and its bounds. The engine sets the
	// notification function (its Notifications channel) and, in
	// P2PHANDSHAKE mode, the descriptor.
	RPC mooncake.RPCConfig
	// TCP configures Mooncake's TCP data transport: its listener is the
	// tcp_data_port Mooncake initiators dial. Its host must be the RPC
	// port's: Mooncake takes both from one entry.
	TCP mctcp.Config
	// RDMA, when set, also installs Mooncake's RDMA transport
	// ("mooncake-rdma": package rdma in its Mooncake mode; its
	// Mooncake field is set by the engine): Mooncake initiators connect
	// queue pairs through the RPC port and READ and WRITE the buffers
	// registered remote-accessible with the rkeys the descriptor
	// publishes, and OpenSegment of a Mooncake rdma segment uses it. It
	// needs the rdma build (rdma.Available) and a device; without either
	// New fails. Nil: TCP only.
	RDMA *rdma.Config
}

// mooncakeState is what Mooncake mode runs besides the transport.
type mooncakeState struct {
	rpc   *mooncake.RPCServer
	p2p   *mooncake.P2PStore // the store New made (P2PHANDSHAKE), closed with the engine
	owned bool               // rpc is the engine's own, not the p2p store's
}

// mooncakeStore makes the P2PHANDSHAKE store when Mooncake mode has no
// store given; it runs before Config.fill, which names the engine after it.
func (c *Config) mooncakeStore() (*mooncake.P2PStore, error) {
	if c.Mooncake == nil || c.Metadata != nil {
		return nil, nil
	}
	st, err := mooncake.NewP2PStore(mooncake.P2PConfig{RPC: c.Mooncake.RPC})
	if err != nil {
		return nil, fmt.Errorf("moonring: mooncake: %w", err)
	}
	c.Metadata = st
	return st, nil
}

// startMooncake installs Mooncake's TCP transport and runs the RPC port
// (the P2P store's, or one of the engine's own). p2p is the store
// mooncakeStore made, or nil.
func (e *Engine) startMooncake(p2p *mooncake.P2PStore) error {
	mc := e.cfg.Mooncake
	e.mu.Lock()
	st := e.mooncake
	e.mu.Unlock()
	if p2p == nil {
		rc := mc.RPC
		rc.Descriptor = nil // answered null, as Mooncake's own engines do outside P2PHANDSHAKE
		srv, err := mooncake.ListenRPC(rc)
		if err != nil {
			return fmt.Errorf("moonring: mooncake rpc port: %w", err)
		}
		e.mu.Lock()
		st.rpc, st.owned = srv, true
		e.mu.Unlock()
	} else {
		e.mu.Lock()
		st.rpc = p2p.Server()
		e.mu.Unlock()
	}
	st.rpc.SetNotify(e.deliver)
	tc := mc.TCP
	if tc.Logger == nil {
		tc.Logger = e.cfg.Logger
	}
	if tc.Listen == "" {
		// The data port on the RPC port's host: Mooncake takes both
		// from one entry.
		host, _, err := net.SplitHostPort(st.rpc.Name())
		if err != nil {
			return fmt.Errorf("moonring: mooncake rpc port %q: %w", st.rpc.Name(), err)
		}
		tc.Listen = net.JoinHostPort(host, "0")
	}
	t, err := mctcp.New(tc)
	if err == nil {
		rpcHost, _, _ := net.SplitHostPort(st.rpc.Name())
		tcpHost, _, _ := net.SplitHostPort(t.Endpoint())
		if rpcHost != tcpHost {
			t.Close()
			return fmt.Errorf("moonring: mooncake: the data port %s and the rpc port %s are on different hosts; Mooncake peers take both from one entry (set MooncakeConfig.TCP.Advertise or RPC.Advertise)", t.Endpoint(), st.rpc.Name())
		}
	}
	if err := e.install(mctcp.Name, t, err, false); err != nil {
		return err
	}
	if err := e.startMooncakeRDMA(st.rpc); err != nil {
		return err
	}
	e.cfg.Logger.Warn("moonring: Mooncake mode: its RPC and TCP data ports carry no authentication; any party that reaches them may read and write this engine's remote-accessible buffers",
		"segment", e.cfg.Name, "rpc", st.rpc.Name(), "tcp", t.Endpoint(), "metadata", e.cfg.Metadata.String())
	return nil
}

// startMooncakeRDMA installs Mooncake's RDMA transport when the
// configuration asks for it, its handshakes answered on the RPC port.
func (e *Engine) startMooncakeRDMA(rpc *mooncake.RPCServer) error {
	if e.cfg.Mooncake.RDMA == nil {
		return nil
	}
	rc := *e.cfg.Mooncake.RDMA
	rc.Mooncake = &rdma.MooncakeMode{Server: e.cfg.Name, RPC: rpc.Name()}
	t, err := rdma.New(rc)
	if err == nil {
		rpc.SetHandshake(t.MooncakeHandshake) // before install publishes the NICs
	}
	if err := e.install(rdma.MooncakeName, t, err, false); err != nil {
		rpc.SetHandshake(nil)
		return err
	}
	e.cfg.Logger.Warn("moonring: Mooncake mode: Mooncake's RDMA handshake is answered on its RPC port without authentication; any party that reaches it may read and write this engine's remote-accessible buffers over RDMA",
		"segment", e.cfg.Name, "rpc", rpc.Name(), "nics", t.ExtraEndpoints()[mooncake.EndpointRDMANICs])
	return nil
}

// mooncakeEndpoints adds what Mooncake mode publishes beyond the
// transports' endpoints: the RPC port, which a Mooncake store writes as
// the segment's rpc_meta entry, and what Mooncake's transport adds (the
// version of its TCP protocol). mu must be held.
func (e *Engine) mooncakeEndpoints(eps map[string]string) {
	if e.mooncake == nil || e.mooncake.rpc == nil {
		return
	}
	eps[mooncake.EndpointRPC] = e.mooncake.rpc.Name()
	for _, t := range e.transports {
		if x, ok := t.(mctcp.ExtraEndpointer); ok {
			maps.Copy(eps, x.ExtraEndpoints())
		}
	}
}

// stopMooncake closes the RPC port and the P2P store New made, after the
// segment was withdrawn. mu must be held; nothing it waits for takes it
// (the RPC port's goroutines deliver to the Notifications channel
// without blocking).
func (e *Engine) stopMooncake() error {
	st := e.mooncake
	if st == nil {
		return nil
	}
	var err error
	if st.owned && st.rpc != nil {
		err = st.rpc.Close()
	}
	if st.p2p != nil {
		err = errors.Join(err, st.p2p.Close())
	}
	e.mooncake.rpc, e.mooncake.p2p, e.mooncake.owned = nil, nil, false
	return err
}

// closeStore closes the P2P store of a New that failed before the engine
// took it.
func closeStore(p *mooncake.P2PStore) {
	if p != nil {
		p.Close()
	}
}

// mooncakeSigned lets a Mooncake engine's unsigned descriptor through the
// signed store, cut down to Mooncake's transports.
func mooncakeSigned(s *metadata.Signed) {
	s.AllowUnsigned(mctcp.Name, mooncake.EndpointRPC, mooncake.TransportRDMA)
}

// MooncakeRPC returns the address of the engine's Mooncake RPC port (with
// P2PHANDSHAKE metadata, also its segment's name), or "" outside Mooncake
// mode or after Close. Safe for concurrent use.
func (e *Engine) MooncakeRPC() string {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.mooncake == nil || e.mooncake.rpc == nil {
		return ""
	}
	return e.mooncake.rpc.Name()
}

func orDefault(s, def string) string {
	if s == "" {
		return def
	}
	return s
}
