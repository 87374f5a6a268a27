/* split.c — the per-block cost model and the stage split at block boundaries (pipeline.h,
 * docs/parallelism.md §Stage split). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pipeline.h"

int dg_pp_kind_parse(const char *name) {
    if (strcmp(name, "1f1b") == 0) return DG_PP_1F1B;
    if (strcmp(name, "interleaved") == 0) return DG_PP_INTERLEAVED;
    return -1;
}

const char *dg_pp_kind_name(int kind) {
    return kind == DG_PP_INTERLEAVED ? "interleaved" : "1f1b";
}

void dg_pp_unit_costs(const dg_pp_model_t *m, dg_pp_cost_t *u) {
    const double L = m->n_layer, C = m->d_model, T = m->seq_len, V = m->vocab, H = m->n_head;
    const double B = m->micro_batch, ab = m->act_bytes, K = m->tp > 0 ? m->tp : 1;
    memset(u, 0, (size_t)(m->n_layer + 2) * sizeof *u);
    /* embedding: a lookup (no FLOPs worth counting), wte + wpe, its output kept for the first block */
    u[0].fwd_flops = B * T * C;
    u[0].bwd_flops = B * T * C;
    u[0].params = V * C + T * C;
    u[0].act_bytes = B * T * C * ab;
    /* a block: qkv (3C^2), attention projection (C^2), MLP (8C^2) multiply-adds per token, plus the
     * attention core 4 T C per token (QK^T and AV); backward twice the forward. Kept per token: the
     * inputs of ln_1, ln_2 and both residuals (4 C, replicated over tp), qkv, the attention output, the
     * MLP's pre- and post-GELU (12 C / tp), the layer norms' f32 statistics (16 B) and the attention's
     * f32 logsumexp per head (4 H / tp B) */
    double blk_fwd = B * T * (24.0 * C * C + 4.0 * T * C) / K;
    double blk_act = B * T * (C * (4.0 + 12.0 / K) * ab + 16.0 + 4.0 * H / K);
    for (int i = 1; i <= m->n_layer; i++) {
        u[i].fwd_flops = blk_fwd;
        u[i].bwd_flops = 2.0 * blk_fwd;
        u[i].params = (12.0 * C * C + 13.0 * C) / K;
        u[i].act_bytes = blk_act;
    }
    /* head: ln_f and the tied lm_head (a copy of wte on the last stage), 2 T C V FLOPs forward; the
     * logits (and dlogits in place) live only from the head's forward to its backward */
    u[m->n_layer + 1].fwd_flops = B * T * 2.0 * C * V;
    u[m->n_layer + 1].bwd_flops = B * T * 4.0 * C * V;
    u[m->n_layer + 1].params = V * C + 2.0 * C;
    u[m->n_layer + 1].act_bytes = B * T * (2.0 * C * ab + 8.0);
    u[m->n_layer + 1].transient_bytes = B * T * (V * ab + 12.0);
    (void)L;
}

double dg_pp_message_bytes(const dg_pp_model_t *m) {
    return (double)m->micro_batch * m->seq_len * m->d_model * m->act_bytes;
}

static void add_cost(dg_pp_cost_t *a, const dg_pp_cost_t *b) {
    a->fwd_flops += b->fwd_flops;
    a->bwd_flops += b->bwd_flops;
    a->params += b->params;
    a->act_bytes += b->act_bytes;
    if (b->transient_bytes > a->transient_bytes) a->transient_bytes = b->transient_bytes;
}

/* chunk c's costs and the per-rank totals, from first_unit / n_units */
static void finish(const dg_pp_cost_t *u, dg_pp_split_t *o) {
    double tot = 0, mx = 0;
    for (int r = 0; r < o->pp; r++)
        o->stage_flops[r] = 0;
    for (int c = 0; c < o->n_chunks; c++) {
        memset(&o->chunk[c], 0, sizeof o->chunk[c]);
        for (int i = 0; i < o->n_units[c]; i++)
            add_cost(&o->chunk[c], &u[o->first_unit[c] + i]);
        o->stage_flops[c % o->pp] += o->chunk[c].fwd_flops + o->chunk[c].bwd_flops;
    }
    for (int r = 0; r < o->pp; r++) {
        tot += o->stage_flops[r];
        if (o->stage_flops[r] > mx) mx = o->stage_flops[r];
    }
    o->imbalance = tot > 0 ? mx / (tot / o->pp) : 1;
}

