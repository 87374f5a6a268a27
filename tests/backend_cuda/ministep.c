/* ministep.c — see ministep.h. Written only against the backend vtable. */
#include "ministep.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum {
    P_WTE,
    P_WPE,
    P_LN1W,
    P_LN1B,
    P_QKVW,
    P_QKVB,
    P_PROJW,
    P_PROJB,
    P_LN2W,
    P_LN2B,
    P_FCW,
    P_FCB,
    P_FCPW,
    P_FCPB,
    P_LNFW,
    P_LNFB,
    P_COUNT
};

struct ministep {
    dg_backend_t *be;
    ministep_cfg_t c;
    dg_dtype_t act;
    size_t off[P_COUNT], len[P_COUNT], np;
    float *master, *grad, *m, *v;
    void *comp;
    int32_t *tok, *tgt;
    /* activations (act) */
    void *x0, *ln1, *qkv, *att, *proj, *x1, *ln2, *fcpre, *fc, *fcproj, *x2, *lnf, *logits;
    /* activation gradients (act) */
    void *dlnf, *dx2, *dfc, *dfcpre, *dln2, *dx1, *datt, *dqkv, *dln1, *dx0;
    /* f32 */
    float *mean1, *rstd1, *mean2, *rstd2, *meanf, *rstdf, *lse, *losses, *sumsq, *gscale, *norm;
    void *aux;
    float *host_losses;
    void *bufs[64];
    int nbufs;
};

static dg_status_t balloc(ministep_t *ms, size_t bytes, void **out) {
    DG_TRY(ms->be->ops->alloc(ms->be, bytes, out));
    DG_ASSERT(ms->nbufs < 64);
    ms->bufs[ms->nbufs++] = *out;
    return DG_OK;
}

