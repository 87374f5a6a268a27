/* ministep.h — a one-block GPT training step written only against backend.h, for tests and benchmarks of
 * any backend: encoder, layernorm, qkv matmul, attention, projection, residual adds, GELU MLP, final
 * layernorm, tied LM head, cross-entropy, the whole backward, gradient norm, clipping and one AdamW call
 * over every parameter (they live in one contiguous f32 buffer, compute copies in one act buffer).
 *
 * The same seed gives the same initial parameters and tokens on every backend, so runs can be compared
 * bit for bit (same backend) or within a tolerance (CPU vs CUDA).
 */
#ifndef DG_TEST_MINISTEP_H
#define DG_TEST_MINISTEP_H

#include <stdint.h>

#include "backend.h"

typedef struct ministep_cfg {
    int B, T, C, NH, V, Vp;
    float lr, clip;
    uint64_t seed;
} ministep_cfg_t;

typedef struct ministep ministep_t;

/* Allocates every buffer on `be` and uploads the initial state. */
dg_status_t ministep_create(dg_backend_t *be, const ministep_cfg_t *cfg, ministep_t **out);
void ministep_free(ministep_t *ms);
/* One optimizer step (t = 1, 2, ...); *loss = mean loss of the step's forward (read back to the host). */
dg_status_t ministep_step(ministep_t *ms, int64_t t, double *loss);
/* Only the forward+backward (no optimizer, no host read-back): for timing. */
dg_status_t ministep_fwd_bwd(ministep_t *ms);
/* Copies of the f32 master parameters and of the gradient norm of the last step. */
dg_status_t ministep_params(ministep_t *ms, float *host, size_t *n);
size_t ministep_nparams(const ministep_t *ms);
dg_status_t ministep_grad_norm(ministep_t *ms, float *norm);

#endif
