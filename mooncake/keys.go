package mooncake

import (
	"os"
	"strings"
)

// ClusterIDEnv is the environment variable through which Mooncake engines
// of one cluster share a key prefix in a shared metadata store.
const ClusterIDEnv = "MC_METADATA_CLUSTER_ID"

// Keys names the entries of one Mooncake cluster in a metadata store.
// The zero Keys is the default cluster.
type Keys struct {
	// ClusterID, when not empty, puts every key under
	// "mooncake/<ClusterID>/" instead of "mooncake/"; a missing trailing
	// slash is added, as Mooncake does.
	ClusterID string
}

// KeysFromEnv returns the Keys a Mooncake engine started with the present
// environment uses.
func KeysFromEnv() Keys { return Keys{ClusterID: os.Getenv(ClusterIDEnv)} }

// Prefix returns the prefix of every key: "mooncake/" or
// "mooncake/<cluster>/".
func (k Keys) Prefix() string {
	if k.ClusterID == "" {
		return "mooncake/"
	}
	if strings.HasSuffix(k.ClusterID, "/") {
		return "mooncake/" + k.ClusterID
	}
	return "mooncake/" + k.ClusterID + "/"
}

// Segment returns the key of a segment's descriptor. A plain name lives
// under "<prefix>ram/<name>"; a name that holds a slash is taken as a path
// already and lives at "<prefix><name>" (Mooncake's rule, so
// "ram/x" and "x" name the same key). An empty name gives "<prefix>ram/",
// which Mooncake warns about and this package never writes.
func (k Keys) Segment(name string) string {
	if strings.Contains(name, "/") {
		return k.Prefix() + name
	}
	return k.Prefix() + "ram/" + name
}

// RPCMeta returns the key of the engine's rpc_meta entry:
// "<prefix>rpc_meta/<name>", whatever the name holds.
func (k Keys) RPCMeta(name string) string { return k.Prefix() + "rpc_meta/" + name }
