/* estimate.c — the per-rank memory estimator (dg_memory.h, docs/planning.md §Memory). */
#include "dg_memory.h"

void dg_mem_estimate(const dg_mem_in_t *in, dg_mem_est_t *out) {
    const double P = in->n_params, L = in->n_layer, C = in->d_model, T = in->seq_len, V = in->vocab;
    const double pb = in->param_bytes, mb = in->micro_batch;
    const double K = in->tp > 0 ? in->tp : 1, S = in->dp_shard > 0 ? in->dp_shard : 1;
    double state_per_param = 16.0 + (pb < 4 ? pb : 0);
    out->state = P / (K * S) * state_per_param;
    double block = 12.0 * C * C / K;
    out->gathered = S > 1 ? (2.0 * block + V * C / K) * pb : 0;
    /* kept per layer: ~10 C-wide tensors + the 4C-wide MLP hidden (pre- and post-GELU: 24/K);
     * recompute=gelu drops the post-GELU copy (4 C-wide elements per token) */
    double act_layer = mb * T * C * (10.0 + (in->recompute_gelu ? 16.0 : 24.0) / K) * (pb / 2.0);
    if (!in->gpu) act_layer += mb * (in->n_head / K) * T * T * 4.0 * 2.0; /* CPU keeps attention probs */
    out->activations = L * act_layer;
    out->logits = mb * T * (V / K) * (pb + 4.0);
    out->buckets = in->bucket_bytes > 0 && S > 1 ? 2.0 * in->bucket_bytes : 0;
    out->total = out->state + out->gathered + out->activations + out->logits + out->buckets;
}
