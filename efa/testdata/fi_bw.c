/* fi_bw.c: the raw libfabric baseline of the efa benchmarks. It does what
 * the efa transport does, with nothing around it: RMA writes or reads of
 * SIZE bytes on an FI_EP_RDM endpoint, WINDOW of them in flight, each on
 * its own SIZE-byte slot, completions read 64 at a time.
 *
 *   fi_bw server PROV BYTES
 *       registers BYTES for remote access, prints one line
 *       "ADDRHEX KEY BASE VIRT" and polls its completion queue (the
 *       progress software providers need) until stdin closes.
 *   fi_bw client PROV write|read SIZE WINDOW ITERS ADDRHEX KEY BASE VIRT
 *       prints "NS" (nanoseconds from the first post to the last
 *       completion of ITERS operations).
 *
 * Built and run by the benchmarks (bench_test.go): gcc -O2 fi_bw.c -lfabric.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

static void die(const char *what, int rc)
{
	fprintf(stderr, "fi_bw: %s: %s\n", what, fi_strerror(rc < 0 ? -rc : rc));
	exit(1);
}

#define TRY(call) do { int rc_ = (int)(call); if (rc_) die(#call, rc_); } while (0)

struct res {
	struct fi_info *info;
	struct fid_fabric *fabric;
	struct fid_domain *domain;
	struct fid_av *av;
	struct fid_cq *cq;
	struct fid_ep *ep;
};

static void setup(struct res *r, const char *prov)
{
	struct fi_info *hints = fi_allocinfo();
	hints->caps = FI_RMA | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE;
	hints->ep_attr->type = FI_EP_RDM;
	hints->mode = FI_CONTEXT | FI_CONTEXT2;
	hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
	hints->domain_attr->threading = FI_THREAD_DOMAIN;
	hints->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
	hints->fabric_attr->prov_name = strdup(prov);
	TRY(fi_getinfo(FI_VERSION(1, 9), NULL, NULL, 0, hints, &r->info));
	fi_freeinfo(hints);
	TRY(fi_fabric(r->info->fabric_attr, &r->fabric, NULL));
	TRY(fi_domain(r->fabric, r->info, &r->domain, NULL));
	struct fi_av_attr av_attr = { .type = FI_AV_TABLE };
	TRY(fi_av_open(r->domain, &av_attr, &r->av, NULL));
	struct fi_cq_attr cq_attr = { .format = FI_CQ_FORMAT_CONTEXT, .size = 4096 };
	TRY(fi_cq_open(r->domain, &cq_attr, &r->cq, NULL));
	TRY(fi_endpoint(r->domain, r->info, &r->ep, NULL));
	TRY(fi_ep_bind(r->ep, &r->av->fid, 0));
	TRY(fi_ep_bind(r->ep, &r->cq->fid, FI_TRANSMIT | FI_RECV));
	TRY(fi_enable(r->ep));
}

static struct fid_mr *reg(struct res *r, void *buf, size_t len, uint64_t access)
{
	struct fid_mr *mr;
	TRY(fi_mr_reg(r->domain, buf, len, access, 0, 1, 0, &mr, NULL));
	return mr;
}

static int64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int server(const char *prov, size_t bytes)
{
	struct res r;
	setup(&r, prov);
	char *buf = aligned_alloc(4096, (bytes + 4095) & ~(size_t)4095);
	memset(buf, 1, bytes);
	struct fid_mr *mr = reg(&r, buf, bytes, FI_REMOTE_READ | FI_REMOTE_WRITE | FI_READ | FI_WRITE);
	unsigned char name[256];
	size_t namelen = sizeof name;
	TRY(fi_getname(&r.ep->fid, name, &namelen));
	for (size_t i = 0; i < namelen; i++)
		printf("%02x", name[i]);
	printf(" %llu %llu %d\n", (unsigned long long)fi_mr_key(mr), (unsigned long long)(uintptr_t)buf,
	       (r.info->domain_attr->mr_mode & FI_MR_VIRT_ADDR) != 0);
	fflush(stdout);
	struct fi_cq_entry e[64];
	for (unsigned long n = 0;; n++) {
		fi_cq_read(r.cq, e, 64);
		if ((n & 1023) == 0) {
			struct pollfd p = { .fd = 0, .events = POLLIN };
			if (poll(&p, 1, 0) > 0)
				break; /* stdin closed (or a line: either ends us) */
		}
	}
	fi_close(&r.ep->fid);
	fi_close(&mr->fid);
	return 0;
}

