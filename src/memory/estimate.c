/* estimate.c — the per-rank memory estimator (dg_memory.h, docs/planning.md §Memory). Every term is an
 * allocation of the trainer; the activation terms follow the tensors the graph's memory planner keeps
 * live at its peak (src/graph/planner.c), checked against dgtrain --dry-run's activation_arena and
 * against measured peak RSS by tests/memory/peak_vs_estimate.py. */
#include "dg_memory.h"

/* Runtime overhead of a rank beyond the estimated buffers, measured as peak-RSS growth minus the other
 * terms (docs/planning.md §Memory): Open MPI's free lists and hash tables, the CPU thread pool and the
 * checkpoint threads' stacks, the data loader, metrics and libraries paged in after start-up. */
#define DG_MEM_RUNTIME_FIXED (6.0 * 1048576.0)
/* HDF5 metadata per checkpoint dataset (chunk B-tree, object header, metadata cache entries). */
#define DG_MEM_PER_DATASET (36.0 * 1024.0)

static void device_terms(const dg_mem_in_t *in, dg_mem_est_t *out) {
    const double P = in->n_params, L = in->n_layer, C = in->d_model, T = in->seq_len, V = in->vocab;
    const double pb = in->param_bytes, mb = in->micro_batch, H = in->n_head;
    const double K = in->tp > 0 ? in->tp : 1, S = in->dp_shard > 0 ? in->dp_shard : 1;
    double state_per_param = 16.0 + (pb < 4 ? pb : 0);
    out->state = P / (K * S) * state_per_param;
    double block = 12.0 * C * C / K;
    out->gathered = S > 1 ? (2.0 * block + V * C / K) * pb : 0;
    /* kept per layer and token: ln_1, res_1, ln_2, res_2 outputs (4 C, replicated over tp), qkv, the
     * attention output, the MLP pre-GELU and GELU outputs (12 C / tp), both layer norms' f32 mean and
     * rstd (16 bytes), and the attention's aux buffer: the f32 probabilities on CPU (H/tp x T per
     * token), the f32 logsumexp on GPU (H/tp). Outside the layers: the encoder output, ln_f's output and
     * its gradient (3 C). With recompute, fewer are kept and the layer being differentiated holds its
     * recomputed ones in its backward (`redo`):
     *   gelu: the GELU output is not kept (8 C / tp kept; redo 4 C / tp);
     *   selective: neither the layer norms' outputs and statistics nor the attention output and aux
     *     (res_1, res_2, qkv, pre-GELU kept: 2 C + 7 C / tp; redo 2 C + 5 C / tp + 16 + aux);
     *   full: the layer's input alone (res_2 of the layer before; with tp > 1 also the two row-parallel
     *     all-reduce outputs, collectives are not re-run: C or 3 C; redo the whole layer) */
    double att = in->gpu ? (H / K) * 4.0 : (H / K) * T * 4.0;
    double all = C * (4.0 + 12.0 / K) * pb + 16.0 + att, kept = all, redo = 0;
    if (in->recompute == 1) kept = C * (4.0 + 8.0 / K) * pb + 16.0 + att, redo = C * 4.0 / K * pb;
    if (in->recompute == 2) kept = C * (2.0 + 7.0 / K) * pb, redo = C * (2.0 + 5.0 / K) * pb + 16.0 + att;
    if (in->recompute >= 3) kept = C * (K > 1 ? 3.0 : 1.0) * pb, redo = all;
    /* the lm_head is the tied embedding, not vocabulary-parallel: full-V logits on every tp rank;
     * the fused loss writes dlogits over them; f32 loss, logsumexp and ln_f rstd/mean rows (3 x 4 B) */
    out->logits = mb * T * (V * pb + 12.0);
    /* the recomputed tensors live in the layers' backward, after lm_head's, where the planner lays them
     * over the dead (d)logits: only what exceeds that buffer adds to the peak */
    double extra = mb * T * redo - out->logits;
    /* a pipeline stage keeps the activations of each in-flight micro-batch until its backward */
    double inflight = in->inflight > 1 ? in->inflight : 1;
    out->activations = inflight * (L * mb * T * kept + mb * T * C * 3.0 * pb) + (extra > 0 ? extra : 0);
    /* FSDP (graph/shard.c): a bucket is a block's parameters, up to bucket_bytes; its gradient is
     * accumulated unsharded in f32 until shard_pack and the reduce-scatter (the arena's placement lets
     * the pack buffer share its space; measured). DDP reduces the flat gradient in place (no buffer). */
    double bucket = 4.0 * block < in->bucket_bytes || in->bucket_bytes <= 0 ? 4.0 * block : in->bucket_bytes;
    out->buckets = S > 1 ? bucket : 0;
}

void dg_mem_estimate(const dg_mem_in_t *in, dg_mem_est_t *out) {
    device_terms(in, out);
    const double K = in->tp > 0 ? in->tp : 1, S = in->dp_shard > 0 ? in->dp_shard : 1;
    /* host_flat[3] (train.c build_ckpt_tensors): params, m, v of the local shard in f32, zeroed at
     * set-up; checkpoint.async adds no copy (the writer borrows host_flat, train.c save_checkpoint) */
    out->checkpoint = in->n_params / (K * S) * 12.0;
    double datasets = 3.0 * (12.0 * in->n_layer + 4.0); /* params, m, v of every tensor */
    out->runtime = DG_MEM_RUNTIME_FIXED + datasets * DG_MEM_PER_DATASET;
    out->host = out->checkpoint + out->runtime;
    double device = out->state + out->gathered + out->activations + out->logits + out->buckets;
    out->total = device + (in->gpu ? 0 : out->host);
}
