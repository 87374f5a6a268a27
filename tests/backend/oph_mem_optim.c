/* oph_mem_optim.c — op harness cases: the memory entry points, casts, elementwise ops, sumsq and
 * sumsq_multi, clip_scale, adamw (plain and multi-tensor) and download_async + fences. */
#include "oph.h"

#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

void oph_case_memory(H *h) {
    if (!oph_case_begin(h, "memory")) return;
    const size_t sizes[] = {0, 1, 3, 256, 1000, (size_t)1 << 20};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0] && !h->bad; k++) {
        size_t n = sizes[k];
        unsigned char *a = oph_dalloc_bytes(h, n), *b = oph_dalloc_bytes(h, n);
        if (h->bad) break;
        if (n == 0) {
            oph_pass(h, "alloc(0) gives a freeable block");
            continue;
        }
        unsigned char *src = oph_hraw(h, n);
        for (size_t i = 0; i < n; i++)
            src[i] = (unsigned char)((i * 131u + 7u) | 1u);
        CALL(h, "to_device", to_device(h->be, a, src, n));
        CALL(h, "copy", copy(h->be, b, a, n));
        unsigned char *back = oph_download_raw(h, b, n);
        char what[64];
        snprintf(what, sizeof what, "to_device/copy/to_host of %zu bytes", n);
        oph_check_bits(h, what, back, src, n);
        oph_digest_add(h, back ? back : src, n);
        CALL(h, "memset0", memset0(h->be, b, n));
        unsigned char *z = oph_download_raw(h, b, n);
        if (z) {
            size_t nz = 0;
            for (size_t i = 0; i < n; i++)
                nz += z[i] != 0;
            if (nz)
                oph_fail(h, "memset0 of %zu bytes left %zu non-zero bytes", n, nz);
            else
                oph_pass(h, "memset0 of %zu bytes", n);
        }
    }
    CALL(h, "sync", sync(h->be));
    oph_case_end(h);
}

static double cast_src_value(H *h, size_t i) {
    static const double edge[] = {1.0,
                                  -1.0,
                                  0.0,
                                  -0.0,
                                  1.0 + 0x1p-8, /* bf16 tie: to even (1) */
                                  1.0 + 3 * 0x1p-8,
                                  1.0 + 0x1p-11, /* f16 tie */
                                  1.0 + 3 * 0x1p-11,
                                  65504.0,
                                  65519.0,
                                  65520.0, /* f16 overflow threshold: rounds to inf */
                                  1e6,
                                  -1e6,
                                  6e-8,
                                  0x1p-25, /* f16 subnormal tie: to 0 */
                                  3 * 0x1p-25,
                                  0x1p-24,
                                  1e-10,
                                  3.4e38,
                                  0x1p-126,
                                  1e-40,
                                  INFINITY,
                                  -INFINITY,
                                  NAN};
    const size_t ne = sizeof edge / sizeof edge[0];
    if (i < ne) return edge[i];
    double mag = ldexp(1.0 + oph_rng_uniform(h), (int)(oph_rng_uniform(h) * 50.0) - 30);
    return (oph_rng_next(h) & 1) ? mag : -mag;
}

void oph_case_cast(H *h, dg_dtype_t st, dg_dtype_t dt, size_t n) {
    if (!oph_case_begin(h, "cast[%s->%s,n=%zu]", dg_dtype_name(st), dg_dtype_name(dt), n)) return;
    double *v = oph_hnew(h, n);
    for (size_t i = 0; i < n; i++)
        v[i] = oph_h_round(cast_src_value(h, i), st);
    void *src = oph_dput(h, st, v, n), *dst = oph_dpoisoned(h, dt, n);
    if (!h->bad) CALL(h, "cast", cast(h->be, dst, dt, src, st, n));
    unsigned char *got = oph_download_raw(h, dst, n * oph_dt_size(dt));
    if (got) {
        double *ref = oph_hnew(h, n);
        for (size_t i = 0; i < n; i++)
            ref[i] = oph_h_round(v[i], dt);
        unsigned char *want = oph_hraw(h, n * oph_dt_size(dt));
        oph_h_encode(dt, ref, want, n);
        size_t bad = 0, first = 0;
        for (size_t i = 0; i < n; i++) {
            double g = oph_h_decode1(dt, got, i);
            int same = isnan(ref[i]) ? isnan(g)
                                     : memcmp(got + i * oph_dt_size(dt), want + i * oph_dt_size(dt),
                                              oph_dt_size(dt)) == 0;
            if (!same && !bad++) first = i;
        }
        if (bad)
            oph_fail(h,
                     "%zu of %zu elements differ from round-to-nearest-even; first [%zu]: src %.10g -> got "
                     "%.10g, want %.10g",
                     bad, n, first, v[first], oph_h_decode1(dt, got, first), ref[first]);
        else
            oph_pass(h, "bit-exact round-to-nearest-even (edge values included)");
        oph_digest_add(h, got, n * oph_dt_size(dt));
    }
    oph_case_end(h);
}

