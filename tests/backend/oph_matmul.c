/* oph_matmul.c — op harness cases: matmul_fwd/bwd, matmul_fwd_res and matmul_bwd_dgelu. */
#include "oph.h"

#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

/* ---- matmul ---- */

typedef struct {
    double *x, *w, *bias, *out;
    const double *dout;
    int N, C, OC;
} mm_ctx_t;
static double mm_obj(void *p) { /* objective of the linear part: what matmul_bwd differentiates */
    mm_ctx_t *c = p;
    oph_ref_matmul(c->out, NULL, c->x, c->w, c->bias, c->N, c->C, c->OC, 0);
    return oph_dotd(c->out, c->dout, (size_t)c->N * c->OC);
}

typedef struct {
    const void *dy, *x, *w;
    int N, C, OC;
} mm_bwd_t;
static void mm_bwd_run(H *h, void *p, void *const g[3], int acc) {
    const mm_bwd_t *c = p;
    if (!h->bad)
        CALL(h, "matmul_bwd", matmul_bwd(h->be, g[0], g[1], g[2], c->dy, c->x, c->w, c->N, c->C, c->OC, acc));
}

void oph_case_matmul(H *h, int N, int C, int OC, int has_bias, int gelu, int fd) {
    if (!oph_case_begin(h, "matmul[N=%d,C=%d,OC=%d%s%s]", N, C, OC, has_bias ? ",bias" : "",
                        gelu ? ",gelu" : ""))
        return;
    const dg_dtype_t A = h->act;
    const size_t nx = (size_t)N * C, nw = (size_t)OC * C, no = (size_t)N * OC;
    double *x = oph_hrand(h, nx, 0.05, 1.0), *w = oph_hrand(h, nw, 0.02, 0.3),
           *bias = oph_hrand(h, OC, 0.05, 0.5), *dout = oph_hrand(h, no, 0.05, 1.0);
    oph_hround(x, nx, A);
    oph_hround(w, nw, A);
    oph_hround(bias, OC, A);
    oph_hround(dout, no, A);
    double *ref = oph_hnew(h, no), *rpre = oph_hnew(h, no);
    oph_ref_matmul(ref, rpre, x, w, has_bias ? bias : NULL, N, C, OC, gelu);
    void *dx = oph_dput(h, A, x, nx), *dw = oph_dput(h, A, w, nw),
         *dbias = has_bias ? oph_dalloc(h, A, OC) : NULL;
    void *dy = oph_dput(h, A, dout, no), *o1 = oph_dpoisoned(h, A, no), *o2 = oph_dpoisoned(h, A, no);
    void *p1 = gelu ? oph_dalloc(h, A, no) : NULL, *p2 = gelu ? oph_dalloc(h, A, no) : NULL;
    if (dbias) oph_upload(h, dbias, A, bias, OC);
    if (gelu) {
        oph_poison(h, p1, A, no);
        oph_poison(h, p2, A, no);
    }
    const dg_epilogue_t epi = gelu ? DG_EPI_GELU : DG_EPI_NONE;
    if (!h->bad) CALL(h, "matmul_fwd", matmul_fwd(h->be, o1, p1, dx, dw, dbias, N, C, OC, epi));
    if (!h->bad) CALL(h, "matmul_fwd", matmul_fwd(h->be, o2, p2, dx, dw, dbias, N, C, OC, epi));
    const double tf = oph_tol_of(h, "matmul_fwd");
    oph_check_close(h, gelu ? "fwd out = gelu(pre)" : "fwd out", oph_download(h, o1, A, no), ref, no, tf,
                    NULL);
    if (gelu) oph_check_close(h, "fwd pre", oph_download(h, p1, A, no), rpre, no, tf, NULL);
    oph_check_dev_bits(h, "fwd repeat", o1, o2, no * oph_dt_size(A));
    oph_digest_dev(h, o1, no * oph_dt_size(A));
    if (gelu) oph_digest_dev(h, p1, no * oph_dt_size(A));

    mm_bwd_t mb = {dy, dx, dw, N, C, OC};
    mm_ctx_t cx = {x, w, bias, fd ? oph_hnew(h, no) : NULL, dout, N, C, OC};
    oph_bwd3_t bw = {.names = {"dinp", "dw", "dbias"},
                     .run = mm_bwd_run,
                     .ctx = &mb,
                     .obj = fd ? mm_obj : NULL,
                     .obj_ctx = &cx,
                     .x = {x, w, bias}};
    double *r[3];
    oph_bwd3_alloc(h, &bw, "matmul_bwd", A, (const size_t[3]){nx, nw, OC}, r);
    oph_ref_matmul_bwd(r[0], r[1], r[2], dout, x, w, N, C, OC);
    oph_check_bwd3(h, &bw);
    void *gw2 = bw.g2[1];
    const double *rdw = r[1], tb = bw.tol;
    /* run 4: no input gradient and no bias gradient wanted */
    if (!h->bad) CALL(h, "memset0", memset0(h->be, gw2, nw * 4));
    if (!h->bad) CALL(h, "matmul_bwd", matmul_bwd(h->be, NULL, gw2, NULL, dy, dx, dw, N, C, OC, 0));
    oph_check_close(h, "bwd dw with dinp=NULL, dbias=NULL", oph_download(h, gw2, DG_F32, nw), rdw, nw, tb,
                    NULL);
    oph_case_end(h);
}