static int client(const char *prov, int write, size_t size, int window, long iters,
                  const char *addrhex, uint64_t key, uint64_t base, int virt)
{
	struct res r;
	setup(&r, prov);
	unsigned char name[256];
	size_t namelen = strlen(addrhex) / 2;
	if (namelen > sizeof name)
		die("address", FI_EINVAL);
	for (size_t i = 0; i < namelen; i++)
		sscanf(addrhex + 2 * i, "%2hhx", &name[i]);
	fi_addr_t peer;
	if (fi_av_insert(r.av, name, 1, &peer, 0, NULL) != 1)
		die("fi_av_insert", FI_EINVAL);
	char *buf = aligned_alloc(4096, size * window);
	memset(buf, 2, size * window);
	struct fid_mr *mr = reg(&r, buf, size * window, FI_READ | FI_WRITE);
	void *desc = fi_mr_desc(mr);
	struct fi_context2 *ctx = calloc(window, sizeof *ctx);
	uint64_t rbase = virt ? base : 0;

	long posted = 0, done = 0;
	/* The free slots, oldest first: a slot completed goes to the back, so
	 * the operations walk all window slots in turn, as the Go benchmark's
	 * do. (A stack would hand the slot just completed out again: with one
	 * operation in flight at a time, as shm's READs are, every operation
	 * would use one block, hot in the caches of both sides.) */
	int *pending = calloc(window, sizeof *pending), npending = 0, phead = 0;
	for (int i = 0; i < window; i++)
		pending[npending++] = i;
	/* One operation first, untimed: tcp;ofi_rxm connects on it. */
	{
		struct iovec iov = { buf, size };
		struct fi_rma_iov rma = { rbase, size, key };
		struct fi_msg_rma msg = { .msg_iov = &iov, .desc = &desc, .iov_count = 1, .addr = peer,
		                          .rma_iov = &rma, .rma_iov_count = 1, .context = &ctx[0] };
		ssize_t rc;
		struct fi_cq_entry e;
		while ((rc = fi_readmsg(r.ep, &msg, FI_COMPLETION | FI_DELIVERY_COMPLETE)) == -FI_EAGAIN)
			fi_cq_read(r.cq, &e, 1);
		if (rc)
			die("warm-up post", (int)rc);
		int64_t give_up = now_ns() + 30 * (int64_t)1000000000;
		while ((rc = fi_cq_read(r.cq, &e, 1)) == -FI_EAGAIN)
			if (now_ns() > give_up)
				die("warm-up: no completion in 30 s", FI_ETIMEDOUT);
		if (rc != 1)
			die("warm-up completion", (int)rc);
	}
	int64_t start = now_ns(), last = start;
	unsigned long idle = 0;
	while (done < iters) {
		while (npending > 0 && posted < iters) {
			int slot = pending[phead];
			struct iovec iov = { buf + (size_t)slot * size, size };
			struct fi_rma_iov rma = { rbase + (uint64_t)slot * size, size, key };
			struct fi_msg_rma msg = { .msg_iov = &iov, .desc = &desc, .iov_count = 1, .addr = peer,
			                          .rma_iov = &rma, .rma_iov_count = 1, .context = &ctx[slot] };
			ssize_t rc = write ? fi_writemsg(r.ep, &msg, FI_COMPLETION | FI_DELIVERY_COMPLETE)
			                   : fi_readmsg(r.ep, &msg, FI_COMPLETION | FI_DELIVERY_COMPLETE);
			if (rc == -FI_EAGAIN)
				break;
			if (rc)
				die("post", (int)rc);
			phead = (phead + 1) % window;
			npending--;
			posted++;
		}
		struct fi_cq_entry e[64];
		ssize_t n = fi_cq_read(r.cq, e, 64);
		if (n == -FI_EAGAIN && (++idle & 0xfffff) == 0 && now_ns() - last > 30 * (int64_t)1000000000)
			die("no completion in 30 s", FI_ETIMEDOUT);
		if (n > 0)
			last = now_ns();
		if (n == -FI_EAVAIL) {
			struct fi_cq_err_entry err = { 0 };
			fi_cq_readerr(r.cq, &err, 0);
			die("completion", err.err);
		}
		for (ssize_t i = 0; i < n; i++) {
			pending[(phead + npending++) % window] = (int)((struct fi_context2 *)e[i].op_context - ctx);
			done++;
		}
	}
	printf("%lld\n", (long long)(now_ns() - start));
	fi_close(&r.ep->fid);
	fi_close(&mr->fid);
	return 0;
}

int main(int argc, char **argv)
{
	if (argc == 4 && !strcmp(argv[1], "server"))
		return server(argv[2], strtoull(argv[3], NULL, 10));
	if (argc == 11 && !strcmp(argv[1], "client"))
		return client(argv[2], !strcmp(argv[3], "write"), strtoull(argv[4], NULL, 10), atoi(argv[5]),
		              atol(argv[6]), argv[7], strtoull(argv[8], NULL, 10), strtoull(argv[9], NULL, 10),
		              atoi(argv[10]));
	fprintf(stderr, "usage: fi_bw server PROV BYTES | fi_bw client PROV write|read SIZE WINDOW ITERS ADDRHEX KEY BASE VIRT\n");
	return 2;
}
