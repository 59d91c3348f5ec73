package rdma

import (
	"reflect"
	"strings"
	"testing"

	"github.com/moonring/moonring/mooncake"
	"github.com/moonring/moonring/segtable"
)

// TestMooncakePeer: a Mooncake segment's RDMA endpoint is read from the
// descriptor ToSegtable makes of the golden rdma descriptor, and bad
// endpoints are refused.
func TestMooncakePeer(t *testing.T) {
	d, err := mooncake.Decode([]byte(mooncakeRDMADesc))
	if err != nil {
		t.Fatal(err)
	}
	sd, err := mooncake.ToSegtable(d, &mooncake.RPCMeta{IPOrHostName: "10.1.0.7", RPCPort: 15001})
	if err != nil {
		t.Fatal(err)
	}
	p, err := parseMooncakePeer(sd)
	if err != nil {
		t.Fatal(err)
	}
	if p.rpc != "10.1.0.7:15001" || len(p.devs) != len(d.Devices) || p.devs[0] != d.Devices[0].Name {
		t.Errorf("peer %+v", p)
	}
	wantServer := d.Name
	if d.RDMAServerName != "" {
		wantServer = d.RDMAServerName
	}
	if p.server != wantServer {
		t.Errorf("server %q, want %q", p.server, wantServer)
	}
	if want := (mooncake.NICMatrix{"cpu:0": {Preferred: []int{0}, Available: []int{1}}}); !reflect.DeepEqual(p.matrix, want) {
		t.Errorf("matrix %v, want %v", p.matrix, want)
	}
	for _, b := range sd.Buffers {
		k, ok := b.Keys[MooncakeName]
		if !ok {
			continue
		}
		rk, err := parseMooncakeKey(k, len(p.devs))
		if err != nil || formatMooncakeKey(rk) != k {
			t.Errorf("key %q: %v, %v", k, rk, err)
		}
	}
	for what, mod := range map[string]func(s *segtable.SegmentDesc){
		"no rpc":      func(s *segtable.SegmentDesc) { delete(s.Endpoints, MooncakeName) },
		"rpc no port": func(s *segtable.SegmentDesc) { s.Endpoints[MooncakeName] = "10.1.0.7" },
		"no nics":     func(s *segtable.SegmentDesc) { delete(s.Endpoints, mooncake.EndpointRDMANICs) },
		"nic fields":  func(s *segtable.SegmentDesc) { s.Endpoints[mooncake.EndpointRDMANICs] = "mlx5_0/0" },
		"nic lid": func(s *segtable.SegmentDesc) {
			s.Endpoints[mooncake.EndpointRDMANICs] = "mlx5_0/70000/" + strings.Repeat("00:", 15) + "00"
		},
		"nic gid": func(s *segtable.SegmentDesc) { s.Endpoints[mooncake.EndpointRDMANICs] = "mlx5_0/0/fe80::1" },
		"nic name @": func(s *segtable.SegmentDesc) {
			s.Endpoints[mooncake.EndpointRDMANICs] = "a@b/0/" + strings.Repeat("00:", 15) + "00"
		},
		"server @": func(s *segtable.SegmentDesc) { s.Endpoints[mooncake.EndpointRDMAServer] = "x@y" },
		"too many nics": func(s *segtable.SegmentDesc) {
			s.Endpoints[mooncake.EndpointRDMANICs] = strings.Repeat("n/0/"+strings.Repeat("00:", 15)+"00,", maxMCDevices) + "n/0/0"
		},
		"matrix NIC": func(s *segtable.SegmentDesc) { s.Endpoints[mooncake.EndpointRDMAMatrix] = "cpu:0=2/" },
		"matrix row": func(s *segtable.SegmentDesc) { s.Endpoints[mooncake.EndpointRDMAMatrix] = "cpu:0" },
		"empty nic name": func(s *segtable.SegmentDesc) {
			s.Endpoints[mooncake.EndpointRDMANICs] = "/0/" + strings.Repeat("00:", 15) + "00"
		},
	} {
		c := *sd
		c.Endpoints = map[string]string{}
		for k, v := range sd.Endpoints {
			c.Endpoints[k] = v
		}
		mod(&c)
		if _, err := parseMooncakePeer(&c); err == nil {
			t.Errorf("%s: parsed", what)
		}
	}
	for _, k := range []string{"", "1", "1,2,3", "1,x", "1,4294967296", "-1,2"} {
		if _, err := parseMooncakeKey(k, 2); err == nil {
			t.Errorf("key %q for 2 NICs parsed", k)
		}
	}
	if k := formatMooncakeKey([]uint32{4294967295, 0, 17}); k != "4294967295,0,17" {
		t.Errorf("formatted %q", k)
	}
}

// mooncakeRDMADesc is an rdma descriptor as a Mooncake engine publishes it
// (two NICs, an rdma_server_name, a buffer without rkeys).
const mooncakeRDMADesc = `{"name":"10.1.0.8:15002","protocol":"rdma","tcp_data_port":0,"timestamp":"2026-12-01 17:10:01.000002",
"rdma_server_name":"192.168.100.8:15002",
"devices":[{"name":"mlx5_0","lid":0,"gid":"00:00:00:00:00:00:00:00:00:00:ff:ff:c0:a8:64:08"},
  {"name":"mlx5_1","lid":7,"gid":"fe:80:00:00:00:00:00:00:0a:42:a1:ff:fe:10:20:30"}],
"priority_matrix":{"cpu:0":[["mlx5_0"],["mlx5_1"]]},
"buffers":[{"name":"cpu:0","addr":139637976727552,"length":1073741824,"rkey":[2101249,2166785],"lkey":[2101249,2166785]},
  {"name":"cpu:0","addr":139640124211200,"length":4096,"rkey":[],"lkey":[99,100]}]}`
