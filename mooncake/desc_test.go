package mooncake

import (
	"encoding/json"
	"errors"
	"flag"
	"os"
	"reflect"
	"strings"
	"testing"

	"github.com/moonring/moonring/segtable"
)

var update = flag.Bool("update", false, "rewrite the golden files this package's encoders produce")

func readGolden(t testing.TB, name string) []byte {
	t.Helper()
	b, err := os.ReadFile("testdata/" + name)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// sameJSON reports whether two documents hold the same JSON values,
// whatever the member order and spacing.
func sameJSON(t testing.TB, a, b []byte) bool {
	t.Helper()
	var x, y any
	if err := json.Unmarshal(a, &x); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &y); err != nil {
		t.Fatal(err)
	}
	return reflect.DeepEqual(x, y)
}

// TestGoldenDescriptors decodes the golden documents (written from the
// format), checks what they hold, and encodes them back: the same JSON
// values where the document has every member Mooncake writes, the same
// descriptor after decoding again everywhere.
func TestGoldenDescriptors(t *testing.T) {
	for _, tc := range []struct {
		file  string
		exact bool // the golden document has every member Mooncake writes
		check func(t *testing.T, d *SegmentDesc)
	}{
		{"tcp.json", true, func(t *testing.T, d *SegmentDesc) {
			if d.Name != "10.1.0.7:15001" || d.Protocol != "tcp" || d.TCPDataPort != 16734 || d.TCPProtoVersion != 2 ||
				len(d.Buffers) != 2 || d.Buffers[0].Length != 1<<30 || d.Buffers[1].Addr != 140397692583936 {
				t.Errorf("%+v", d)
			}
		}},
		{"tcp-v1.json", false, func(t *testing.T, d *SegmentDesc) {
			if d.TCPProtoVersion != 1 || d.TCPDataPort != 12001 {
				t.Errorf("a descriptor without tcp_proto_version: %+v", d)
			}
		}},
		{"rdma.json", true, func(t *testing.T, d *SegmentDesc) {
			if d.Protocol != "rdma" || len(d.Devices) != 2 || d.Devices[1].LID != 7 || d.RDMAServerName != "192.168.100.8:15002" ||
				!reflect.DeepEqual(d.PriorityMatrix["cpu:0"], TopologyEntry{[]string{"mlx5_0"}, []string{"mlx5_1"}}) ||
				len(d.Buffers) != 3 || d.Buffers[1].RKey[0] != 4294967295 || len(d.Buffers[2].RKey) != 0 || len(d.Buffers[2].LKey) != 2 {
				t.Errorf("%+v", d)
			}
		}},
		{"multi.json", true, func(t *testing.T, d *SegmentDesc) {
			if d.Protocol != "tcp,rdma" || !d.Has("rdma") || len(d.Buffers) != 3 || d.Buffers[2].Protocol != "cxl" || d.Buffers[2].Offset != 4096 {
				t.Errorf("%+v", d)
			}
		}},
		{"nvlink.json", true, func(t *testing.T, d *SegmentDesc) {
			if d.Buffers[0].ShmName == "" {
				t.Errorf("%+v", d)
			}
		}},
	} {
		t.Run(tc.file, func(t *testing.T) {
			golden := readGolden(t, tc.file)
			d, err := Decode(golden)
			if err != nil {
				t.Fatal(err)
			}
			tc.check(t, d)
			enc, err := d.Encode()
			if err != nil {
				t.Fatal(err)
			}
			if tc.exact && !sameJSON(t, enc, golden) {
				t.Errorf("encoded\n%s\nwant the values of\n%s", enc, golden)
			}
			d2, err := Decode(enc)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(d, d2) {
				t.Errorf("decode(encode(d)) = %+v\nwant %+v", d2, d)
			}
		})
	}
}