void oph_case_elementwise(H *h, size_t n) {
    if (!oph_case_begin(h, "add/accumulate/scale[n=%zu]", n)) return;
    const dg_dtype_t A = h->act;
    double *a = oph_hrand(h, n, 0.05, 2.0), *b = oph_hrand(h, n, 0.05, 2.0), *d0 = oph_hrand(h, n, 0.05, 2.0);
    oph_hround(a, n, A);
    oph_hround(b, n, A);
    oph_hround(d0, n, A);
    void *da = oph_dput(h, A, a, n), *db = oph_dput(h, A, b, n), *dout = oph_dpoisoned(h, A, n),
         *dacc = oph_dpoisoned(h, A, n);
    if (!h->bad) CALL(h, "add", add(h->be, dout, da, db, n));
    double *ref = oph_add_arrays(h, a, b, n);
    void *raw = oph_download_raw(h, dout, n * oph_dt_size(A));
    oph_check_close(h, "add", oph_download(h, dout, A, n), ref, n, oph_tol_of(h, "add"), NULL);
    if (raw) oph_digest_add(h, raw, n * oph_dt_size(A));
    /* out aliasing an input */
    void *alias = oph_ddup(h, da, n * oph_dt_size(A));
    if (!h->bad) CALL(h, "add", add(h->be, alias, alias, db, n));
    oph_check_bits(h, "add with out == a", oph_download_raw(h, alias, n * oph_dt_size(A)), raw,
                   n * oph_dt_size(A));
    /* accumulate: acc=0 copies over poison, acc=1 adds */
    if (!h->bad) CALL(h, "accumulate", accumulate(h->be, dacc, da, n, 0));
    oph_check_dev_bits(h, "accumulate acc=0 overwrites", dacc, da, n * oph_dt_size(A));
    oph_upload(h, dacc, A, d0, n);
    if (!h->bad) CALL(h, "accumulate", accumulate(h->be, dacc, da, n, 1));
    oph_check_close(h, "accumulate acc=1 adds", oph_download(h, dacc, A, n), oph_add_arrays(h, d0, a, n), n,
                    oph_tol_of(h, "accumulate"), a);
    /* scale_f32 */
    double *x = oph_hrand(h, n, 0.05, 2.0), *xs = oph_hnew(h, n);
    oph_hround(x, n, DG_F32);
    for (size_t i = 0; i < n; i++)
        xs[i] = x[i] * (double)0.37f;
    void *dx = oph_dput(h, DG_F32, x, n);
    if (!h->bad) CALL(h, "scale_f32", scale_f32(h->be, dx, n, 0.37f));
    oph_check_close(h, "scale_f32", oph_download(h, dx, DG_F32, n), xs, n, oph_tol_of(h, "scale_f32"), NULL);
    /* add_f32 (v1.5): f32 whatever the act dtype; one rounding per element, so the result must equal
     * float(x + y) exactly; the source stays untouched */
    double *y = oph_hrand(h, n, 0.05, 2.0), *xy = oph_hnew(h, n);
    oph_hround(y, n, DG_F32);
    for (size_t i = 0; i < n; i++)
        xy[i] = (double)((float)x[i] + (float)y[i]);
    void *dy = oph_dput(h, DG_F32, y, n), *dz = oph_dput(h, DG_F32, x, n);
    void *yraw = oph_download_raw(h, dy, n * sizeof(float));
    if (!h->bad) CALL(h, "add_f32", add_f32(h->be, (float *)dz, (const float *)dy, n));
    oph_check_close(h, "add_f32", oph_download(h, dz, DG_F32, n), xy, n, oph_tol_of(h, "add_f32"), NULL);
    oph_check_bits(h, "add_f32 leaves src", oph_download_raw(h, dy, n * sizeof(float)), yraw,
                   n * sizeof(float));
    oph_case_end(h);
}

void oph_case_sumsq(H *h, size_t n) {
    if (!oph_case_begin(h, "sumsq_f32[n=%zu]", n)) return;
    double *x = oph_hrand(h, n, 0.01, 3.0);
    oph_hround(x, n, DG_F32);
    const double pre = 1.5;
    void *dx = oph_dput(h, DG_F32, x, n), *dout = oph_dalloc(h, DG_F32, 1), *dout2 = oph_dalloc(h, DG_F32, 1);
    oph_upload(h, dout, DG_F32, &pre, 1);
    oph_upload(h, dout2, DG_F32, &pre, 1);
    if (!h->bad) CALL(h, "sumsq_f32", sumsq_f32(h->be, dout, dx, n));
    if (!h->bad) CALL(h, "sumsq_f32", sumsq_f32(h->be, dout2, dx, n));
    double *got = oph_download(h, dout, DG_F32, 1);
    if (got)
        oph_check_scalar(h, "*out += sum(x^2)", got[0], pre + oph_dotd(x, x, n), oph_tol_of(h, "sumsq_f32"));
    oph_check_dev_bits(h, "repeat", dout, dout2, 4);
    oph_digest_dev(h, dout, 4);
    oph_case_end(h);
}

/* sumsq_multi (contract v1.7): one call over a segment table of one flat buffer against one sumsq_f32 per
 * segment, in table order, into an accumulator that starts non-zero, on the same backend: bitwise the same
 * value. variant 0: hand-picked segments, not in offset order: a big one (more than SUMSQ_MAX_BLOCKS = 512
 * blocks of 4096 elements on CUDA: the block count is capped), misaligned offsets (no 16-byte vector loads
 * on CUDA), a single element, fewer elements than a block has threads, exactly one block, one overlapping
 * another, one ending at the buffer's end, one skipped. variant 1: 600 random segments (more than one
 * 256-segment chunk of the CUDA kernels' scans and of the ordered add), some skipped. variant 2: three
 * segments whose totals add to different bits in the reverse order (one above 2^24, where floats are 2
 * apart, then two below 1 whose sum is above 1), so that the check sees the order of the additions (the
 * case checks that it can: the reversed calls must give other bits). Also: the skip flags
 * are the device table's, a recorded call replays with the flags its table holds then (backends that
 * record graphs), an empty table leaves the accumulator alone, a repeat gives the same bits. */
