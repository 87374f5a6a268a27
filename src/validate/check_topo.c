/* check_topo.c — topology and binding: every node has the GPUs, NUMA nodes, cores and NICs its SLA node
 * type expects (and CUDA sees the GPUs hwloc sees, when built with CUDA); every rank with a GPU is bound
 * to cores near it and no two ranks of a node share cores when there are enough; no GPU carries more
 * ranks than allowed; and the library versions (MPI, hwloc, OpenBLAS, CUDA driver and runtime, NCCL)
 * are the same on every rank.
 *
 * Each rank describes itself in one fixed-size record (what dg_boot_topology found and chose); rank 0
 * gathers them and judges, so every failure can name the ranks and hosts involved.
 */
#define _GNU_SOURCE
#include <cblas.h>
#include <fnmatch.h>
#include <hwloc.h>
#include <stdlib.h>
#include <string.h>

#include "validate_impl.h"

typedef struct {
    int node_id, local_rank, local_size;
    int n_gpus, n_numa, n_cores, n_pus, n_nics, n_ib;
    int cuda_visible;      /* CUDA devices this rank sees; -1 when built without CUDA */
    char bad_gpu_name[64]; /* first GPU whose name does not match the type's gpu_model ("" = all match) */
    int gpu;               /* index into the node's GPUs, -1 none */
    char gpu_busid[32];
    char gpu_name[64];
    int near; /* 1 bound within the GPU's cores, 0 not, -1 no GPU or locality unknown */
    char gpu_cpuset[256];
    char bound[256];
    char bind_status[64];
    char versions[512];
} topo_rec_t;

/* "mpi=..;hwloc_api=..;openblas=..;dgtrain=..[;cuda_driver=..;cuda_runtime=..;nccl=..]" (';' separates) */
static void versions(const char *mpi, char *buf, size_t cap) {
    unsigned hv = hwloc_get_api_version();
    /* openblas_get_config() is e.g. "OpenBLAS 0.3.21 DYNAMIC_ARCH NO_AFFINITY Haswell MAX_THREADS=64": the
     * version and the build options, which decide the kernels (a node with another flavour is slower) */
    char ob[96], mv[200];
    snprintf(ob, sizeof ob, "%.95s", openblas_get_config());
    snprintf(mv, sizeof mv, "%.199s", mpi);
    for (char *p = ob; *p; p++)
        if (*p == ';') *p = ',';
    for (char *p = mv; *p; p++)
        if (*p == ';') *p = ',';
    size_t o = (size_t)snprintf(buf, cap, "mpi=%s;hwloc_api=%u.%u.%u;openblas=%s;dgtrain=%s", mv,
                                (hv >> 16) & 0xff, (hv >> 8) & 0xff, hv & 0xff, ob, DG_VERSION_STRING);
#ifdef DG_HAVE_CUDA
    if (o + 2 < cap) {
        buf[o++] = ';';
        dg_vgpu_versions(buf + o, cap - o);
    }
#else
    (void)o;
#endif
}