func TestRPCMetaGolden(t *testing.T) {
	golden := readGolden(t, "rpc_meta.json")
	r, err := DecodeRPCMeta(golden)
	if err != nil || *r != (RPCMeta{"10.1.0.7", 15001}) {
		t.Fatalf("%+v, %v", r, err)
	}
	enc, _ := r.Encode()
	if !sameJSON(t, enc, golden) {
		t.Fatalf("encoded %s", enc)
	}
	for _, bad := range []string{`{}`, `{"ip_or_host_name":"h"}`, `{"ip_or_host_name":"","rpc_port":1}`,
		`{"ip_or_host_name":"h","rpc_port":65536}`, `{"ip_or_host_name":"h","rpc_port":-1}`, `{"ip_or_host_name":1,"rpc_port":1}`, `null`} {
		if _, err := DecodeRPCMeta([]byte(bad)); !errors.Is(err, ErrBadDoc) {
			t.Errorf("%s: %v", bad, err)
		}
	}
}

// TestDecodeRefuses: what Mooncake's decoder calls corrupted, and what
// breaks our bounds.
func TestDecodeRefuses(t *testing.T) {
	rdma := func(devs, bufs string) string {
		return `{"name":"n","protocol":"rdma","devices":` + devs + `,"buffers":` + bufs + `}`
	}
	dev := `[{"name":"mlx5_0","lid":0,"gid":"00"}]`
	many := `[` + strings.Repeat(`{"name":"d","gid":"g"},`, MaxDevices) + `{"name":"d","gid":"g"}]`
	for what, doc := range map[string]string{
		"not JSON":           `{`,
		"not an object":      `[1]`,
		"null":               `null`,
		"no name":            `{"protocol":"tcp"}`,
		"empty name":         `{"name":"","protocol":"tcp"}`,
		"no protocol":        `{"name":"n"}`,
		"unknown protocol":   `{"name":"n","protocol":"carrier-pigeon"}`,
		"protocol number":    `{"name":"n","protocol":7}`,
		"bad protocol list":  `{"name":"n","protocol":["tcp","nvlink"]}`,
		"repeated protocols": `{"name":"n","protocol":["tcp","tcp"]}`,
		"list of one":        `{"name":"n","protocol":["tcp"]}`,
		"port":               `{"name":"n","protocol":"tcp","tcp_data_port":70000}`,
		"negative port":      `{"name":"n","protocol":"tcp","tcp_data_port":-1}`,
		"string addr":        `{"name":"n","protocol":"tcp","buffers":[{"name":"n","addr":"1","length":1}]}`,
		"zero addr":          `{"name":"n","protocol":"tcp","buffers":[{"name":"n","addr":0,"length":1}]}`,
		"zero length":        `{"name":"n","protocol":"tcp","buffers":[{"name":"n","addr":1,"length":0}]}`,
		"nameless buffer":    `{"name":"n","protocol":"tcp","buffers":[{"addr":1,"length":1}]}`,
		"wrapping range":     `{"name":"n","protocol":"tcp","buffers":[{"name":"n","addr":18446744073709551615,"length":2}]}`,
		"negative addr":      `{"name":"n","protocol":"tcp","buffers":[{"name":"n","addr":-4096,"length":1}]}`,
		"device without gid": rdma(`[{"name":"mlx5_0","lid":0}]`, `[]`),
		"lid over 16 bits":   rdma(`[{"name":"mlx5_0","lid":65536,"gid":"00"}]`, `[]`),
		"rkeys not lkeys":    rdma(dev, `[{"name":"cpu:0","addr":1,"length":1,"rkey":[1],"lkey":[]}]`),
		"rkeys not devices":  rdma(dev, `[{"name":"cpu:0","addr":1,"length":1,"rkey":[1,2],"lkey":[1,2]}]`),
		"64-bit rdma key":    rdma(dev, `[{"name":"cpu:0","addr":1,"length":1,"rkey":[4294967296],"lkey":[1]}]`),
		"too many devices":   rdma(many, `[]`),
		"matrix row":         `{"name":"n","protocol":"rdma","priority_matrix":{"cpu:0":[["a"]]}}`,
		"matrix type":        `{"name":"n","protocol":"rdma","priority_matrix":[1]}`,
		"nccl no device_id":  `{"name":"n","protocol":"nccl","buffers":[{"name":"n","addr":1,"length":1}]}`,
		"ub no tseg":         `{"name":"n","protocol":"ub","devices":[{"name":"u","eid":"e"}],"buffers":[{"name":"n","addr":1,"length":1}]}`,
		"long name":          `{"name":"` + strings.Repeat("x", MaxString+1) + `","protocol":"tcp"}`,
	} {
		if d, err := Decode([]byte(doc)); !errors.Is(err, ErrBadDoc) || !errors.Is(err, segtable.ErrBadDesc) {
			t.Errorf("%s: %+v, %v", what, d, err)
		}
	}
	big := make([]byte, MaxDocBytes+1)
	if _, err := Decode(big); !errors.Is(err, ErrBadDoc) {
		t.Errorf("oversized: %v", err)
	}
	// What Mooncake accepts, so do we: a buffer without keys (not remote
	// accessible), barex keys not indexed by device, an nvlink buffer
	// without a handle skipped, unknown members, null priority matrix.
	for what, doc := range map[string]string{
		"keyless buffer":  rdma(dev, `[{"name":"cpu:0","addr":1,"length":1,"rkey":[],"lkey":[5]}]`),
		"barex":           `{"name":"n","protocol":"barex","devices":[{"name":"d","gid":"g"}],"buffers":[{"name":"cpu:0","addr":1,"length":1,"rkey":[1,2],"lkey":[3,4]}]}`,
		"nvlink skipped":  `{"name":"n","protocol":"nvlink","buffers":[{"name":"cuda:0","addr":1,"length":1}]}`,
		"unknown members": `{"name":"n","protocol":"tcp","future":{"x":[1,2]},"buffers":[{"name":"n","addr":1,"length":1,"extra":true}]}`,
		"null matrix":     `{"name":"n","protocol":"rdma","priority_matrix":null}`,
	} {
		if _, err := Decode([]byte(doc)); err != nil {
			t.Errorf("%s: %v", what, err)
		}
	}
}

