package mooncake

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/moonring/moonring/segtable"
)

// Limits of what the decoders accept. A Mooncake engine that registers a
// large buffer over RDMA publishes one buffer entry per registered chunk and
// per NIC a key, so the counts are generous; the byte limit bounds the work
// either way.
const (
	// MaxDocBytes bounds a segment descriptor document.
	MaxDocBytes = 16 << 20
	// MaxBuffers bounds the buffers of one descriptor.
	MaxBuffers = 1 << 16
	// MaxDevices bounds the devices (NICs) of one descriptor, and so the
	// keys of one buffer.
	MaxDevices = 256
	// MaxString bounds every string of a document: names, GIDs, paths.
	MaxString = 4096
	// MaxMatrix bounds the entries of the priority matrix and the device
	// names of one entry.
	MaxMatrix = 1024
)

// ErrBadDoc reports a document that is not well-formed Mooncake metadata
// or breaks a bound. It wraps [segtable.ErrBadDesc]; a retry does not help.
var ErrBadDoc = fmt.Errorf("mooncake: malformed document: %w", segtable.ErrBadDesc)

// Protocol names Mooncake writes in a descriptor's "protocol".
const (
	ProtoTCP  = "tcp"
	ProtoRDMA = "rdma"
)

// knownProtocols are the protocol names Mooncake's decoder accepts in a
// single-protocol descriptor; any other is refused there, and here.
var knownProtocols = []string{
	"rdma", "barex", "efa", "cxi", "ub", "tcp", "nccl", "nvlink",
	"nvlink_intra", "hip", "maca", "musa", "ubshmem", "sunrise_link",
	"nvmeof", "ascend", "cxl",
}

// multiProtocols are those that a multi-protocol descriptor may combine.
var multiProtocols = []string{"cxl", "tcp", "rdma", "hip", "maca", "musa"}

// rdmaLike are the protocols whose descriptors carry NICs (name, LID, GID)
// and per-buffer key lists; for all but barex a buffer's keys are indexed
// by device, one per NIC.
func rdmaLike(p string) bool { return p == "rdma" || p == "barex" || p == "efa" || p == "cxi" }

func keysPerDevice(p string) bool { return p == "rdma" || p == "efa" || p == "cxi" }

func shmLike(p string) bool {
	switch p {
	case "nvlink", "nvlink_intra", "hip", "maca", "musa", "ubshmem", "sunrise_link":
		return true
	}
	return false
}

// SegmentDesc is a Mooncake segment descriptor: what a Mooncake engine
// publishes under mooncake/ram/<name>, and what the P2PHANDSHAKE metadata
// exchange carries. Fields that a protocol does not use stay zero.
type SegmentDesc struct {
	// Name is the segment's name, the engine's server name (often
	// "host:port" with the engine's RPC port, always so in P2PHANDSHAKE).
	Name string
	// Protocol is the transport that registered the buffers ("tcp",
	// "rdma", ...). A multi-protocol descriptor, which Mooncake writes as
	// a JSON array, is kept comma-joined ("rdma,cxl").
	Protocol string
	// Devices are the NICs of an rdma-like segment (their index is the
	// index of a buffer's keys), or the devices of ub and ascend.
	Devices []Device
	// Buffers are the registered buffers, in the publisher's order.
	Buffers []Buffer
	// PriorityMatrix maps a location ("cpu:0", "cuda:1") to the NICs
	// preferred for it and those also usable; Mooncake picks a peer's NIC
	// through it (NICMatrix.Row: a location without a row takes every NIC
	// the matrix names, and an empty matrix reaches no buffer). nil when
	// absent (Mooncake writes null for an empty one).
	PriorityMatrix map[string]TopologyEntry
	// TCPDataPort is the port of Mooncake's TCP transport (0: none).
	TCPDataPort int
	// TCPProtoVersion is the TCP data protocol version the segment's
	// server speaks: 1 (no acknowledgements) when the field is absent, 2
	// with acknowledged WRITEs and status-prefixed READs.
	TCPProtoVersion int
	// Timestamp is the publisher's local time of encoding,
	// "YYYY-MM-DD HH:MM:SS.ffffff"; informative only.
	Timestamp string
	// RDMAServerName, when not empty, replaces Name in the NIC paths of
	// the RDMA handshake (a host with a separate RDMA address).
	RDMAServerName string
	// CXLName and CXLBaseAddr: the cxl protocol's shared region.
	CXLName     string
	CXLBaseAddr uint64
	// RankInfo is ascend's rank_info object, kept verbatim.
	RankInfo json.RawMessage
	// Moonring is the moonring extension: the full moonring descriptor of
	// a segment a moonring engine published in Mooncake's schema. Mooncake
	// ignores members it does not know. nil in Mooncake's own documents.
	Moonring json.RawMessage
}

