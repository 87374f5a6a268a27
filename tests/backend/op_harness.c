/* op_harness.c — backend-generic kernel tests against float64 references (see op_harness.h).
 *
 * Layout: oph_core.c host-side dtype rounding and encoding (written independently of any backend, with
 * frexp/ldexp/rint) and the check primitives (closeness, poison, bitwise repeat, finite differences);
 * oph_ref.c the float64 reference of every op; oph_mem_optim.c, oph_matmul.c, oph_layers.c one case
 * function per op; this file the driver. Shared declarations: oph.h.
 */
#include "oph.h"

#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

/* ======================= driver ======================= */

void dg_harness_opts_init(dg_harness_opts_t *o) {
    memset(o, 0, sizeof *o);
    o->tol_scale = 1.0;
}

int dg_op_harness_run(dg_backend_t *be, const dg_harness_opts_t *opts) {
    dg_harness_opts_t defaults;
    dg_harness_opts_init(&defaults);
    const dg_harness_opts_t *o = opts ? opts : &defaults;
    H hs = {0}, *h = &hs;
    h->be = be;
    h->o = o;
    h->log = o->log ? o->log : stdout;
    h->act = be->act_dtype;
    h->tol_scale = o->tol_scale > 0 ? o->tol_scale : 1.0;
    h->rng = o->seed ? o->seed : 0x5EED0DA7A0000001ull;

    /* Shapes: the odd sizes (C=72, T=13, NH=3, V=259, Vp=320), degenerate ones (T=1, one row,
     * C not a multiple of the vector width), T past the CPU attention block (64), and "wide" cases that
     * span many GEMM tiles and exceed every single-thread cutoff, so thread splits are exercised. The
     * wide cases skip finite differences (their analytic float64 gradients are still checked). */
    oph_case_memory(h);
    const dg_dtype_t fl[] = {DG_F32, DG_BF16, DG_F16};
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 3; j++)
            oph_case_cast(h, fl[i], fl[j], 1000);
    oph_case_cast(h, DG_F32, DG_BF16, 50000);
    oph_case_elementwise(h, 1001);
    oph_case_elementwise(h, 70001);
    oph_case_sumsq(h, 1000);
    oph_case_sumsq(h, 100003);
    oph_case_sumsq_multi(h, 0);
    oph_case_sumsq_multi(h, 1);
    oph_case_sumsq_multi(h, 2);
    oph_case_clip(h);
    oph_case_adamw(h, 1000, 1, 1);
    oph_case_adamw(h, 1001, 7, 0);
    oph_case_adamw(h, 70001, 3, 1);
    oph_case_adamw_multi(h, 1);
    oph_case_adamw_multi(h, 0);
    oph_case_download_fence(h);

    oph_case_encoder(h, 2, 13, 72, 259, 320, 1);
    oph_case_encoder(h, 3, 5, 20, 7, 11, 1);
    oph_case_encoder(h, 4, 64, 160, 259, 320, 0);

    oph_case_layernorm(h, 26, 72, 0.0, 1);
    oph_case_layernorm(h, 5, 3, 2.0, 1);
    oph_case_layernorm(h, 97, 40, 30.0, 1);
    oph_case_layernorm(h, 300, 200, 0.5, 0);
    if (o->large) {
        /* GPT-2's rows (N = B*T = 32768, C = 768): hundreds of per-block partial rows of dw/db */
        oph_case_layernorm(h, 32768, 768, 0.5, 0);
        /* more rows than the CUDA backward's grid covers at once (rows per warp > 1 past its block cap),
         * C = 72: most lanes of a warp own no column */
        oph_case_layernorm(h, 70001, 72, 1.0, 0);
        /* C = 1600 (GPT-2 1.5B): the generic kernels there */
        oph_case_layernorm(h, 9001, 1600, 0.5, 0);
    }

    oph_case_matmul(h, 26, 72, 216, 1, 0, 1);
    oph_case_matmul(h, 26, 72, 288, 1, 1, 1);
    oph_case_matmul(h, 13, 37, 19, 0, 0, 1);
    oph_case_matmul(h, 7, 72, 259, 0, 1, 1);
    oph_case_matmul(h, 300, 160, 576, 1, 1, 0);
    oph_case_matmul(h, 520, 96, 300, 1, 0, 0);
    if (o->large) /* bias gradient over many row slabs, a last column tile of 8 columns */
        oph_case_matmul(h, 4099, 16, 2312, 1, 0, 0);

    oph_case_matmul_res(h, 26, 72, 72, 1, 0);
    oph_case_matmul_res(h, 13, 37, 19, 0,
                        0); /* odd sizes: CUDA may have no algorithm (the unfused fallback) */
    oph_case_matmul_res(h, 7, 288, 72, 1, 1); /* the residual off the output's alignment */
    oph_case_matmul_res(h, 300, 576, 160, 1, 0);
    oph_case_matmul_res(h, 520, 96, 300, 0, 3);

    oph_case_matmul_dgelu(h, 26, 72, 24, 1, 1);
    oph_case_matmul_dgelu(h, 13, 37, 19, 0, 1); /* C not a multiple of 8: no DGELU epilogue on CUDA */
    oph_case_matmul_dgelu(h, 7, 288, 72, 1, 1);
    oph_case_matmul_dgelu(h, 300, 576, 160, 1, 0);

    oph_case_gelu(h, 1000, 1);
    oph_case_gelu(h, 7, 1);
    oph_case_gelu(h, 40001, 0);

    oph_case_attention(h, 2, 13, 72, 3, 1);
    oph_case_attention(h, 1, 1, 8, 2, 1);
    oph_case_attention(h, 2, 70, 48, 4, 1);
    oph_case_attention(h, 3, 130, 96, 2, 0);

    oph_case_crossentropy(h, 26, 259, 320, 1);
    oph_case_crossentropy(h, 3, 5, 5, 1);
    oph_case_crossentropy(h, 40, 1000, 1024, 0);
    oph_case_crossentropy_fused(h, 26, 259, 320, 0, 0);
    oph_case_crossentropy_fused(h, 3, 5, 5, 0, 0);
    oph_case_crossentropy_fused(h, 40, 1000, 1024, 0, 0);
    oph_case_crossentropy_fused(h, 7, 259, 320, 1, 0); /* logits misaligned: the scalar reduction */
    oph_case_crossentropy_fused(h, 7, 259, 320, 0,
                                3); /* dlogits misaligned: vector reduction, scalar stores */
    oph_case_crossentropy_fused(h, 5, 1003, 1003, 0, 0);
    oph_case_crossentropy_fused(h, 3, 120000, 120064, 0, 0); /* rows beyond shared memory on every GPU */

    fprintf(h->log, "op harness [%s, act %s]: %d cases, %d checks, %d failed\n", be->ops->name,
            dg_dtype_name(h->act), h->cases, h->checks, h->failures);
    fflush(h->log);
    return h->failures;
}