func TestToSegtable(t *testing.T) {
	d, err := Decode(readGolden(t, "rdma.json"))
	if err != nil {
		t.Fatal(err)
	}
	// P2PHANDSHAKE: no rpc_meta, the name gives host and RPC port.
	s, err := ToSegtable(d, nil)
	if err != nil {
		t.Fatal(err)
	}
	wantEP := map[string]string{
		EndpointRPC:        "10.1.0.8:15002",
		TransportRDMA:      "10.1.0.8:15002",
		EndpointRDMANICs:   "mlx5_0/0/00:00:00:00:00:00:00:00:00:00:ff:ff:c0:a8:64:08,mlx5_1/7/fe:80:00:00:00:00:00:00:0a:42:a1:ff:fe:10:20:30",
		EndpointRDMAServer: "192.168.100.8:15002",
		EndpointRDMAMatrix: "cpu:0=0/1;cuda:0=1/",
	}
	if !reflect.DeepEqual(s.Endpoints, wantEP) {
		t.Errorf("endpoints %v\nwant %v", s.Endpoints, wantEP)
	}
	if s.Epoch != 0 || len(s.Buffers) != 3 || len(s.Devices) != 2 || s.Devices[0].Kind != "rnic" {
		t.Fatalf("%+v", s)
	}
	// Sorted by address; keys in device order; a keyless buffer has none.
	if b := s.Buffers[0]; b.Addr != 139637976727552 || b.Location != "cpu:0" || b.Keys[TransportRDMA] != "2101249,2166785" {
		t.Errorf("buffer 0 %+v", b)
	}
	if b := s.Buffers[1]; b.Addr != 139640124211200 || len(b.Keys) != 0 {
		t.Errorf("buffer 1 %+v", b)
	}
	if b := s.Buffers[2]; b.Location != "cuda:0" || b.Keys[TransportRDMA] != "4294967295,1" {
		t.Errorf("buffer 2 %+v", b)
	}

	// Multi-protocol: the tcp and rdma entries of one range merge; the
	// cxl buffer has no address and no moonring transport.
	d, _ = Decode(readGolden(t, "multi.json"))
	s, err = ToSegtable(d, &RPCMeta{"10.9.9.9", 15003})
	if err != nil {
		t.Fatal(err)
	}
	if len(s.Buffers) != 1 || s.Buffers[0].Location != "cpu:1" || s.Buffers[0].Keys[TransportRDMA] != "77" ||
		s.Buffers[0].Keys[TransportTCP] != "" || s.Endpoints[TransportTCP] != "10.9.9.9:17000" {
		t.Errorf("%+v", s)
	}
	if _, ok := s.Buffers[0].Keys[TransportTCP]; !ok {
		t.Error("no tcp key")
	}

	// A tcp segment named by a hostname alone: no RPC port, TCP from the
	// name's host.
	d, _ = Decode(readGolden(t, "tcp-v1.json"))
	s, err = ToSegtable(d, nil)
	if err != nil || s.Endpoints[TransportTCP] != "node-a:12001" || s.Endpoints[EndpointTCPVersion] != "1" || s.Endpoints[EndpointRPC] != "" {
		t.Errorf("%+v, %v", s, err)
	}

	d, _ = Decode(readGolden(t, "nvlink.json"))
	if _, err := ToSegtable(d, nil); !errors.Is(err, ErrUnsupported) {
		t.Errorf("nvlink: %v", err)
	}

	// Overlapping ranges are refused.
	d, _ = Decode([]byte(`{"name":"n","protocol":"tcp","tcp_data_port":1,"buffers":[{"name":"n","addr":4096,"length":4096},{"name":"n","addr":6000,"length":10}]}`))
	if _, err := ToSegtable(d, nil); !errors.Is(err, segtable.ErrBadDesc) {
		t.Errorf("overlap: %v", err)
	}
}