// Device is one device of a descriptor.
type Device struct {
	Name string
	LID  uint16
	// GID is the port's GID as 16 bytes in hex joined by colons
	// ("fe80:00:00:..." style: each byte two digits), as Mooncake prints it.
	GID string
	// EID: the ub protocol's device identifier.
	EID string
}

// Buffer is one registered buffer of a descriptor.
type Buffer struct {
	// Name is the buffer's location for rdma-like protocols ("cpu:0"), the
	// segment name for tcp.
	Name   string
	Addr   uint64
	Length uint64
	// RKey and LKey: one key per device, in the order of Devices. RKey is
	// empty for a buffer not registered remote-accessible.
	RKey []uint64
	LKey []uint64
	// DeviceID: the nccl and ascend device index; -1 when absent.
	DeviceID int
	// ShmName: the IPC handle of nvlink-like protocols.
	ShmName string
	// Offset: a cxl buffer's place in the region (it has no Addr).
	Offset uint64
	// TSeg: ub's segment tokens.
	TSeg []string
	// Protocol: the buffer's protocol in a multi-protocol descriptor.
	Protocol string
	// FilePath and LocalPathMap: an nvmeof buffer (a file, no address).
	FilePath     string
	LocalPathMap map[string]string
}

// TopologyEntry is one row of the priority matrix.
type TopologyEntry struct {
	Preferred []string
	Available []string
}

// Protocols returns the descriptor's protocols, one or more.
func (d *SegmentDesc) Protocols() []string {
	if d.Protocol == "" {
		return nil
	}
	return strings.Split(d.Protocol, ",")
}

// Has reports whether p is one of the descriptor's protocols.
func (d *SegmentDesc) Has(p string) bool { return slices.Contains(d.Protocols(), p) }

// TimestampNow returns the present local time in the form Mooncake writes.
func TimestampNow() string { return time.Now().Format("2006-01-02 15:04:05.000000") }

// The JSON as read. Pointers tell an absent member from a zero one where
// Mooncake does.
type wireDoc struct {
	Name            *string               `json:"name"`
	Protocol        json.RawMessage       `json:"protocol"`
	Devices         []wireDevice          `json:"devices"`
	Buffers         []wireBuffer          `json:"buffers"`
	PriorityMatrix  map[string][][]string `json:"priority_matrix"`
	TCPDataPort     *int64                `json:"tcp_data_port"`
	TCPProtoVersion *int64                `json:"tcp_proto_version"`
	Timestamp       *string               `json:"timestamp"`
	RDMAServerName  *string               `json:"rdma_server_name"`
	CXLName         *string               `json:"cxl_name"`
	CXLBaseAddr     *uint64               `json:"cxl_base_addr"`
	RankInfo        json.RawMessage       `json:"rank_info"`
	Moonring        json.RawMessage       `json:"moonring"`
}

type wireDevice struct {
	Name string  `json:"name"`
	LID  *uint64 `json:"lid"`
	GID  string  `json:"gid"`
	EID  string  `json:"eid"`
}

