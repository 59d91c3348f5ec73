//go:build rdma && cgo

package rdma

/*
#cgo LDFLAGS: -libverbs
#include "shim.h"
*/
import "C"

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"unsafe"
)

// Completion statuses the transport tells apart (enum ibv_wc_status).
const (
	wcSuccess      = C.IBV_WC_SUCCESS
	wcLocLenErr    = C.IBV_WC_LOC_LEN_ERR
	wcLocProtErr   = C.IBV_WC_LOC_PROT_ERR
	wcFlushErr     = C.IBV_WC_WR_FLUSH_ERR
	wcRemInvReqErr = C.IBV_WC_REM_INV_REQ_ERR
	wcRemAccessErr = C.IBV_WC_REM_ACCESS_ERR
)

const pollBatch = 64

func wcStatusString(s uint32) string {
	return C.GoString(C.ibv_wc_status_str(C.enum_ibv_wc_status(s)))
}

func errnoString(rc C.int) string { return syscall.Errno(rc).Error() }

// cArray allocates n zeroed elements of size bytes in C memory.
func cArray(n int, size C.size_t) unsafe.Pointer {
	return C.calloc(C.size_t(n), size)
}

// stage is a queue pair's C memory for building one Post's chain: up to
// depth requests, work requests and scatter/gather entries.
type stage struct {
	req *C.mr_req
	wr  *C.struct_ibv_send_wr
	sge *C.struct_ibv_sge
	n   int
}

func newStage(depth int) *stage {
	return &stage{
		req: (*C.mr_req)(cArray(depth, C.size_t(unsafe.Sizeof(C.mr_req{})))),
		wr:  (*C.struct_ibv_send_wr)(cArray(depth, C.mr_sizeof_wr())),
		sge: (*C.struct_ibv_sge)(cArray(depth, C.mr_sizeof_sge())),
		n:   depth,
	}
}

func (s *stage) free() {
	C.free(unsafe.Pointer(s.req))
	C.free(unsafe.Pointer(s.wr))
	C.free(unsafe.Pointer(s.sge))
	*s = stage{}
}

func (s *stage) reqs() []C.mr_req { return unsafe.Slice(s.req, s.n) }

// setReq writes request i of the stage.
func (s *stage) setReq(i int, wrID, laddr, raddr uint64, n, lkey, rkey uint32, op uint8) {
	r := &s.reqs()[i]
	r.wr_id = C.uint64_t(wrID)
	r.laddr = C.uint64_t(laddr)
	r.raddr = C.uint64_t(raddr)
	r.len = C.uint32_t(n)
	r.lkey = C.uint32_t(lkey)
	r.rkey = C.uint32_t(rkey)
	r.op = C.uint32_t(op)
}

// builtWR is one work request of a built chain, read back for tests.
type builtWR struct {
	WRID       uint64
	Opcode     string
	Signaled   bool
	NumSGE     int
	SGEAddr    uint64
	SGELength  uint32
	SGELKey    uint32
	RemoteAddr uint64
	RKey       uint32
	NextIsNext bool // next points to the following work request
	NextIsNil  bool
}

// buildForTest runs the C chain builder over the stage's first n requests
// and reads every field of the result back. Tests use it; the data path
// builds inside mr_post.
func (s *stage) buildForTest(n int) []builtWR {
	C.mr_build(s.req, C.int(n), s.wr, s.sge)
	out := make([]builtWR, n)
	for i := range out {
		w := C.mr_wr_at(s.wr, C.int(i))
		b := &out[i]
		b.WRID = uint64(w.wr_id)
		switch w.opcode {
		case C.IBV_WR_RDMA_READ:
			b.Opcode = "RDMA_READ"
		case C.IBV_WR_RDMA_WRITE:
			b.Opcode = "RDMA_WRITE"
		case C.IBV_WR_SEND:
			b.Opcode = "SEND"
		default:
			b.Opcode = "opcode" + strconv.Itoa(int(w.opcode))
		}
		b.Signaled = w.send_flags&C.IBV_SEND_SIGNALED != 0
		b.NumSGE = int(w.num_sge)
		if w.sg_list != nil {
			b.SGEAddr = uint64(w.sg_list.addr)
			b.SGELength = uint32(w.sg_list.length)
			b.SGELKey = uint32(w.sg_list.lkey)
			if w.sg_list != (*C.struct_ibv_sge)(unsafe.Add(unsafe.Pointer(s.sge), uintptr(i)*uintptr(C.mr_sizeof_sge()))) {
				b.SGELKey ^= 0xffffffff // not its own entry: make the check fail
			}
		}
		rdma := (*struct {
			remoteAddr C.uint64_t
			rkey       C.uint32_t
		})(unsafe.Pointer(&w.wr))
		b.RemoteAddr = uint64(rdma.remoteAddr)
		b.RKey = uint32(rdma.rkey)
		b.NextIsNil = w.next == nil
		b.NextIsNext = i+1 < n && w.next == C.mr_wr_at(s.wr, C.int(i+1))
	}
	return out
}

// batches is an endpoint's C array of per-queue-pair batches.
type batches struct {
	p *C.mr_batch
	n int
}

func newBatches(n int) batches {
	return batches{p: (*C.mr_batch)(cArray(n, C.size_t(unsafe.Sizeof(C.mr_batch{})))), n: n}
}

func (b *batches) free() { C.free(unsafe.Pointer(b.p)); b.p = nil }

func (b *batches) all() []C.mr_batch { return unsafe.Slice(b.p, b.n) }

// post posts the first nb batches in one cgo call.
func (b *batches) post(nb int) { C.mr_post(b.p, C.int(nb)) }

// poller is a completion queue's C memory for one poll.
type poller struct {
	wc  *C.struct_ibv_wc
	out *C.mr_wc
}