// publishable is a moonring descriptor that speaks Mooncake's TCP and RDMA.
func publishable() *segtable.SegmentDesc {
	return &segtable.SegmentDesc{
		Version: segtable.DescVersion,
		Name:    "10.2.0.1:15100",
		Epoch:   0x1234abcd,
		Endpoints: map[string]string{
			"tcp":              "10.2.0.1:7000",
			EndpointRPC:        "10.2.0.1:15100",
			TransportTCP:       "10.2.0.1:16000",
			EndpointTCPVersion: "2",
			TransportRDMA:      "10.2.0.1:15100",
			EndpointRDMANICs:   "rxe0/0/00:00:00:00:00:00:00:00:00:00:ff:ff:0a:02:00:01,rxe1/3/fe:80:00:00:00:00:00:00:00:00:00:00:00:00:00:01",
			EndpointRDMAMatrix: "cpu:0=1/0;cuda:1=0/",
		},
		Buffers: []segtable.BufferDesc{
			{Addr: 0x7f0000000000, Length: 1 << 20, Location: "cpu:0", Keys: map[string]string{"tcp": "1.abc", TransportTCP: "", TransportRDMA: "17,18"}},
			{Addr: 0x7f1000000000, Length: 4096, Location: "", Keys: map[string]string{TransportTCP: ""}},
		},
		Devices: []segtable.DeviceDesc{{Name: "rxe0", Kind: "nic", Node: 0}},
		MAC:     "bWFj",
	}
}

