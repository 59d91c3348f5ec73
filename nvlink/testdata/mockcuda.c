/*
 * mockcuda.c: a stand-in for libcuda.so.1 with the C ABI of the functions
 * the nvlink package calls, so that its real driver layer (cuda.go: the
 * purego bindings, argument order, the 64-byte handle passed by value,
 * out-parameters, CUresult handling) runs on machines without a GPU.
 *
 * It is a model, not a GPU: "device memory" is a shared-memory file
 * mapped into the process, so that another process can map it through the
 * IPC handle (which carries the file's name); copies run at once with
 * memcpy; an event reports CUDA_ERROR_NOT_READY on its first query after
 * a record and success afterwards, so callers must poll. Only what the
 * package uses is here. Build: cc -shared -fPIC -o libmockcuda.so mockcuda.c
 */
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef uint64_t CUdeviceptr;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUevent;
typedef struct { char reserved[64]; } CUipcMemHandle;

enum { NDEV = 2, MAXALLOC = 1024 };
enum {
	OK = 0, INVALID_VALUE = 1, NOT_INITIALIZED = 3, INVALID_DEVICE = 101,
	INVALID_CONTEXT = 201, INVALID_HANDLE = 400, NOT_FOUND = 500, NOT_READY = 600,
};

struct alloc {
	uintptr_t base;
	size_t size;
	int dev;
	int imported; /* mapped from another process's handle */
	char name[48];
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct alloc allocs[MAXALLOC];
static int inited;
static int counter;
static __thread int current = -1;

struct event { int queries_left; };

static struct alloc *find(uintptr_t p) {
	for (int i = 0; i < MAXALLOC; i++)
		if (allocs[i].base && p >= allocs[i].base && p < allocs[i].base + allocs[i].size)
			return &allocs[i];
	return NULL;
}

static struct alloc *slot(void) {
	for (int i = 0; i < MAXALLOC; i++)
		if (!allocs[i].base)
			return &allocs[i];
	return NULL;
}

CUresult cuInit(unsigned flags) {
	if (flags != 0) return INVALID_VALUE;
	inited = 1;
	return OK;
}

CUresult cuDeviceGetCount(int *n) {
	if (!inited) return NOT_INITIALIZED;
	*n = NDEV;
	return OK;
}

CUresult cuDeviceGet(CUdevice *d, int ordinal) {
	if (ordinal < 0 || ordinal >= NDEV) return INVALID_DEVICE;
	*d = ordinal + 100; /* not the ordinal: callers must pass what they got */
	return OK;
}

CUresult cuDeviceGetPCIBusId(char *buf, int len, CUdevice d) {
	if (d < 100 || d >= 100 + NDEV || len < 13) return INVALID_DEVICE;
	snprintf(buf, len, "0000:%02X:00.0", 0x3b + d - 100);
	return OK;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) {
	if (d < 100 || d >= 100 + NDEV) return INVALID_DEVICE;
	*c = (CUcontext)(uintptr_t)(0x5000 + d - 100);
	return OK;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
	return d < 100 || d >= 100 + NDEV ? INVALID_DEVICE : OK;
}

CUresult cuCtxSetCurrent(CUcontext c) {
	uintptr_t v = (uintptr_t)c;
	if (v < 0x5000 || v >= 0x5000 + NDEV) return INVALID_CONTEXT;
	current = (int)(v - 0x5000);
	return OK;
}

static CUresult mapfile(const char *name, size_t size, int create, uintptr_t *out) {
	char path[80];
	snprintf(path, sizeof path, "/dev/shm/%s", name);
	int fd = open(path, create ? O_RDWR | O_CREAT | O_EXCL : O_RDWR, 0600);
	if (fd < 0) return INVALID_HANDLE;
	if (create && ftruncate(fd, (off_t)size) != 0) { close(fd); unlink(path); return INVALID_VALUE; }
	void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (p == MAP_FAILED) return INVALID_VALUE;
	*out = (uintptr_t)p;
	return OK;
}

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t size) {
	if (current < 0) return INVALID_CONTEXT;
	if (size == 0) return INVALID_VALUE;
	pthread_mutex_lock(&mu);
	struct alloc *a = slot();
	CUresult r = a ? OK : 2;
	if (r == OK) {
		snprintf(a->name, sizeof a->name, "mockcuda-%d-%d", (int)getpid(), ++counter);
		r = mapfile(a->name, size, 1, &a->base);
		a->size = size;
		a->dev = current;
		a->imported = 0;
		if (r == OK) *p = a->base; else a->base = 0;
	}
	pthread_mutex_unlock(&mu);
	return r;
}

CUresult cuMemFree_v2(CUdeviceptr p) {
	pthread_mutex_lock(&mu);
	struct alloc *a = find(p);
	CUresult r = a && a->base == p && !a->imported ? OK : INVALID_VALUE;
	if (r == OK) {
		char path[80];
		snprintf(path, sizeof path, "/dev/shm/%s", a->name);
		unlink(path);
		munmap((void *)a->base, a->size);
		a->base = 0;
	}
	pthread_mutex_unlock(&mu);
	return r;
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
	pthread_mutex_lock(&mu);
	struct alloc *a = find(p);
	if (a) { if (base) *base = a->base; if (size) *size = a->size; }
	pthread_mutex_unlock(&mu);
	return a ? OK : NOT_FOUND;
}

CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr p) {
	pthread_mutex_lock(&mu);
	struct alloc *a = find(p);
	CUresult r = a ? OK : INVALID_VALUE;
	if (a && attr == 2) *(unsigned *)data = 2; /* CU_MEMORYTYPE_DEVICE */
	else if (a && attr == 9) *(int *)data = a->dev;
	else if (a) r = INVALID_VALUE;
	pthread_mutex_unlock(&mu);
	return r;
}

/* The handle: "mockipc", the exporter's pid, the size, the file name. */
CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p) {
	pthread_mutex_lock(&mu);
	struct alloc *a = find(p);
	CUresult r = a && a->base == p && !a->imported ? OK : INVALID_VALUE;
	if (r == OK) {
		memset(h, 0, sizeof *h);
		memcpy(h->reserved, "mockipc", 8);
		int pid = getpid();
		uint64_t size = a->size;
		memcpy(h->reserved + 8, &pid, 4);
		memcpy(h->reserved + 12, &size, 8);
		memcpy(h->reserved + 20, a->name, strlen(a->name) < 43 ? strlen(a->name) : 43);
	}
	pthread_mutex_unlock(&mu);
	return r;
}

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle h, unsigned flags) {
	if (current < 0) return INVALID_CONTEXT;
	if (memcmp(h.reserved, "mockipc", 8) != 0 || flags > 1) return INVALID_VALUE;
	int pid;
	uint64_t size;
	char name[48] = {0};
	memcpy(&pid, h.reserved + 8, 4);
	memcpy(&size, h.reserved + 12, 8);
	memcpy(name, h.reserved + 20, 43);
	if (pid == getpid()) return INVALID_CONTEXT; /* as CUDA: no opening one's own handles */
	pthread_mutex_lock(&mu);
	struct alloc *a = slot();
	CUresult r = a ? mapfile(name, size, 0, &a->base) : 2;
	if (r == OK) {
		a->size = size;
		a->dev = current;
		a->imported = 1;
		strcpy(a->name, name);
		*p = a->base;
	}
	pthread_mutex_unlock(&mu);
	return r;
}

CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
	pthread_mutex_lock(&mu);
	struct alloc *a = find(p);
	CUresult r = a && a->base == p && a->imported ? OK : INVALID_VALUE;
	if (r == OK) { munmap((void *)a->base, a->size); a->base = 0; }
	pthread_mutex_unlock(&mu);
	return r;
}

CUresult cuStreamCreate(CUstream *s, unsigned flags) {
	if (current < 0) return INVALID_CONTEXT;
	if (flags != 1) return INVALID_VALUE; /* the package asks for CU_STREAM_NON_BLOCKING */
	*s = malloc(16);
	return OK;
}

CUresult cuStreamDestroy_v2(CUstream s) { free(s); return OK; }
CUresult cuStreamSynchronize(CUstream s) { return s ? OK : INVALID_HANDLE; }

CUresult cuEventCreate(CUevent *e, unsigned flags) {
	if (current < 0) return INVALID_CONTEXT;
	if (flags != 2) return INVALID_VALUE; /* CU_EVENT_DISABLE_TIMING */
	*e = calloc(1, sizeof(struct event));
	return OK;
}

CUresult cuEventRecord(CUevent e, CUstream s) {
	if (!e || !s) return INVALID_HANDLE;
	((struct event *)e)->queries_left = 1;
	return OK;
}

CUresult cuEventQuery(CUevent e) {
	struct event *ev = e;
	if (!ev) return INVALID_HANDLE;
	if (ev->queries_left > 0) { ev->queries_left--; return NOT_READY; }
	return OK;
}

CUresult cuEventDestroy_v2(CUevent e) { free(e); return OK; }

static CUresult copy(uintptr_t dst, uintptr_t src, size_t n, CUstream s, int ddev, int sdev) {
	if (!s) return INVALID_HANDLE;
	pthread_mutex_lock(&mu);
	struct alloc *d = ddev ? find(dst) : NULL, *r = sdev ? find(src) : NULL;
	int bad = (ddev && (!d || dst + n > d->base + d->size)) || (sdev && (!r || src + n > r->base + r->size));
	pthread_mutex_unlock(&mu);
	if (bad) return 700; /* CUDA_ERROR_ILLEGAL_ADDRESS */
	memcpy((void *)dst, (const void *)src, n);
	return OK;
}

CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) { return copy(d, s, n, st, 1, 1); }
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *s, size_t n, CUstream st) { return copy(d, (uintptr_t)s, n, st, 1, 0); }
CUresult cuMemcpyDtoHAsync_v2(void *d, CUdeviceptr s, size_t n, CUstream st) { return copy((uintptr_t)d, s, n, st, 0, 1); }