func newPoller() poller {
	return poller{
		wc:  (*C.struct_ibv_wc)(cArray(pollBatch, C.mr_sizeof_wc())),
		out: (*C.mr_wc)(cArray(pollBatch, C.size_t(unsafe.Sizeof(C.mr_wc{})))),
	}
}

func (p *poller) free() {
	C.free(unsafe.Pointer(p.wc))
	C.free(unsafe.Pointer(p.out))
}

func (p *poller) poll(cq *C.struct_ibv_cq) []C.mr_wc {
	n := int(C.mr_poll(cq, p.wc, p.out, pollBatch))
	if n <= 0 {
		return nil
	}
	return unsafe.Slice(p.out, n)
}

// deviceList returns the names of the RDMA devices present.
func deviceList() ([]string, error) {
	var n C.int
	list, err := C.ibv_get_device_list(&n)
	if list == nil {
		return nil, fmt.Errorf("rdma: ibv_get_device_list: %v", err)
	}
	defer C.ibv_free_device_list(list)
	var names []string
	for _, d := range unsafe.Slice(list, int(n)) {
		names = append(names, C.GoString(C.ibv_get_device_name(d)))
	}
	return names, nil
}

// openDevice opens the device named name.
func openDevice(name string) (*C.struct_ibv_context, error) {
	var n C.int
	list, err := C.ibv_get_device_list(&n)
	if list == nil {
		return nil, fmt.Errorf("rdma: ibv_get_device_list: %v", err)
	}
	defer C.ibv_free_device_list(list)
	for _, d := range unsafe.Slice(list, int(n)) {
		if C.GoString(C.ibv_get_device_name(d)) == name {
			ctx, err := C.ibv_open_device(d)
			if ctx == nil {
				return nil, fmt.Errorf("rdma: open %s: %v", name, err)
			}
			return ctx, nil
		}
	}
	return nil, fmt.Errorf("rdma: no device %s", name)
}

var portStates = map[C.enum_ibv_port_state]string{
	C.IBV_PORT_NOP: "NOP", C.IBV_PORT_DOWN: "DOWN", C.IBV_PORT_INIT: "INIT",
	C.IBV_PORT_ARMED: "ARMED", C.IBV_PORT_ACTIVE: "ACTIVE", C.IBV_PORT_ACTIVE_DEFER: "ACTIVE_DEFER",
}

// portInfo is what queryPorts learns of one port.
type portInfo struct {
	PortInfo
	mtuCode uint8
}

// queryPorts describes every port of ctx.
func queryPorts(ctx *C.struct_ibv_context) ([]portInfo, int, error) {
	var da C.struct_ibv_device_attr
	if rc := C.ibv_query_device(ctx, &da); rc != 0 {
		return nil, 0, fmt.Errorf("ibv_query_device: %v", syscall.Errno(rc))
	}
	var out []portInfo
	for p := 1; p <= int(da.phys_port_cnt); p++ {
		var pa C.struct_ibv_port_attr
		if rc := C.mr_query_port(ctx, C.int(p), &pa); rc != 0 {
			return nil, 0, fmt.Errorf("ibv_query_port %d: %v", p, syscall.Errno(rc))
		}
		pi := portInfo{PortInfo: PortInfo{Port: p, State: portStates[pa.state], LID: uint16(pa.lid), Chosen: -1}, mtuCode: uint8(pa.active_mtu)}
		pi.MTU = mtuBytes(pi.mtuCode)
		ethernet := pa.link_layer == C.IBV_LINK_LAYER_ETHERNET
		if ethernet {
			pi.LinkLayer = "Ethernet"
		} else {
			pi.LinkLayer = "InfiniBand"
		}
		n := int(pa.gid_tbl_len)
		if n > 0 {
			entries := make([]C.struct_ibv_gid_entry, n)
			got := C.mr_gid_table(ctx, &entries[0], C.size_t(n))
			for _, e := range entries[:max(int(got), 0)] {
				if int(e.port_num) != p {
					continue
				}
				g := GID{Index: int(e.gid_index), Type: GIDType(e.gid_type)}
				copy(g.Raw[:], C.GoBytes(unsafe.Pointer(&e.gid), 16))
				pi.GIDs = append(pi.GIDs, g)
			}
		}
		if g, err := ChooseGID(pi.GIDs, ethernet, nil); err == nil {
			for i := range pi.GIDs {
				if pi.GIDs[i].Index == g.Index {
					pi.Chosen = i
				}
			}
		}
		out = append(out, pi)
	}
	return out, int(da.max_qp_rd_atom), nil
}

// numaNode reads a device's NUMA node from sysfs; -1 when unknown.
func numaNode(name string) int {
	b, err := os.ReadFile("/sys/class/infiniband/" + name + "/device/numa_node")
	if err != nil {
		return -1
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return -1
	}
	return n
}

// Devices lists the RDMA devices of this machine with their ports, link
// layers, GID tables and NUMA nodes (for `moonring info`). Safe for
// concurrent use.
func Devices() ([]DeviceInfo, error) {
	names, err := deviceList()
	if err != nil {
		return nil, err
	}
	var out []DeviceInfo
	for _, name := range names {
		ctx, err := openDevice(name)
		if err != nil {
			return nil, err
		}
		ports, _, err := queryPorts(ctx)
		C.ibv_close_device(ctx)
		if err != nil {
			return nil, fmt.Errorf("rdma: %s: %w", name, err)
		}
		d := DeviceInfo{Name: name, NUMANode: numaNode(name)}
		for _, p := range ports {
			d.Ports = append(d.Ports, p.PortInfo)
		}
		out = append(out, d)
	}
	return out, nil
}