type wireBuffer struct {
	Name         string            `json:"name"`
	Addr         uint64            `json:"addr"`
	Length       uint64            `json:"length"`
	RKey         []uint64          `json:"rkey"`
	LKey         []uint64          `json:"lkey"`
	DeviceID     *int64            `json:"device_id"`
	ShmName      string            `json:"shm_name"`
	Offset       uint64            `json:"offset"`
	TSeg         []string          `json:"tseg"`
	Protocol     string            `json:"protocol"`
	FilePath     string            `json:"file_path"`
	LocalPathMap map[string]string `json:"local_path_map"`
}

func bad(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrBadDoc, fmt.Sprintf(format, args...))
}

// Decode parses a Mooncake segment descriptor. It refuses documents over
// MaxDocBytes, members of the wrong JSON type, counts and strings over the
// limits, unknown protocols, and what Mooncake's own decoder refuses as
// corrupted: a device without name or GID (rdma-like), a buffer without
// name, address or length, key lists whose lengths differ or (rdma, efa,
// cxi) differ from the number of devices. It also refuses a buffer whose
// range wraps around. Members it does not know are ignored.
func Decode(b []byte) (*SegmentDesc, error) {
	if len(b) > MaxDocBytes {
		return nil, bad("%d bytes, more than %d", len(b), MaxDocBytes)
	}
	var w wireDoc
	if err := json.Unmarshal(b, &w); err != nil {
		return nil, bad("%v", err)
	}
	return w.desc()
}

func checkStr(what, s string) error {
	if len(s) > MaxString {
		return bad("%s is %d bytes, more than %d", what, len(s), MaxString)
	}
	return nil
}

func (w *wireDoc) desc() (*SegmentDesc, error) {
	d := new(SegmentDesc)
	if w.Name == nil || *w.Name == "" {
		return nil, bad("no name")
	}
	d.Name = *w.Name
	if err := checkStr("name", d.Name); err != nil {
		return nil, err
	}
	protos, err := decodeProtocol(w.Protocol)
	if err != nil {
		return nil, err
	}
	d.Protocol = strings.Join(protos, ",")
	multi := len(protos) > 1
	if w.TCPDataPort != nil {
		if *w.TCPDataPort < 0 || *w.TCPDataPort > math.MaxUint16 {
			return nil, bad("tcp_data_port %d", *w.TCPDataPort)
		}
		d.TCPDataPort = int(*w.TCPDataPort)
	}
	d.TCPProtoVersion = 1
	if w.TCPProtoVersion != nil {
		if *w.TCPProtoVersion < 0 || *w.TCPProtoVersion > math.MaxUint16 {
			return nil, bad("tcp_proto_version %d", *w.TCPProtoVersion)
		}
		d.TCPProtoVersion = int(*w.TCPProtoVersion)
	}
	for _, s := range []struct {
		dst  *string
		src  *string
		what string
	}{{&d.Timestamp, w.Timestamp, "timestamp"}, {&d.RDMAServerName, w.RDMAServerName, "rdma_server_name"}, {&d.CXLName, w.CXLName, "cxl_name"}} {
		if s.src != nil {
			if err := checkStr(s.what, *s.src); err != nil {
				return nil, err
			}
			*s.dst = *s.src
		}
	}
	if w.CXLBaseAddr != nil {
		d.CXLBaseAddr = *w.CXLBaseAddr
	}
	if len(w.RankInfo) > 0 && !bytes.Equal(w.RankInfo, []byte("null")) {
		d.RankInfo = slices.Clone(w.RankInfo)
	}
	if len(w.Moonring) > 0 && !bytes.Equal(w.Moonring, []byte("null")) {
		d.Moonring = slices.Clone(w.Moonring)
	}
	if len(w.Devices) > MaxDevices {
		return nil, bad("%d devices, more than %d", len(w.Devices), MaxDevices)
	}
	if len(w.Buffers) > MaxBuffers {
		return nil, bad("%d buffers, more than %d", len(w.Buffers), MaxBuffers)
	}
	if err := d.decodeMatrix(w.PriorityMatrix); err != nil {
		return nil, err
	}
	for i, wd := range w.Devices {
		dev := Device{Name: wd.Name, GID: wd.GID, EID: wd.EID}
		if wd.LID != nil {
			if *wd.LID > math.MaxUint16 {
				return nil, bad("device %d: lid %d", i, *wd.LID)
			}
			dev.LID = uint16(*wd.LID)
		}
		for _, s := range []string{dev.Name, dev.GID, dev.EID} {
			if err := checkStr(fmt.Sprintf("device %d", i), s); err != nil {
				return nil, err
			}
		}
		d.Devices = append(d.Devices, dev)
	}
	if multi {
		return d, d.decodeMultiBuffers(w.Buffers, protos)
	}
	return d, d.decodeBuffers(w.Buffers, protos[0])
}