void oph_case_sumsq_multi(H *h, int variant) {
    static const char *const names[3] = {"big, misaligned, tiny", "600 random segments", "order"};
    if (!oph_case_begin(h, "sumsq_multi[%s]", names[variant])) return;
    if (!h->be->ops->sumsq_multi) { /* optional entry: the executor falls back to sumsq_f32 */
        oph_pass(h, "sumsq_multi: not provided by the %s backend (optional)", h->be->ops->name);
        oph_case_end(h);
        return;
    }
    enum { NR = 600 };
    const size_t big = 512u * 4096u + 102913u; /* 2200065: capped at 512 blocks, n % 4 == 1 */
    size_t span = variant == 1 ? 1000003 : variant == 2 ? 64 : big + 8 + 11;
    int ns = variant == 1 ? NR : variant == 2 ? 3 : 8;
    dg_sumsq_seg_t *tab = NULL;
    if (!h->bad && !CALL(h, "host_alloc", host_alloc(h->be, (size_t)ns * sizeof *tab, (void **)&tab))) {
        oph_case_end(h);
        return;
    }
    if (variant == 0) {
        const dg_sumsq_seg_t fixed[8] = {{3, 70001, 0},         /* misaligned (12 bytes), 18 blocks on CUDA */
                                         {8, (uint32_t)big, 0}, /* the big one, 16-byte aligned */
                                         {100, 1, 0},           /* one element */
                                         {1001, 255, 0},        /* fewer elements than threads, misaligned */
                                         {12, 4096 * 3 + 7, DG_SUMSQ_SEG_SKIP}, /* skipped */
                                         {2000000, 5000, 0}, /* inside the big one (segments are only read) */
                                         {50, 4096, 0},      /* exactly one block, misaligned (200 bytes) */
                                         {big + 8 + 11 - 37, 37, 0}}; /* up to the buffer's end, misaligned */
        memcpy(tab, fixed, sizeof fixed);
    } else if (variant == 2) {
        const dg_sumsq_seg_t fixed[3] = {{0, 15, 0}, {20, 9, 0}, {41, 4, 0}};
        memcpy(tab, fixed, sizeof fixed);
    } else {
        for (int i = 0; i < ns; i++) {
            uint32_t n = 1 + (uint32_t)oph_rng_int(h, i % 50 == 0 ? 20000 : 3000);
            tab[i].count = n;
            tab[i].off = (uint64_t)oph_rng_int(h, (int)(span - n + 1));
            tab[i].flags = oph_rng_int(h, 10) == 0 ? DG_SUMSQ_SEG_SKIP : 0u;
        }
    }
    double *x = oph_hrand(h, span, 0.01, 2.0);
    if (variant == 2) /* totals: 15 x 1100^2 = 18150000 (exact, even; above 2^24 floats are 2 apart), then
                       * 9 x ~0.27^2 ~ 0.7 and 4 x 0.35^2 = 0.49: forward both vanish into the first total,
                       * backward their sum 1.19 rounds it up to 18150002 */
        for (int i = 0; i < 64; i++) {
            double mag = i < 15                ? 1100.0
                         : (i >= 20 && i < 29) ? 0.25 + 1e-3 * i
                         : (i >= 41 && i < 45) ? 0.35
                                               : 0;
            if (mag > 0) x[i] = (i % 2 ? -mag : mag);
        }
    oph_hround(x, span, DG_F32);
    const double pre = variant == 2 ? 0.0 : 1.5;
    void *dx = oph_dput(h, DG_F32, x, span), *dtab = oph_dalloc_bytes(h, (size_t)ns * sizeof *tab);
    void *dout[5];
    for (int k = 0; k < 5; k++) {
        dout[k] = oph_dalloc(h, DG_F32, 1);
        oph_upload(h, dout[k], DG_F32, &pre, 1);
    }
    const float *fx = dx;
    /* [0] one call; [1] one sumsq_f32 per segment in table order; [2] the call repeated */
    if (!h->bad) CALL(h, "upload_async", upload_async(h->be, dtab, tab, (size_t)ns * sizeof *tab));
    if (!h->bad) CALL(h, "sumsq_multi", sumsq_multi(h->be, dout[0], fx, span, tab, dtab, ns));
    if (!h->bad) CALL(h, "sumsq_multi", sumsq_multi(h->be, dout[2], fx, span, tab, dtab, ns));
    double ref = pre;
    int nskip = 0;
    for (int i = 0; i < ns && !h->bad; i++) {
        if (tab[i].flags & DG_SUMSQ_SEG_SKIP) {
            nskip++;
            continue;
        }
        CALL(h, "sumsq_f32", sumsq_f32(h->be, dout[1], fx + tab[i].off, tab[i].count));
        ref += oph_dotd(x + tab[i].off, x + tab[i].off, tab[i].count);
    }
    if (!h->bad) CALL(h, "sync", sync(h->be));
    unsigned char *r0 = oph_download_raw(h, dout[0], 4);
    oph_check_bits(h, "sumsq_multi == sumsq_f32 per segment in table order", r0,
                   oph_download_raw(h, dout[1], 4), 4);
    oph_check_bits(h, "repeat", oph_download_raw(h, dout[2], 4), r0, 4);
    double *got = oph_download(h, dout[0], DG_F32, 1);
    if (got)
        oph_check_scalar(h, "*out += sum over the segments of x^2", got[0], ref, oph_tol_of(h, "sumsq_f32"));
    if (r0) oph_digest_add(h, r0, 4);
    if (!h->bad && nskip == 0 && variant != 2) oph_fail(h, "sumsq_multi: the table has no skipped segment");
    if (variant == 2 && !h->bad) { /* [4]: the calls in reverse order must give other bits */
        for (int i = ns - 1; i >= 0 && !h->bad; i--)
            CALL(h, "sumsq_f32", sumsq_f32(h->be, dout[4], fx + tab[i].off, tab[i].count));
        unsigned char *rr = oph_download_raw(h, dout[4], 4);
        if (r0 && rr && memcmp(r0, rr, 4) == 0)
            oph_fail(
                h,
                "sumsq_multi[order]: the reversed calls give the same bits: the case cannot see the order");
        else
            oph_pass(h, "the reversed calls give other bits: the order of the additions is checked");
    }

    /* the skip flags come from the device table: another skip set uploaded there (the host table, which
     * gives only the geometry, unchanged) changes the sum as the sequence of calls with that set would */
    dg_sumsq_seg_t *tab2 = oph_hraw(h, (size_t)ns * sizeof *tab);
    memcpy(tab2, tab, (size_t)ns * sizeof *tab);
    for (int i = 0; i < ns; i++)
        tab2[i].flags = (i % 3 == 1) ? DG_SUMSQ_SEG_SKIP : 0u;
    void *dout2[2] = {oph_dalloc(h, DG_F32, 1), oph_dalloc(h, DG_F32, 1)};
    for (int k = 0; k < 2; k++)
        oph_upload(h, dout2[k], DG_F32, &pre, 1);
    if (!h->bad) CALL(h, "to_device", to_device(h->be, dtab, tab2, (size_t)ns * sizeof *tab));
    if (!h->bad) CALL(h, "sumsq_multi", sumsq_multi(h->be, dout2[0], fx, span, tab, dtab, ns));
    for (int i = 0; i < ns && !h->bad; i++)
        if (!(tab2[i].flags & DG_SUMSQ_SEG_SKIP))
            CALL(h, "sumsq_f32", sumsq_f32(h->be, dout2[1], fx + tab[i].off, tab[i].count));
    if (!h->bad) CALL(h, "sync", sync(h->be));
    oph_check_dev_bits(h, "sumsq_multi follows the device table's skip flags", dout2[0], dout2[1], 4);

    /* where the backend records graphs: the upload of the table and the call recorded once, then the
     * page-locked host table's flags changed (its geometry kept, as the contract asks) and the recording
     * replayed: the replay sums with the flags of the moment, bitwise as the sequence of calls does */
    void *dout3 = h->be->ops->graph_begin ? oph_dalloc(h, DG_F32, 1) : NULL;
    if (dout3 && !h->bad && CALL(h, "graph_begin", graph_begin(h->be))) {
        void *gr = NULL;
        dg_status_t su = h->be->ops->upload_async(h->be, dtab, tab, (size_t)ns * sizeof *tab);
        dg_status_t sm = su == DG_OK ? h->be->ops->sumsq_multi(h->be, dout3, fx, span, tab, dtab, ns) : su;
        dg_status_t se = h->be->ops->graph_end(h->be, &gr);
        if (oph_call_ok(h, sm, "sumsq_multi (recorded)") && oph_call_ok(h, se, "graph_end") && gr) {
            for (int i = 0; i < ns; i++)
                tab[i].flags = tab2[i].flags;
            oph_upload(h, dout3, DG_F32, &pre, 1);
            if (!h->bad) CALL(h, "graph_launch", graph_launch(h->be, gr));
            if (!h->bad) CALL(h, "sync", sync(h->be));
            oph_check_dev_bits(h, "recorded sumsq_multi replayed with other skip flags", dout3, dout2[1], 4);
        }
        if (gr) h->be->ops->graph_free(h->be, gr);
    }

    /* an empty table: nothing happens */
    if (!h->bad) CALL(h, "sumsq_multi", sumsq_multi(h->be, dout[3], fx, span, tab, dtab, 0));
    if (!h->bad) CALL(h, "sync", sync(h->be));
    float pre_f = (float)pre;
    oph_check_bits(h, "sumsq_multi over no segment leaves *out", oph_download_raw(h, dout[3], 4), &pre_f, 4);
    h->be->ops->host_free(h->be, tab);
    oph_case_end(h);
}

