/* oph_layers.c — op harness cases: encoder, layernorm, gelu, attention and cross-entropy (plain, fused). */
#include "oph.h"

#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

/* ---- encoder ---- */

typedef struct {
    const int32_t *tok;
    double *wte, *wpe, *out;
    const double *dout;
    int B, T, C;
} enc_ctx_t;
static double enc_obj(void *p) {
    enc_ctx_t *c = p;
    oph_ref_encoder(c->out, c->tok, c->wte, c->wpe, c->B, c->T, c->C);
    return oph_dotd(c->out, c->dout, (size_t)c->B * c->T * c->C);
}

void oph_case_encoder(H *h, int B, int T, int C, int V, int Vp, int fd) {
    if (!oph_case_begin(h, "encoder[B=%d,T=%d,C=%d,V=%d,Vp=%d]", B, T, C, V, Vp)) return;
    const dg_dtype_t A = h->act;
    const int Tmax = T + 3; /* position rows past T must stay untouched */
    const size_t N = (size_t)B * T, no = N * C, nte = (size_t)Vp * C, npe = (size_t)Tmax * C;
    int32_t *tok = oph_rand_tokens(h, N, V);
    double *wte = oph_hrand(h, nte, 0.05, 1.0), *wpe = oph_hrand(h, npe, 0.05, 1.0),
           *dout = oph_hrand(h, no, 0.05, 1.0);
    oph_hround(wte, nte, A);
    oph_hround(wpe, npe, A);
    oph_hround(dout, no, A);
    double *ref = oph_hnew(h, no);
    oph_ref_encoder(ref, tok, wte, wpe, B, T, C);
    void *dtok = oph_dalloc(h, DG_I32, N), *dte = oph_dput(h, A, wte, nte), *dpe = oph_dput(h, A, wpe, npe),
         *dy = oph_dput(h, A, dout, no);
    void *o1 = oph_dpoisoned(h, A, no), *o2 = oph_dpoisoned(h, A, no);
    oph_upload_i32(h, dtok, tok, N);
    if (!h->bad) CALL(h, "encoder_fwd", encoder_fwd(h->be, o1, dtok, dte, dpe, B, T, C));
    if (!h->bad) CALL(h, "encoder_fwd", encoder_fwd(h->be, o2, dtok, dte, dpe, B, T, C));
    oph_check_close(h, "fwd out", oph_download(h, o1, A, no), ref, no, oph_tol_of(h, "encoder_fwd"), NULL);
    oph_check_dev_bits(h, "fwd repeat", o1, o2, no * oph_dt_size(A));
    oph_digest_dev(h, o1, no * oph_dt_size(A));

    /* backward: analytic float64 grads */
    double *gte = oph_hnew(h, nte), *gpe = oph_hnew(h, npe);
    for (size_t i = 0; i < N; i++)
        for (int c = 0; c < C; c++) {
            gte[(size_t)tok[i] * C + c] += dout[i * C + c];
            gpe[(i % T) * C + c] += dout[i * C + c];
        }
    const double tb = oph_tol_of(h, "encoder_bwd");
    void *gte1 = oph_dalloc(h, DG_F32, nte), *gpe1 = oph_dalloc(h, DG_F32, npe),
         *gte2 = oph_dalloc(h, DG_F32, nte), *gpe2 = oph_dalloc(h, DG_F32, npe);
    /* run 1 from zero */
    if (!h->bad) CALL(h, "memset0", memset0(h->be, gte1, nte * 4));
    if (!h->bad) CALL(h, "memset0", memset0(h->be, gpe1, npe * 4));
    if (!h->bad) CALL(h, "encoder_bwd", encoder_bwd(h->be, gte1, gpe1, dy, dtok, B, T, C));
    double *g1 = oph_download(h, gte1, DG_F32, nte), *p1 = oph_download(h, gpe1, DG_F32, npe);
    oph_check_close(h, "bwd dwte", g1, gte, nte, tb, NULL);
    oph_check_close(h, "bwd dwpe", p1, gpe, npe, tb, NULL);
    if (fd) {
        enc_ctx_t cx = {tok, wte, wpe, oph_hnew(h, no), dout, B, T, C};
        oph_check_fd(h, "bwd dwte", enc_obj, &cx, wte, nte, g1, gte, tb);
        oph_check_fd(h, "bwd dwpe", enc_obj, &cx, wpe, npe, p1, gpe, tb);
    }
    oph_digest_dev(h, gte1, nte * 4);
    oph_digest_dev(h, gpe1, npe * 4);
    /* run 2 into non-zero gradients: must add */
    double *pre_te = oph_prefill(h, gte2, DG_F32, nte), *pre_pe = oph_prefill(h, gpe2, DG_F32, npe);
    if (!h->bad) CALL(h, "encoder_bwd", encoder_bwd(h->be, gte2, gpe2, dy, dtok, B, T, C));
    oph_check_close(h, "bwd dwte accumulates (+=)", oph_download(h, gte2, DG_F32, nte),
                    oph_add_arrays(h, pre_te, gte, nte), nte, tb, gte);
    oph_check_close(h, "bwd dwpe accumulates (+=)", oph_download(h, gpe2, DG_F32, npe),
                    oph_add_arrays(h, pre_pe, gpe, npe), npe, tb, gpe);
    /* run 3 = run 1 */
    if (!h->bad) CALL(h, "memset0", memset0(h->be, gte2, nte * 4));
    if (!h->bad) CALL(h, "memset0", memset0(h->be, gpe2, npe * 4));
    if (!h->bad) CALL(h, "encoder_bwd", encoder_bwd(h->be, gte2, gpe2, dy, dtok, B, T, C));
    oph_check_dev_bits(h, "bwd repeat dwte", gte2, gte1, nte * 4);
    oph_check_dev_bits(h, "bwd repeat dwpe", gpe2, gpe1, npe * 4);
    oph_case_end(h);
}

