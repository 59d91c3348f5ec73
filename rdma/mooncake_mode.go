// mooncake_mode.go holds the configuration of the transport's Mooncake
// mode (Config.Mooncake), in every build; the mode itself is in
// mooncake_target.go and mooncake_initiator.go (build tag rdma).

package rdma

import (
	"errors"

	"github.com/moonring/moonring/mooncake"
)

// MooncakeName is the transport's name in Mooncake mode, and the name of
// its endpoint and keys in a segment descriptor (mooncake.TransportRDMA).
const MooncakeName = mooncake.TransportRDMA

// Errors of Mooncake mode.
var (
	// ErrNotMooncake reports a Mooncake handshake given to a transport
	// that is not in Mooncake mode.
	ErrNotMooncake = errors.New("rdma: not in Mooncake mode")
	// ErrMooncakeConfig reports a MooncakeMode that New cannot use: an
	// RPC address that is not host:port, or an empty server name or one
	// holding '@' (the NIC path's separator).
	ErrMooncakeConfig = errors.New("rdma: bad Mooncake mode configuration")
)

// MooncakeMode configures the transport's Mooncake mode: Mooncake's RDMA
// handshake (a Connection frame on the engine's Mooncake RPC port, per
// pair of NICs, QPsPerDevice queue pairs each; mooncake/FORMATS.md, "The
// RDMA handshake") instead of moonring's control channel, and Mooncake's
// descriptor members (the NICs as "name/lid/gid", decimal rkeys in device
// order). The RPC port is the engine's: its Handshake function must be set
// to the transport's MooncakeHandshake. A MooncakeMode is read by New and
// not kept.
//
// Mooncake's wire has no authentication: whoever reaches the RPC port may
// connect queue pairs, and with the rkeys the descriptor publishes read and
// write every buffer registered remote-accessible with this transport (no
// other: a local-only buffer's region grants no remote access).
type MooncakeMode struct {
	// Server is the server part of this engine's NIC paths
	// ("server@device"): its segment name (P2PHANDSHAKE: the RPC port's
	// "ip:port"). Mooncake peers send their handshake to the RPC port
	// this name resolves to.
	Server string
	// RPC is the "host:port" of the engine's RPC port, the transport's
	// endpoint (Endpoints["mooncake-rdma"]).
	RPC string
	// Client sends this engine's handshakes to peers' RPC ports (nil: the
	// zero mooncake.RPCClient, 10 s per exchange).
	Client *mooncake.RPCClient
}
