/* op_harness.h — the backend-generic op harness (docs/design.md §5): runs every kernel of a dg_backend_t
 * against float64 references implemented here in plain C (never against another backend's code).
 *
 * For each kernel and several shapes (odd ones included: C=72, T=13, NH=3, V=259, Vp=320, T past the
 * attention block size, sizes that span many GEMM tiles and threads) it:
 *   - feeds random non-zero inputs, rounded on the host to the backend's act dtype, so the float64
 *     reference sees exactly the values the backend sees;
 *   - poisons every output with NaN first and reports any element left unwritten;
 *   - compares forward outputs with the float64 reference: elementwise relative error, floored at the
 *     RMS of the reference, against a bound per op and per act dtype (looser for bf16/f16);
 *   - compares backward outputs with an analytic float64 gradient (every element) and with central
 *     finite differences of the float64 forward (sampled elements plus random directional derivatives),
 *     objective sum(dout * out) with random dout;
 *   - checks accumulation: parameter gradients add into non-zero pre-filled buffers, acc=0 overwrites
 *     poisoned activation gradients and acc=1 adds into non-zero ones; dlogits aliasing logits;
 *   - checks determinism: each run repeated on fresh buffers must give identical bits;
 *   - checks matmul_fwd_res (contract v1.11) against float64 (x·wᵀ + bias + res), out of place and in
 *     place (out == res), with a residual off the output's alignment;
 *   - checks crossentropy_fused (contract v1.10) bit for bit against crossentropy_fwd + crossentropy_bwd
 *     on the same backend, out of place and in place, with misaligned logits / dlogits and rows too large
 *     for GPU shared memory;
 *   - checks adamw (bias correction, weight decay, device grad scale), clip_scale, sumsq (and sumsq_multi
 *     against one sumsq_f32 per segment, bit for bit), cast between
 *     f32/bf16/f16 (bit-exact round-to-nearest-even, edge values included), add/accumulate/scale and the
 *     memory entry points (256-byte alignment, copies, memset0);
 *   - checks download_async + fences (contract v1.8; skipped where the backend has none): a kernel's
 *     result read back after fence_wait while later work changes the source, eagerly and, where the
 *     backend records graphs, in two replays of one recording.
 *
 * Link the static library dg_op_harness; see tests/backend/test_backend_cpu.c for a driver.
 */
#ifndef DG_OP_HARNESS_H
#define DG_OP_HARNESS_H

#include <stdint.h>
#include <stdio.h>

#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dg_harness_opts {
    uint64_t seed;    /* input-data seed (0 = the built-in default); results are reproducible for a seed */
    int verbose;      /* 0: failures and the summary; 1: also one line per passed check */
    const char *only; /* run only cases whose name contains this substring (NULL or "" = all) */
    double tol_scale; /* multiplies every tolerance (<= 0 means 1.0) */
    int skip_fd;      /* 1: skip finite differences (the analytic float64 gradients are still compared) */
    /* 1: also the large cases (layernorm at N = 32768 x C = 768 and other many-row shapes, a 4099-row
     * matmul with 2312 outputs), where GPU kernels partition rows into many blocks and reduce many partial
     * rows; several GiB of host memory for the float64 references, so meant for GPU backends */
    int large;
    FILE *log; /* where lines go (NULL = stdout) */
    /* If non-NULL, one line "case-name hash" per case with a 64-bit FNV-1a hash of the bytes of every
     * output of that case's first run: two runs (thread counts, builds) can be compared bit for bit. */
    FILE *digests;
} dg_harness_opts_t;

/* Fill `o` with the defaults (seed 0, quiet, everything, tolerances x1, stdout). */
void dg_harness_opts_init(dg_harness_opts_t *o);

/* Run every case on `be` (act dtype taken from be->act_dtype). Returns the number of failed checks
 * (0 = all passed); a summary line "op harness [backend, dtype]: N checks, F failed" ends the log. */
int dg_op_harness_run(dg_backend_t *be, const dg_harness_opts_t *o);

/* The relative-error bound the harness uses for `op` (e.g. "matmul_fwd", "attention_bwd") at act dtype
 * `act`, before tol_scale; -1 for an unknown op. Exposed so a driver can print or reason about them. */
double dg_op_harness_tolerance(const char *op, dg_dtype_t act);

#ifdef __cplusplus
}
#endif
#endif