/* ---- matmul_fwd_res (contract v1.11): the linear layer and the residual add in one call ---- */

/* out = x·wᵀ + bias + res against float64, out of place (res untouched) and in place (out == res), every
 * output poisoned first, repeated for bits; a residual buffer `off` elements past a 256-byte boundary
 * (CUDA: C's alignment differs from D's). */
void oph_case_matmul_res(H *h, int N, int C, int OC, int has_bias, int off) {
    if (!oph_case_begin(h, "matmul_fwd_res[N=%d,C=%d,OC=%d%s,off=%d]", N, C, OC, has_bias ? ",bias" : "",
                        off))
        return;
    if (!h->be->ops->matmul_fwd_res) { /* optional entry: the graph keeps the matmul and the add */
        oph_pass(h, "matmul_fwd_res: not provided by the %s backend (optional)", h->be->ops->name);
        oph_case_end(h);
        return;
    }
    const dg_dtype_t A = h->act;
    const size_t nx = (size_t)N * C, nw = (size_t)OC * C, no = (size_t)N * OC, ob = no * oph_dt_size(A);
    double *x = oph_hrand(h, nx, 0.05, 1.0), *w = oph_hrand(h, nw, 0.02, 0.3),
           *bias = oph_hrand(h, OC, 0.05, 0.5), *res = oph_hrand(h, no, -1.0, 1.0);
    oph_hround(x, nx, A);
    oph_hround(w, nw, A);
    oph_hround(bias, OC, A);
    oph_hround(res, no, A);
    double *ref = oph_hnew(h, no);
    oph_ref_matmul(ref, NULL, x, w, has_bias ? bias : NULL, N, C, OC, 0);
    for (size_t i = 0; i < no; i++)
        ref[i] += res[i];
    void *dx = oph_dput(h, A, x, nx), *dw = oph_dput(h, A, w, nw),
         *db = has_bias ? oph_dalloc(h, A, OC) : NULL;
    char *rbase = oph_dalloc_bytes(h, ob + 256);
    void *o1 = oph_dpoisoned(h, A, no), *o2 = oph_dpoisoned(h, A, no);
    if (h->bad) {
        oph_case_end(h);
        return;
    }
    void *dr = rbase + (size_t)off * oph_dt_size(A);
    if (db) oph_upload(h, db, A, bias, OC);
    oph_upload(h, dr, A, res, no);
    void *rraw = oph_download_raw(h, dr, ob);
    if (!h->bad) CALL(h, "matmul_fwd_res", matmul_fwd_res(h->be, o1, dx, dw, db, dr, N, C, OC));
    if (!h->bad) CALL(h, "matmul_fwd_res", matmul_fwd_res(h->be, o2, dx, dw, db, dr, N, C, OC));
    const double tf = oph_tol_of(h, "matmul_fwd_res");
    oph_check_close(h, "out = x·wᵀ + bias + res", oph_download(h, o1, A, no), ref, no, tf, NULL);
    oph_check_dev_bits(h, "repeat", o1, o2, ob);
    oph_check_bits(h, "out of place leaves res", oph_download_raw(h, dr, ob), rraw, ob);
    oph_digest_dev(h, o1, ob);
    /* in place: the residual stream updated where it lies */
    if (!h->bad) CALL(h, "matmul_fwd_res", matmul_fwd_res(h->be, dr, dx, dw, db, dr, N, C, OC));
    oph_check_close(h, "in place (out == res)", oph_download(h, dr, A, no), ref, no, tf, NULL);
    oph_case_end(h);
}

/* ---- matmul_bwd_dgelu: matmul_bwd through a GELU ---- */

