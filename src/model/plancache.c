/* plancache.c — the plan cache (dg_model.h "plan cache and circuit breaker", docs/cuda.md "Plan
 * cache"): the key of a build (versions, libraries by file hash, the IR hash, the options that change
 * the plan), one entry file per rank holding the graph after the passes, the memory plan, the model's
 * references into them and the probe figures, read back into a model instead of running the passes.
 *
 * Entry file: a first line "DGPLAN 1 <bytes that follow> <FNV-1a 64 of them, hex>", then text lines
 * "key.<name>=<value>" and "probe.<name>=<value>", a line "end", then the binary part (little-endian
 * int64 fields, see put_node / put_model). Written to <path>.tmp.<pid> and renamed over the entry.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <link.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "model_impl.h"

/* ---------------- hashes ---------------- */

static uint64_t fnv1a(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= 0x100000001b3ull;
    }
    return h;
}
#define FNV0 0xcbf29ce484222325ull

/* Library files are hundreds of MB (cuDNN, cuBLASLt), hashed on a cold start: XXH3 (measured 13.0 GB/s
 * on libcublasLt.so.13, 542 MB, one core of the development machine) instead of a word-wise multiply
 * chain (4.9 GB/s there). */
static int hash_file(const char *path, uint64_t *out) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    size_t cap = (size_t)4 << 20;
    unsigned char *buf = dg_xmalloc(cap);
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    int rc = 0;
    for (;;) {
        ssize_t r = read(fd, buf, cap);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            rc = -1;
            break;
        }
        if (r == 0) break;
        XXH3_64bits_update(&st, buf, (size_t)r);
    }
    free(buf);
    close(fd);
    if (rc == 0) *out = XXH3_64bits_digest(&st);
    return rc;
}

/* ---------------- growable text and byte buffers ---------------- */

typedef struct {
    unsigned char *p;
    size_t n, cap;
} buf_t;

static void buf_put(buf_t *b, const void *p, size_t n) {
    if (b->n + n > b->cap) {
        size_t c = b->cap ? b->cap : 4096;
        while (c < b->n + n)
            c *= 2;
        unsigned char *q = realloc(b->p, c);
        DG_ASSERT(q != NULL);
        b->p = q;
        b->cap = c;
    }
    memcpy(b->p + b->n, p, n);
    b->n += n;
}