/* ---- layernorm ---- */

typedef struct {
    double *x, *w, *b, *out;
    const double *dout;
    int N, C;
} ln_ctx_t;
static double ln_obj(void *p) {
    ln_ctx_t *c = p;
    oph_ref_layernorm(c->out, NULL, NULL, c->x, c->w, c->b, c->N, c->C);
    return oph_dotd(c->out, c->dout, (size_t)c->N * c->C);
}

typedef struct {
    const void *dy, *x, *w;
    void *mean, *rstd;
    int N, C;
} ln_bwd_t;
static void ln_bwd_run(H *h, void *p, void *const g[3], int acc) {
    const ln_bwd_t *c = p;
    if (!h->bad)
        CALL(h, "layernorm_bwd",
             layernorm_bwd(h->be, g[0], g[1], g[2], c->dy, c->x, c->w, c->mean, c->rstd, c->N, c->C, acc));
}

void oph_case_layernorm(H *h, int N, int C, double offset, int fd) {
    if (!oph_case_begin(h, "layernorm[N=%d,C=%d,offset=%g]", N, C, offset)) return;
    const dg_dtype_t A = h->act;
    const size_t n = (size_t)N * C;
    double *x = oph_hrand(h, n, 0.05, 1.5), *w = oph_hrand(h, C, 0.2, 1.5), *b = oph_hrand(h, C, 0.05, 1.0);
    double *dout = oph_hrand(h, n, 0.05, 1.0);
    for (size_t i = 0; i < n; i++)
        x[i] += offset; /* rows with |mean| >> std test the variance formula */
    oph_hround(x, n, A);
    oph_hround(w, C, A);
    oph_hround(b, C, A);
    oph_hround(dout, n, A);
    double *ref = oph_hnew(h, n), *rmean = oph_hnew(h, N), *rrstd = oph_hnew(h, N);
    oph_ref_layernorm(ref, rmean, rrstd, x, w, b, N, C);
    void *dx = oph_dput(h, A, x, n), *dw = oph_dput(h, A, w, C), *dbb = oph_dput(h, A, b, C),
         *dy = oph_dput(h, A, dout, n);
    void *o1 = oph_dpoisoned(h, A, n), *m1 = oph_dpoisoned(h, DG_F32, N), *r1 = oph_dpoisoned(h, DG_F32, N);
    void *o2 = oph_dpoisoned(h, A, n), *m2 = oph_dpoisoned(h, DG_F32, N), *r2 = oph_dpoisoned(h, DG_F32, N);
    if (!h->bad) CALL(h, "layernorm_fwd", layernorm_fwd(h->be, o1, m1, r1, dx, dw, dbb, N, C));
    if (!h->bad) CALL(h, "layernorm_fwd", layernorm_fwd(h->be, o2, m2, r2, dx, dw, dbb, N, C));
    const double tf = oph_tol_of(h, "layernorm_fwd");
    oph_check_close(h, "fwd out", oph_download(h, o1, A, n), ref, n, tf, NULL);
    oph_check_close(h, "fwd mean", oph_download(h, m1, DG_F32, N), rmean, N, tf, NULL);
    oph_check_close(h, "fwd rstd", oph_download(h, r1, DG_F32, N), rrstd, N, tf, NULL);
    oph_check_dev_bits(h, "fwd repeat", o1, o2, n * oph_dt_size(A));
    oph_check_dev_bits(h, "fwd repeat rstd", r1, r2, N * 4);
    oph_digest_dev(h, o1, n * oph_dt_size(A));
    oph_digest_dev(h, m1, N * 4);
    oph_digest_dev(h, r1, N * 4);

    ln_bwd_t lb = {dy, dx, dw, m1, r1, N, C};
    ln_ctx_t cx = {x, w, b, fd ? oph_hnew(h, n) : NULL, dout, N, C};
    oph_bwd3_t bw = {.names = {"dinp", "dw", "db"},
                     .run = ln_bwd_run,
                     .ctx = &lb,
                     .obj = fd ? ln_obj : NULL,
                     .obj_ctx = &cx,
                     .x = {x, w, b}};
    double *r[3];
    oph_bwd3_alloc(h, &bw, "layernorm_bwd", A, (const size_t[3]){n, C, C}, r);
    oph_ref_layernorm_bwd(r[0], r[1], r[2], dout, x, w, N, C);
    oph_check_bwd3(h, &bw);
    oph_case_end(h);
}