// decodeProtocol reads "protocol": a string, or an array of two or more
// combinable names (Mooncake's multi-protocol builds).
func decodeProtocol(raw json.RawMessage) ([]string, error) {
	if len(raw) == 0 {
		return nil, bad("no protocol")
	}
	var one string
	if err := json.Unmarshal(raw, &one); err == nil {
		if !slices.Contains(knownProtocols, one) {
			return nil, bad("unknown protocol %.64q", one)
		}
		return []string{one}, nil
	}
	var many []string
	if err := json.Unmarshal(raw, &many); err != nil {
		return nil, bad("protocol is neither a string nor a list of strings")
	}
	// Mooncake reads a list only of two or more (one alone is not taken
	// as a string).
	if len(many) < 2 || len(many) > len(multiProtocols) {
		return nil, bad("protocol list of %d", len(many))
	}
	for i, p := range many {
		if !slices.Contains(multiProtocols, p) || slices.Contains(many[:i], p) {
			return nil, bad("protocol list %.128q", strings.Join(many, ","))
		}
	}
	return many, nil
}

func (d *SegmentDesc) decodeMatrix(m map[string][][]string) error {
	if m == nil {
		return nil
	}
	if len(m) > MaxMatrix {
		return bad("priority matrix of %d entries", len(m))
	}
	d.PriorityMatrix = make(map[string]TopologyEntry, len(m))
	for loc, rows := range m {
		if len(rows) != 2 {
			return bad("priority matrix entry %.64q has %d lists, want 2", loc, len(rows))
		}
		if len(rows[0])+len(rows[1]) > MaxMatrix {
			return bad("priority matrix entry %.64q too long", loc)
		}
		if err := checkStr("priority matrix location", loc); err != nil {
			return err
		}
		for _, r := range rows {
			for _, n := range r {
				if err := checkStr("priority matrix device", n); err != nil {
					return err
				}
			}
		}
		d.PriorityMatrix[loc] = TopologyEntry{Preferred: nonNil(rows[0]), Available: nonNil(rows[1])}
	}
	return nil
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}

func (d *SegmentDesc) checkDevices(p string) error {
	for i, dev := range d.Devices {
		switch {
		case rdmaLike(p) && (dev.Name == "" || dev.GID == ""):
			return bad("device %d has no name or gid", i)
		case p == "ub" && (dev.Name == "" || dev.EID == ""):
			return bad("device %d has no name or eid", i)
		case p == "ascend" && dev.Name == "":
			return bad("device %d has no name", i)
		}
	}
	return nil
}