static void buf_printf(buf_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void buf_printf(buf_t *b, const char *fmt, ...) {
    char tmp[2048];
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (k < 0) return;
    buf_put(b, tmp, (size_t)k < sizeof tmp ? (size_t)k : sizeof tmp - 1);
}

static void put64(buf_t *b, int64_t v) {
    buf_put(b, &v, sizeof v);
}

typedef struct {
    const unsigned char *p;
    size_t n, at;
    int bad;
} rd_t;

static int64_t get64(rd_t *r) {
    int64_t v = 0;
    if (r->bad || r->at + sizeof v > r->n) {
        r->bad = 1;
        return 0;
    }
    memcpy(&v, r->p + r->at, sizeof v);
    r->at += sizeof v;
    return v;
}

/* ---------------- library identities (hashed once per path, size and mtime) ---------------- */

typedef struct {
    char path[512];
    int64_t size, mtime_ns;
    uint64_t hash;
} libhash_t;

typedef struct {
    libhash_t *v;
    int n, cap, dirty;
} libhash_tab_t;

static void libtab_load(libhash_tab_t *t, const char *file) {
    FILE *f = fopen(file, "r");
    if (!f) return;
    char line[700];
    while (fgets(line, sizeof line, f)) {
        libhash_t e;
        int used = 0;
        if (sscanf(line, "%" SCNx64 " %" SCNd64 " %" SCNd64 " %n", &e.hash, &e.size, &e.mtime_ns, &used) != 3)
            continue;
        char *p = line + used;
        p[strcspn(p, "\n")] = 0;
        if (!*p || strlen(p) >= sizeof e.path) continue;
        snprintf(e.path, sizeof e.path, "%s", p);
        if (t->n == t->cap) {
            t->cap = t->cap ? 2 * t->cap : 16;
            t->v = realloc(t->v, (size_t)t->cap * sizeof *t->v);
            DG_ASSERT(t->v != NULL);
        }
        t->v[t->n++] = e;
    }
    fclose(f);
}

static void libtab_save(const libhash_tab_t *t, const char *file) {
    char tmp[1300];
    dg_fmt(tmp, sizeof tmp, "%s.tmp.%d", file, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f) return;
    for (int i = 0; i < t->n; i++)
        fprintf(f, "%016" PRIx64 " %" PRId64 " %" PRId64 " %s\n", t->v[i].hash, t->v[i].size,
                t->v[i].mtime_ns, t->v[i].path);
    if (fclose(f) != 0 || rename(tmp, file) != 0) unlink(tmp);
}

/* The hash of a file by path, from the table when its size and mtime are the ones remembered. */
static int lib_hash(libhash_tab_t *t, const char *path, uint64_t *out) {
    struct stat st;
    if (stat(path, &st) != 0) return -1;
    int64_t mt = (int64_t)st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec;
    for (int i = 0; i < t->n; i++)
        if (strcmp(t->v[i].path, path) == 0 && t->v[i].size == (int64_t)st.st_size &&
            t->v[i].mtime_ns == mt) {
            *out = t->v[i].hash;
            return 0;
        }
    uint64_t h;
    if (hash_file(path, &h) != 0) return -1;
    libhash_t e = {.size = (int64_t)st.st_size, .mtime_ns = mt, .hash = h};
    if (strlen(path) >= sizeof e.path) return -1;
    snprintf(e.path, sizeof e.path, "%s", path);
    int slot = -1;
    for (int i = 0; i < t->n; i++)
        if (strcmp(t->v[i].path, path) == 0) slot = i;
    if (slot < 0) {
        if (t->n == t->cap) {
            t->cap = t->cap ? 2 * t->cap : 16;
            t->v = realloc(t->v, (size_t)t->cap * sizeof *t->v);
            DG_ASSERT(t->v != NULL);
        }
        slot = t->n++;
    }
    t->v[slot] = e;
    t->dirty = 1;
    *out = h;
    return 0;
}

/* The runtime libraries that decide what a plan computes, by the start of their file name. */
static const char *const lib_prefixes[] = {"libcuda.so",  "libcudart.so", "libcublasLt.so", "libcublas.so",
                                           "libcudnn.so", "libcudnn_",    "libnccl.so",     "libopenblas",
                                           "libblas.so",  "libgomp.so",   "libmpi.so"};

typedef struct {
    char path[512];
    uint64_t bid; /* XXH3 of the object's GNU build ID, 0 when it has none */
} lib_t;

typedef struct {
    lib_t *v;
    int n, cap;
    uint64_t exe_bid; /* the main program's */
} libs_t;

/* The GNU build ID of a loaded object, read from its PT_NOTE segments in memory (no file read): the
 * linker's hash of the object's contents, so it identifies a library build as a hash of the file would
 * (and costs nothing: hashing the CUDA libraries' files took ~1 s of a cold start on the GPU host).
 * Returned as XXH3 of the ID's bytes, 0 when the object has no build ID. */
static uint64_t build_id_of(const struct dl_phdr_info *info) {
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type != PT_NOTE) continue;
        const unsigned char *q = (const unsigned char *)(info->dlpi_addr + ph->p_vaddr),
                            *end = q + ph->p_memsz;
        const size_t al = ph->p_align == 8 ? 8 : 4; /* a segment of 8-aligned notes pads to 8 */
        while (q + sizeof(ElfW(Nhdr)) <= end) {
            ElfW(Nhdr) nh;
            memcpy(&nh, q, sizeof nh);
            const unsigned char *name = q + sizeof nh;
            const unsigned char *desc = name + ((nh.n_namesz + al - 1) & ~(al - 1));
            const unsigned char *next = desc + ((nh.n_descsz + al - 1) & ~(al - 1));
            if (next > end || next <= q) break;
            if (nh.n_type == NT_GNU_BUILD_ID && nh.n_namesz == 4 && memcmp(name, "GNU", 4) == 0 &&
                nh.n_descsz > 0)
                return XXH3_64bits(desc, nh.n_descsz) | 1u; /* never 0 */
            q = next;
        }
    }
    return 0;
}

static int collect_lib(struct dl_phdr_info *info, size_t size, void *ctx) {
    (void)size;
    libs_t *l = ctx;
    const char *p = info->dlpi_name;
    if (!p || !*p) {
        if (!l->exe_bid && info->dlpi_phdr) l->exe_bid = build_id_of(info); /* the first: the program */
        return 0;
    }
    const char *base = strrchr(p, '/');
    base = base ? base + 1 : p;
    int want = 0;
    for (size_t i = 0; i < sizeof lib_prefixes / sizeof *lib_prefixes; i++)
        if (strncmp(base, lib_prefixes[i], strlen(lib_prefixes[i])) == 0) want = 1;
    if (!want || strlen(p) >= 512) return 0;
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 16;
        l->v = realloc(l->v, (size_t)l->cap * sizeof *l->v);
        DG_ASSERT(l->v != NULL);
    }
    lib_t *e = &l->v[l->n++];
    snprintf(e->path, sizeof e->path, "%s", p);
    e->bid = build_id_of(info);
    return 0;
}

static int cmp_lib(const void *a, const void *b) {
    return strcmp(((const lib_t *)a)->path, ((const lib_t *)b)->path);
}

/* A version function of an already loaded library (never loads one). */
static void *loaded_sym(const char *lib_path, const char *sym) {
    void *h = lib_path ? dlopen(lib_path, RTLD_LAZY | RTLD_NOLOAD) : NULL;
    void *f = h ? dlsym(h, sym) : dlsym(RTLD_DEFAULT, sym);
    if (h) dlclose(h);
    return f;
}

static const char *find_lib(const libs_t *l, const char *prefix) {
    for (int i = 0; i < l->n; i++) {
        const char *b = strrchr(l->v[i].path, '/');
        b = b ? b + 1 : l->v[i].path;
        if (strncmp(b, prefix, strlen(prefix)) == 0) return l->v[i].path;
    }
    return NULL;
}

