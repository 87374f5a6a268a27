/* model_impl.h — private to src/model/: the layout of dg_model_t and the functions its files share.
 * gpt2.c (the GPT-2 family: presets, builder, parameter naming/placement, initialisation), model.c
 * (create/free, the pass pipeline, flat storage, accessors), run.c (forward/backward/optimizer and
 * CUDA Graph replay), state.c (tensor state access, profiling, plan printing).
 */
#ifndef DG_MODEL_IMPL_H
#define DG_MODEL_IMPL_H

#include "comm.h"
#include "dg_env.h"
#include "dg_model.h"
#include "graph.h"

#define PARAM_ALIGN_ELEMS 64 /* 256 bytes of f32: every tensor starts aligned in the flat buffers */

/* Where this rank's piece of a parameter sits in the global tensor.
 * Tensor parallelism: the tp-local tensor is the concatenation, along tp_dim, of n_seg segments of the
 * global tensor (QKV: its q, k and v rows for this rank's heads); tp_dim = -1 means replicated.
 * FSDP: this rank holds rows [row0, row0 + nrows) of the tp-local tensor, stored as Rs rows (the rest
 * zero padding). */
typedef struct {
    int ndim;
    int64_t gshape[2];
    int tp_dim, n_seg;
    int64_t seg_start[3], seg_len[3];
    int tp_rank0_only;    /* replicated over tp, but only tp rank 0 uses it (row-parallel bias) */
    int64_t lrows, lcols; /* tp-local shape (lcols = 1 for vectors) */
    int64_t Rs, row0, nrows;
    size_t local_numel; /* Rs * lcols */
} place_t;

struct dg_model {
    dg_model_desc_t d;
    dg_backend_t *be;
    int B, T, flags;
    uint64_t seed;

    dg_graph_t *g;
    dg_memplan_t *plan;
    dg_exec_t *ex;

    int np;
    dg_param_info_t *info;
    char (*names)[64];
    dg_node_t **pnode;
    size_t *off; /* element offset of each tensor in the flat buffers */
    size_t total;

    float *master, *grad, *adam_m, *adam_v;
    void *compute; /* act-dtype copy of the params; NULL when act is f32 (the master is used) */
    int32_t *tokens_dev, *targets_dev;
    float *scalars_dev;

    dg_node_t *tokens, *targets, *losses, *logits, *scalars;
    float *host_losses; /* page-locked (host_alloc): the micro-batch's token losses, B*T */
    /* Host reads without draining the queue (backend contract v1.8): the forward's losses and the
     * optimizer's gradient norm are copied (download_async) at the point where they are final and the
     * host waits on a fence placed right after the copy, not for the backward or the AdamW behind it.
     * async_reads = 0 (a backend without the ops, or DG_SYNC_HOST_READS=1 when the model was created):
     * sync + to_host after each phase, as before. Both give the same bits. */
    int async_reads;
    void *loss_fence, *norm_fence;
    float *host_norm;      /* page-locked: the gradient norm's copy */
    const dg_node_t *clip; /* the OPT phase's CLIP_SCALE (the norm is final after it); NULL: sync path */
    int opt_pending;       /* an optimizer step returned before its AdamW ran (async_reads): the host mirrors
                              that the AdamW's queued uploads read are not free until a later fence or sync */
    unsigned char *frozen; /* per tensor */