func (w *wireBuffer) buffer(i int) (Buffer, error) {
	b := Buffer{Name: w.Name, Addr: w.Addr, Length: w.Length, RKey: w.RKey, LKey: w.LKey,
		DeviceID: -1, ShmName: w.ShmName, Offset: w.Offset, TSeg: w.TSeg, Protocol: w.Protocol,
		FilePath: w.FilePath, LocalPathMap: w.LocalPathMap}
	if w.DeviceID != nil {
		if *w.DeviceID < math.MinInt32 || *w.DeviceID > math.MaxInt32 {
			return b, bad("buffer %d: device_id %d", i, *w.DeviceID)
		}
		b.DeviceID = int(*w.DeviceID)
	}
	if len(b.RKey) > MaxDevices || len(b.LKey) > MaxDevices || len(b.TSeg) > MaxDevices || len(b.LocalPathMap) > MaxDevices {
		return b, bad("buffer %d: more than %d keys", i, MaxDevices)
	}
	for _, s := range append([]string{b.Name, b.ShmName, b.Protocol, b.FilePath}, b.TSeg...) {
		if err := checkStr(fmt.Sprintf("buffer %d", i), s); err != nil {
			return b, err
		}
	}
	for k, v := range b.LocalPathMap {
		if checkStr("", k) != nil || checkStr("", v) != nil {
			return b, bad("buffer %d: local_path_map entry too long", i)
		}
	}
	if b.Addr+b.Length < b.Addr {
		return b, bad("buffer %d: range [%#x, +%d) wraps", i, b.Addr, b.Length)
	}
	return b, nil
}

// checkKeys applies the key-list rules of rdma-like buffers.
func (d *SegmentDesc) checkKeys(i int, b *Buffer, p string) error {
	if len(b.RKey) == 0 {
		return nil
	}
	if len(b.RKey) != len(b.LKey) || (keysPerDevice(p) && len(b.RKey) != len(d.Devices)) {
		return bad("buffer %d: %d rkeys, %d lkeys, %d devices", i, len(b.RKey), len(b.LKey), len(d.Devices))
	}
	if p == "rdma" || p == "barex" {
		for _, k := range append(slices.Clone(b.RKey), b.LKey...) {
			if k > math.MaxUint32 {
				return bad("buffer %d: key %#x wider than 32 bits", i, k)
			}
		}
	}
	return nil
}

func (d *SegmentDesc) decodeBuffers(ws []wireBuffer, p string) error {
	if err := d.checkDevices(p); err != nil {
		return err
	}
	for i := range ws {
		b, err := ws[i].buffer(i)
		if err != nil {
			return err
		}
		b.Protocol = "" // meaningful in multi-protocol descriptors only
		switch {
		case p == "nvmeof":
			if b.FilePath == "" {
				return bad("buffer %d: no file_path", i)
			}
		case p == "cxl":
			if b.Name == "" || b.Length == 0 {
				return bad("buffer %d: no name or length", i)
			}
		case shmLike(p) && b.ShmName == "":
			// Mooncake skips such a buffer: another transport's, in a
			// node's shared segment.
			continue
		case b.Name == "" || b.Addr == 0 || b.Length == 0:
			return bad("buffer %d: no name, address or length", i)
		case p == "ub" && len(b.TSeg) == 0:
			return bad("buffer %d: no tseg", i)
		case p == "nccl" && b.DeviceID < 0:
			return bad("buffer %d: no device_id", i)
		}
		if rdmaLike(p) {
			if err := d.checkKeys(i, &b, p); err != nil {
				return err
			}
		}
		d.Buffers = append(d.Buffers, b)
	}
	return nil
}

func (d *SegmentDesc) decodeMultiBuffers(ws []wireBuffer, protos []string) error {
	if slices.Contains(protos, "rdma") {
		if err := d.checkDevices("rdma"); err != nil {
			return err
		}
	}
	for i := range ws {
		b, err := ws[i].buffer(i)
		if err != nil {
			return err
		}
		switch b.Protocol {
		case "cxl":
			if b.Name == "" || b.Length == 0 {
				return bad("buffer %d: no name or length", i)
			}
		case "rdma", "tcp", "hip", "maca", "musa":
			if b.Name == "" || b.Addr == 0 || b.Length == 0 {
				return bad("buffer %d: no name, address or length", i)
			}
			if b.Protocol == "rdma" {
				if err := d.checkKeys(i, &b, "rdma"); err != nil {
					return err
				}
			} else if b.Protocol != "tcp" && b.ShmName == "" {
				return bad("buffer %d: no shm_name", i)
			}
		default:
			continue // Mooncake skips a buffer of a protocol it does not parse
		}
		d.Buffers = append(d.Buffers, b)
	}
	return nil
}