static void key_versions(buf_t *k, const libs_t *l, const dg_backend_t *be) {
    typedef int (*int_ptr_fn)(int *);
    typedef size_t (*size_fn)(void);
    typedef const char *(*str_fn)(void);
    str_fn obc = (str_fn)loaded_sym(find_lib(l, "libopenblas"), "openblas_get_config");
    buf_printf(k, "key.openblas=%s\n", obc ? obc() : "-");
    if (strcmp(be->ops->name, "cuda") != 0) return;
    int v = 0;
    int_ptr_fn drv = (int_ptr_fn)loaded_sym(find_lib(l, "libcuda.so"), "cuDriverGetVersion");
    buf_printf(k, "key.cuda_driver=%d\n", drv && drv(&v) == 0 ? v : -1);
    int_ptr_fn rt = (int_ptr_fn)loaded_sym(find_lib(l, "libcudart.so"), "cudaRuntimeGetVersion");
    v = 0;
    buf_printf(k, "key.cuda_runtime=%d\n", rt && rt(&v) == 0 ? v : -1); /* -1: linked statically (binary) */
    size_fn lt = (size_fn)loaded_sym(find_lib(l, "libcublasLt.so"), "cublasLtGetVersion");
    buf_printf(k, "key.cublaslt=%zu\n", lt ? lt() : (size_t)0);
    size_fn dnn = (size_fn)loaded_sym(find_lib(l, "libcudnn"), "cudnnGetVersion");
    buf_printf(k, "key.cudnn=%zu\n", dnn ? dnn() : (size_t)0);
    int_ptr_fn nc = (int_ptr_fn)loaded_sym(find_lib(l, "libnccl.so"), "ncclGetVersion");
    v = 0;
    buf_printf(k, "key.nccl=%d\n", nc && nc(&v) == 0 ? v : -1);
    /* the current device through the driver API (the runtime made its context current on this thread) */
    typedef int (*cu_dev_fn)(int *);
    typedef int (*cu_attr_fn)(int *, int, int);
    typedef int (*cu_name_fn)(char *, int, int);
    const char *cu = find_lib(l, "libcuda.so");
    cu_dev_fn getdev = (cu_dev_fn)loaded_sym(cu, "cuCtxGetDevice");
    cu_attr_fn attr = (cu_attr_fn)loaded_sym(cu, "cuDeviceGetAttribute");
    cu_name_fn name = (cu_name_fn)loaded_sym(cu, "cuDeviceGetName");
    int dev = -1, ma = -1, mi = -1;
    char nm[256] = "?";
    if (getdev && getdev(&dev) == 0) {
        if (attr) {
            (void)attr(&ma, 75, dev); /* CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR */
            (void)attr(&mi, 76, dev); /* ..._MINOR */
        }
        if (name && name(nm, (int)sizeof nm, dev) != 0) snprintf(nm, sizeof nm, "?");
    }
    buf_printf(k, "key.device=%s\nkey.compute_capability=%d.%d\n", nm, ma, mi);
}

/* ---------------- graph serialization ---------------- */

/* Node pointer -> id; -2 when it is not the graph's node (the plan cannot be cached). */
static int64_t nid(const dg_graph_t *g, const dg_node_t *n) {
    if (!n) return -1;
    if (n->id < 0 || n->id >= g->n || g->nodes[n->id] != n) return -2;
    return n->id;
}

/* A node reference as its id; *ok = 0 when it is not the graph's node. */
static void put_id(buf_t *b, const dg_graph_t *g, const dg_node_t *n, int *ok) {
    int64_t i = nid(g, n);
    if (i == -2) *ok = 0;
    put64(b, i);
}
#define PID(x) put_id(b, g, (x), &ok)

/* A node's list of cnt node references, as get_node_ids reads it: cnt, then cap ids (-1 past cnt). */
static void put_ids(buf_t *b, const dg_graph_t *g, dg_node_t *const *ids, int cnt, int cap, int *ok) {
    put64(b, cnt);
    for (int i = 0; i < cap; i++)
        put_id(b, g, i < cnt ? ids[i] : NULL, ok);
}

static int put_node(buf_t *b, const dg_graph_t *g, const dg_node_t *n) {
    int ok = 1;
    buf_put(b, n->name, sizeof n->name);
    put64(b, n->op);
    put64(b, n->phase);
    put64(b, n->flags);
    put64(b, n->storage);
    put64(b, n->stream);
    put64(b, n->dtype);
    put64(b, n->ndim);
    for (int d = 0; d < DG_MAX_DIMS; d++) {
        put64(b, n->shape[d]);
        put64(b, n->stride[d]);
        put64(b, n->gshape[d]);
    }
    put64(b, (int64_t)n->nbytes);
    put64(b, n->shard_dim);
    put64(b, n->shard_off);
    put_ids(b, g, n->src, n->n_src, DG_MAX_SRC, &ok);
    put_ids(b, g, n->upd, n->n_upd, DG_MAX_UPD, &ok);
    put_ids(b, g, n->side, n->n_side, DG_MAX_SIDE, &ok);
    put_ids(b, g, n->wait, n->n_wait, DG_MAX_WAIT, &ok);
    for (int i = 0; i < DG_MAX_ATTR; i++)
        put64(b, n->attr[i]);
    PID(n->view_src);
    put64(b, (int64_t)n->view_offs);
    put64(b, n->needs_grad);
    PID(n->grad);
    PID(n->master);
    put64(b, n->param_index);
    return ok;
}