/* ---- gelu ---- */

typedef struct {
    double *x;
    const double *dout;
    size_t n;
} gelu_ctx_t;
static double gelu_obj(void *p) {
    gelu_ctx_t *c = p;
    double s = 0;
    for (size_t i = 0; i < c->n; i++)
        s += c->dout[i] * oph_ref_gelu1(c->x[i]);
    return s;
}

void oph_case_gelu(H *h, size_t n, int fd) {
    if (!oph_case_begin(h, "gelu[n=%zu]", n)) return;
    const dg_dtype_t A = h->act;
    double *x = oph_hrand(h, n, 0.01, 5.0), *dout = oph_hrand(h, n, 0.05, 1.0);
    for (size_t i = 0; i < n; i += 17)
        x[i] *= 3.0; /* some tails, out to |x| = 15 */
    oph_hround(x, n, A);
    oph_hround(dout, n, A);
    double *ref = oph_hnew(h, n), *rdx = oph_hnew(h, n);
    for (size_t i = 0; i < n; i++) {
        ref[i] = oph_ref_gelu1(x[i]);
        rdx[i] = dout[i] * oph_ref_gelu_grad1(x[i]);
    }
    void *dx = oph_dput(h, A, x, n), *dy = oph_dput(h, A, dout, n), *o1 = oph_dpoisoned(h, A, n),
         *o2 = oph_dpoisoned(h, A, n);
    void *g1 = oph_dpoisoned(h, A, n), *g2 = oph_dalloc(h, A, n);
    if (!h->bad) CALL(h, "gelu_fwd", gelu_fwd(h->be, o1, dx, n));
    if (!h->bad) CALL(h, "gelu_fwd", gelu_fwd(h->be, o2, dx, n));
    oph_check_close(h, "fwd", oph_download(h, o1, A, n), ref, n, oph_tol_of(h, "gelu_fwd"), NULL);
    oph_check_dev_bits(h, "fwd repeat", o1, o2, n * oph_dt_size(A));
    oph_digest_dev(h, o1, n * oph_dt_size(A));
    const double tb = oph_tol_of(h, "gelu_bwd");
    if (!h->bad) CALL(h, "gelu_bwd", gelu_bwd(h->be, g1, dx, dy, n, 0));
    double *a = oph_download(h, g1, A, n);
    oph_check_close(h, "bwd (acc=0)", a, rdx, n, tb, NULL);
    if (fd) {
        gelu_ctx_t cx = {x, dout, n};
        oph_check_fd(h, "bwd dinp", gelu_obj, &cx, x, n, a, rdx, tb);
    }
    oph_digest_dev(h, g1, n * oph_dt_size(A));
    double *pre = oph_hrand(h, n, 0.05, 1.0);
    oph_hround(pre, n, A);
    oph_upload(h, g2, A, pre, n);
    if (!h->bad) CALL(h, "gelu_bwd", gelu_bwd(h->be, g2, dx, dy, n, 1));
    oph_check_close(h, "bwd (acc=1 adds)", oph_download(h, g2, A, n), oph_add_arrays(h, pre, rdx, n), n, tb,
                    rdx);
    oph_poison(h, g2, A, n);
    if (!h->bad) CALL(h, "gelu_bwd", gelu_bwd(h->be, g2, dx, dy, n, 0));
    oph_check_dev_bits(h, "bwd repeat", g2, g1, n * oph_dt_size(A));
    oph_case_end(h);
}