// Encode writes the descriptor as Mooncake's encoder does for its
// protocol: the members every descriptor has (name, protocol,
// tcp_data_port, tcp_proto_version, timestamp, rdma_server_name when set),
// then those of the protocol; the moonring extension when set. Member order
// is not Mooncake's (keys are sorted); JSON readers do not care.
func (d *SegmentDesc) Encode() ([]byte, error) {
	if d.Name == "" {
		return nil, bad("no name")
	}
	protos := d.Protocols()
	if len(protos) == 0 {
		return nil, bad("no protocol")
	}
	m := map[string]any{
		"name":              d.Name,
		"tcp_data_port":     d.TCPDataPort,
		"tcp_proto_version": d.TCPProtoVersion,
		"timestamp":         d.Timestamp,
	}
	if d.RDMAServerName != "" {
		m["rdma_server_name"] = d.RDMAServerName
	}
	if len(d.Moonring) > 0 {
		m["moonring"] = json.RawMessage(d.Moonring)
	}
	if len(protos) > 1 {
		m["protocol"] = protos
		d.encodeMulti(m, protos)
	} else {
		m["protocol"] = protos[0]
		if err := d.encodeSingle(m, protos[0]); err != nil {
			return nil, err
		}
	}
	return json.Marshal(m)
}

func (d *SegmentDesc) devicesJSON(withGID, withEID bool) []any {
	out := make([]any, 0, len(d.Devices))
	for _, dev := range d.Devices {
		o := map[string]any{"name": dev.Name}
		if withEID {
			o["eid"] = dev.EID
		} else {
			o["lid"] = dev.LID
		}
		if withGID {
			o["gid"] = dev.GID
		}
		out = append(out, o)
	}
	return out
}

func (d *SegmentDesc) matrixJSON() any {
	if len(d.PriorityMatrix) == 0 {
		return nil // Mooncake writes an empty topology as null
	}
	m := make(map[string]any, len(d.PriorityMatrix))
	for loc, e := range d.PriorityMatrix {
		m[loc] = [2][]string{nonNil(e.Preferred), nonNil(e.Available)}
	}
	return m
}

func keysJSON(k []uint64) []uint64 {
	if k == nil {
		return []uint64{}
	}
	return k
}