static int put_graph(buf_t *b, const dg_graph_t *g) {
    int ok = 1;
    put64(b, g->n);
    for (int i = 0; i < g->n; i++)
        ok &= put_node(b, g, g->nodes[i]);
    return ok;
}

static void put_segs(buf_t *b, const dg_opt_seg_t *s, int n) {
    put64(b, n);
    for (int i = 0; i < n; i++) {
        put64(b, s[i].param_index);
        put64(b, s[i].decay);
        put64(b, (int64_t)s[i].off);
        put64(b, (int64_t)s[i].count);
    }
}

static dg_opt_seg_t *get_segs(rd_t *r, int *n_out) {
    int64_t n = get64(r);
    *n_out = 0;
    if (r->bad || n < 0 || n > (int64_t)(r->n / 32)) {
        r->bad = 1;
        return NULL;
    }
    if (n == 0) return NULL;
    dg_opt_seg_t *s = dg_xcalloc((size_t)n, sizeof *s);
    for (int64_t i = 0; i < n; i++) {
        s[i].param_index = (int)get64(r);
        s[i].decay = (int)get64(r);
        s[i].off = (size_t)get64(r);
        s[i].count = (size_t)get64(r);
    }
    *n_out = (int)n;
    return s;
}

/* ---------------- the key ---------------- */

uint64_t dg_pc_ir_hash(const dg_graph_t *g) {
    buf_t b = {0};
    (void)put_graph(&b, g);
    uint64_t h = fnv1a(FNV0, b.p, b.n);
    free(b.p);
    return h;
}

void dg_pc_init(dg_pc_t *pc, const char *dir) {
    memset(pc, 0, sizeof *pc);
    snprintf(pc->dir, sizeof pc->dir, "%s", dir);
    snprintf(pc->outcome, sizeof pc->outcome, "miss");
}

void dg_pc_free(dg_pc_t *pc) {
    free(pc->key);
    free(pc->file);
    pc->key = NULL;
    pc->file = NULL;
}

static dg_status_t mkdir_p(const char *dir) {
    char p[1024];
    snprintf(p, sizeof p, "%s", dir);
    for (char *s = p + 1; *s; s++) {
        if (*s != '/') continue;
        *s = 0;
        if (mkdir(p, 0777) != 0 && errno != EEXIST)
            return DG_ERR(DG_ERR_RUNTIME, "plan cache: cannot create %s: %s", p, strerror(errno));
        *s = '/';
    }
    if (mkdir(p, 0777) != 0 && errno != EEXIST)
        return DG_ERR(DG_ERR_RUNTIME, "plan cache: cannot create %s: %s", p, strerror(errno));
    return DG_OK;
}