void oph_case_clip(H *h) {
    if (!oph_case_begin(h, "clip_scale")) return;
    /* {sumsq, clip, extra}: clipping active, inactive, disabled */
    const double cases[][3] = {{16.0, 1.0, 0.25}, {16.0, 5.0, 0.25}, {16.0, 0.0, 0.5}, {2.0e6, 3.0, 1.0}};
    void *ss = oph_dalloc(h, DG_F32, 1), *gs = oph_dpoisoned(h, DG_F32, 1), *nm = oph_dpoisoned(h, DG_F32, 1);
    for (size_t k = 0; k < sizeof cases / sizeof cases[0] && !h->bad; k++) {
        double s = cases[k][0], clip = cases[k][1], extra = cases[k][2];
        oph_upload(h, ss, DG_F32, &s, 1);
        if (!CALL(h, "clip_scale", clip_scale(h->be, gs, nm, ss, (float)clip, (float)extra))) break;
        double norm = sqrt(s), want = (clip > 0 ? fmin(1.0, clip / (norm + 1e-6)) : 1.0) * extra;
        double *g = oph_download(h, gs, DG_F32, 1), *n = oph_download(h, nm, DG_F32, 1);
        char what[96];
        snprintf(what, sizeof what, "scale (sumsq=%g clip=%g extra=%g)", s, clip, extra);
        if (g) oph_check_scalar(h, what, g[0], want, oph_tol_of(h, "clip_scale"));
        snprintf(what, sizeof what, "norm (sumsq=%g)", s);
        if (n) oph_check_scalar(h, what, n[0], norm, oph_tol_of(h, "clip_scale"));
        oph_digest_dev(h, gs, 4);
        oph_digest_dev(h, nm, 4);
    }
    oph_case_end(h);
}