dg_status_t dg_pp_split(const dg_pp_model_t *m, int kind, int pp, int virt, double mem_budget,
                        dg_pp_split_t *o) {
    const int L = m->n_layer;
    memset(o, 0, sizeof *o);
    if (pp < 1 || virt < 1 || (int64_t)pp * virt > DG_PP_MAX_CHUNKS)
        return DG_ERR(DG_ERR_USAGE, "pipeline: pp=%d x pp_virtual=%d must be between 1 and %d chunks", pp,
                      virt, DG_PP_MAX_CHUNKS);
    if (pp > L)
        return DG_ERR(DG_ERR_USAGE,
                      "pipeline: pp=%d stages need at least one block each, the model has n_layer=%d", pp, L);
    if (kind == DG_PP_INTERLEAVED && L % (pp * virt) != 0)
        return DG_ERR(DG_ERR_USAGE,
                      "pipeline: the interleaved schedule needs n_layer=%d divisible by pp x pp_virtual = "
                      "%d x %d = %d",
                      L, pp, virt, pp * virt);
    if (kind != DG_PP_INTERLEAVED && virt != 1)
        return DG_ERR(DG_ERR_USAGE,
                      "pipeline: the 1f1b schedule has one stage per rank (pp_virtual=1, got %d)", virt);
    dg_pp_cost_t *u = dg_xcalloc((size_t)L + 2, sizeof *u);
    dg_pp_unit_costs(m, u);
    o->pp = pp;
    o->virt = virt;
    o->n_chunks = pp * virt;
    if (kind == DG_PP_INTERLEAVED) {
        int per = L / o->n_chunks;
        for (int c = 0; c < o->n_chunks; c++) {
            o->first_unit[c] = c == 0 ? 0 : 1 + c * per;
            o->n_units[c] = per + (c == 0) + (c == o->n_chunks - 1);
        }
        finish(u, o);
        free(u);
        return DG_OK;
    }
    /* 1F1B: blocks 1..L into pp contiguous non-empty runs; stage 0 adds the embedding, stage pp-1 the head.
     * best[s][j]: the smallest achievable max stage cost for stages 0..s covering blocks 1..j. */
    double *pre = dg_xcalloc((size_t)L + 1, sizeof(double)),
           *pact = dg_xcalloc((size_t)L + 1, sizeof(double));
    double *ppar = dg_xcalloc((size_t)L + 1, sizeof(double));
    for (int j = 1; j <= L; j++) {
        pre[j] = pre[j - 1] + u[j].fwd_flops + u[j].bwd_flops;
        pact[j] = pact[j - 1] + u[j].act_bytes;
        ppar[j] = ppar[j - 1] + u[j].params;
    }
    double *best = dg_xmalloc((size_t)pp * (L + 1) * sizeof(double));
    int *arg = dg_xcalloc((size_t)pp * (L + 1), sizeof(int));
    for (size_t i = 0; i < (size_t)pp * (L + 1); i++)
        best[i] = INFINITY;
    const dg_pp_cost_t *emb = &u[0], *head = &u[L + 1];
    /* cost and feasibility of stage s holding blocks i+1..j */
#define STAGE_COST(s, i, j, out)                                                                             \
    do {                                                                                                     \
        double f_ = pre[j] - pre[i], a_ = pact[j] - pact[i], p_ = ppar[j] - ppar[i], t_ = 0;                 \
        if ((s) == 0) f_ += emb->fwd_flops + emb->bwd_flops, a_ += emb->act_bytes, p_ += emb->params;        \
        if ((s) == pp - 1)                                                                                   \
            f_ += head->fwd_flops + head->bwd_flops, a_ += head->act_bytes, p_ += head->params,              \
                t_ = head->transient_bytes;                                                                  \
        double mem_ = p_ * m->state_bytes_per_param + a_ * (pp - (s)) + t_;                                  \
        (out) = mem_budget > 0 && mem_ > mem_budget ? INFINITY : f_;                                         \
    } while (0)
    for (int j = 1; j <= L; j++)
        STAGE_COST(0, 0, j, best[j]);
    for (int s = 1; s < pp; s++)
        for (int j = s + 1; j <= L; j++)
            for (int i = s; i < j; i++) {
                double c, prev = best[(size_t)(s - 1) * (L + 1) + i];
                if (!isfinite(prev)) continue;
                STAGE_COST(s, i, j, c);
                double v = c > prev ? c : prev;
                /* ties: the earliest cut, so earlier stages (more in-flight micro-batches) hold fewer */
                if (v < best[(size_t)s * (L + 1) + j]) {
                    best[(size_t)s * (L + 1) + j] = v;
                    arg[(size_t)s * (L + 1) + j] = i;
                }
            }
#undef STAGE_COST
    dg_status_t st = DG_OK;
    if (!isfinite(best[(size_t)(pp - 1) * (L + 1) + L])) {
        st = DG_ERR(DG_ERR_USAGE,
                    "pipeline: no split of %d blocks into %d stages keeps every stage within %.2f GiB "
                    "(state + activations of its in-flight micro-batches)",
                    L, pp, mem_budget / 1073741824.0);
    } else {
        int j = L;
        for (int s = pp - 1; s >= 0; s--) {
            int i = s ? arg[(size_t)s * (L + 1) + j] : 0;
            o->first_unit[s] = s == 0 ? 0 : i + 1;
            o->n_units[s] = (j - i) + (s == 0) + (s == pp - 1);
            j = i;
        }
        finish(u, o);
    }
    free(best);
    free(arg);
    free(pre);
    free(pact);
    free(ppar);
    free(u);
    return st;
}