/* CUmemcpyAttributes: source access order, two CUmemLocation hints, flags. */
typedef struct {
	int srcAccessOrder;
	struct { int type, id; } srcLocHint, dstLocHint;
	unsigned flags;
} CUmemcpyAttributes;

/*
 * CUDA 13's batch copy (no failIdx). The model insists on what the
 * transport passes: one attribute for every copy, sources in stream order
 * (1), no hints, and a copy count the arrays agree with; the copies run
 * at once, every one checked before any runs.
 */
CUresult cuMemcpyBatchAsync_v2(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                               CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs, CUstream st) {
	if (!st) return INVALID_HANDLE;
	if (!dsts || !srcs || !sizes || count == 0 || !attrs || !attrsIdxs || numAttrs != 1 || attrsIdxs[0] != 0)
		return INVALID_VALUE;
	if (attrs[0].srcAccessOrder != 1 || attrs[0].srcLocHint.type || attrs[0].dstLocHint.type || attrs[0].flags)
		return INVALID_VALUE;
	pthread_mutex_lock(&mu);
	for (size_t i = 0; i < count; i++) {
		struct alloc *d = find(dsts[i]), *r = find(srcs[i]);
		if (!d || !r || dsts[i] + sizes[i] > d->base + d->size || srcs[i] + sizes[i] > r->base + r->size) {
			pthread_mutex_unlock(&mu);
			return 700; /* CUDA_ERROR_ILLEGAL_ADDRESS */
		}
	}
	pthread_mutex_unlock(&mu);
	for (size_t i = 0; i < count; i++)
		memcpy((void *)dsts[i], (const void *)srcs[i], sizes[i]);
	return OK;
}

CUresult cuMemHostAlloc(void **p, size_t n, unsigned flags) {
	if (flags != 1 && flags != 3) return INVALID_VALUE; /* PORTABLE, with or without DEVICEMAP */
	*p = malloc(n);
	return *p ? OK : 2;
}

CUresult cuMemFreeHost(void *p) { free(p); return OK; }

/* Mapped pinned memory: the model's device address of it is its address. */
CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *d, void *p, unsigned flags) {
	if (!d || !p || flags) return INVALID_VALUE;
	*d = (CUdeviceptr)p;
	return OK;
}

/*
 * The gather kernel. The model does not compile PTX: it checks the image
 * looks like the transport's kernel and, on a launch, does what the
 * kernel does: the blocks of column b (however many rows) copy descriptor
 * (start+b)&mask, {dst, src, len} of 8 bytes each, from the ring the
 * first parameter points at.
 */
typedef void *CUmodule;
typedef void *CUfunction;
static int module_tag, function_tag;

CUresult cuModuleLoadData(CUmodule *m, const void *image) {
	if (!m || !image) return INVALID_VALUE;
	const char *ptx = image;
	if (strncmp(ptx, ".version ", 9) || !strstr(ptx, ".entry moonring_gather(") || !strstr(ptx, "ld.global.v4.u32"))
		return 218; /* CUDA_ERROR_INVALID_PTX */
	*m = &module_tag;
	return OK;
}

CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name) {
	if (!f || m != &module_tag) return INVALID_HANDLE;
	if (strcmp(name, "moonring_gather")) return NOT_FOUND;
	*f = &function_tag;
	return OK;
}

CUresult cuModuleUnload(CUmodule m) { return m == &module_tag ? OK : INVALID_HANDLE; }

/* The last launch's grid (x and y) and block sizes, for the tests (mock_last_launch). */
static unsigned last_grid, last_rows, last_block;

unsigned mock_last_launch(unsigned *rows, unsigned *block) {
	*rows = last_rows;
	*block = last_block;
	return last_grid;
}

CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, CUstream st, void **params, void **extra) {
	if (f != &function_tag || !st) return INVALID_HANDLE;
	if (gx == 0 || gy == 0 || gy > 65535 || gz != 1 || bx == 0 || bx > 1024 || bx % 32 || by != 1 || bz != 1 || shared || !params || extra)
		return INVALID_VALUE;
	last_grid = gx;
	last_rows = gy;
	last_block = bx;
	const uint64_t *ring = (const uint64_t *)*(uint64_t *)params[0];
	uint32_t start = *(uint32_t *)params[1], mask = *(uint32_t *)params[2];
	for (unsigned b = 0; b < gx; b++) {
		const uint64_t *d = ring + 3 * ((start + b) & mask);
		if (d[2] == 0) continue;
		if (d[2] % 16 || d[0] % 16 || d[1] % 16) return 716; /* CUDA_ERROR_MISALIGNED_ADDRESS */
		CUresult r = copy(d[0], d[1], d[2], st, 1, 1);
		if (r != OK) return r;
	}
	return OK;
}

CUresult cuGetErrorString(CUresult r, const char **s) {
	switch (r) {
	case INVALID_VALUE: *s = "invalid argument (mock)"; return OK;
	case INVALID_CONTEXT: *s = "invalid device context (mock)"; return OK;
	case INVALID_HANDLE: *s = "invalid resource handle (mock)"; return OK;
	case 700: *s = "an illegal memory access was encountered (mock)"; return OK;
	}
	*s = "unknown error (mock)";
	return OK;
}