/* The device scalar block of adamw_dev / adamw_multi_dev in the page-locked sch (DG_DS_COUNT floats):
 * gradient scale gsc, norm 1.5, lr and the bias corrections of step t for betas b1, b2 (as f32) */
static void ds_fill(float *sch, double gsc, double lr, double b1, double b2, double t) {
    memset(sch, 0, DG_DS_COUNT * sizeof(float));
    sch[DG_DS_GSCALE] = (float)gsc;
    sch[DG_DS_NORM] = 1.5f;
    sch[DG_DS_LR] = (float)lr;
    sch[DG_DS_INV_BC1] = (float)(1.0 / (1.0 - pow((double)(float)b1, t)));
    sch[DG_DS_INV_BC2] = (float)(1.0 / (1.0 - pow((double)(float)b2, t)));
}

/* upload_async of the block sch into the device block dsc: 1 when it went */
static int ds_upload(H *h, void *dsc, const float *sch) {
    return CALL(h, "upload_async", upload_async(h->be, dsc, sch, DG_DS_COUNT * sizeof(float)));
}

void oph_case_adamw(H *h, size_t n, int64_t t, int with_compute) {
    if (!oph_case_begin(h, "adamw[n=%zu,t=%lld%s]", n, (long long)t, with_compute ? ",compute" : "")) return;
    const double lr = 0.05, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1, gsc = 0.8;
    double *p = oph_hrand(h, n, 0.1, 2.0), *g = oph_hrand(h, n, 0.01, 1.0), *m = oph_hrand(h, n, 0.001, 0.2),
           *v = oph_hrand(h, n, 0.001, 0.2);
    for (size_t i = 0; i < n; i++)
        v[i] = fabs(v[i]) * 0.1; /* second moments are non-negative */
    oph_hround(p, n, DG_F32);
    oph_hround(g, n, DG_F32);
    oph_hround(m, n, DG_F32);
    oph_hround(v, n, DG_F32);
    /* float64 reference step, with the float32 hyper-parameters the backend receives */
    double *rp = oph_hnew(h, n), *rm = oph_hnew(h, n), *rv = oph_hnew(h, n), *rdelta = oph_hnew(h, n);
    const double fb1 = (float)b1, fb2 = (float)b2, flr = (float)lr, feps = (float)eps, fwd = (float)wd,
                 fgs = (float)gsc;
    const double bc1 = 1.0 - pow(fb1, (double)t), bc2 = 1.0 - pow(fb2, (double)t);
    for (size_t i = 0; i < n; i++) {
        double gg = g[i] * fgs;
        rm[i] = fb1 * m[i] + (1 - fb1) * gg;
        rv[i] = fb2 * v[i] + (1 - fb2) * gg * gg;
        rdelta[i] = -flr * ((rm[i] / bc1) / (sqrt(rv[i] / bc2) + feps) + fwd * p[i]);
        rp[i] = p[i] + rdelta[i];
    }
    void *dp = oph_dput(h, DG_F32, p, n), *dg = oph_dput(h, DG_F32, g, n), *dm = oph_dput(h, DG_F32, m, n),
         *dv = oph_dput(h, DG_F32, v, n), *dgs = oph_dalloc(h, DG_F32, 1);
    void *dc = with_compute ? oph_dalloc(h, h->act, n) : NULL;
    double gsr = fgs;
    oph_upload(h, dgs, DG_F32, &gsr, 1);
    if (dc) oph_poison(h, dc, h->act, n);
    if (!h->bad)
        CALL(h, "adamw",
             adamw(h->be, dp, dc, dg, dm, dv, n, (float)lr, (float)b1, (float)b2, (float)eps, (float)wd, t,
                   dgs));
    const double tol = oph_tol_of(h, "adamw");
    double *gp = oph_download(h, dp, DG_F32, n);
    oph_check_close(h, "m", oph_download(h, dm, DG_F32, n), rm, n, tol, NULL);
    oph_check_close(h, "v", oph_download(h, dv, DG_F32, n), rv, n, tol, NULL);
    if (gp) {
        double *gdelta = oph_hnew(h, n);
        for (size_t i = 0; i < n; i++)
            gdelta[i] = gp[i] - p[i];
        oph_check_close(h, "master update (new - old)", gdelta, rdelta, n, tol, NULL);
        oph_check_close(h, "master", gp, rp, n, tol * 0.1, NULL);
    }
    if (dc && gp) {
        /* compute = the new master rounded to the act dtype, exactly */
        unsigned char *gc = oph_download_raw(h, dc, n * oph_dt_size(h->act));
        double *want = oph_hnew(h, n);
        for (size_t i = 0; i < n; i++)
            want[i] = oph_h_round(gp[i], h->act);
        unsigned char *wb = oph_hraw(h, n * oph_dt_size(h->act));
        oph_h_encode(h->act, want, wb, n);
        oph_check_bits(h, "compute copy == act-dtype cast of new master", gc, wb, n * oph_dt_size(h->act));
        if (gc) oph_digest_add(h, gc, n * oph_dt_size(h->act));
    }
    oph_digest_dev(h, dp, n * 4);
    oph_digest_dev(h, dm, n * 4);
    oph_digest_dev(h, dv, n * 4);
    /* repeat from the same state: same bits */
    void *dp2 = oph_dput(h, DG_F32, p, n), *dm2 = oph_dput(h, DG_F32, m, n), *dv2 = oph_dput(h, DG_F32, v, n);
    if (!h->bad)
        CALL(h, "adamw",
             adamw(h->be, dp2, NULL, dg, dm2, dv2, n, (float)lr, (float)b1, (float)b2, (float)eps, (float)wd,
                   t, dgs));
    oph_check_dev_bits(h, "repeat: master", dp2, dp, n * 4);
    oph_check_dev_bits(h, "repeat: v", dv2, dv, n * 4);
    /* adamw_dev from the same state, lr and bias corrections through the device scalar block (uploaded
     * from page-locked memory with upload_async): the same bits as adamw */
    float *sch = NULL;
    void *dsc = oph_dalloc(h, DG_F32, DG_DS_COUNT);
    if (!h->bad && CALL(h, "host_alloc", host_alloc(h->be, DG_DS_COUNT * sizeof(float), (void **)&sch))) {
        ds_fill(sch, gsc, lr, b1, b2, (double)t);
        void *dp3 = oph_dput(h, DG_F32, p, n), *dm3 = oph_dput(h, DG_F32, m, n),
             *dv3 = oph_dput(h, DG_F32, v, n);
        void *dc3 = with_compute ? oph_dalloc(h, h->act, n) : NULL;
        if (dc3) oph_poison(h, dc3, h->act, n);
        /* run 1: the block's norm 1.5; run 2: a non-finite norm in the block skips the step, nothing
         * changes (master and v stay those of run 1, which equal adamw's) */
        for (int r = 0; r < 2; r++) {
            sch[DG_DS_NORM] = r ? NAN : 1.5f;
            if (!h->bad && ds_upload(h, dsc, sch))
                CALL(h, "adamw_dev",
                     adamw_dev(h->be, dp3, dc3, dg, dm3, dv3, n, (float)b1, (float)b2, (float)eps, (float)wd,
                               dsc));
            if (!h->bad) CALL(h, "sync", sync(h->be));
            const char *pre = r ? "adamw_dev with a NaN norm leaves" : "adamw_dev == adamw:";
            char what[96];
            snprintf(what, sizeof what, "%s master", pre);
            oph_check_dev_bits(h, what, dp3, dp, n * 4);
            if (!r) oph_check_dev_bits(h, "adamw_dev == adamw: m", dm3, dm, n * 4);
            snprintf(what, sizeof what, "%s v", pre);
            oph_check_dev_bits(h, what, dv3, dv, n * 4);
            if (!r && dc3)
                oph_check_dev_bits(h, "adamw_dev == adamw: compute", dc3, dc, n * oph_dt_size(h->act));
        }
        h->be->ops->host_free(h->be, sch);
    }
    oph_case_end(h);
}