/* ---- attention ---- */

typedef struct {
    double *qkv, *out, *p;
    const double *dout;
    int B, T, C, NH;
} att_ctx_t;
static double att_obj(void *pv) {
    att_ctx_t *c = pv;
    oph_ref_attention(c->out, c->qkv, c->B, c->T, c->C, c->NH, c->p);
    return oph_dotd(c->out, c->dout, (size_t)c->B * c->T * c->C);
}

void oph_case_attention(H *h, int B, int T, int C, int NH, int fd) {
    if (!oph_case_begin(h, "attention[B=%d,T=%d,C=%d,NH=%d]", B, T, C, NH)) return;
    const dg_dtype_t A = h->act;
    const size_t nq = (size_t)B * T * 3 * C, no = (size_t)B * T * C;
    double *qkv = oph_hrand(h, nq, 0.05, 1.5), *dout = oph_hrand(h, no, 0.05, 1.0);
    oph_hround(qkv, nq, A);
    oph_hround(dout, no, A);
    double *ref = oph_hnew(h, no), *p = oph_hnew(h, T), *dp = oph_hnew(h, T), *rdq = oph_hnew(h, nq);
    oph_ref_attention(ref, qkv, B, T, C, NH, p);
    oph_ref_attention_bwd(rdq, dout, qkv, B, T, C, NH, p, dp);
    const size_t auxb = h->be->ops->attention_aux_bytes(h->be, B, T, C, NH);
    void *dq = oph_dput(h, A, qkv, nq), *dy = oph_dput(h, A, dout, no), *o1 = oph_dpoisoned(h, A, no),
         *o2 = oph_dpoisoned(h, A, no);
    void *aux1 = oph_dalloc_bytes(h, auxb), *aux2 = oph_dalloc_bytes(h, auxb);
    void *g1 = oph_dpoisoned(h, A, nq), *g2 = oph_dpoisoned(h, A, nq);
    oph_poison_bytes(h, aux1, auxb); /* backward reading aux the forward never wrote would produce NaN */
    oph_poison_bytes(h, aux2, auxb);
    if (!h->bad) CALL(h, "attention_fwd", attention_fwd(h->be, o1, aux1, dq, B, T, C, NH));
    if (!h->bad) CALL(h, "attention_fwd", attention_fwd(h->be, o2, aux2, dq, B, T, C, NH));
    oph_check_close(h, "fwd out", oph_download(h, o1, A, no), ref, no, oph_tol_of(h, "attention_fwd"), NULL);
    oph_check_dev_bits(h, "fwd repeat", o1, o2, no * oph_dt_size(A));
    oph_digest_dev(h, o1, no * oph_dt_size(A));
    const double tb = oph_tol_of(h, "attention_bwd");
    if (!h->bad) CALL(h, "attention_bwd", attention_bwd(h->be, g1, dy, dq, o1, aux1, B, T, C, NH));
    if (!h->bad) CALL(h, "attention_bwd", attention_bwd(h->be, g2, dy, dq, o2, aux2, B, T, C, NH));
    double *a = oph_download(h, g1, A, nq);
    oph_check_close(h, "bwd dqkv", a, rdq, nq, tb, NULL);
    if (fd) {
        att_ctx_t cx = {qkv, oph_hnew(h, no), p, dout, B, T, C, NH};
        oph_check_fd(h, "bwd dqkv", att_obj, &cx, qkv, nq, a, rdq, tb);
    }
    oph_check_dev_bits(h, "bwd repeat", g1, g2, nq * oph_dt_size(A));
    oph_digest_dev(h, g1, nq * oph_dt_size(A));
    oph_case_end(h);
}

