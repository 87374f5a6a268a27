/* ref64.h — float64 reference implementations of the graph's ops and of a whole GPT-2 forward, written
 * independently of every backend, for the graph tests (forward values and finite differences). */
#ifndef DG_TEST_REF64_H
#define DG_TEST_REF64_H

#include <stddef.h>
#include <stdint.h>

void ref_encoder(double *out, const int32_t *tok, const double *wte, const double *wpe, int B, int T, int C);
void ref_layernorm(double *out, const double *x, const double *w, const double *b, int N, int C);
void ref_matmul(double *out, const double *x, const double *w, const double *bias, int N, int C, int OC);
void ref_gelu(double *out, const double *x, size_t n);
void ref_attention(double *out, const double *qkv, int B, int T, int C, int NH);
void ref_crossentropy(double *losses, const double *logits, const int32_t *targets, int N, int V, int Vp);

/* GPT-2 forward in float64. params[i] follows dg_model_param order (wte [Vp,C], wpe [T,C], 12 per layer,
 * ln_f). Returns the SUM of token losses over B*T tokens. */
typedef struct ref_gpt {
    int L, NH, C, T, V, Vp, B;
} ref_gpt_t;
double ref_gpt_loss_sum(const ref_gpt_t *m, double *const *params, const int32_t *tokens,
                        const int32_t *targets, double *logits_out /* NULL or [B*T, Vp] */);

/* deterministic test data */
uint64_t ref_rng_next(uint64_t *s);
double ref_rng_uniform(uint64_t *s); /* [0, 1) */
void ref_fill(float *x, size_t n, double lo, double hi, uint64_t *s);

#endif