    /* distribution */
    dg_model_parallel_t par;
    int tp, tp_rank, k, shard_rank, rep, rep_rank;
    place_t *place;               /* per tensor */
    dg_shard_plan_t *shard;       /* buckets (NULL on one data-parallel rank) */
    int32_t *tok_host, *tgt_host; /* page-locked staging of the micro-batch's ids (upload_async) */
    /* graph replay (dg_model_set_graph_replay) */
    int gr_on, gr_warm;
    void (*trace_cb)(void *ctx, const char *op, const char *name, const char *phase, int comm, double t0,
                     double t1); /* dg_model_set_trace */
    void *trace_ctx;
    void *gr[4];         /* GR_*: instantiated graphs, NULL until recorded */
    float gr_key[4][8];  /* the values each recording baked in */
    int accum, fb_count; /* dg_model_set_grad_accum; forward_backward calls since zero_grad / the step */
    void *gr_agree_dev;  /* one f32 on the device: the recording agreement over nccl comms */
    dg_model_graph_cb_t gr_cb;
    void *gr_ctx;
    /* executor fallbacks (dg_model_set_fallback_cb): reports delivered so far */
    dg_model_fallback_cb_t fb_cb;
    void *fb_ctx;
    int fb_sent;
    /* fused AdamW (pass fuse_adamw) and fused norm (pass fuse_sumsq): the flat leaves they created, and
     * the device segment tables */
    dg_fuse_adamw_t fuse;
    void *segs_dev, *norm_segs_dev;
    /* plan cache and circuit breaker (plancache.c, model.c) */
    dg_model_build_info_t binfo;
    int conservative; /* the breaker's plan: no fusion passes, eager allocation, no graph replay */
    int init_pending; /* the weights are drawn after the plan-cache probe (dg_model_create_parallel) */
    char want_fb[16]; /* set by a build the breaker stopped: "compile_timeout" | "compile_oom" */
    char want_fb_reason[320];
    int n_mfb, mfb_sent; /* the breaker's fallback reports, delivered before the executor's */
    struct dg_exec_fallback mfb[2];
    /* pipeline chunk (dg_model.h "pipeline chunks"; stage.c): units [u0, u1) of the L + 2; whole model:
     * 0, L + 2. gidx: per tensor, its index in the whole model (the initialisation's stream) */
    int u0, u1, pp_chunk;
    int *gidx, cur_gidx;
    dg_node_t *x_in, *dx_out, *x_out; /* input activation, output gradient seed, output activation */
    char x_out_name[64];
    int n_slots;
    struct dg_stage_slot *slots; /* slot 0 runs on ex; the others on executors of their own */
    int64_t step;                /* dg_model_set_step */
    int stall_rank;              /* test hook DG_TEST_STALL_COLLECTIVE_RANK/_STEP (-1: off) */
    int64_t stall_step;
};

/* plancache.c: one rank's plan-cache entry (dg_model.h "plan cache and circuit breaker") */
typedef struct dg_pc {
    char dir[1024];
    char path[1200]; /* this rank's entry */
    char *key;       /* "key.<name>=<value>\n" lines */
    int have;        /* an intact entry under the same key was read (dg_pc_lookup) */
    unsigned char *file;
    const unsigned char *bin; /* its binary part, inside file */
    size_t bin_n;
    double probe[4]; /* the entry's probe: loss, logits sum, weighted sum, absolute sum */
    char outcome[16], reason[320];
} dg_pc_t;
void dg_pc_init(dg_pc_t *pc, const char *dir);
void dg_pc_free(dg_pc_t *pc);
uint64_t dg_pc_ir_hash(const dg_graph_t *g);
/* The key and this rank's entry path, from a model whose forward graph is built (before the passes). */
dg_status_t dg_pc_key(dg_pc_t *pc, const dg_model_t *m);
/* Reads the entry: have = 1, or outcome miss / stale / corrupt with the reason. */
void dg_pc_lookup(dg_pc_t *pc);
/* Replaces the model's forward graph by the entry's compiled graph and plan (and the references). */
dg_status_t dg_pc_apply(dg_pc_t *pc, dg_model_t *m);
dg_status_t dg_pc_store(const dg_pc_t *pc, const dg_model_t *m, const double probe[4]);

/* gpt2.c */
dg_status_t dg_gpt2_build_forward(dg_model_t *m);    /* params, forward ops, loss */
int dg_gpt2_decay_of(const dg_node_t *p, void *ctx); /* AdamW weight decay for a parameter */
int dg_gpt2_param_group(const dg_model_t *m,
                        const char *nm); /* FSDP group: 0 embeddings, 1+l layer l, L+1 ln_f */
void dg_gpt2_init_tensor(const dg_model_t *m, int i, float *h); /* this rank's piece of tensor i, at init */
int64_t dg_model_global_row(const place_t *pl, int64_t lr);     /* tp-local row -> global row */
/* stage.c: slot 0's input buffers of a pipeline chunk (bound before the executor is made) */
dg_status_t dg_stage_bind0(dg_model_t *m);
void dg_stage_free(dg_model_t *m);
/* run.c */
dg_status_t dg_model_check_ids(const dg_model_t *m, const int32_t *ids, const char *what);
float dg_model_mean_losses(const dg_model_t *m);
void dg_model_maybe_stall(const dg_model_t *m);
/* test hook DG_TEST_STALL_COLLECTIVE_RANK/_STEP */ /* mean of host_losses (double sum in token order) */
/* the optimizer step's checks and runtime values (the part before the OPT phase runs) */
dg_status_t dg_model_opt_prepare(dg_model_t *m, const dg_optim_hparams_t *h);
dg_status_t dg_model_need_memory(const dg_model_t *m,
                                 const char *what); /* usage error for a plan-only model */
void dg_model_replay_drop(dg_model_t *m);           /* frees the recorded CUDA Graphs */
void dg_model_fb_flush(dg_model_t *m);              /* delivers pending executor fallback reports */

#endif /* DG_MODEL_IMPL_H */