dg_status_t dg_pc_key(dg_pc_t *pc, const dg_model_t *m) {
    DG_TRY(mkdir_p(pc->dir));
    buf_t k = {0};
    char side[1100];
    dg_fmt(side, sizeof side, "%s/libhash.txt", pc->dir);
    libhash_tab_t tab = {0};
    libtab_load(&tab, side);
    buf_printf(&k, "key.version=%s\n", DG_VERSION_STRING);
    libs_t libs = {0};
    dl_iterate_phdr(collect_lib, &libs);
    /* each object by its build ID where it has one ("bid:"), else by the hash of its file */
    uint64_t h = 0;
    if (libs.exe_bid) {
        buf_printf(&k, "key.binary=bid:%016" PRIx64 "\n", libs.exe_bid);
    } else {
        char exe[512];
        ssize_t r = readlink("/proc/self/exe", exe, sizeof exe - 1);
        if (r > 0) {
            exe[r] = 0;
            if (lib_hash(&tab, exe, &h) != 0) h = 0;
        }
        buf_printf(&k, "key.binary=%016" PRIx64 "\n", h);
    }
    if (libs.n > 1) qsort(libs.v, (size_t)libs.n, sizeof *libs.v, cmp_lib);
    for (int i = 0; i < libs.n; i++) {
        const lib_t *e = &libs.v[i];
        const char *b = strrchr(e->path, '/');
        b = b ? b + 1 : e->path;
        if (e->bid) {
            buf_printf(&k, "key.lib.%s=bid:%016" PRIx64 "\n", b, e->bid);
            continue;
        }
        if (lib_hash(&tab, e->path, &h) != 0) h = 0;
        buf_printf(&k, "key.lib.%s=%016" PRIx64 "\n", b, h);
    }
    key_versions(&k, &libs, m->be);
    free(libs.v);
    if (tab.dirty) libtab_save(&tab, side);
    free(tab.v);
    buf_printf(&k, "key.backend=%s\nkey.act_dtype=%s\nkey.fp8=%d\n", m->be->ops->name,
               dg_dtype_name(m->g->act_dtype), m->be->fp8);
    buf_printf(&k, "key.ir=%016" PRIx64 "\n", dg_pc_ir_hash(m->g));
    buf_printf(&k, "key.model=%d %d %d %d %d %d\n", m->d.n_layer, m->d.n_head, m->d.d_model, m->d.seq_len,
               m->d.vocab_size, m->d.padded_vocab);
    buf_printf(&k, "key.micro_batch=%d\nkey.flags=%d\n", m->B, m->flags);
    const dg_model_parallel_t *p = &m->par;
    buf_printf(&k, "key.mesh=%d %d %d order %d %d %d\nkey.coord=%d %d %d\n", p->mesh.size[0], p->mesh.size[1],
               p->mesh.size[2], p->mesh.order[0], p->mesh.order[1], p->mesh.order[2], p->coord[0],
               p->coord[1], p->coord[2]);
    buf_printf(&k, "key.buckets=%zu %zu overlap %d reshard %d reduce %s\n", p->bucket_bytes,
               p->prefetch_bytes, p->overlap, p->reshard_after_forward, dg_dtype_name(p->reduce_dtype));
    /* the test hooks that change the pipeline (their values as the registry reads them) */
    buf_printf(&k, "key.env=adamw_per_param %d unfused_ce %d unfused_resid %d no_kernel %s\n",
               dg_env_bool("DG_TEST_ADAMW_PER_PARAM"), dg_env_bool("DG_TEST_UNFUSED_CE"),
               dg_env_bool("DG_TEST_UNFUSED_RESID"), dg_env_str("DG_TEST_NO_KERNEL"));
    buf_printf(&k, "key.missing_kernels=");
    for (int op = 0; op < DG_OP_COUNT; op++)
        if (dg_op_missing_kernel(m->be, (dg_op_kind_t)op))
            buf_printf(&k, "%s,", dg_op_name((dg_op_kind_t)op));
    buf_printf(&k, "\n");
    buf_put(&k, "", 1);
    free(pc->key);
    pc->key = (char *)k.p;
    /* one entry per rank and model shape: a key change replaces it (and is named) */
    char slot[128];
    dg_fmt(slot, sizeof slot, "%d %d %d %d %d %d|%d %d %d", m->d.n_layer, m->d.n_head, m->d.d_model,
           m->d.seq_len, m->d.vocab_size, m->d.padded_vocab, p->mesh.size[0], p->mesh.size[1],
           p->mesh.size[2]);
    dg_fmt(pc->path, sizeof pc->path, "%s/plan-%d.%d.%d-%016" PRIx64 ".bin", pc->dir, p->coord[0],
           p->coord[1], p->coord[2], fnv1a(FNV0, slot, strlen(slot)));
    return DG_OK;
}

/* ---------------- reading an entry ---------------- */

