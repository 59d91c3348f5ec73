// shim.h: the C side of the rdma transport (package rdma, build tag rdma):
// work request chains built and posted in C memory, completion polling, and
// wrappers of the verbs macros and inline functions cgo cannot call.
#ifndef MOONRING_RDMA_SHIM_H
#define MOONRING_RDMA_SHIM_H
#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>

// mr_req is one slice as Go writes it into C memory for the shim.
typedef struct {
	uint64_t wr_id;
	uint64_t laddr;
	uint64_t raddr;
	uint32_t len;
	uint32_t lkey;
	uint32_t rkey;
	uint32_t op; // 1 READ, 2 WRITE, 3 SEND (a notification)
} mr_req;

// mr_batch is the work of one Post on one queue pair.
typedef struct {
	struct ibv_qp *qp;
	mr_req *req;
	struct ibv_send_wr *wr;
	struct ibv_sge *sge;
	int n;
	int posted; // out: how many of n the queue pair took
	int err;    // out: ibv_post_send's error
} mr_batch;

// mr_build turns n requests into a chain of signaled RDMA work requests,
// one scatter/gather entry each, in wr and sge.
static void mr_build(const mr_req *req, int n, struct ibv_send_wr *wr, struct ibv_sge *sge) {
	for (int i = 0; i < n; i++) {
		memset(&wr[i], 0, sizeof wr[i]);
		sge[i].addr = req[i].laddr;
		sge[i].length = req[i].len;
		sge[i].lkey = req[i].lkey;
		wr[i].wr_id = req[i].wr_id;
		wr[i].sg_list = &sge[i];
		wr[i].num_sge = req[i].len ? 1 : 0;
		wr[i].opcode = req[i].op == 1 ? IBV_WR_RDMA_READ : req[i].op == 3 ? IBV_WR_SEND : IBV_WR_RDMA_WRITE;
		wr[i].send_flags = IBV_SEND_SIGNALED;
		wr[i].wr.rdma.remote_addr = req[i].raddr;
		wr[i].wr.rdma.rkey = req[i].rkey;
		wr[i].next = i + 1 < n ? &wr[i + 1] : NULL;
	}
}

// mr_post builds and posts the chains of nb queue pairs: one call per Post.
static void mr_post(mr_batch *b, int nb) {
	for (int i = 0; i < nb; i++) {
		struct ibv_send_wr *bad = NULL;
		b[i].posted = 0;
		b[i].err = 0;
		if (b[i].n == 0)
			continue;
		mr_build(b[i].req, b[i].n, b[i].wr, b[i].sge);
		int rc = ibv_post_send(b[i].qp, b[i].wr, &bad);
		if (rc == 0) {
			b[i].posted = b[i].n;
		} else {
			b[i].err = rc;
			b[i].posted = bad ? (int)(bad - b[i].wr) : 0;
		}
	}
}

// mr_wc is a completion as Go reads it.
typedef struct {
	uint64_t wr_id;
	uint32_t status;
	uint32_t vendor_err;
	uint32_t byte_len;
} mr_wc;

// mr_poll polls up to n completions into out.
static int mr_poll(struct ibv_cq *cq, struct ibv_wc *wc, mr_wc *out, int n) {
	int got = ibv_poll_cq(cq, n, wc);
	for (int i = 0; i < got; i++) {
		out[i].wr_id = wc[i].wr_id;
		out[i].status = wc[i].status;
		out[i].vendor_err = wc[i].vendor_err;
		out[i].byte_len = wc[i].byte_len;
	}
	return got;
}

static struct ibv_mr *mr_reg(struct ibv_pd *pd, uintptr_t addr, size_t len, int remote) {
	int flags = IBV_ACCESS_LOCAL_WRITE;
	if (remote)
		flags |= IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
	return ibv_reg_mr(pd, (void *)addr, len, flags);
}

static int mr_query_port(struct ibv_context *ctx, int port, struct ibv_port_attr *a) {
	return ibv_query_port(ctx, port, a);
}

static ssize_t mr_gid_table(struct ibv_context *ctx, struct ibv_gid_entry *e, size_t n) {
	return ibv_query_gid_table(ctx, e, n, 0);
}

static struct ibv_qp *mr_create_qp(struct ibv_pd *pd, struct ibv_cq *cq, int depth, int rdepth) {
	struct ibv_qp_init_attr a;
	memset(&a, 0, sizeof a);
	a.send_cq = cq;
	a.recv_cq = cq;
	a.qp_type = IBV_QPT_RC;
	a.cap.max_send_wr = depth;
	a.cap.max_recv_wr = rdepth;
	a.cap.max_send_sge = 1;
	a.cap.max_recv_sge = 1;
	a.cap.max_inline_data = 16;
	return ibv_create_qp(pd, &a);
}

// mr_post_recv posts one receive of len bytes at addr.
static int mr_post_recv(struct ibv_qp *qp, uint64_t addr, uint32_t len, uint32_t lkey, uint64_t wr_id) {
	struct ibv_sge sge = { .addr = addr, .length = len, .lkey = lkey };
	struct ibv_recv_wr wr, *bad = NULL;
	memset(&wr, 0, sizeof wr);
	wr.wr_id = wr_id;
	wr.sg_list = &sge;
	wr.num_sge = 1;
	return ibv_post_recv(qp, &wr, &bad);
}