/* adamw_multi_dev (contract v1.6): one call over a table of segments of flat buffers (gaps between them,
 * weight decay on and off, a skipped segment, counts that are not multiples of 4, an offset that is an odd
 * multiple of 4, two segments with no gap) against one adamw_dev
 * per segment from the same state on the same backend: bitwise the same flat buffers, gaps and skipped
 * segment untouched; a non-finite norm changes nothing. */
void oph_case_adamw_multi(H *h, int with_compute) {
    if (!oph_case_begin(h, "adamw_multi_dev[%s]", with_compute ? "compute" : "no compute")) return;
    if (!h->be->ops->adamw_multi_dev) { /* optional entry: the executor falls back to adamw_dev */
        oph_pass(h, "adamw_multi_dev: not provided by the %s backend (optional)", h->be->ops->name);
        oph_case_end(h);
        return;
    }
    enum { NS = 5 };
    const size_t counts[NS] = {1000, 7, 70001, 333, 64};
    const uint32_t flags[NS] = {DG_ADAMW_SEG_DECAY, 0, DG_ADAMW_SEG_DECAY,
                                DG_ADAMW_SEG_SKIP | DG_ADAMW_SEG_DECAY, 0};
    dg_adamw_seg_t *tab = oph_hraw(h, NS * sizeof *tab);
    size_t span = 0;
    /* offsets: multiples of 64 with a gap of at least 64 before each, except segment 1 (4 past a multiple
     * of 64: an odd multiple of 4) and segment 4, right after segment 3 (the next multiple of 4: the two
     * share an 8-element group, as kernels working in groups of 8 see them) */
    for (int i = 0; i < NS; i++) {
        tab[i].off = (span + 64 + 63) / 64 * 64;
        if (i == 1) tab[i].off += 4;
        if (i == 4) tab[i].off = (span + 3) / 4 * 4;
        tab[i].count = (uint32_t)counts[i];
        tab[i].flags = flags[i];
        span = tab[i].off + counts[i];
    }
    span += 5; /* a tail after the last segment */
    const double b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
    double *p = oph_hrand(h, span, 0.1, 2.0), *g = oph_hrand(h, span, 0.01, 1.0),
           *m = oph_hrand(h, span, 0.001, 0.2), *v = oph_hrand(h, span, 0.001, 0.2);
    for (size_t i = 0; i < span; i++)
        v[i] = fabs(v[i]) * 0.1;
    /* two copies of the state: [0] through adamw_multi_dev, [1] through adamw_dev per segment */
    void *dp[2], *dm[2], *dv[2], *dc[2] = {NULL, NULL};
    void *dg = oph_dput(h, DG_F32, g, span);
    for (int k = 0; k < 2; k++) {
        dp[k] = oph_dalloc(h, DG_F32, span);
        dm[k] = oph_dalloc(h, DG_F32, span);
        dv[k] = oph_dalloc(h, DG_F32, span);
        oph_upload(h, dp[k], DG_F32, p, span);
        oph_upload(h, dm[k], DG_F32, m, span);
        oph_upload(h, dv[k], DG_F32, v, span);
        if (with_compute) {
            dc[k] = oph_dalloc(h, h->act, span);
            oph_poison(h, dc[k], h->act, span);
        }
    }
    unsigned char *p0 = oph_download_raw(h, dp[0], span * 4);
    void *dtab = oph_dalloc_bytes(h, NS * sizeof *tab);
    if (!h->bad) CALL(h, "to_device", to_device(h->be, dtab, tab, NS * sizeof *tab));
    float *sch = NULL;
    void *dsc = oph_dalloc(h, DG_F32, DG_DS_COUNT);
    if (!h->bad && CALL(h, "host_alloc", host_alloc(h->be, DG_DS_COUNT * sizeof(float), (void **)&sch))) {
        ds_fill(sch, 0.8, 0.05, b1, b2, 3.0);
        if (!h->bad && ds_upload(h, dsc, sch))
            CALL(h, "adamw_multi_dev",
                 adamw_multi_dev(h->be, dtab, NS, span, dp[0], dc[0], dg, dm[0], dv[0], (float)b1, (float)b2,
                                 (float)eps, (float)wd, dsc));
        for (int i = 0; i < NS && !h->bad; i++) {
            if (tab[i].flags & DG_ADAMW_SEG_SKIP) continue;
            size_t o = tab[i].off;
            char *c1 = dc[1] ? (char *)dc[1] + o * oph_dt_size(h->act) : NULL;
            CALL(h, "adamw_dev",
                 adamw_dev(h->be, (float *)dp[1] + o, c1, (const float *)dg + o, (float *)dm[1] + o,
                           (float *)dv[1] + o, tab[i].count, (float)b1, (float)b2, (float)eps,
                           (tab[i].flags & DG_ADAMW_SEG_DECAY) ? (float)wd : 0.0f, dsc));
        }
        if (!h->bad) CALL(h, "sync", sync(h->be));
        oph_check_dev_bits(h, "adamw_multi_dev == adamw_dev per segment: master", dp[0], dp[1], span * 4);
        oph_check_dev_bits(h, "adamw_multi_dev == adamw_dev per segment: m", dm[0], dm[1], span * 4);
        oph_check_dev_bits(h, "adamw_multi_dev == adamw_dev per segment: v", dv[0], dv[1], span * 4);
        if (with_compute)
            oph_check_dev_bits(h, "adamw_multi_dev == adamw_dev per segment: compute", dc[0], dc[1],
                               span * oph_dt_size(h->act));
        /* the gaps and the skipped segment keep their values; the other segments moved */
        unsigned char *p1 = oph_download_raw(h, dp[0], span * 4);
        if (p0 && p1 && !h->bad) {
            size_t changed_gap = 0, unchanged_seg = 0, prev_end = 0;
            for (int i = 0; i <= NS; i++) {
                size_t lo = i < NS ? tab[i].off : span;
                changed_gap += memcmp(p0 + prev_end * 4, p1 + prev_end * 4, (lo - prev_end) * 4) != 0;
                if (i == NS) break;
                int same = memcmp(p0 + lo * 4, p1 + lo * 4, tab[i].count * 4) == 0;
                if (same != ((tab[i].flags & DG_ADAMW_SEG_SKIP) != 0)) unchanged_seg++;
                prev_end = lo + tab[i].count;
            }
            if (changed_gap || unchanged_seg)
                oph_fail(h, "adamw_multi_dev: %zu gaps changed, %zu segments wrongly (un)changed",
                         changed_gap, unchanged_seg);
            else
                oph_pass(h, "adamw_multi_dev: gaps and the skipped segment untouched, %d segments updated",
                         NS - 1);
        }
        if (p1) oph_digest_add(h, p1, span * 4);
        /* a non-finite norm: nothing changes */
        sch[DG_DS_NORM] = INFINITY;
        if (!h->bad && ds_upload(h, dsc, sch))
            CALL(h, "adamw_multi_dev",
                 adamw_multi_dev(h->be, dtab, NS, span, dp[0], dc[0], dg, dm[0], dv[0], (float)b1, (float)b2,
                                 (float)eps, (float)wd, dsc));
        if (!h->bad) CALL(h, "sync", sync(h->be));
        oph_check_bits(h, "adamw_multi_dev with an infinite norm leaves master",
                       oph_download_raw(h, dp[0], span * 4), p1, span * 4);
        oph_check_dev_bits(h, "adamw_multi_dev with an infinite norm leaves m", dm[0], dm[1], span * 4);
        h->be->ops->host_free(h->be, sch);
    }
    oph_case_end(h);
}