// TestFromSegtable: the document moonring publishes (golden
// published.json, with its timestamp fixed) is one Mooncake's decoder
// accepts, and moonring reads back what it published.
func TestFromSegtable(t *testing.T) {
	s := publishable()
	d, rpc, err := FromSegtable(s)
	if err != nil {
		t.Fatal(err)
	}
	if *rpc != (RPCMeta{"10.2.0.1", 15100}) {
		t.Errorf("rpc_meta %+v", rpc)
	}
	d.Timestamp = "2026-12-01 17:30:00.000000"
	enc, err := d.Encode()
	if err != nil {
		t.Fatal(err)
	}
	if *update {
		var v any
		json.Unmarshal(enc, &v)
		pretty, _ := json.MarshalIndent(v, "", "  ")
		os.WriteFile("testdata/published.json", append(pretty, '\n'), 0o644)
	}
	if golden := readGolden(t, "published.json"); !sameJSON(t, enc, golden) {
		t.Errorf("published\n%s\nwant the values of\n%s", enc, golden)
	}
	md, err := Decode(enc)
	if err != nil {
		t.Fatal(err)
	}
	if md.Protocol != "rdma" || md.TCPDataPort != 16000 || md.TCPProtoVersion != 2 || md.Buffers[1].Name != DefaultLocation ||
		len(md.Buffers[1].RKey) != 0 || !reflect.DeepEqual(md.Buffers[0].RKey, []uint64{17, 18}) ||
		!reflect.DeepEqual(md.PriorityMatrix["cpu:0"], TopologyEntry{[]string{"rxe1"}, []string{"rxe0"}}) ||
		!reflect.DeepEqual(md.PriorityMatrix["cuda:1"], TopologyEntry{[]string{"rxe0"}, []string{}}) {
		t.Errorf("%+v", md)
	}
	back, err := ToSegtable(md, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back, s) {
		t.Errorf("read back %+v\nwant %+v", back, s)
	}
	// Without the extension (as a Mooncake engine sees it), the Mooncake
	// parts still map.
	md.Moonring = nil
	plain, err := ToSegtable(md, rpc)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{EndpointRPC, TransportTCP, EndpointTCPVersion, TransportRDMA, EndpointRDMANICs, EndpointRDMAMatrix} {
		if plain.Endpoints[k] != s.Endpoints[k] {
			t.Errorf("endpoint %s: %q, want %q", k, plain.Endpoints[k], s.Endpoints[k])
		}
	}
	if plain.Buffers[0].Keys[TransportRDMA] != "17,18" {
		t.Errorf("%+v", plain.Buffers[0])
	}

	// A tcp-only descriptor names its buffers by the segment.
	tcpOnly := &segtable.SegmentDesc{Version: 1, Name: "h:1", Endpoints: map[string]string{TransportTCP: "h:2"},
		Buffers: []segtable.BufferDesc{{Addr: 4096, Length: 1}}}
	d, rpc, err = FromSegtable(tcpOnly)
	if err != nil || d.Protocol != "tcp" || d.Buffers[0].Name != "h:1" || *rpc != (RPCMeta{"h", 0}) || d.TCPDataPort != 2 {
		t.Errorf("%+v %+v %v", d, rpc, err)
	}

	for what, mut := range map[string]func(*segtable.SegmentDesc){
		"rkeys per NIC":  func(s *segtable.SegmentDesc) { s.Buffers[0].Keys[TransportRDMA] = "17" },
		"rkey":           func(s *segtable.SegmentDesc) { s.Buffers[0].Keys[TransportRDMA] = "17,x" },
		"NIC":            func(s *segtable.SegmentDesc) { s.Endpoints[EndpointRDMANICs] = "rxe0" },
		"two hosts":      func(s *segtable.SegmentDesc) { s.Endpoints[TransportTCP] = "10.2.0.2:16000" },
		"tcp endpoint":   func(s *segtable.SegmentDesc) { s.Endpoints[TransportTCP] = "nohost" },
		"version":        func(s *segtable.SegmentDesc) { s.Endpoints[EndpointTCPVersion] = "0" },
		"zero address":   func(s *segtable.SegmentDesc) { s.Buffers[0].Addr = 0 },
		"invalid":        func(s *segtable.SegmentDesc) { s.Version = 0 },
		"no name":        func(s *segtable.SegmentDesc) { s.Name = "" },
		"NIC name comma": func(s *segtable.SegmentDesc) { s.Endpoints[EndpointRDMANICs] = "a/0/g," },
		"matrix NIC":     func(s *segtable.SegmentDesc) { s.Endpoints[EndpointRDMAMatrix] = "cpu:0=2/" },
		"matrix row":     func(s *segtable.SegmentDesc) { s.Endpoints[EndpointRDMAMatrix] = "cpu:0=0" },
	} {
		s := publishable()
		mut(s)
		if _, _, err := FromSegtable(s); !errors.Is(err, segtable.ErrBadDesc) {
			t.Errorf("%s: %v", what, err)
		}
	}
}