/* ---- cross-entropy ---- */

typedef struct {
    double *z, *loss;
    const int32_t *tg;
    int N, V, Vp;
    double dloss;
} ce_ctx_t;
static double ce_obj(void *p) {
    ce_ctx_t *c = p;
    oph_ref_ce(c->loss, NULL, c->z, c->tg, c->N, c->V, c->Vp);
    double s = 0;
    for (int i = 0; i < c->N; i++)
        s += c->loss[i];
    return s * c->dloss;
}

void oph_case_crossentropy(H *h, int N, int V, int Vp, int fd) {
    if (!oph_case_begin(h, "crossentropy[N=%d,V=%d,Vp=%d]", N, V, Vp)) return;
    const dg_dtype_t A = h->act;
    const size_t nz = (size_t)N * Vp;
    double *z = oph_hrand(h, nz, 0.05, 4.0); /* padded columns hold garbage too: they must be ignored */
    int32_t *tg = oph_rand_tokens(h, N, V);
    oph_hround(z, nz, A);
    const double dloss = (double)(float)(1.3 / N);
    double *rl = oph_hnew(h, N), *rlse = oph_hnew(h, N), *rdz = oph_hnew(h, nz);
    oph_ref_ce(rl, rlse, z, tg, N, V, Vp);
    oph_ref_ce_bwd(rdz, z, tg, N, V, Vp, dloss);
    void *dz = oph_dput(h, A, z, nz), *dtg = oph_dalloc(h, DG_I32, N);
    void *l1 = oph_dpoisoned(h, DG_F32, N), *s1 = oph_dpoisoned(h, DG_F32, N),
         *l2 = oph_dpoisoned(h, DG_F32, N), *s2 = oph_dpoisoned(h, DG_F32, N);
    void *g1 = oph_dpoisoned(h, A, nz), *g2 = oph_dpoisoned(h, A, nz);
    oph_upload_i32(h, dtg, tg, N);
    if (!h->bad) CALL(h, "crossentropy_fwd", crossentropy_fwd(h->be, l1, s1, dz, dtg, N, V, Vp));
    if (!h->bad) CALL(h, "crossentropy_fwd", crossentropy_fwd(h->be, l2, s2, dz, dtg, N, V, Vp));
    const double tf = oph_tol_of(h, "crossentropy_fwd");
    oph_check_close(h, "fwd losses", oph_download(h, l1, DG_F32, N), rl, N, tf, NULL);
    oph_check_close(h, "fwd lse", oph_download(h, s1, DG_F32, N), rlse, N, tf, NULL);
    oph_check_dev_bits(h, "fwd repeat", l1, l2, N * 4);
    oph_digest_dev(h, l1, N * 4);
    oph_digest_dev(h, s1, N * 4);
    const double tb = oph_tol_of(h, "crossentropy_bwd");
    if (!h->bad)
        CALL(h, "crossentropy_bwd", crossentropy_bwd(h->be, g1, dz, s1, dtg, N, V, Vp, (float)dloss));
    double *a = oph_download(h, g1, A, nz);
    oph_check_close(h, "bwd dlogits (padded columns = 0)", a, rdz, nz, tb, NULL);
    if (fd) {
        ce_ctx_t cx = {z, oph_hnew(h, N), tg, N, V, Vp, dloss};
        oph_check_fd(h, "bwd dlogits", ce_obj, &cx, z, nz, a, rdz, tb);
    }
    oph_digest_dev(h, g1, nz * oph_dt_size(A));
    if (!h->bad)
        CALL(h, "crossentropy_bwd", crossentropy_bwd(h->be, g2, dz, s1, dtg, N, V, Vp, (float)dloss));
    oph_check_dev_bits(h, "bwd repeat", g2, g1, nz * oph_dt_size(A));
    /* in place: dlogits aliasing logits */
    void *inplace = oph_ddup(h, dz, nz * oph_dt_size(A));
    if (!h->bad)
        CALL(h, "crossentropy_bwd",
             crossentropy_bwd(h->be, inplace, inplace, s1, dtg, N, V, Vp, (float)dloss));
    oph_check_dev_bits(h, "bwd in place (dlogits == logits)", inplace, g1, nz * oph_dt_size(A));
    oph_case_end(h);
}