static void fill_record(vctx_t *c, topo_rec_t *t) {
    dg_boot_t *b = c->b;
    memset(t, 0, sizeof *t);
    t->node_id = b->node_id;
    t->local_rank = b->local_rank;
    t->local_size = b->local_size;
    t->n_gpus = b->topo.n_gpus;
    t->n_numa = b->topo.n_numa;
    t->n_cores = b->topo.n_cores;
    t->n_pus = b->topo.n_pus;
    t->n_nics = b->topo.n_nics;
    for (int i = 0; i < b->topo.n_nics; i++)
        t->n_ib += strcmp(b->topo.nics[i].kind, "ib") == 0;
    /* GPU names: hwloc knows the model only with its NVML/CUDA plugins ("PCI 10de:2335" otherwise, which
     * says nothing either way); CUDA knows the name of this rank's own device */
    const dg_sla_node_t *nt = dg_sla_node(c->sla, c->type_of_rank[c->rank]);
    for (int i = 0; i < b->topo.n_gpus; i++)
        if (strncmp(b->topo.gpus[i].name, "PCI ", 4) != 0 &&
            fnmatch(nt->gpu_model, b->topo.gpus[i].name, 0) != 0) {
            snprintf(t->bad_gpu_name, sizeof t->bad_gpu_name, "%s", b->topo.gpus[i].name);
            break;
        }
    t->cuda_visible = -1;
#ifdef DG_HAVE_CUDA
    char err[256];
    t->cuda_visible = dg_vgpu_count(err, sizeof err);
    if (b->gpu >= 0 && t->cuda_visible > 0 && !t->bad_gpu_name[0]) {
        char name[64];
        const dg_gpu_info_t *g = &b->topo.gpus[b->gpu];
        dg_vgpu_name(dg_vgpu_device(g->pci_busid, g->cuda_index), name, sizeof name);
        if (name[0] && fnmatch(nt->gpu_model, name, 0) != 0)
            snprintf(t->bad_gpu_name, sizeof t->bad_gpu_name, "%s", name);
    }
#endif
    t->gpu = b->gpu;
    t->near = -1;
    if (b->gpu >= 0) {
        const dg_gpu_info_t *g = &b->topo.gpus[b->gpu];
        snprintf(t->gpu_busid, sizeof t->gpu_busid, "%s", g->pci_busid);
        snprintf(t->gpu_name, sizeof t->gpu_name, "%s", g->name);
        snprintf(t->gpu_cpuset, sizeof t->gpu_cpuset, "%s", g->cpuset);
        hwloc_bitmap_t gs = hwloc_bitmap_alloc(), bs = hwloc_bitmap_alloc();
        if (g->cpuset[0] && hwloc_bitmap_list_sscanf(gs, g->cpuset) == 0 && !hwloc_bitmap_iszero(gs) &&
            hwloc_bitmap_list_sscanf(bs, b->bound_cpuset) == 0 && !hwloc_bitmap_iszero(bs))
            t->near = hwloc_bitmap_isincluded(bs, gs);
        hwloc_bitmap_free(gs);
        hwloc_bitmap_free(bs);
    }
    snprintf(t->bound, sizeof t->bound, "%s", b->bound_cpuset);
    snprintf(t->bind_status, sizeof t->bind_status, "%s", b->bind_status);
    versions(b->mpi_version, t->versions, sizeof t->versions);
}

/* ---------------------------------------------------------------- devices */

static void check_devices(vctx_t *c, const topo_rec_t *all) {
    dg_vcheck_t *k = vc_add(c, "topology.devices");
    dg_boot_t *b = c->b;
    int *bad = dg_xcalloc((size_t)b->n_nodes, sizeof(int));
    int nbad = 0;
    vbuf_t why = {0}, det = {0};
    vbuf_printf(&det, "{\"nodes\": [");
    for (int n = 0; n < b->n_nodes; n++) {
        int lead = c->leader_of_node[n];
        const topo_rec_t *t = &all[lead];
        int type = c->type_of_rank[lead];
        const dg_sla_node_t *e = dg_sla_node(c->sla, type);
        char probs[512] = "";
        size_t o = 0;
        char ex[32];
#define DEV(cnt, val, what)                                                                                  \
    if (!dg_sla_count_ok(&e->cnt, val) && o < sizeof probs) {                                                \
        dg_sla_count_format(&e->cnt, ex, sizeof ex);                                                         \
        o += (size_t)snprintf(probs + o, sizeof probs - o, "%s%d %s, expected %s", o ? "; " : "", val, what, \
                              ex);                                                                           \
    }
        DEV(gpus, t->n_gpus, "GPUs")
        DEV(numa_nodes, t->n_numa, "NUMA nodes")
        DEV(cores, t->n_cores, "cores")
        DEV(nics, t->n_nics, "NICs")
        DEV(ib_nics, t->n_ib, "InfiniBand NICs")
#undef DEV
        if (t->bad_gpu_name[0] && o < sizeof probs)
            o += (size_t)snprintf(probs + o, sizeof probs - o, "%sGPU '%s' does not match gpu_model '%s'",
                                  o ? "; " : "", t->bad_gpu_name, e->gpu_model);
        /* every rank of the node must see GPUs through CUDA when hwloc sees them */
        for (int r = 0; r < c->size && o < sizeof probs; r++)
            if (b->node_ids[r] == n && all[r].cuda_visible == 0 && t->n_gpus > 0) {
                o += (size_t)snprintf(probs + o, sizeof probs - o,
                                      "%srank %d sees no CUDA device although hwloc lists %d GPUs (driver, "
                                      "CUDA_VISIBLE_DEVICES or cgroup?)",
                                      o ? "; " : "", r, t->n_gpus);
                break;
            }
        vbuf_printf(&det, "%s{\"node\": %d, \"host\": ", n ? ", " : "", n);
        vbuf_json_str(&det, b->hosts[lead]);
        vbuf_printf(&det, ", \"type\": ");
        vbuf_json_str(&det, dg_sla_type_name(c->sla, type));
        vbuf_printf(
            &det,
            ", \"gpus\": %d, \"numa_nodes\": %d, \"cores\": %d, \"pus\": %d, \"nics\": %d, \"ib_nics\": %d, "
            "\"cuda_visible\": %d, \"problems\": ",
            t->n_gpus, t->n_numa, t->n_cores, t->n_pus, t->n_nics, t->n_ib, t->cuda_visible);
        vbuf_json_str(&det, probs);
        vbuf_printf(&det, "}");
        if (probs[0]) {
            bad[nbad++] = n;
            vbuf_printf(&why, "%snode %d (%s, type '%s'): %s", why.n ? "; " : "", n, b->hosts[lead],
                        dg_sla_type_name(c->sla, type), probs);
        }
    }
    vbuf_printf(&det, "]}");
    if (k) {
        const topo_rec_t *t0 = &all[0];
        snprintf(k->measured, sizeof k->measured,
                 "%d/%d nodes as expected (node 0: %d GPUs, %d NUMA, %d cores, %d NICs)", b->n_nodes - nbad,
                 b->n_nodes, t0->n_gpus, t0->n_numa, t0->n_cores, t0->n_nics);
        const dg_sla_node_t *e = dg_sla_node(c->sla, c->type_of_rank[0]);
        char g[16], nu[16], co[16], ni[16];
        dg_sla_count_format(&e->gpus, g, sizeof g);
        dg_sla_count_format(&e->numa_nodes, nu, sizeof nu);
        dg_sla_count_format(&e->cores, co, sizeof co);
        dg_sla_count_format(&e->nics, ni, sizeof ni);
        snprintf(k->reference, sizeof k->reference, "%s: gpus %s, numa %s, cores %s, nics %s%s",
                 dg_sla_type_name(c->sla, c->type_of_rank[0]), g, nu, co, ni,
                 dg_sla_n_types(c->sla) > 1 ? " (per node type)" : "");
        k->has_value = 1;
        k->value = b->n_nodes - nbad;
        if (nbad) {
            k->verdict = DG_VERDICT_FAIL;
            snprintf(k->message, sizeof k->message, "%s", why.s);
        }
        dg_vcheck_set_details(k, det.s);
    }
    vbuf_free(&why);
    vbuf_free(&det);
    free(bad);
}

