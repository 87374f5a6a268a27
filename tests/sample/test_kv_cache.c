/* test_kv_cache.c — the KV-cache decoder (src/model/dg_infer.h) against full recomputation, on the weights
 * of a real checkpoint (tests/sample/kv_cache.sh trains the tiny model a few steps with dgtrain first).
 *
 *   test_kv_cache CKPT            CPU: a prompt, then 64 greedy tokens; at every position (prompt rows
 *                                 included) the cache's logits are within 1e-5 of the training graph's
 *                                 full forward (dg_model_logits) and of the engine's own no-cache path
 *                                 (attention_fwd); the greedy token equals the argmax of the full
 *                                 recompute; feeding past seq_len is refused with the cache unchanged.
 *   test_kv_cache CKPT --cuda     GPU (label gpu): attention_kv_fwd on CUDA (bf16) against the CPU one
 *                                 over a prefill block and decode steps, then cache vs recompute on CUDA
 *                                 for 64 greedy tokens within a bf16 bound.
 */
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "checkpoint.h"
#include "config.h"
#include "dg_infer.h"
#include "dg_sampler.h"
#include "dg_check.h"
#include "dg_test_skip.h"
#include "dg_model.h"

#define GREEDY 64

typedef struct {
    int n;
    char **names;
    float **data;
} weights_t;

/* Every model/ tensor of the checkpoint, full fp32, and the model description from its stored config. */
static void load_ckpt(const char *path, weights_t *w, dg_model_desc_t *d) {
    dg_ckpt_info_t info;
    OK(dg_ckpt_info_read(path, &info));
    dg_config_t *cfg = calloc(1, sizeof *cfg);
    OK(dg_config_load_buffer(cfg, path, info.meta.config_text, strlen(info.meta.config_text), 0, NULL));
    dg_model_spec_t sp = {cfg->model.preset,  cfg->model.n_layer, cfg->model.n_head,
                          cfg->model.d_model, cfg->model.seq_len, cfg->model.vocab_size};
    OK(dg_model_desc_resolve(&sp, d));
    free(cfg);
    dg_ckpt_tensor_t *t = calloc((size_t)info.n_entries, sizeof *t);
    w->names = calloc((size_t)info.n_entries, sizeof *w->names);
    w->data = calloc((size_t)info.n_entries, sizeof *w->data);
    w->n = 0;
    for (int i = 0; i < info.n_entries; i++) {
        const dg_ckpt_entry_t *e = &info.entries[i];
        if (strncmp(e->path, "model/", 6) != 0) continue;
        dg_ckpt_tensor_t *x = &t[w->n];
        size_t numel = 1;
        x->ndim = e->ndim;
        for (int k = 0; k < e->ndim; k++)
            x->gshape[k] = x->count[k] = e->shape[k], numel *= (size_t)e->shape[k];
        x->owner = 1;
        w->names[w->n] = strdup(e->path + 6);
        x->path = strdup(e->path);
        x->data = w->data[w->n] = malloc(numel * sizeof(float));
        w->n++;
    }
    OK(dg_ckpt_load(MPI_COMM_SELF, path, NULL, t, w->n));
    for (int i = 0; i < w->n; i++)
        free((void *)t[i].path);
    free(t);
    dg_ckpt_info_destroy(&info);
}

static const float *find_w(const weights_t *w, const char *name) {
    for (int i = 0; i < w->n; i++)
        if (strcmp(w->names[i], name) == 0) return w->data[i];
    fprintf(stderr, "FAIL: the checkpoint has no tensor model/%s\n", name);
    exit(1);
}

static void fill_engine(dg_infer_t *e, const weights_t *w) {
    for (int i = 0; i < dg_infer_n_tensors(e); i++)
        OK(dg_infer_set_tensor(e, i, find_w(w, dg_infer_tensor_name(e, i))));
}

static double max_diff(const float *a, const float *b, int n, double *amax) {
    double m = 0;
    for (int i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (!(d <= m)) m = d; /* NaN propagates */
        if (amax && fabs(b[i]) > *amax) *amax = fabs(b[i]);
    }
    return m;
}

static dg_backend_t *cpu_backend(void) {
    dg_backend_config_t bc = {.act_dtype = DG_F32, .threads = 2};
    dg_backend_t *be;
    OK(dg_backend_cpu_create(&bc, &be));
    return be;
}

static const char k_prompt[] = "The cat sat on ";

/* ---------------- CPU ---------------- */