// mr_note_reply gives a receive buffer back and sends the answer to the
// notification it held: one call per notification on the target.
static int mr_note_reply(struct ibv_qp *qp, uint64_t raddr, uint32_t rlen, uint32_t lkey, uint64_t rwr_id,
		uint64_t aaddr, uint32_t alen, uint64_t awr_id) {
	int rc = mr_post_recv(qp, raddr, rlen, lkey, rwr_id);
	if (rc)
		return rc;
	struct ibv_sge sge = { .addr = aaddr, .length = alen, .lkey = lkey };
	struct ibv_send_wr wr, *bad = NULL;
	memset(&wr, 0, sizeof wr);
	wr.wr_id = awr_id;
	wr.sg_list = &sge;
	wr.num_sge = 1;
	wr.opcode = IBV_WR_SEND;
	wr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
	return ibv_post_send(qp, &wr, &bad);
}

// mr_cq_event takes one completion event from ch, acknowledged; 0 when
// there is none (the channel's fd is non-blocking).
static int mr_cq_event(struct ibv_comp_channel *ch) {
	struct ibv_cq *cq;
	void *ctx;
	if (ibv_get_cq_event(ch, &cq, &ctx))
		return 0;
	ibv_ack_cq_events(cq, 1);
	return 1;
}

// mr_async_event takes one asynchronous event of ctx, acknowledged: its
// type, and its port or queue pair. 0 when there is none (non-blocking fd).
static int mr_async_event(struct ibv_context *ctx, int *type, int *port, struct ibv_qp **qp) {
	struct ibv_async_event ev;
	if (ibv_get_async_event(ctx, &ev))
		return 0;
	*type = ev.event_type;
	*port = 0;
	*qp = NULL;
	switch (ev.event_type) {
	case IBV_EVENT_PORT_ACTIVE:
	case IBV_EVENT_PORT_ERR:
	case IBV_EVENT_LID_CHANGE:
	case IBV_EVENT_PKEY_CHANGE:
	case IBV_EVENT_GID_CHANGE:
	case IBV_EVENT_SM_CHANGE:
	case IBV_EVENT_CLIENT_REREGISTER:
		*port = ev.element.port_num;
		break;
	case IBV_EVENT_QP_FATAL:
	case IBV_EVENT_QP_REQ_ERR:
	case IBV_EVENT_QP_ACCESS_ERR:
	case IBV_EVENT_COMM_EST:
	case IBV_EVENT_SQ_DRAINED:
	case IBV_EVENT_PATH_MIG:
	case IBV_EVENT_PATH_MIG_ERR:
	case IBV_EVENT_QP_LAST_WQE_REACHED:
		*qp = ev.element.qp;
		break;
	default:
		break;
	}
	ibv_ack_async_event(&ev);
	return 1;
}

static int mr_req_notify(struct ibv_cq *cq) { return ibv_req_notify_cq(cq, 0); }

static int mr_to_init(struct ibv_qp *qp, int port) {
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_INIT;
	a.pkey_index = 0;
	a.port_num = port;
	a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
	return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
}

// mr_to_rtr_hop brings qp to RTR against the peer's queue pair dqpn: with
// a GRH (dgid, sgid_index, hop limit hop) when global, min RNR timer 12.
static int mr_to_rtr_hop(struct ibv_qp *qp, int port, int mtu, uint32_t dqpn, uint32_t rpsn, uint16_t dlid,
		const uint8_t *dgid, int sgid_index, int global, int rd_atomic, int hop) {
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = mtu;
	a.dest_qp_num = dqpn;
	a.rq_psn = rpsn;
	a.max_dest_rd_atomic = rd_atomic;
	a.min_rnr_timer = 12;
	a.ah_attr.dlid = dlid;
	a.ah_attr.sl = 0;
	a.ah_attr.src_path_bits = 0;
	a.ah_attr.port_num = port;
	if (global) {
		a.ah_attr.is_global = 1;
		memcpy(a.ah_attr.grh.dgid.raw, dgid, 16);
		a.ah_attr.grh.sgid_index = sgid_index;
		a.ah_attr.grh.hop_limit = hop;
	}
	return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
		IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
}

// mr_to_rtr is mr_to_rtr_hop with moonring's own hop limit, 64.
static int mr_to_rtr(struct ibv_qp *qp, int port, int mtu, uint32_t dqpn, uint32_t rpsn, uint16_t dlid,
		const uint8_t *dgid, int sgid_index, int global, int rd_atomic) {
	return mr_to_rtr_hop(qp, port, mtu, dqpn, rpsn, dlid, dgid, sgid_index, global, rd_atomic, 64);
}

static int mr_to_rts(struct ibv_qp *qp, uint32_t psn, int rd_atomic, int timeout, int retry) {
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_RTS;
	a.timeout = timeout;
	a.retry_cnt = retry;
	a.rnr_retry = 7;
	a.sq_psn = psn;
	a.max_rd_atomic = rd_atomic;
	return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
		IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
}

static int mr_to_err(struct ibv_qp *qp) {
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_ERR;
	return ibv_modify_qp(qp, &a, IBV_QP_STATE);
}

// The sizes Go needs to allocate C arrays.
static size_t mr_sizeof_wr(void) { return sizeof(struct ibv_send_wr); }
static size_t mr_sizeof_sge(void) { return sizeof(struct ibv_sge); }
static size_t mr_sizeof_wc(void) { return sizeof(struct ibv_wc); }

// Readers of a built chain, for the tests of mr_build.
static struct ibv_send_wr *mr_wr_at(struct ibv_send_wr *wr, int i) { return &wr[i]; }

#endif