/* ---------------------------------------------------------------- binding */

static void check_binding(vctx_t *c, const topo_rec_t *all) {
    dg_vcheck_t *k = vc_add(c, "topology.binding");
    if (!k) return;
    dg_boot_t *b = c->b;
    vbuf_t why = {0}, note = {0}, det = {0};
    int *far = dg_xmalloc((size_t)c->size * sizeof(int)), nfar = 0;
    int *failed = dg_xmalloc((size_t)c->size * sizeof(int)), nfailed = 0;
    int nbound = 0, n_with_gpu = 0;
    vbuf_printf(&det, "{\"ranks\": [");
    for (int r = 0; r < c->size; r++) {
        const topo_rec_t *t = &all[r];
        const dg_sla_node_t *e = dg_sla_node(c->sla, c->type_of_rank[r]);
        if (strncmp(t->bind_status, "failed", 6) == 0) failed[nfailed++] = r;
        if (strcmp(t->bind_status, "applied") == 0) nbound++;
        if (t->gpu >= 0) n_with_gpu++;
        if (t->gpu >= 0 && e->bind_near_gpu && t->near == 0) far[nfar++] = r;
        vbuf_printf(&det, "%s{\"rank\": %d, \"host\": ", r ? ", " : "", r);
        vbuf_json_str(&det, b->hosts[r]);
        vbuf_printf(&det, ", \"cpuset\": ");
        vbuf_json_str(&det, t->bound);
        vbuf_printf(&det, ", \"bind\": ");
        vbuf_json_str(&det, t->bind_status);
        vbuf_printf(&det, ", \"gpu\": ");
        vbuf_json_str(&det, t->gpu >= 0 ? t->gpu_busid : "");
        vbuf_printf(&det, ", \"gpu_cpuset\": ");
        vbuf_json_str(&det, t->gpu_cpuset);
        vbuf_printf(&det, ", \"near_gpu\": %s}", t->near < 0 ? "null" : t->near ? "true" : "false");
    }
    vbuf_printf(&det, "]}");
    char who[1024];
    if (nfailed) {
        vc_fmt_ranks(c, failed, nfailed, who, sizeof who);
        vbuf_printf(&why, "binding failed on %s (%s)", who, all[failed[0]].bind_status);
    }
    if (nfar) {
        vc_fmt_ranks(c, far, nfar, who, sizeof who);
        vbuf_printf(&why, "%s%s bound away from its GPU (e.g. rank %d: cpuset %s, GPU %s is near %s)",
                    why.n ? "; " : "", who, far[0], all[far[0]].bound, all[far[0]].gpu_busid,
                    all[far[0]].gpu_cpuset);
    }
    /* ranks of one node sharing PUs while the node has enough for all of them */
    int nshare = 0;
    hwloc_bitmap_t a = hwloc_bitmap_alloc(), bb = hwloc_bitmap_alloc();
    for (int r = 0; r < c->size; r++) {
        for (int q = r + 1; q < c->size; q++) {
            if (b->node_ids[q] != b->node_ids[r]) continue;
            const topo_rec_t *t = &all[r];
            if (hwloc_bitmap_list_sscanf(a, t->bound) != 0 || hwloc_bitmap_list_sscanf(bb, all[q].bound) != 0)
                continue;
            if (!hwloc_bitmap_intersects(a, bb)) continue;
            if (t->local_size > t->n_pus) {
                if (!note.n)
                    vbuf_printf(&note, "node %d (%s) runs %d ranks on %d PUs: ranks share PUs",
                                b->node_ids[r], b->hosts[r], t->local_size, t->n_pus);
                continue;
            }
            if (nshare++ < 4)
                vbuf_printf(&why, "%srank %d (%s) and rank %d share PUs (%s / %s)", why.n ? "; " : "", r,
                            b->hosts[r], q, t->bound, all[q].bound);
        }
    }
    hwloc_bitmap_free(a);
    hwloc_bitmap_free(bb);
    if (nshare > 4) vbuf_printf(&why, " and %d more pairs", nshare - 4);
    if (nshare)
        vbuf_printf(&why,
                    " (dgtrain binds each rank itself with topology.bind=auto; with bind=none the launcher's "
                    "binding is used)");
    snprintf(k->measured, sizeof k->measured, "%d/%d ranks bound (%.40s on rank 0: %.60s)%s", nbound, c->size,
             all[0].bind_status, all[0].bound, n_with_gpu ? "" : ", no GPUs");
    snprintf(k->reference, sizeof k->reference, "near own GPU, no shared PUs");
    k->has_value = 1;
    k->value = c->size - nfar - nfailed;
    vc_conclude(k, &why, &note, &det);
    free(far);
    free(failed);
}