static uint64_t rng_next(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static float rng_sym(uint64_t *s, float a) { /* uniform in [-a, a) */
    return (float)(((double)(rng_next(s) >> 11) * (1.0 / 9007199254740992.0) * 2.0 - 1.0) * a);
}

size_t ministep_nparams(const ministep_t *ms) {
    return ms->np;
}

dg_status_t ministep_create(dg_backend_t *be, const ministep_cfg_t *cfg, ministep_t **out) {
    *out = NULL;
    ministep_t *ms = dg_xcalloc(1, sizeof *ms);
    ms->be = be;
    ms->c = *cfg;
    ms->act = be->act_dtype;
    const int B = cfg->B, T = cfg->T, C = cfg->C, Vp = cfg->Vp;
    const size_t N = (size_t)B * T, as = dg_dtype_size(ms->act);
    const size_t lens[P_COUNT] = {(size_t)Vp * C,
                                  (size_t)T * C,
                                  C,
                                  C,
                                  (size_t)3 * C * C,
                                  3 * (size_t)C,
                                  (size_t)C * C,
                                  C,
                                  C,
                                  C,
                                  (size_t)4 * C * C,
                                  4 * (size_t)C,
                                  (size_t)4 * C * C,
                                  C,
                                  C,
                                  C};
    size_t o = 0;
    for (int i = 0; i < P_COUNT; i++) {
        ms->off[i] = o;
        ms->len[i] = lens[i];
        o += (lens[i] + 127) / 128 * 128; /* every tensor starts 256-byte aligned in bf16 and f32 */
    }
    ms->np = o;
    dg_status_t s = DG_OK;
#define A(ptr, bytes)                                                                                        \
    do {                                                                                                     \
        if ((s = balloc(ms, (bytes), (void **)&(ptr))) != DG_OK) goto fail;                                  \
    } while (0)
    A(ms->master, o * 4);
    A(ms->grad, o * 4);
    A(ms->m, o * 4);
    A(ms->v, o * 4);
    A(ms->comp, o * as);
    A(ms->tok, N * 4);
    A(ms->tgt, N * 4);
    A(ms->x0, N * C * as);
    A(ms->ln1, N * C * as);
    A(ms->qkv, N * 3 * C * as);
    A(ms->att, N * C * as);
    A(ms->proj, N * C * as);
    A(ms->x1, N * C * as);
    A(ms->ln2, N * C * as);
    A(ms->fcpre, N * 4 * C * as);
    A(ms->fc, N * 4 * C * as);
    A(ms->fcproj, N * C * as);
    A(ms->x2, N * C * as);
    A(ms->lnf, N * C * as);
    A(ms->logits, N * Vp * as);
    A(ms->dlnf, N * C * as);
    A(ms->dx2, N * C * as);
    A(ms->dfc, N * 4 * C * as);
    A(ms->dfcpre, N * 4 * C * as);
    A(ms->dln2, N * C * as);
    A(ms->dx1, N * C * as);
    A(ms->datt, N * C * as);
    A(ms->dqkv, N * 3 * C * as);
    A(ms->dln1, N * C * as);
    A(ms->dx0, N * C * as);
    A(ms->mean1, N * 4);
    A(ms->rstd1, N * 4);
    A(ms->mean2, N * 4);
    A(ms->rstd2, N * 4);
    A(ms->meanf, N * 4);
    A(ms->rstdf, N * 4);
    A(ms->lse, N * 4);
    A(ms->losses, N * 4);
    A(ms->sumsq, 4);
    A(ms->gscale, 4);
    A(ms->norm, 4);
    A(ms->aux, be->ops->attention_aux_bytes(be, B, T, C, cfg->NH));
#undef A
    {
        /* initial state: small random weights, layernorm gains near 1, padded vocab rows zero */
        uint64_t r = cfg->seed ? cfg->seed : 1;
        float *h = dg_xcalloc(o, sizeof(float));
        for (int p = 0; p < P_COUNT; p++) {
            float *t = h + ms->off[p];
            const int is_ln_w = p == P_LN1W || p == P_LN2W || p == P_LNFW;
            for (size_t i = 0; i < ms->len[p]; i++)
                t[i] = is_ln_w ? 1.f + rng_sym(&r, 0.1f) : rng_sym(&r, 0.05f);
        }
        memset(h + ms->off[P_WTE] + (size_t)cfg->V * C, 0, (size_t)(Vp - cfg->V) * C * sizeof(float));
        int32_t *tk = dg_xmalloc(N * 4), *tg = dg_xmalloc(N * 4);
        for (size_t i = 0; i < N; i++)
            tk[i] = (int32_t)(rng_next(&r) % (uint64_t)cfg->V);
        for (size_t i = 0; i < N; i++)
            tg[i] = i + 1 < N ? tk[i + 1] : tk[0];
        s = be->ops->to_device(be, ms->master, h, o * 4);
        if (!s) s = be->ops->to_device(be, ms->tok, tk, N * 4);
        if (!s) s = be->ops->to_device(be, ms->tgt, tg, N * 4);
        if (!s) s = be->ops->sync(be); /* the host arrays are freed next */
        free(h);
        free(tk);
        free(tg);
        if (s) goto fail;
    }
    if ((s = be->ops->memset0(be, ms->m, o * 4))) goto fail;
    if ((s = be->ops->memset0(be, ms->v, o * 4))) goto fail;
    if ((s = be->ops->cast(be, ms->comp, ms->act, ms->master, DG_F32, o))) goto fail;
    ms->host_losses = dg_xmalloc(N * sizeof(float));
    *out = ms;
    return DG_OK;
fail:
    ministep_free(ms);
    return s;
}

void ministep_free(ministep_t *ms) {
    if (!ms) return;
    for (int i = 0; i < ms->nbufs; i++)
        ms->be->ops->free(ms->be, ms->bufs[i]);
    free(ms->host_losses);
    free(ms);
}

static void *cp(ministep_t *ms, int p) { /* compute copy of parameter p */
    return (char *)ms->comp + ms->off[p] * dg_dtype_size(ms->act);
}
static float *gp(ministep_t *ms, int p) {
    return ms->grad + ms->off[p];
}

dg_status_t ministep_fwd_bwd(ministep_t *ms) {
    dg_backend_t *be = ms->be;
    const dg_backend_ops_t *op = be->ops;
    const int B = ms->c.B, T = ms->c.T, C = ms->c.C, NH = ms->c.NH, V = ms->c.V, Vp = ms->c.Vp, N = B * T;
    const size_t nc = (size_t)N * C, as = dg_dtype_size(ms->act);
    DG_TRY(op->memset0(be, ms->grad, ms->np * 4));
    /* forward */
    DG_TRY(op->encoder_fwd(be, ms->x0, ms->tok, cp(ms, P_WTE), cp(ms, P_WPE), B, T, C));
    DG_TRY(
        op->layernorm_fwd(be, ms->ln1, ms->mean1, ms->rstd1, ms->x0, cp(ms, P_LN1W), cp(ms, P_LN1B), N, C));
    DG_TRY(
        op->matmul_fwd(be, ms->qkv, NULL, ms->ln1, cp(ms, P_QKVW), cp(ms, P_QKVB), N, C, 3 * C, DG_EPI_NONE));
    DG_TRY(op->attention_fwd(be, ms->att, ms->aux, ms->qkv, B, T, C, NH));
    DG_TRY(
        op->matmul_fwd(be, ms->proj, NULL, ms->att, cp(ms, P_PROJW), cp(ms, P_PROJB), N, C, C, DG_EPI_NONE));
    DG_TRY(op->add(be, ms->x1, ms->x0, ms->proj, nc));
    DG_TRY(
        op->layernorm_fwd(be, ms->ln2, ms->mean2, ms->rstd2, ms->x1, cp(ms, P_LN2W), cp(ms, P_LN2B), N, C));
    DG_TRY(op->matmul_fwd(be, ms->fc, ms->fcpre, ms->ln2, cp(ms, P_FCW), cp(ms, P_FCB), N, C, 4 * C,
                          DG_EPI_GELU));
    DG_TRY(op->matmul_fwd(be, ms->fcproj, NULL, ms->fc, cp(ms, P_FCPW), cp(ms, P_FCPB), N, 4 * C, C,
                          DG_EPI_NONE));
    DG_TRY(op->add(be, ms->x2, ms->x1, ms->fcproj, nc));
    DG_TRY(
        op->layernorm_fwd(be, ms->lnf, ms->meanf, ms->rstdf, ms->x2, cp(ms, P_LNFW), cp(ms, P_LNFB), N, C));
    DG_TRY(op->matmul_fwd(be, ms->logits, NULL, ms->lnf, cp(ms, P_WTE), NULL, N, C, Vp, DG_EPI_NONE));
    DG_TRY(op->crossentropy_fwd(be, ms->losses, ms->lse, ms->logits, ms->tgt, N, V, Vp));
    /* backward (dlogits overwrite the logits in place) */
    DG_TRY(op->crossentropy_bwd(be, ms->logits, ms->logits, ms->lse, ms->tgt, N, V, Vp, 1.0f / (float)N));
    DG_TRY(
        op->matmul_bwd(be, ms->dlnf, gp(ms, P_WTE), NULL, ms->logits, ms->lnf, cp(ms, P_WTE), N, C, Vp, 0));
    DG_TRY(op->layernorm_bwd(be, ms->dx2, gp(ms, P_LNFW), gp(ms, P_LNFB), ms->dlnf, ms->x2, cp(ms, P_LNFW),
                             ms->meanf, ms->rstdf, N, C, 0));
    /* the MLP's projection backward through the GELU in one call, as the graph schedules it */
    DG_TRY(op->matmul_bwd_dgelu(be, ms->dfcpre, gp(ms, P_FCPW), gp(ms, P_FCPB), ms->dx2, ms->fc,
                                cp(ms, P_FCPW), ms->fcpre, N, 4 * C, C, 0));
    DG_TRY(op->matmul_bwd(be, ms->dln2, gp(ms, P_FCW), gp(ms, P_FCB), ms->dfcpre, ms->ln2, cp(ms, P_FCW), N,
                          C, 4 * C, 0));
    /* the residual stream: dx1 = dx2 + layernorm-2 input gradient */
    DG_TRY(op->copy(be, ms->dx1, ms->dx2, nc * as));
    DG_TRY(op->layernorm_bwd(be, ms->dx1, gp(ms, P_LN2W), gp(ms, P_LN2B), ms->dln2, ms->x1, cp(ms, P_LN2W),
                             ms->mean2, ms->rstd2, N, C, 1));
    DG_TRY(op->matmul_bwd(be, ms->datt, gp(ms, P_PROJW), gp(ms, P_PROJB), ms->dx1, ms->att, cp(ms, P_PROJW),
                          N, C, C, 0));
    DG_TRY(op->attention_bwd(be, ms->dqkv, ms->datt, ms->qkv, ms->att, ms->aux, B, T, C, NH));
    DG_TRY(op->matmul_bwd(be, ms->dln1, gp(ms, P_QKVW), gp(ms, P_QKVB), ms->dqkv, ms->ln1, cp(ms, P_QKVW), N,
                          C, 3 * C, 0));
    DG_TRY(op->accumulate(be, ms->dx0, ms->dx1, nc, 0));
    DG_TRY(op->layernorm_bwd(be, ms->dx0, gp(ms, P_LN1W), gp(ms, P_LN1B), ms->dln1, ms->x0, cp(ms, P_LN1W),
                             ms->mean1, ms->rstd1, N, C, 1));
    DG_TRY(op->encoder_bwd(be, gp(ms, P_WTE), gp(ms, P_WPE), ms->dx0, ms->tok, B, T, C));
    return DG_OK;
}

dg_status_t ministep_step(ministep_t *ms, int64_t t, double *loss) {
    dg_backend_t *be = ms->be;
    const dg_backend_ops_t *op = be->ops;
    const int N = ms->c.B * ms->c.T;
    DG_TRY(ministep_fwd_bwd(ms));
    DG_TRY(op->memset0(be, ms->sumsq, 4));
    DG_TRY(op->sumsq_f32(be, ms->sumsq, ms->grad, ms->np));
    DG_TRY(op->clip_scale(be, ms->gscale, ms->norm, ms->sumsq, ms->c.clip, 1.0f));
    DG_TRY(op->adamw(be, ms->master, ms->comp, ms->grad, ms->m, ms->v, ms->np, ms->c.lr, 0.9f, 0.95f, 1e-8f,
                     0.01f, t, ms->gscale));
    DG_TRY(op->to_host(be, ms->host_losses, ms->losses, (size_t)N * 4));
    double s = 0;
    for (int i = 0; i < N; i++)
        s += ms->host_losses[i];
    *loss = s / N;
    return DG_OK;
}

dg_status_t ministep_params(ministep_t *ms, float *host, size_t *n) {
    *n = ms->np;
    return ms->be->ops->to_host(ms->be, host, ms->master, ms->np * 4);
}

dg_status_t ministep_grad_norm(ministep_t *ms, float *norm) {
    return ms->be->ops->to_host(ms->be, norm, ms->norm, 4);
}