func (d *SegmentDesc) encodeSingle(m map[string]any, p string) error {
	bufs := make([]any, 0, len(d.Buffers))
	base := func(b Buffer) map[string]any {
		return map[string]any{"name": b.Name, "addr": b.Addr, "length": b.Length}
	}
	switch {
	case rdmaLike(p):
		m["devices"] = d.devicesJSON(true, false)
		for _, b := range d.Buffers {
			o := base(b)
			o["rkey"], o["lkey"] = keysJSON(b.RKey), keysJSON(b.LKey)
			bufs = append(bufs, o)
		}
		m["priority_matrix"] = d.matrixJSON()
	case p == "ub":
		m["devices"] = d.devicesJSON(false, true)
		for _, b := range d.Buffers {
			o := base(b)
			o["tseg"] = nonNil(b.TSeg)
			bufs = append(bufs, o)
		}
		m["priority_matrix"] = d.matrixJSON()
	case p == "tcp":
		for _, b := range d.Buffers {
			bufs = append(bufs, base(b))
		}
	case p == "nccl" || p == "ascend":
		if p == "ascend" {
			devs := make([]any, 0, len(d.Devices))
			for _, dev := range d.Devices {
				devs = append(devs, map[string]any{"name": dev.Name, "lid": dev.LID})
			}
			m["devices"] = devs
			if len(d.RankInfo) > 0 {
				m["rank_info"] = json.RawMessage(d.RankInfo)
			}
		}
		for _, b := range d.Buffers {
			o := base(b)
			o["device_id"] = b.DeviceID
			bufs = append(bufs, o)
		}
	case shmLike(p):
		for _, b := range d.Buffers {
			o := base(b)
			o["shm_name"] = b.ShmName
			bufs = append(bufs, o)
		}
	case p == "cxl":
		m["cxl_name"], m["cxl_base_addr"] = d.CXLName, d.CXLBaseAddr
		for _, b := range d.Buffers {
			bufs = append(bufs, map[string]any{"name": b.Name, "offset": b.Offset, "length": b.Length})
		}
	case p == "nvmeof":
		for _, b := range d.Buffers {
			lpm := b.LocalPathMap
			if lpm == nil {
				lpm = map[string]string{}
			}
			bufs = append(bufs, map[string]any{"file_path": b.FilePath, "length": b.Length, "local_path_map": lpm})
		}
	default:
		return bad("unknown protocol %.64q", p)
	}
	m["buffers"] = bufs
	return nil
}

func (d *SegmentDesc) encodeMulti(m map[string]any, protos []string) {
	for _, p := range protos {
		switch p {
		case "rdma":
			m["devices"] = d.devicesJSON(true, false)
			m["priority_matrix"] = d.matrixJSON()
		case "cxl":
			m["cxl_name"], m["cxl_base_addr"] = d.CXLName, d.CXLBaseAddr
		}
	}
	bufs := make([]any, 0, len(d.Buffers))
	for _, b := range d.Buffers {
		o := map[string]any{"name": b.Name, "length": b.Length, "protocol": b.Protocol}
		switch b.Protocol {
		case "cxl":
			o["offset"] = b.Offset
		case "rdma":
			o["addr"], o["rkey"], o["lkey"] = b.Addr, keysJSON(b.RKey), keysJSON(b.LKey)
		case "tcp":
			o["addr"] = b.Addr
		case "hip", "maca", "musa":
			o["addr"], o["shm_name"] = b.Addr, b.ShmName
		}
		bufs = append(bufs, o)
	}
	m["buffers"] = bufs
}

// RPCMeta is the document under mooncake/rpc_meta/<name>: where the
// engine's RPC (handshake) daemon listens. A Mooncake TCP initiator also
// takes the host of a segment's TCP data port from it.
type RPCMeta struct {
	IPOrHostName string `json:"ip_or_host_name"`
	RPCPort      uint16 `json:"rpc_port"`
}

// MaxRPCMetaBytes bounds an rpc_meta document.
const MaxRPCMetaBytes = 64 << 10

// DecodeRPCMeta parses an rpc_meta document: an object with a non-empty
// host and a port that fits 16 bits.
func DecodeRPCMeta(b []byte) (*RPCMeta, error) {
	if len(b) > MaxRPCMetaBytes {
		return nil, bad("rpc_meta of %d bytes", len(b))
	}
	var w struct {
		Host *string `json:"ip_or_host_name"`
		Port *uint64 `json:"rpc_port"`
	}
	if err := json.Unmarshal(b, &w); err != nil {
		return nil, bad("rpc_meta: %v", err)
	}
	if w.Host == nil || *w.Host == "" || len(*w.Host) > MaxString {
		return nil, bad("rpc_meta: no host")
	}
	if w.Port == nil || *w.Port > math.MaxUint16 {
		return nil, bad("rpc_meta: no port or a port over 65535")
	}
	return &RPCMeta{IPOrHostName: *w.Host, RPCPort: uint16(*w.Port)}, nil
}

// Encode writes the rpc_meta document.
func (r *RPCMeta) Encode() ([]byte, error) { return json.Marshal(r) }