/* ---------------------------------------------------------------- GPU sharing */

static void check_gpu_sharing(vctx_t *c, const topo_rec_t *all) {
    if (!c->rep) return;
    dg_boot_t *b = c->b;
    int any = 0;
    for (int r = 0; r < c->size; r++)
        any |= all[r].gpu >= 0;
    if (!any) {
        vc_skip(c, "topology.gpu_sharing", "no rank has a GPU (hwloc found none on any node)");
        return;
    }
    dg_vcheck_t *k = vc_add(c, "topology.gpu_sharing");
    vbuf_t why = {0};
    int worst = 0, nbad = 0;
    int *grp = dg_xmalloc((size_t)c->size * sizeof(int));
    int *seen = dg_xcalloc((size_t)c->size, sizeof(int));
    int no_gpu[64], n_no_gpu = 0;
    for (int r = 0; r < c->size; r++) {
        if (all[r].gpu < 0) {
            if (all[r].n_gpus > 0 && n_no_gpu < 64) no_gpu[n_no_gpu++] = r;
            continue;
        }
        if (seen[r]) continue;
        int n = 0;
        for (int q = r; q < c->size; q++)
            if (!seen[q] && all[q].gpu >= 0 && b->node_ids[q] == b->node_ids[r] &&
                strcmp(all[q].gpu_busid, all[r].gpu_busid) == 0) {
                seen[q] = 1;
                grp[n++] = q;
            }
        if (n > worst) worst = n;
        int allowed = dg_sla_node(c->sla, c->type_of_rank[r])->ranks_per_gpu;
        if (n > allowed) {
            char who[512];
            vc_fmt_ranks(c, grp, n, who, sizeof who);
            if (nbad++ < 4)
                vbuf_printf(&why, "%sGPU %s of %s is shared by %d ranks (%s), allowed %d", why.n ? "; " : "",
                            all[r].gpu_busid, b->hosts[r], n, who, allowed);
        }
    }
    if (n_no_gpu) {
        char who[1024];
        vc_fmt_ranks(c, no_gpu, n_no_gpu, who, sizeof who);
        vbuf_printf(&why, "%s%s got no GPU although the node has some", why.n ? "; " : "", who);
    }
    snprintf(k->measured, sizeof k->measured, "at most %d rank%s per GPU", worst, worst == 1 ? "" : "s");
    snprintf(k->reference, sizeof k->reference, "<= %d (ranks_per_gpu)",
             dg_sla_node(c->sla, c->type_of_rank[0])->ranks_per_gpu);
    k->has_value = 1;
    k->value = worst;
    if (why.n) {
        k->verdict = DG_VERDICT_FAIL;
        snprintf(k->message, sizeof k->message, "%s", why.s);
    }
    vbuf_free(&why);
    free(grp);
    free(seen);
}

