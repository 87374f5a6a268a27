/* memfit.c — the memory-fit check before the large allocations (memfit.h). */
#include "memfit.h"

#include "dg_mpi.h"

#include <stdio.h>
#include <string.h>

#define GIB 1073741824.0

void dg_memfit_input(const dg_config_t *c, const dg_model_desc_t *d, const dg_mesh_shape_t *m,
                     int micro_batch, int gpu, dg_mem_in_t *in) {
    memset(in, 0, sizeof *in);
    in->n_params = (double)dg_model_n_params(d);
    in->n_layer = d->n_layer;
    in->n_head = d->n_head;
    in->d_model = d->d_model;
    in->seq_len = d->seq_len;
    in->vocab = d->padded_vocab;
    /* the CPU backend computes in f32 whatever train.precision says (backend_cpu.c) */
    in->param_bytes = gpu && c->train.precision_id != DG_PREC_FP32 ? 2 : 4;
    in->dp_shard = m->size[DG_MESH_DP_SHARD];
    in->tp = m->size[DG_MESH_TP];
    in->micro_batch = micro_batch;
    in->recompute = (int)c->train.recompute_id;
    in->gpu = gpu;
    in->bucket_bytes = c->parallel.bucket_mb * 1048576.0;
}

static const char *const rc_names[] = {"none", "gelu", "selective", "full"};

/* "; with train.recompute=gelu X GiB, selective Y GiB, full Z GiB: train.recompute=L fits" for the levels
 * above in's (same estimator), or "...: no recompute level fits"; "" at full. */
static void recompute_clause(const dg_mem_in_t *in, double avail, char *out, size_t cap) {
    out[0] = 0;
    if (in->recompute >= 3) return;
    dg_mem_in_t t = *in;
    dg_mem_est_t e;
    int fit = -1;
    size_t l = 0;
    for (int r = in->recompute + 1; r <= 3; r++) {
        t.recompute = r;
        dg_mem_estimate(&t, &e);
        if (fit < 0 && e.total <= avail) fit = r;
        l += (size_t)snprintf(out + l, cap - l, "%s%s %.2f GiB",
                              r == in->recompute + 1 ? "; with train.recompute=" : ", ", rc_names[r],
                              e.total / GIB);
        if (l >= cap) return;
    }
    if (fit >= 0)
        snprintf(out + l, cap - l, ": train.recompute=%s fits", rc_names[fit]);
    else
        snprintf(out + l, cap - l, ": no recompute level fits");
}

/* A setting that fits `avail`, found with the same estimator: smaller micro-batch, a recompute level,
 * then a larger dp_shard (more ranks). */
static void suggest(const dg_mem_in_t *in, double avail, char *out, size_t cap) {
    dg_mem_in_t t = *in;
    dg_mem_est_t e;
    for (int mb = (int)in->micro_batch / 2; mb >= 1; mb /= 2) {
        t.micro_batch = mb;
        dg_mem_estimate(&t, &e);
        if (e.total <= avail) {
            snprintf(out, cap, "train.micro_batch=%d (%.2f GiB)", mb, e.total / GIB);
            return;
        }
    }
    t = *in;
    for (int r = in->recompute + 1; r <= 3; r++) {
        t.recompute = r;
        dg_mem_estimate(&t, &e);
        if (e.total <= avail) {
            snprintf(out, cap, "train.recompute=%s (%.2f GiB)", rc_names[r], e.total / GIB);
            return;
        }
    }
    t = *in;
    for (int s = in->dp_shard * 2; s <= 65536; s *= 2) {
        t.dp_shard = s;
        t.micro_batch = 1;
        t.recompute = 3;
        dg_mem_estimate(&t, &e);
        if (e.total <= avail) {
            snprintf(out, cap, "dp_shard=%d ranks with train.micro_batch=1, train.recompute=full (%.2f GiB)",
                     s, e.total / GIB);
            return;
        }
    }
    snprintf(out, cap, "none found up to dp_shard=65536");
}

/* This rank's available bytes and where the figure came from. */
static void rank_avail(int local_size, const dg_config_t *c, int gpu, double *bytes, char *src, size_t cap) {
    double b = -1;
    snprintf(src, cap, "unknown");
    if (gpu) {
        if (dg_mem_gpu_free(&b) == DG_OK)
            snprintf(src, cap, "GPU free");
        else
            b = -1;
    } else {
        dg_mem_avail_t a;
        if (dg_mem_host_available(&a) == DG_OK) {
            b = a.bytes / (local_size > 0 ? local_size : 1);
            snprintf(src, cap, "%s / %d ranks on the node", a.source, local_size);
        }
    }
    double lim = c->parallel.memory_limit_mb * 1048576.0;
    if (lim > 0 && (b < 0 || lim < b)) {
        b = lim;
        snprintf(src, cap, "parallel.memory_limit_mb=%g", c->parallel.memory_limit_mb);
    }
    *bytes = b;
}

dg_status_t dg_memfit_check(MPI_Comm world, int local_size, const dg_config_t *c, const dg_mem_in_t *in,
                            const char *mesh_str, char *line_out, size_t cap) {
    int rank = 0;
    MPI_Comm_rank(world, &rank);
    char src[96];
    double mine = 0;
    rank_avail(local_size, c, in->gpu, &mine, src, sizeof src);
    struct {
        double v;
        int r;
    } lo = {mine < 0 ? 1e300 : mine, rank}, red;
    DG_MPI_CHECK(MPI_Allreduce(&lo, &red, 1, MPI_DOUBLE_INT, MPI_MINLOC, world));
    DG_MPI_CHECK(MPI_Bcast(src, (int)sizeof src, MPI_CHAR, red.r, world));
    dg_mem_est_t e;
    dg_mem_estimate(in, &e);
    char line[1400];
    if (red.v >= 1e300) {
        snprintf(line, sizeof line, "memory: needs %.2f GiB per rank; available memory unknown (not checked)",
                 e.total / GIB);
        if (line_out) snprintf(line_out, cap, "%s", line);
        return DG_OK;
    }
    int fits = e.total <= red.v;
    char sug[192] = "", rcl[192] = "";
    if (!fits) suggest(in, red.v, sug, sizeof sug);
    if (!fits) recompute_clause(in, red.v, rcl, sizeof rcl);
    snprintf(line, sizeof line,
             "memory: needs %.2f GiB per rank (state %.2f + gathered %.2f + activations %.2f + logits %.2f + "
             "buckets %.2f%s checkpoint %.2f + runtime %.2f), %s %.2f GiB available on rank %d (%s); mesh "
             "%s, micro_batch %d, "
             "recompute %s%s%s%s",
             e.total / GIB, e.state / GIB, e.gathered / GIB, e.activations / GIB, e.logits / GIB,
             e.buckets / GIB, in->gpu ? "; host, not counted:" : " +", e.checkpoint / GIB, e.runtime / GIB,
             fits ? "fits" : "does not fit:", red.v / GIB, red.r, src, mesh_str, (int)in->micro_batch,
             rc_names[in->recompute < 0 || in->recompute > 3 ? 0 : in->recompute],
             fits ? "" : "; would fit: ", sug, rcl);
    if (line_out) snprintf(line_out, cap, "%s", line);
    if (!fits) return DG_ERR(DG_ERR_USAGE, "%s", line);
    return DG_OK;
}