/* download_async + fences (contract v1.8): a kernel's result copied into page-locked memory and read on
 * the host after fence_wait, with busy work queued before it (so that an unwaited read would still see
 * the poison) and work queued after the fence that changes the source (the copy holds the value at its
 * queue position; the wait does not need that later work). Then, where the backend records graphs, the
 * same sequence recorded once and replayed twice: each replay copies again and fires the fence again. */
static int dl_expect(H *h, const char *what, const float *host, const double *x0, size_t n, double factor) {
    size_t bad = 0, first = n;
    for (size_t i = 0; i < n; i++) {
        float want = (float)(x0[i] * factor); /* exact: x0 is f32-representable, factor a power of two */
        if (memcmp(&host[i], &want, sizeof want) != 0) {
            bad++;
            if (first == n) first = i;
        }
    }
    if (bad)
        oph_fail(h, "%s: %zu of %zu values differ (first at %zu: %g, expected %g)", what, bad, n, first,
                 (double)host[first], x0[first] * factor);
    else
        oph_pass(h, "%s: %zu values as expected", what, n);
    return bad == 0;
}

static void host_poison(float *p, size_t n) {
    uint32_t pat = 0x7FC0DEADu;
    for (size_t i = 0; i < n; i++)
        memcpy(&p[i], &pat, 4);
}