/* ---------------------------------------------------------------- versions */

/* value of `key` in "k=v;k=v" into out ("" when absent) */
static void field(const char *s, const char *key, char *out, size_t cap) {
    size_t kl = strlen(key);
    out[0] = 0;
    for (const char *p = s; p && *p;) {
        if (strncmp(p, key, kl) == 0 && p[kl] == '=') {
            const char *v = p + kl + 1, *e = strchr(v, ';');
            snprintf(out, cap, "%.*s", (int)(e ? e - v : (long)strlen(v)), v);
            return;
        }
        p = strchr(p, ';');
        if (p) p++;
    }
}

static void check_versions(vctx_t *c, const topo_rec_t *all) {
    dg_vcheck_t *k = vc_add(c, "topology.versions");
    if (!k) return;
    static const char *keys[] = {"mpi",         "hwloc_api",    "openblas", "dgtrain",
                                 "cuda_driver", "cuda_runtime", "nccl"};
    const int nk = (int)(sizeof keys / sizeof *keys);
    vbuf_t why = {0}, det = {0}, summary = {0};
    vbuf_printf(&det, "{");
    char(*vals)[256] = dg_xmalloc((size_t)c->size * sizeof *vals);
    int *odd = dg_xmalloc((size_t)c->size * sizeof(int));
    int fields = 0;
    for (int i = 0; i < nk; i++) {
        for (int r = 0; r < c->size; r++)
            field(all[r].versions, keys[i], vals[r], sizeof vals[r]);
        int present = 0;
        for (int r = 0; r < c->size; r++)
            present |= vals[r][0] != 0;
        if (!present) continue;
        fields++;
        /* the majority value is "right"; the others are named */
        int best = 0, best_n = 0;
        for (int r = 0; r < c->size; r++) {
            int n = 0;
            for (int q = 0; q < c->size; q++)
                n += strcmp(vals[q], vals[r]) == 0;
            if (n > best_n) best_n = n, best = r;
        }
        vbuf_printf(&det, "%s\"%s\": ", det.n > 1 ? ", " : "", keys[i]);
        vbuf_json_str(&det, vals[best]);
        if (i != 0) vbuf_printf(&summary, "%s%s %s", summary.n ? ", " : "", keys[i], vals[best]);
        if (best_n == c->size) continue;
        int n = 0;
        for (int r = 0; r < c->size; r++)
            if (strcmp(vals[r], vals[best]) != 0) odd[n++] = r;
        char who[1024];
        vc_fmt_ranks(c, odd, n, who, sizeof who);
        vbuf_printf(&why, "%s%s differs on %s: '%s' instead of '%s'", why.n ? "; " : "", keys[i], who,
                    vals[odd[0]], vals[best]);
    }
    vbuf_printf(&det, "}");
    snprintf(k->measured, sizeof k->measured, "%s", summary.s ? summary.s : "-");
    snprintf(k->reference, sizeof k->reference, "the same on all %d ranks", c->size);
    k->has_value = 1;
    k->value = fields;
    vc_conclude(k, &why, NULL, &det);
    vbuf_free(&summary);
    free(vals);
    free(odd);
}

dg_status_t vc_check_topology(vctx_t *c) {
    double t0 = dg_now_s();
    topo_rec_t mine;
    fill_record(c, &mine);
    topo_rec_t *all = c->rank == 0 ? dg_xmalloc((size_t)c->size * sizeof *all) : NULL;
    DG_MPI_CHECK(
        MPI_Gather(&mine, (int)sizeof mine, MPI_BYTE, all, (int)sizeof mine, MPI_BYTE, 0, c->b->world));
    if (c->rank == 0) {
        int first = c->rep->n;
        if (vc_selected(c, "topology.devices")) check_devices(c, all);
        if (vc_selected(c, "topology.binding")) check_binding(c, all);
        if (vc_selected(c, "topology.gpu_sharing")) check_gpu_sharing(c, all);
        if (vc_selected(c, "topology.versions")) check_versions(c, all);
        double dt = (dg_now_s() - t0) / (c->rep->n - first > 0 ? c->rep->n - first : 1);
        for (int i = first; i < c->rep->n; i++)
            c->rep->checks[i].seconds = dt;
    }
    free(all);
    return DG_OK;
}