// TestExtensionMustAgree: a moonring extension whose buffers are not the
// Mooncake buffers, or that names another segment, is refused.
func TestExtensionMustAgree(t *testing.T) {
	d, _, err := FromSegtable(publishable())
	if err != nil {
		t.Fatal(err)
	}
	d2 := *d
	d2.Buffers = d.Buffers[:1]
	if _, err := ToSegtable(&d2, nil); !errors.Is(err, ErrBadDoc) {
		t.Errorf("fewer Mooncake buffers: %v", err)
	}
	d3 := *d
	d3.Name = "other:1"
	if _, err := ToSegtable(&d3, nil); !errors.Is(err, ErrBadDoc) {
		t.Errorf("another name: %v", err)
	}
	d4 := *d
	d4.Moonring = []byte(`{"version":1}`)
	if _, err := ToSegtable(&d4, nil); !errors.Is(err, segtable.ErrBadDesc) {
		t.Errorf("bad extension: %v", err)
	}
}

func TestKeys(t *testing.T) {
	for _, tc := range []struct {
		k              Keys
		name, seg, rpc string
	}{
		{Keys{}, "10.0.0.1:123", "mooncake/ram/10.0.0.1:123", "mooncake/rpc_meta/10.0.0.1:123"},
		{Keys{ClusterID: "c1"}, "n", "mooncake/c1/ram/n", "mooncake/c1/rpc_meta/n"},
		{Keys{ClusterID: "c1/"}, "n", "mooncake/c1/ram/n", "mooncake/c1/rpc_meta/n"},
		{Keys{}, "nvmeof/disk0", "mooncake/nvmeof/disk0", "mooncake/rpc_meta/nvmeof/disk0"},
		{Keys{}, "", "mooncake/ram/", "mooncake/rpc_meta/"},
	} {
		if got := tc.k.Segment(tc.name); got != tc.seg {
			t.Errorf("%+v.Segment(%q) = %q, want %q", tc.k, tc.name, got, tc.seg)
		}
		if got := tc.k.RPCMeta(tc.name); got != tc.rpc {
			t.Errorf("%+v.RPCMeta(%q) = %q, want %q", tc.k, tc.name, got, tc.rpc)
		}
	}
	t.Setenv(ClusterIDEnv, "env-cluster")
	if got := KeysFromEnv().Segment("x"); got != "mooncake/env-cluster/ram/x" {
		t.Errorf("from the environment: %q", got)
	}
}

func TestSplitServerName(t *testing.T) {
	for _, tc := range []struct {
		name string
		host string
		port uint16
		ok   bool
	}{
		{"10.0.0.1:12345", "10.0.0.1", 12345, true},
		{"node-a", "node-a", 0, false},
		{"node-a:x", "node-a", 0, false},
		{"[fe80::1]:80", "fe80::1", 80, true},
		{"[fe80::1]", "fe80::1", 0, false},
		{"fe80::1", "fe80::1", 0, false},
		{"host:70000", "host", 0, false},
	} {
		h, p, ok := SplitServerName(tc.name)
		if h != tc.host || (ok && p != tc.port) || ok != tc.ok {
			t.Errorf("SplitServerName(%q) = %q %d %v, want %q %d %v", tc.name, h, p, ok, tc.host, tc.port, tc.ok)
		}
	}
}