typedef struct {
    double *pre, *w, *bias, *act, *out;
    const double *inp, *dout;
    int N, C, OC;
} mmg_ctx_t;
/* through the GELU: sum(dout * (gelu(pre)·wᵀ + b)); what dpre differentiates */
static double mmg_obj_pre(void *p) {
    mmg_ctx_t *c = p;
    for (size_t i = 0; i < (size_t)c->N * c->C; i++)
        c->act[i] = oph_ref_gelu1(c->pre[i]);
    oph_ref_matmul(c->out, NULL, c->act, c->w, c->bias, c->N, c->C, c->OC, 0);
    return oph_dotd(c->out, c->dout, (size_t)c->N * c->OC);
}
/* with the GELU output fixed to the act-dtype values the backend reads (what dw and dbias differentiate) */
static double mmg_obj_w(void *p) {
    mmg_ctx_t *c = p;
    oph_ref_matmul(c->out, NULL, c->inp, c->w, c->bias, c->N, c->C, c->OC, 0);
    return oph_dotd(c->out, c->dout, (size_t)c->N * c->OC);
}

void oph_case_matmul_dgelu(H *h, int N, int C, int OC, int has_bias, int fd) {
    if (!oph_case_begin(h, "matmul_bwd_dgelu[N=%d,C=%d,OC=%d%s]", N, C, OC, has_bias ? ",bias" : "")) return;
    const dg_dtype_t A = h->act;
    const size_t nx = (size_t)N * C, nw = (size_t)OC * C, no = (size_t)N * OC;
    double *pre = oph_hrand(h, nx, 0.01, 3.0), *w = oph_hrand(h, nw, 0.02, 0.3),
           *bias = oph_hrand(h, OC, 0.05, 0.5), *dout = oph_hrand(h, no, 0.05, 1.0);
    for (size_t i = 0; i < nx; i += 13)
        pre[i] *= 2.5; /* some tails */
    oph_hround(pre, nx, A);
    oph_hround(w, nw, A);
    oph_hround(bias, OC, A);
    oph_hround(dout, no, A);
    double *inp = oph_hnew(h, nx);
    for (size_t i = 0; i < nx; i++)
        inp[i] = oph_h_round(oph_ref_gelu1(pre[i]), A); /* the saved (or recomputed) GELU output */
    /* float64 references: dpre = (dout·w) ⊙ gelu'(pre), dw = doutᵀ·inp, dbias = colsum(dout) */
    double *rdx = oph_hnew(h, nx), *rdw = oph_hnew(h, nw), *rdb = oph_hnew(h, OC);
    oph_ref_matmul_bwd(rdx, rdw, rdb, dout, inp, w, N, C, OC);
    for (size_t i = 0; i < nx; i++)
        rdx[i] *= oph_ref_gelu_grad1(pre[i]);
    const double tb = oph_tol_of(h, "matmul_bwd_dgelu");
    void *dpre_ = oph_dput(h, A, pre, nx), *dinp = oph_dput(h, A, inp, nx), *dw = oph_dput(h, A, w, nw),
         *dy = oph_dput(h, A, dout, no);
    void *gx1 = oph_dpoisoned(h, A, nx), *gw1 = oph_dalloc(h, DG_F32, nw), *gb1 = oph_dalloc(h, DG_F32, OC);
    void *gx2 = oph_dalloc(h, A, nx), *gw2 = oph_dalloc(h, DG_F32, nw), *gb2 = oph_dalloc(h, DG_F32, OC);
    /* run 1: acc = 0 into poison, parameter gradients from zero */
    if (!h->bad) CALL(h, "memset0", memset0(h->be, gw1, nw * 4));
    if (!h->bad) CALL(h, "memset0", memset0(h->be, gb1, OC * 4));
    if (!h->bad)
        CALL(h, "matmul_bwd_dgelu",
             matmul_bwd_dgelu(h->be, gx1, gw1, has_bias ? gb1 : NULL, dy, dinp, dw, dpre_, N, C, OC, 0));
    double *ax = oph_download(h, gx1, A, nx), *aw = oph_download(h, gw1, DG_F32, nw),
           *ab = oph_download(h, gb1, DG_F32, OC);
    oph_check_close(h, "dpre (acc=0)", ax, rdx, nx, tb, NULL);
    oph_check_close(h, "dw", aw, rdw, nw, tb, NULL);
    if (has_bias) oph_check_close(h, "dbias", ab, rdb, OC, tb, NULL);
    if (fd) {
        mmg_ctx_t cx = {pre, w, bias, oph_hnew(h, nx), oph_hnew(h, no), inp, dout, N, C, OC};
        oph_check_fd(h, "dpre", mmg_obj_pre, &cx, pre, nx, ax, rdx, tb);
        oph_check_fd(h, "dw", mmg_obj_w, &cx, w, nw, aw, rdw, tb);
        if (has_bias) oph_check_fd(h, "dbias", mmg_obj_w, &cx, bias, OC, ab, rdb, tb);
    }
    oph_digest_dev(h, gx1, nx * oph_dt_size(A));
    oph_digest_dev(h, gw1, nw * 4);
    /* the unfused composition on the same backend: matmul_bwd, then gelu_bwd. f32: the same bits (the
     * contract); bf16/f16: within the bound (the fused epilogue rounds once, not twice). */
    if (!h->bad) CALL(h, "memset0", memset0(h->be, gw2, nw * 4));
    if (!h->bad) CALL(h, "memset0", memset0(h->be, gb2, OC * 4));
    if (!h->bad)
        CALL(h, "matmul_bwd", matmul_bwd(h->be, gx2, gw2, has_bias ? gb2 : NULL, dy, dinp, dw, N, C, OC, 0));
    if (!h->bad) CALL(h, "gelu_bwd", gelu_bwd(h->be, gx2, dpre_, gx2, nx, 0));
    if (A == DG_F32) {
        oph_check_dev_bits(h, "dpre == matmul_bwd + gelu_bwd", gx1, gx2, nx * 4);
    } else {
        oph_check_close(h, "dpre vs matmul_bwd + gelu_bwd", ax, oph_download(h, gx2, A, nx), nx, 2 * tb, rdx);
    }
    oph_check_dev_bits(h, "dw == matmul_bwd's", gw1, gw2, nw * 4);
    /* run 2: acc = 1 adds after the derivative; parameter gradients accumulate */
    double *px = oph_prefill(h, gx2, A, nx), *pw = oph_prefill(h, gw2, DG_F32, nw);
    double *pb = oph_prefill(h, gb2, DG_F32, OC);
    if (!h->bad)
        CALL(h, "matmul_bwd_dgelu",
             matmul_bwd_dgelu(h->be, gx2, gw2, has_bias ? gb2 : NULL, dy, dinp, dw, dpre_, N, C, OC, 1));
    oph_check_close(h, "dpre (acc=1 adds)", oph_download(h, gx2, A, nx), oph_add_arrays(h, px, rdx, nx), nx,
                    tb, rdx);
    oph_check_close(h, "dw accumulates (+=)", oph_download(h, gw2, DG_F32, nw),
                    oph_add_arrays(h, pw, rdw, nw), nw, tb, rdw);
    if (has_bias)
        oph_check_close(h, "dbias accumulates (+=)", oph_download(h, gb2, DG_F32, OC),
                        oph_add_arrays(h, pb, rdb, OC), OC, tb, rdb);
    /* run 3: dpre aliasing inp (acc = 0), otherwise run 1's call (with its bias gradient: on CUDA the
     * weight-gradient GEMM with the BGRADB epilogue is another algorithm than without, so dropping it
     * would change dw's bits for a reason other than the aliasing): the same bits as run 1 */
    void *alias = oph_dput(h, A, inp, nx);
    void *gb3 = has_bias ? oph_dalloc(h, DG_F32, OC) : NULL;
    if (!h->bad) CALL(h, "memset0", memset0(h->be, gw2, nw * 4));
    if (gb3 && !h->bad) CALL(h, "memset0", memset0(h->be, gb3, OC * 4));
    if (!h->bad)
        CALL(h, "matmul_bwd_dgelu",
             matmul_bwd_dgelu(h->be, alias, gw2, gb3, dy, alias, dw, dpre_, N, C, OC, 0));
    oph_check_dev_bits(h, "dpre in place over inp == run 1", alias, gx1, nx * oph_dt_size(A));
    oph_check_dev_bits(h, "dw in place == run 1", gw2, gw1, nw * 4);
    if (gb3) oph_check_dev_bits(h, "dbias in place == run 1", gb3, gb1, OC * 4);
    /* run 4 = run 1, repeated */
    oph_poison(h, gx2, A, nx);
    if (!h->bad) CALL(h, "memset0", memset0(h->be, gw2, nw * 4));
    if (!h->bad) CALL(h, "memset0", memset0(h->be, gb2, OC * 4));
    if (!h->bad)
        CALL(h, "matmul_bwd_dgelu",
             matmul_bwd_dgelu(h->be, gx2, gw2, has_bias ? gb2 : NULL, dy, dinp, dw, dpre_, N, C, OC, 0));
    oph_check_dev_bits(h, "repeat dpre", gx2, gx1, nx * oph_dt_size(A));
    oph_check_dev_bits(h, "repeat dw", gw2, gw1, nw * 4);
    if (has_bias) oph_check_dev_bits(h, "repeat dbias", gb2, gb1, OC * 4);
    /* bad aliasing is refused, not computed */
    if (!h->bad) {
        dg_status_t st =
            h->be->ops->matmul_bwd_dgelu(h->be, dpre_, gw2, NULL, dy, dinp, dw, dpre_, N, C, OC, 0);
        if (st == DG_OK)
            oph_fail(h, "dpre aliasing pre was accepted");
        else
            oph_pass(h, "dpre aliasing pre refused: %s", dg_last_error());
    }
    oph_case_end(h);
}