static void dl_queue(H *h, void *dx, float *hp, void *f, size_t n, int busy) {
    for (int k = 0; k < busy && !h->bad; k++) /* time on the queue before the copy */
        CALL(h, "scale_f32", scale_f32(h->be, dx, n, 1.0f));
    if (!h->bad) CALL(h, "scale_f32", scale_f32(h->be, dx, n, 2.0f)); /* the value read back */
    if (!h->bad) CALL(h, "download_async", download_async(h->be, hp, dx, n * sizeof(float)));
    if (!h->bad) CALL(h, "fence_record", fence_record(h->be, f));
    if (!h->bad) CALL(h, "scale_f32", scale_f32(h->be, dx, n, 4.0f)); /* behind the fence */
}

void oph_case_download_fence(H *h) {
    if (!oph_case_begin(h, "download_async+fence")) return;
    const dg_backend_ops_t *o = h->be->ops;
    if (!o->download_async || !o->fence_create || !o->fence_destroy || !o->fence_record || !o->fence_wait) {
        oph_pass(h, "download_async / fences: not provided by the %s backend (optional)", o->name);
        oph_case_end(h);
        return;
    }
    const size_t n = (size_t)1 << 20;
    const int busy = 32;
    double *x0 = oph_hrand(h, n, 0.5, 2.0);
    oph_hround(x0, n, DG_F32);
    void *dx = oph_dput(h, DG_F32, x0, n);
    float *hp = NULL;
    void *f = NULL;
    if (!h->bad) CALL(h, "host_alloc", host_alloc(h->be, n * sizeof(float), (void **)&hp));
    if (!h->bad) CALL(h, "fence_create", fence_create(h->be, &f));
    if (!h->bad && !f) oph_fail(h, "fence_create returned DG_OK and a NULL fence");
    if (!h->bad && f) CALL(h, "fence_wait (never recorded)", fence_wait(h->be, f));
    if (!h->bad && hp && f) {
        CALL(h, "sync", sync(h->be));
        host_poison(hp, n);
        dl_queue(h, dx, hp, f, n, busy);
        if (!h->bad && CALL(h, "fence_wait", fence_wait(h->be, f)))
            dl_expect(h, "eager: the copy after fence_wait", hp, x0, n, 2.0);
        if (!h->bad) CALL(h, "sync", sync(h->be));
        float *after = oph_download_raw(h, dx, n * sizeof(float));
        if (after) dl_expect(h, "eager: the source after the work behind the fence", after, x0, n, 8.0);
        oph_digest_add(h, hp, n * sizeof(float));
    }
    if (!h->bad && hp && f && o->graph_begin && o->graph_end && o->graph_launch && o->graph_free) {
        oph_upload(h, dx, DG_F32, x0, n);
        void *g = NULL;
        if (!h->bad) CALL(h, "sync", sync(h->be));
        if (!h->bad && CALL(h, "graph_begin", graph_begin(h->be))) {
            dl_queue(h, dx, hp, f, n, busy); /* recorded, not run */
            int rec_ok = !h->bad;
            h->bad = 0; /* graph_end must run either way */
            if (CALL(h, "graph_end", graph_end(h->be, &g)) && !rec_ok) h->bad = 1;
        }
        double factor = 2.0;
        for (int rep = 1; rep <= 2 && !h->bad && g; rep++) {
            host_poison(hp, n);
            char what[96];
            snprintf(what, sizeof what, "graph replay %d: the copy after fence_wait", rep);
            if (CALL(h, "graph_launch", graph_launch(h->be, g)) &&
                CALL(h, "fence_wait", fence_wait(h->be, f)))
                dl_expect(h, what, hp, x0, n, factor);
            factor *= 8.0; /* each replay scales the source by 2 before its copy and by 4 after */
        }
        if (!h->bad) CALL(h, "sync", sync(h->be));
        float *after = oph_download_raw(h, dx, n * sizeof(float));
        if (after) dl_expect(h, "graph: the source after two replays", after, x0, n, 64.0);
        if (g) o->graph_free(h->be, g);
    } else if (!h->bad) {
        oph_pass(h, "graph recording: not provided by the %s backend", o->name);
    }
    if (f) o->fence_destroy(h->be, f);
    if (hp) o->host_free(h->be, hp);
    oph_case_end(h);
}