static void run_cpu(const weights_t *w, const dg_model_desc_t *d) {
    dg_backend_t *be = cpu_backend(), *be2 = cpu_backend();
    dg_infer_t *e;
    OK(dg_infer_create(d, be, DG_INFER_ALL_LOGITS, &e));
    fill_engine(e, w);
    dg_model_t *m;
    OK(dg_model_create(d, be2, 1, 1, &m));
    for (int i = 0; i < dg_model_n_tensors(m); i++)
        OK(dg_model_set_tensor(m, i, DG_STATE_PARAM, find_w(w, dg_model_param(m, i)->name)));
    const int V = d->vocab_size, S = d->seq_len, P = (int)strlen(k_prompt);
    EXPECT(P + GREEDY <= S, "prompt %d + %d tokens do not fit seq_len %d", P, GREEDY, S);
    int32_t *seq = calloc((size_t)S, sizeof *seq);
    for (int i = 0; i < P; i++)
        seq[i] = (uint8_t)k_prompt[i];
    float *lc = malloc((size_t)S * V * sizeof(float)), *lf = malloc((size_t)V * sizeof(float)),
          *lr = malloc((size_t)V * sizeof(float));
    OK(dg_infer_feed(e, seq, P, 1, lc)); /* prefill: every prompt row */
    double worst = 0, worst_own = 0;
    int mismatches = 0, n = P;
    for (int pos = 0; pos < P + GREEDY; pos++) {
        const float *c = pos < P ? lc + (size_t)pos * V : lc;
        OK(dg_model_logits(m, seq, pos, lf)); /* full forward of the training graph over seq_len */
        OK(dg_infer_recompute(e, seq, pos + 1, lr));
        double dm = max_diff(c, lf, V, NULL), dr = max_diff(c, lr, V, NULL);
        if (!(dm <= worst)) worst = dm;
        if (!(dr <= worst_own)) worst_own = dr;
        EXPECT(dm <= 1e-5, "position %d: cache vs dg_model_logits differ by %.3g (> 1e-5)", pos, dm);
        EXPECT(dr <= 1e-5, "position %d: cache vs no-cache recompute differ by %.3g (> 1e-5)", pos, dr);
        if (pos < P - 1) continue;
        /* greedy: the cache's token is the full recompute's argmax */
        const int32_t t = dg_argmax(c, V);
        if (t != dg_argmax(lf, V)) mismatches++;
        if (pos == P + GREEDY - 1) break;
        seq[n++] = t;
        OK(dg_infer_feed(e, &t, 1, 0, lc)); /* one position against the cache */
        EXPECT(dg_infer_pos(e) == n, "pos %d after feeding %d tokens", dg_infer_pos(e), n);
    }
    EXPECT(mismatches == 0, "%d greedy tokens differ from the argmax of full recomputation", mismatches);
    printf("cpu: %d prompt rows + %d greedy tokens: max |cache - dg_model_logits| = %.3g, max |cache - "
           "recompute| = %.3g\n",
           P, GREEDY, worst, worst_own);
    /* past the context: refused, cache untouched */
    int32_t *fill = calloc((size_t)S, sizeof *fill);
    const int before = dg_infer_pos(e);
    dg_status_t s = dg_infer_feed(e, fill, S - before + 1, 0, NULL);
    EXPECT(s == DG_ERR_USAGE && strstr(dg_last_error(), "seq_len"), "feeding past seq_len: status %d (%s)",
           (int)s, dg_last_error());
    EXPECT(dg_infer_pos(e) == before, "a refused feed moved pos from %d to %d", before, dg_infer_pos(e));
    int32_t bad = V;
    s = dg_infer_feed(e, &bad, 1, 0, NULL);
    EXPECT(s == DG_ERR_USAGE, "token id %d (= vocab_size) accepted", (int)bad);
    free(fill);
    free(seq);
    free(lc);
    free(lf);
    free(lr);
    dg_model_free(m);
    dg_infer_free(e);
    dg_backend_free(be);
    dg_backend_free(be2);
}

/* ---------------- CUDA ---------------- */

#ifdef DG_HAVE_CUDA
static void fill_rand(float *x, size_t n, uint64_t *st) {
    for (size_t i = 0; i < n; i++)
        x[i] = (float)((dg_splitmix64(st) >> 11) * 0x1.0p-53 * 2.0 - 1.0);
}