/* crossentropy_fused (contract v1.10): the same bits as crossentropy_fwd followed by crossentropy_bwd on
 * this backend, out of place and in place (dlogits == logits), with every output poisoned first; and
 * within the forward/backward tolerances of the float64 references. lg_off / dl_off shift logits /
 * dlogits by that many elements from a 256-byte boundary (CUDA: misaligned logits take the scalar
 * reduction; misaligned dlogits keep the vector reduction with scalar stores). A large Vp: rows that do
 * not fit in GPU shared memory (CUDA's two-pass kernel). */
void oph_case_crossentropy_fused(H *h, int N, int V, int Vp, int lg_off, int dl_off) {
    if (!oph_case_begin(h, "crossentropy_fused[N=%d,V=%d,Vp=%d,off=%d/%d]", N, V, Vp, lg_off, dl_off)) return;
    if (!h->be->ops->crossentropy_fused) { /* optional entry: the graph keeps the two ops */
        oph_pass(h, "crossentropy_fused: not provided by the %s backend (optional)", h->be->ops->name);
        oph_case_end(h);
        return;
    }
    const dg_dtype_t A = h->act;
    const size_t es = oph_dt_size(A), nz = (size_t)N * Vp, zb = nz * es;
    double *z = oph_hrand(h, nz, 0.05, 4.0); /* padded columns hold garbage too: they must be ignored */
    int32_t *tg = oph_rand_tokens(h, N, V);
    tg[N - 1] = V - 1; /* the last real column (in a vector that reaches into the padding) */
    oph_hround(z, nz, A);
    const double dloss = (double)(float)(0.7 / N);
    double *rl = oph_hnew(h, N), *rlse = oph_hnew(h, N), *rdz = oph_hnew(h, nz);
    oph_ref_ce(rl, rlse, z, tg, N, V, Vp);
    oph_ref_ce_bwd(rdz, z, tg, N, V, Vp, dloss);
    char *zbase = oph_dalloc_bytes(h, zb + 256), *gbase = oph_dalloc_bytes(h, zb + 256),
         *rbase = oph_dalloc_bytes(h, zb + 256);
    void *dtg = oph_dalloc(h, DG_I32, N);
    void *l1 = oph_dpoisoned(h, DG_F32, N), *s1 = oph_dpoisoned(h, DG_F32, N),
         *l2 = oph_dpoisoned(h, DG_F32, N), *s2 = oph_dpoisoned(h, DG_F32, N);
    if (h->bad) {
        oph_case_end(h);
        return;
    }
    void *dz = zbase + (size_t)lg_off * es, *g1 = gbase + (size_t)dl_off * es,
         *g0 = rbase + (size_t)dl_off * es;
    oph_upload(h, dz, A, z, nz);
    oph_upload_i32(h, dtg, tg, N);
    void *zraw = oph_download_raw(h, dz, zb);
    /* the unfused pair on this backend: the reference bits */
    oph_poison(h, g0, A, nz);
    if (!h->bad) CALL(h, "crossentropy_fwd", crossentropy_fwd(h->be, l1, s1, dz, dtg, N, V, Vp));
    if (!h->bad)
        CALL(h, "crossentropy_bwd", crossentropy_bwd(h->be, g0, dz, s1, dtg, N, V, Vp, (float)dloss));
    void *rl_bits = oph_download_raw(h, l1, N * 4), *rs_bits = oph_download_raw(h, s1, N * 4);
    void *rg_bits = oph_download_raw(h, g0, zb);
    /* fused, out of place */
    oph_poison(h, g1, A, nz);
    if (!h->bad)
        CALL(h, "crossentropy_fused", crossentropy_fused(h->be, l2, s2, g1, dz, dtg, N, V, Vp, (float)dloss));
    oph_check_close(h, "fused losses", oph_download(h, l2, DG_F32, N), rl, N,
                    oph_tol_of(h, "crossentropy_fwd"), NULL);
    oph_check_close(h, "fused lse", oph_download(h, s2, DG_F32, N), rlse, N,
                    oph_tol_of(h, "crossentropy_fwd"), NULL);
    oph_check_close(h, "fused dlogits (padded columns = 0)", oph_download(h, g1, A, nz), rdz, nz,
                    oph_tol_of(h, "crossentropy_bwd"), NULL);
    oph_check_bits(h, "fused losses == crossentropy_fwd's", oph_download_raw(h, l2, N * 4), rl_bits, N * 4);
    oph_check_bits(h, "fused lse == crossentropy_fwd's", oph_download_raw(h, s2, N * 4), rs_bits, N * 4);
    oph_check_bits(h, "fused dlogits == crossentropy_bwd's", oph_download_raw(h, g1, zb), rg_bits, zb);
    oph_check_bits(h, "fused out of place leaves the logits", oph_download_raw(h, dz, zb), zraw, zb);
    oph_digest_dev(h, l2, N * 4);
    oph_digest_dev(h, s2, N * 4);
    oph_digest_dev(h, g1, zb);
    /* fused, in place: dlogits over the logits */
    oph_poison(h, l2, DG_F32, N);
    oph_poison(h, s2, DG_F32, N);
    if (!h->bad)
        CALL(h, "crossentropy_fused", crossentropy_fused(h->be, l2, s2, dz, dz, dtg, N, V, Vp, (float)dloss));
    oph_check_bits(h, "fused in place: losses", oph_download_raw(h, l2, N * 4), rl_bits, N * 4);
    oph_check_bits(h, "fused in place: lse", oph_download_raw(h, s2, N * 4), rs_bits, N * 4);
    oph_check_bits(h, "fused in place: dlogits over the logits == crossentropy_bwd's",
                   oph_download_raw(h, dz, zb), rg_bits, zb);
    oph_case_end(h);
}
