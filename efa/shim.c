//go:build efa && cgo

/* shim.c: see shim.h. */
#include "shim.h"

int fi_setup(fi_res *r, const char *prov, const char *domain, int cq_size, int *stage)
{
	struct fi_info *hints, *info = NULL;
	int ret;

	memset(r, 0, sizeof *r);
	*stage = 0;
	hints = fi_allocinfo();
	if (!hints)
		return -FI_ENOMEM;
	hints->caps = FI_RMA | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE;
	hints->ep_attr->type = FI_EP_RDM;
	hints->mode = FI_CONTEXT | FI_CONTEXT2;
	hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED |
	                              FI_MR_PROV_KEY | FI_MR_ENDPOINT;
	hints->domain_attr->threading = FI_THREAD_SAFE;
	hints->fabric_attr->prov_name = strdup(prov);
	if (domain)
		hints->domain_attr->name = strdup(domain);
	/* A WRITE completes once its bytes are in the target's memory: the
	 * engine reports it done to its caller then. Providers that cannot
	 * say so are refused below rather than used with weaker semantics. */
	hints->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
	ret = fi_getinfo(FI_VERSION(1, 9), NULL, NULL, 0, hints, &info);
	fi_freeinfo(hints);
	if (ret)
		return ret;
	r->info = info;
	r->flags = FI_COMPLETION | FI_DELIVERY_COMPLETE;
	r->mr_mode = info->domain_attr->mr_mode;
	r->max_msg = info->ep_attr->max_msg_size;
	r->tx_size = info->tx_attr->size;
	r->addr_format = info->addr_format;
	r->key_size = info->domain_attr->mr_key_size;
	strncpy(r->prov, info->fabric_attr->prov_name, sizeof r->prov - 1);

	*stage = 1;
	if ((ret = fi_fabric(info->fabric_attr, &r->fabric, NULL)))
		goto fail;
	*stage = 2;
	if ((ret = fi_domain(r->fabric, info, &r->domain, NULL)))
		goto fail;
	*stage = 3;
	struct fi_av_attr av_attr = { .type = FI_AV_TABLE };
	if ((ret = fi_av_open(r->domain, &av_attr, &r->av, NULL)))
		goto fail;
	*stage = 4;
	struct fi_cq_attr cq_attr = { .format = FI_CQ_FORMAT_CONTEXT, .size = cq_size,
	                              .wait_obj = FI_WAIT_NONE };
	if ((ret = fi_cq_open(r->domain, &cq_attr, &r->cq, NULL)))
		goto fail;
	*stage = 5;
	if ((ret = fi_endpoint(r->domain, info, &r->ep, NULL)))
		goto fail;
	*stage = 6;
	if ((ret = fi_ep_bind(r->ep, &r->av->fid, 0)))
		goto fail;
	if ((ret = fi_ep_bind(r->ep, &r->cq->fid, FI_TRANSMIT | FI_RECV)))
		goto fail;
	*stage = 7;
	if ((ret = fi_enable(r->ep)))
		goto fail;
	*stage = 8;
	r->namelen = sizeof r->name;
	if ((ret = fi_getname(&r->ep->fid, r->name, &r->namelen)))
		goto fail;
	if (r->namelen == 0 || r->namelen > sizeof r->name) {
		ret = -FI_ETOOSMALL;
		goto fail;
	}
	return 0;
fail:
	fi_teardown(r);
	return ret;
}

void fi_teardown(fi_res *r)
{
	if (r->ep)
		fi_close(&r->ep->fid);
	if (r->av)
		fi_close(&r->av->fid);
	if (r->cq)
		fi_close(&r->cq->fid);
	if (r->domain)
		fi_close(&r->domain->fid);
	if (r->fabric)
		fi_close(&r->fabric->fid);
	if (r->info)
		fi_freeinfo(r->info);
	r->ep = NULL;
	r->av = NULL;
	r->cq = NULL;
	r->domain = NULL;
	r->fabric = NULL;
	r->info = NULL;
}

int fi_reg(fi_res *r, uint64_t addr, uint64_t len, uint64_t access, uint64_t key,
           struct fid_mr **mr, uint64_t *key_out, uint64_t *desc_out)
{
	int ret = fi_mr_reg(r->domain, (void *)(uintptr_t)addr, len, access, 0, key, 0, mr, NULL);
	if (ret)
		return ret;
	if (r->mr_mode & FI_MR_ENDPOINT) {
		if ((ret = fi_mr_bind(*mr, &r->ep->fid, 0)) || (ret = fi_mr_enable(*mr))) {
			fi_close(&(*mr)->fid);
			return ret;
		}
	}
	*key_out = fi_mr_key(*mr);
	if (*key_out == FI_KEY_NOTAVAIL) {
		fi_close(&(*mr)->fid);
		return -FI_ENOKEY;
	}
	*desc_out = (uint64_t)(uintptr_t)fi_mr_desc(*mr);
	return 0;
}

int fi_unreg(struct fid_mr *mr)
{
	return fi_close(&mr->fid);
}

int fi_insert(fi_res *r, const void *addr, uint64_t *out)
{
	fi_addr_t a = FI_ADDR_NOTAVAIL;
	int ret = fi_av_insert(r->av, addr, 1, &a, 0, NULL);
	if (ret < 0)
		return ret;
	if (ret != 1 || a == FI_ADDR_NOTAVAIL)
		return -FI_EADDRNOTAVAIL;
	*out = a;
	return 0;
}

int fi_remove(fi_res *r, uint64_t addr)
{
	fi_addr_t a = addr;
	return fi_av_remove(r->av, &a, 1, 0);
}

size_t mr_post(fi_res *r, mr_op *ops, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		mr_op *o = &ops[i];
		struct iovec iov = { (void *)(uintptr_t)o->local, o->len };
		void *desc = (void *)(uintptr_t)o->desc;
		struct fi_rma_iov rma = { o->raddr, o->len, o->rkey };
		struct fi_msg_rma msg = {
			.msg_iov = &iov, .desc = &desc, .iov_count = 1, .addr = o->dest,
			.rma_iov = &rma, .rma_iov_count = 1, .context = (void *)(uintptr_t)o->ctx,
		};
		ssize_t ret = o->op == 2 ? fi_writemsg(r->ep, &msg, r->flags)
		                         : fi_readmsg(r->ep, &msg, r->flags);
		if (ret == -FI_EAGAIN)
			return i;
		o->rc = (int32_t)ret;
	}
	return n;
}

int cq_poll(fi_res *r, cq_ent *out, int max)
{
	struct fi_cq_entry buf[64];
	int got = 0;

	if (max > 64)
		max = 64;
	while (got < max) {
		ssize_t n = fi_cq_read(r->cq, buf, max - got);
		if (n > 0) {
			for (ssize_t i = 0; i < n; i++, got++) {
				out[got].ctx = (uint64_t)(uintptr_t)buf[i].op_context;
				out[got].err = 0;
				out[got].perr = 0;
			}
			if (n < max - got + n)
				break; /* the queue is drained for now */
			continue;
		}
		if (n == -FI_EAVAIL) {
			struct fi_cq_err_entry e;
			memset(&e, 0, sizeof e);
			if (fi_cq_readerr(r->cq, &e, 0) != 1)
				break;
			out[got].ctx = (uint64_t)(uintptr_t)e.op_context;
			out[got].err = e.err ? e.err : FI_EIO;
			out[got].perr = e.prov_errno;
			got++;
			continue;
		}
		if (n != -FI_EAGAIN && got == 0)
			return (int)n;
		break;
	}
	return got;
}