/* attention_kv_fwd on CUDA (act bf16) against the CPU's, same inputs (bf16-rounded on both sides). */
static void kv_entry_vs_cpu(dg_backend_t *gpu, dg_backend_t *cpu) {
    const int C = 128, NH = 4, cap = 96, steps[] = {40, 1, 1, 7, 1};
    uint64_t st = 7;
    float *kc = calloc((size_t)cap * C, 4), *vc = calloc((size_t)cap * C, 4),
          *q = malloc((size_t)cap * 3 * C * 4), *oc = malloc((size_t)cap * C * 4),
          *og = malloc((size_t)cap * C * 4);
    void *gq, *gk, *gv, *go, *g32;
    OK(gpu->ops->alloc(gpu, (size_t)cap * 3 * C * 4, &g32));
    OK(gpu->ops->alloc(gpu, (size_t)cap * 3 * C * 2, &gq));
    OK(gpu->ops->alloc(gpu, (size_t)cap * C * 2, &gk));
    OK(gpu->ops->alloc(gpu, (size_t)cap * C * 2, &gv));
    OK(gpu->ops->alloc(gpu, (size_t)cap * C * 2, &go));
    int p0 = 0;
    double worst = 0;
    for (size_t k = 0; k < sizeof steps / sizeof *steps; k++) {
        const int n = steps[k];
        fill_rand(q, (size_t)n * 3 * C, &st);
        OK(gpu->ops->to_device(gpu, g32, q, (size_t)n * 3 * C * 4));
        OK(gpu->ops->cast(gpu, gq, DG_BF16, g32, DG_F32, (size_t)n * 3 * C));
        OK(gpu->ops->cast(gpu, g32, DG_F32, gq, DG_BF16,
                          (size_t)n * 3 * C)); /* the bf16 values, for the CPU */
        OK(gpu->ops->to_host(gpu, q, g32, (size_t)n * 3 * C * 4));
        OK(cpu->ops->attention_kv_fwd(cpu, oc, kc, vc, q, p0, n, cap, C, NH));
        OK(gpu->ops->attention_kv_fwd(gpu, go, gk, gv, gq, p0, n, cap, C, NH));
        OK(gpu->ops->cast(gpu, g32, DG_F32, go, DG_BF16, (size_t)n * C));
        OK(gpu->ops->to_host(gpu, og, g32, (size_t)n * C * 4));
        double dm = max_diff(og, oc, n * C, NULL);
        if (!(dm <= worst)) worst = dm;
        EXPECT(dm <= 1e-2, "attention_kv_fwd cuda vs cpu, block [%d, %d): max diff %.3g (> 1e-2)", p0, p0 + n,
               dm);
        p0 += n;
    }
    printf("cuda: attention_kv_fwd vs cpu over %d positions: max diff %.3g\n", p0, worst);
    void *bufs[] = {gq, gk, gv, go, g32};
    for (int i = 0; i < 5; i++)
        gpu->ops->free(gpu, bufs[i]);
    free(kc), free(vc), free(q), free(oc), free(og);
}

static int run_cuda(const weights_t *w, const dg_model_desc_t *d) {
    dg_backend_config_t bc = {.act_dtype = DG_BF16};
    dg_backend_t *gpu;
    if (dg_backend_cuda_create(&bc, &gpu) != DG_OK)
        return dg_test_skip(1, "no usable CUDA device: %s", dg_last_error());
    dg_backend_t *cpu = cpu_backend();
    kv_entry_vs_cpu(gpu, cpu);
    dg_infer_t *e;
    OK(dg_infer_create(d, gpu, 0, &e));
    fill_engine(e, w);
    const int V = d->vocab_size, P = (int)strlen(k_prompt);
    int32_t seq[512];
    for (int i = 0; i < P; i++)
        seq[i] = (uint8_t)k_prompt[i];
    float *lc = malloc((size_t)V * 4), *lr = malloc((size_t)V * 4);
    OK(dg_infer_feed(e, seq, P, 0, lc));
    double worst = 0;
    int n = P;
    for (int k = 0; k < GREEDY; k++) {
        double amax = 0;
        OK(dg_infer_recompute(e, seq, n, lr));
        double dm = max_diff(lc, lr, V, &amax), bound = 2e-2 * (amax > 1 ? amax : 1);
        if (!(dm <= worst)) worst = dm;
        EXPECT(dm <= bound, "cuda bf16, position %d: cache vs recompute differ by %.3g (> %.3g)", n - 1, dm,
               bound);
        const int32_t t = dg_argmax(lc, V);
        seq[n++] = t;
        if (k + 1 < GREEDY) OK(dg_infer_feed(e, &t, 1, 0, lc));
    }
    printf("cuda bf16: %d greedy tokens: max |cache - recompute| = %.3g\n", GREEDY, worst);
    free(lc), free(lr);
    dg_infer_free(e);
    dg_backend_free(gpu);
    dg_backend_free(cpu);
    return dg_fails != 0;
}
#endif

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: test_kv_cache CKPT [--cuda]\n");
        return 2;
    }
    MPI_Init(NULL, NULL);
    weights_t w;
    dg_model_desc_t d;
    load_ckpt(argv[1], &w, &d);
    int rc;
    if (argc > 2 && strcmp(argv[2], "--cuda") == 0) {
#ifdef DG_HAVE_CUDA
        rc = run_cuda(&w, &d);
#else
        rc = dg_test_skip(1, "built without CUDA");
#endif
    } else {
        run_cpu(&w, &d);
        rc = dg_fails != 0;
    }
    for (int i = 0; i < w.n; i++)
        free(w.names[i]), free(w.data[i]);
    free(w.names), free(w.data);
    MPI_Finalize();
    if (rc == 0) printf("PASS\n");
    return rc;
}
