/* shim.h: the C side of the efa transport (build tag efa). Every function
 * here is called once per batch or once per setup step, never per slice
 * from Go. Nothing here calls back into Go. */
#ifndef MOONRING_EFA_SHIM_H
#define MOONRING_EFA_SHIM_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_errno.h>

/* One RMA operation, filled by Go in Go memory (no Go pointers: addresses
 * are integers), posted by mr_post. */
typedef struct {
	uint64_t local;  /* first local byte */
	uint64_t len;
	uint64_t desc;   /* fi_mr_desc of the local MR, or 0 */
	uint64_t raddr;  /* remote address (virtual, or offset in the MR) */
	uint64_t rkey;
	uint64_t dest;   /* fi_addr_t of the peer */
	uint64_t ctx;    /* the operation's struct fi_context2 */
	uint32_t op;     /* 1 read, 2 write */
	int32_t rc;      /* out: the post's result (0, or a negative FI_E*) */
} mr_op;

/* One completion, as Poll hands it to Go. */
typedef struct {
	uint64_t ctx;
	int32_t err;  /* 0, or a positive FI_E* */
	int32_t perr; /* the provider's own error number */
} cq_ent;

typedef struct {
	struct fi_info *info;
	struct fid_fabric *fabric;
	struct fid_domain *domain;
	struct fid_av *av;
	struct fid_cq *cq;
	struct fid_ep *ep;
	uint64_t flags;      /* op flags of every fi_writemsg / fi_readmsg */
	size_t namelen;
	char name[256];      /* fi_getname */
	char prov[64];       /* fabric_attr->prov_name */
	uint64_t mr_mode;
	uint64_t max_msg;
	uint64_t tx_size;
	uint32_t addr_format;
	size_t key_size;
} fi_res;

/* fi_setup opens everything for provider prov (and domain, when not
 * NULL); on failure it returns a negative FI_E* and sets *stage to the step
 * that failed, having closed what it opened. */
int fi_setup(fi_res *r, const char *prov, const char *domain, int cq_size, int *stage);
void fi_teardown(fi_res *r);

int fi_reg(fi_res *r, uint64_t addr, uint64_t len, uint64_t access, uint64_t key,
           struct fid_mr **mr, uint64_t *key_out, uint64_t *desc_out);
int fi_unreg(struct fid_mr *mr);

int fi_insert(fi_res *r, const void *addr, uint64_t *out);
int fi_remove(fi_res *r, uint64_t addr);

size_t mr_post(fi_res *r, mr_op *ops, size_t n);
int cq_poll(fi_res *r, cq_ent *out, int max);

#endif