static void set_outcome(dg_pc_t *pc, const char *outcome, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void set_outcome(dg_pc_t *pc, const char *outcome, const char *fmt, ...) {
    snprintf(pc->outcome, sizeof pc->outcome, "%s", outcome);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(pc->reason, sizeof pc->reason, fmt, ap);
    va_end(ap);
}

/* The value of "name=" in a block of lines, copied into out (cap bytes); 0 when absent. */
static int line_value(const char *text, const char *name, char *out, size_t cap) {
    size_t ln = strlen(name);
    for (const char *s = text; s && *s;) {
        const char *e = strchr(s, '\n');
        size_t len = e ? (size_t)(e - s) : strlen(s);
        if (len > ln && strncmp(s, name, ln) == 0 && s[ln] == '=') {
            size_t vl = len - ln - 1;
            if (vl >= cap) vl = cap - 1;
            memcpy(out, s + ln + 1, vl);
            out[vl] = 0;
            return 1;
        }
        s = e ? e + 1 : NULL;
    }
    return 0;
}

/* The first key line of `want` that `have` lacks or holds differently. */
static int key_diff(const char *want, const char *have, char *why, size_t cap) {
    for (const char *s = want; *s;) {
        const char *e = strchr(s, '\n');
        size_t len = e ? (size_t)(e - s) : strlen(s);
        const char *eq = memchr(s, '=', len);
        if (eq) {
            char name[160], v_new[200], v_old[200] = "(none)";
            size_t nl = (size_t)(eq - s) < sizeof name ? (size_t)(eq - s) : sizeof name - 1;
            memcpy(name, s, nl);
            name[nl] = 0;
            size_t vl = len - nl - 1 < sizeof v_new - 1 ? len - nl - 1 : sizeof v_new - 1;
            memcpy(v_new, eq + 1, vl);
            v_new[vl] = 0;
            int found = line_value(have, name, v_old, sizeof v_old);
            if (!found || strcmp(v_old, v_new) != 0) {
                dg_fmt(why, cap, "%s changed: '%.80s' -> '%.80s'", name + 4, found ? v_old : "(none)", v_new);
                return 1;
            }
        }
        s = e ? e + 1 : s + len;
    }
    return 0;
}

void dg_pc_lookup(dg_pc_t *pc) {
    pc->have = 0;
    FILE *f = fopen(pc->path, "rb");
    if (!f) {
        set_outcome(pc, "miss", "no entry %s", pc->path);
        return;
    }
    char head[128];
    unsigned long long nrest = 0, hash = 0;
    int ver = 0;
    if (!fgets(head, sizeof head, f) || sscanf(head, "DGPLAN %d %llu %llx", &ver, &nrest, &hash) != 3 ||
        ver != 1 || nrest > ((unsigned long long)1 << 34)) {
        fclose(f);
        set_outcome(pc, "corrupt", "%s: no valid header line", pc->path);
        return;
    }
    unsigned char *rest = dg_xmalloc((size_t)nrest + 1);
    size_t got = fread(rest, 1, (size_t)nrest, f);
    int extra = fgetc(f) != EOF;
    fclose(f);
    if (got != nrest || extra) {
        free(rest);
        set_outcome(pc, "corrupt", "%s: %zu bytes after the header, %llu expected (truncated or grown)",
                    pc->path, got, nrest);
        return;
    }
    if (fnv1a(FNV0, rest, (size_t)nrest) != (uint64_t)hash) {
        free(rest);
        set_outcome(pc, "corrupt", "%s: checksum mismatch (damaged)", pc->path);
        return;
    }
    rest[nrest] = 0;
    char *endm = strstr((char *)rest, "\nend\n");
    if (!endm) {
        free(rest);
        set_outcome(pc, "corrupt", "%s: no end of the text part", pc->path);
        return;
    }
    size_t text_n = (size_t)(endm - (char *)rest) + 1;
    char *text = dg_xmalloc(text_n + 1);
    memcpy(text, rest, text_n);
    text[text_n] = 0;
    char why[300];
    if (key_diff(pc->key, text, why, sizeof why)) {
        free(text);
        free(rest);
        set_outcome(pc, "stale", "key %s", why);
        return;
    }
    char v[64];
    static const char *const pn[4] = {"probe.loss", "probe.sum", "probe.wsum", "probe.abssum"};
    for (int i = 0; i < 4; i++) {
        if (!line_value(text, pn[i], v, sizeof v) || sscanf(v, "%la", &pc->probe[i]) != 1) {
            free(text);
            free(rest);
            set_outcome(pc, "corrupt", "%s: %s missing or unreadable", pc->path, pn[i]);
            return;
        }
    }
    free(text);
    free(pc->file);
    pc->file = rest;
    pc->bin = rest + text_n + 4; /* after "end\n" */
    pc->bin_n = (size_t)nrest - text_n - 4;
    pc->have = 1;
    set_outcome(pc, "hit", "%s", pc->path);
}

/* ---------------- writing an entry ---------------- */

static int put_model(buf_t *b, const dg_model_t *m) {
    const dg_graph_t *g = m->g;
    int ok = 1;
    put64(b, g->act_dtype);
    put64(b, (int64_t)g->generation);
    for (int d = 0; d < DG_MESH_NDIM; d++) {
        put64(b, g->mesh.size[d]);
        put64(b, g->mesh.order[d]);
    }
    ok &= put_graph(b, g);
    put_segs(b, g->opt_segs, g->n_opt_segs);
    put_segs(b, g->norm_segs, g->n_norm_segs);
    PID(m->tokens);
    PID(m->targets);
    PID(m->losses);
    PID(m->logits);
    PID(m->scalars);
    put64(b, m->np);
    for (int i = 0; i < m->np; i++)
        PID(m->pnode[i]);
    const dg_fuse_adamw_t *f = &m->fuse;
    PID(f->master);
    PID(f->grad);
    PID(f->m);
    PID(f->v);
    PID(f->param);
    PID(f->segs);
    PID(f->norm_segs);
    put64(b, m->shard ? m->shard->n_buckets : -1);
    for (int j = 0; m->shard && j < m->shard->n_buckets; j++) {
        const dg_bucket_t *bk = &m->shard->buckets[j];
        put64(b, bk->first);
        put64(b, bk->last);
        put64(b, bk->S);
        PID(bk->pleaf);
        PID(bk->gleaf);
    }
    const dg_memplan_t *p = m->plan;
    put64(b, p->n_nodes);
    put64(b, (int64_t)p->arena_bytes);
    put64(b, (int64_t)p->act_bytes_sum);
    put64(b, (int64_t)p->live_peak_bytes);
    for (int i = 0; i < p->n_nodes; i++) {
        put64(b, (int64_t)p->offset[i]);
        put64(b, p->live_start[i]);
        put64(b, p->live_end[i]);
    }
#undef PID
    return ok;
}

dg_status_t dg_pc_store(const dg_pc_t *pc, const dg_model_t *m, const double probe[4]) {
    buf_t rest = {0};
    buf_put(&rest, pc->key, strlen(pc->key));
    static const char *const pn[4] = {"probe.loss", "probe.sum", "probe.wsum", "probe.abssum"};
    for (int i = 0; i < 4; i++)
        buf_printf(&rest, "%s=%a\n", pn[i], probe[i]);
    buf_printf(&rest, "end\n");
    if (!put_model(&rest, m)) {
        free(rest.p);
        DG_LOG_WARN("plan cache: the plan holds a node outside its graph; not cached");
        return DG_OK;
    }
    char tmp[1300];
    dg_fmt(tmp, sizeof tmp, "%s.tmp.%d", pc->path, (int)getpid());
    FILE *f = fopen(tmp, "wb");
    dg_status_t st = DG_OK;
    if (!f) {
        st = DG_ERR(DG_ERR_RUNTIME, "plan cache: cannot write %s: %s", tmp, strerror(errno));
    } else {
        fprintf(f, "DGPLAN 1 %zu %016" PRIx64 "\n", rest.n, fnv1a(FNV0, rest.p, rest.n));
        size_t w = fwrite(rest.p, 1, rest.n, f);
        int bad = w != rest.n || fflush(f) != 0 || fsync(fileno(f)) != 0;
        bad |= fclose(f) != 0;
        if (bad || rename(tmp, pc->path) != 0) {
            st = DG_ERR(DG_ERR_RUNTIME, "plan cache: cannot write %s: %s", pc->path, strerror(errno));
            unlink(tmp);
        }
    }
    free(rest.p);
    return st;
}

/* ---------------- applying an entry to a model ---------------- */

static dg_node_t *node_at(rd_t *r, dg_node_t **nodes, int n) {
    int64_t i = get64(r);
    if (i == -1) return NULL;
    if (i < 0 || i >= n) {
        r->bad = 1;
        return NULL;
    }
    return nodes[i];
}

static int get_node_ids(rd_t *r, dg_node_t **nodes, int n, dg_node_t **dst, int cnt, int cap) {
    if (cnt < 0 || cnt > cap) r->bad = 1;
    for (int i = 0; i < cap; i++) {
        dg_node_t *x = node_at(r, nodes, n);
        if (i < cnt) dst[i] = x;
        if (i < cnt && !x) r->bad = 1;
    }
    return !r->bad;
}

dg_status_t dg_pc_apply(dg_pc_t *pc, dg_model_t *m) {
    rd_t r = {pc->bin, pc->bin_n, 0, 0};
    int64_t act = get64(&r), gen = get64(&r);
    dg_mesh_shape_t mesh;
    for (int d = 0; d < DG_MESH_NDIM; d++) {
        mesh.size[d] = (int)get64(&r);
        mesh.order[d] = (int)get64(&r);
    }
    int64_t n = get64(&r);
    if (r.bad || n <= 0 || n > (int64_t)(pc->bin_n / 96) || act != (int64_t)m->g->act_dtype)
        return DG_ERR(DG_ERR_RUNTIME, "plan cache: %s: bad graph header", pc->path);
    dg_graph_t *g = dg_graph_create(m->be);
    g->nodes = dg_xcalloc((size_t)n, sizeof *g->nodes);
    g->cap = (int)n;
    for (int64_t i = 0; i < n; i++)
        g->nodes[i] = dg_xcalloc(1, sizeof(dg_node_t));
    g->n = (int)n;
    g->generation = (uint64_t)gen;
    g->mesh = mesh;
    for (int64_t i = 0; i < n && !r.bad; i++) {
        dg_node_t *x = g->nodes[i];
        x->id = (int)i;
        if (r.at + sizeof x->name > r.n) {
            r.bad = 1;
            break;
        }
        memcpy(x->name, r.p + r.at, sizeof x->name);
        x->name[sizeof x->name - 1] = 0;
        r.at += sizeof x->name;
        x->op = (dg_op_kind_t)get64(&r);
        x->phase = (dg_phase_t)get64(&r);
        x->flags = (unsigned)get64(&r);
        x->storage = (dg_storage_t)get64(&r);
        x->stream = (int)get64(&r);
        x->dtype = (dg_dtype_t)get64(&r);
        x->ndim = (int)get64(&r);
        for (int d = 0; d < DG_MAX_DIMS; d++) {
            x->shape[d] = get64(&r);
            x->stride[d] = get64(&r);
            x->gshape[d] = get64(&r);
        }
        x->nbytes = (size_t)get64(&r);
        x->shard_dim = (int)get64(&r);
        x->shard_off = get64(&r);
        x->n_src = (int)get64(&r);
        get_node_ids(&r, g->nodes, (int)n, x->src, x->n_src, DG_MAX_SRC);
        x->n_upd = (int)get64(&r);
        get_node_ids(&r, g->nodes, (int)n, x->upd, x->n_upd, DG_MAX_UPD);
        x->n_side = (int)get64(&r);
        get_node_ids(&r, g->nodes, (int)n, x->side, x->n_side, DG_MAX_SIDE);
        x->n_wait = (int)get64(&r);
        get_node_ids(&r, g->nodes, (int)n, x->wait, x->n_wait, DG_MAX_WAIT);
        for (int k = 0; k < DG_MAX_ATTR; k++)
            x->attr[k] = get64(&r);
        x->view_src = node_at(&r, g->nodes, (int)n);
        x->view_offs = (size_t)get64(&r);
        x->needs_grad = (int)get64(&r);
        x->grad = node_at(&r, g->nodes, (int)n);
        x->master = node_at(&r, g->nodes, (int)n);
        x->param_index = (int)get64(&r);
        if (x->op < 0 || x->op >= DG_OP_COUNT || x->ndim < 0 || x->ndim > DG_MAX_DIMS) r.bad = 1;
    }
    g->opt_segs = get_segs(&r, &g->n_opt_segs);
    g->norm_segs = get_segs(&r, &g->n_norm_segs);
    dg_node_t *tokens = node_at(&r, g->nodes, (int)n), *targets = node_at(&r, g->nodes, (int)n),
              *losses = node_at(&r, g->nodes, (int)n), *logits = node_at(&r, g->nodes, (int)n),
              *scalars = node_at(&r, g->nodes, (int)n);
    int64_t np = get64(&r);
    if (np != m->np) r.bad = 1;
    dg_node_t **pnode = dg_xcalloc((size_t)(m->np > 0 ? m->np : 1), sizeof *pnode);
    for (int i = 0; i < m->np && !r.bad; i++) {
        pnode[i] = node_at(&r, g->nodes, (int)n);
        if (!pnode[i] || strcmp(pnode[i]->name, m->pnode[i]->name) != 0) r.bad = 1;
    }
    dg_fuse_adamw_t fu = {.off = m->off, .n = m->np, .span = m->total};
    fu.master = node_at(&r, g->nodes, (int)n);
    fu.grad = node_at(&r, g->nodes, (int)n);
    fu.m = node_at(&r, g->nodes, (int)n);
    fu.v = node_at(&r, g->nodes, (int)n);
    fu.param = node_at(&r, g->nodes, (int)n);
    fu.segs = node_at(&r, g->nodes, (int)n);
    fu.norm_segs = node_at(&r, g->nodes, (int)n);
    int64_t nb = get64(&r);
    if (!r.bad && (nb >= 0) != (m->shard != NULL)) r.bad = 1;
    dg_bucket_t *bk = NULL;
    if (!r.bad && nb > 0) {
        if (nb > m->np) r.bad = 1;
        bk = dg_xcalloc((size_t)(nb > 0 ? nb : 1), sizeof *bk);
        for (int64_t j = 0; j < nb && !r.bad; j++) {
            bk[j].first = (int)get64(&r);
            bk[j].last = (int)get64(&r);
            bk[j].S = get64(&r);
            bk[j].pleaf = node_at(&r, g->nodes, (int)n);
            bk[j].gleaf = node_at(&r, g->nodes, (int)n);
            if (bk[j].first < 0 || bk[j].last >= m->np || bk[j].first > bk[j].last || !bk[j].pleaf ||
                !bk[j].gleaf)
                r.bad = 1;
        }
    }
    dg_memplan_t *p = dg_xcalloc(1, sizeof *p);
    p->n_nodes = (int)get64(&r);
    p->arena_bytes = (size_t)get64(&r);
    p->act_bytes_sum = (size_t)get64(&r);
    p->live_peak_bytes = (size_t)get64(&r);
    if (p->n_nodes != n) r.bad = 1;
    if (!r.bad) {
        p->offset = dg_xcalloc((size_t)n, sizeof *p->offset);
        p->live_start = dg_xcalloc((size_t)n, sizeof *p->live_start);
        p->live_end = dg_xcalloc((size_t)n, sizeof *p->live_end);
        for (int64_t i = 0; i < n && !r.bad; i++) {
            p->offset[i] = (size_t)get64(&r);
            p->live_start[i] = (int)get64(&r);
            p->live_end[i] = (int)get64(&r);
            if (p->offset[i] != SIZE_MAX &&
                (p->offset[i] >= p->arena_bytes || p->live_start[i] < 0 || p->live_end[i] < p->live_start[i]))
                r.bad = 1;
        }
    }
    if (!r.bad && r.at != r.n) r.bad = 1;
    if (!r.bad && (!tokens || !targets || !losses || !logits || !scalars)) r.bad = 1;
    dg_status_t st = DG_OK;
    if (r.bad) st = DG_ERR(DG_ERR_RUNTIME, "plan cache: %s does not parse", pc->path);
    if (st == DG_OK) {
        st = dg_graph_verify(g);
        if (st != DG_OK) st = dg_err_prefix(st, "plan cache: %s", pc->path);
    }
    if (st != DG_OK) {
        dg_graph_free(g);
        dg_plan_free(p);
        free(pnode);
        free(bk);
        return st;
    }
    /* the entry's graph replaces the forward graph the builder made (its info, names and placements
     * stay: they come from the model sizes, which the key fixes) */
    dg_graph_free(m->g);
    m->g = g;
    p->graph = g;
    p->generation = g->generation;
    m->plan = p;
    m->tokens = tokens;
    m->targets = targets;
    m->losses = losses;
    m->logits = logits;
    m->scalars = scalars;
    memcpy(m->pnode, pnode, (size_t)m->np * sizeof *pnode);
    free(pnode);
    m->fuse = fu;
    if (m->shard) {
        for (int i = 0; i < m->shard->n; i++)
            m->shard->params[i].p = m->pnode[i];
        free(m->shard->buckets);
        m->shard->buckets = bk;
        m->shard->n_buckets = (int)nb;
    } else {
        free(bk);
    }
    return DG_OK;
}
