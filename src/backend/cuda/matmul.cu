/* matmul.cu — the linear layers through cuBLASLt: forward with fused bias / bias+GELU epilogues, backward
 * with the input gradient (optionally accumulated), the weight gradient accumulated straight into the
 * f32 gradient buffer (bf16/f16 A and B, f32 C = D, beta = 1) and the bias gradient by our column sums.
 *
 * Plans (descriptors + the algorithm: the measured fastest of cuBLASLt's candidates, kept in the tuning
 * file of gemm_tune.h for later runs, or with DG_CUDA_GEMM_TUNE=0 the heuristic's first pick) are cached
 * per shape, types, epilogue and pointer alignment, so each shape is planned once and always runs the
 * same algorithm: with the backend's own workspace on its one stream that makes every GEMM bitwise
 * reproducible. Where cuBLASLt
 * offers no fused epilogue for a combination, or DG_CUDA_FUSED_EPILOGUES=0, the plain GEMM runs and
 * the epilogue is done by the kernels in elementwise.cu. The bias gradient is always our column sum
 * (dg_cuda_colsum_acc: one read of dout at memory bandwidth plus a small final pass, deterministic) after
 * the plain weight-gradient GEMM, not cuBLASLt's BGRADB epilogue, which the H200 runs as separate kernels
 * (globalKernelBgradAB_v2 + splitKreduce_kernel) and which measured slower (docs/cuda.md, "Why these
 * implementations").
 *
 * matmul_bwd_dgelu (the MLP's second linear layer, whose input is a GELU output) takes the input gradient
 * through GELU's derivative with the DGELU epilogue (aux = the saved pre-activation).
 *
 * matmul_fwd_res (contract v1.11: a linear layer and the residual add after it) is one GEMM with beta = 1
 * and the residual as cuBLASLt's C matrix, a different pointer from D (or the same one, in place), of D's
 * layout: D = A·B + 1·C (+ bias in the BIAS epilogue).
 *
 * Row-major to column-major: a row-major [R, K] matrix is a column-major K x R one, so
 * out[N,OC] = inp[N,C]·w[OC,C]ᵀ is the column-major D(OC x N) = wᵀ(OC x C) · inp(C x N).
 */
#include <math.h>
#include <string.h>

#include "cuda_impl.cuh"
#include "gemm_tune.h"

static cudaDataType_t cuda_type(dg_dtype_t t) {
    return t == DG_F32 ? CUDA_R_32F : t == DG_BF16 ? CUDA_R_16BF : CUDA_R_16F;
}

static int align_class(const void *p) {
    if (!p) return 256;
    uintptr_t a = (uintptr_t)p;
    int c = 256;
    while (c > 1 && (a % (uintptr_t)c) != 0)
        c >>= 1;
    return c;
}

typedef struct gemm_call {
    int transa, transb, m, n, k;
    const void *A;
    int lda;
    const void *B;
    int ldb;
    void *D;
    int ldd;
    const void *C; /* cuBLASLt's C (read with beta): NULL means D itself (in place); same layout as D */
    cudaDataType_t abtype, dtype;
    float beta;
    cublasLtEpilogue_t epi;
    void *bias; /* the BIAS / GELU_AUX_BIAS epilogues' bias */
    void *aux;
    int aux_ld;
    const float *a_scale, *b_scale; /* E4M3 A and B (abtype CUDA_R_8F_E4M3): their inverse scales (device) */
} gemm_call_t;

/* The C matrix of a call: its own, or D (every call but matmul_fwd_res's accumulates in place, if at all). */
static const void *gemm_c(const gemm_call_t *g) {
    return g->C ? g->C : g->D;
}

void dg_cuda_gemm_plans_free(dg_cuda_t *c) {
    for (int i = 0; i < c->n_plans; i++) {
        dg_gemm_plan_t *p = &c->plans[i];
        if (p->la) cublasLtMatrixLayoutDestroy(p->la);
        if (p->lb) cublasLtMatrixLayoutDestroy(p->lb);
        if (p->lc) cublasLtMatrixLayoutDestroy(p->lc);
        if (p->desc) cublasLtMatmulDescDestroy(p->desc);
    }
    free(c->plans);
    c->plans = NULL;
    c->n_plans = c->cap_plans = 0;
}

/* ---- measured algorithm choice (DG_CUDA_GEMM_TUNE=1) ----
 *
 * cuBLASLt's heuristic ranks its algorithms by a model of the GPU, not by measurement. With tuning on,
 * the plan asks for up to DG_GEMM_TUNE_MAX candidates and times each on the call's own operands the
 * first time the shape is seen, outside any CUDA Graph capture (a shape first seen inside one keeps the
 * heuristic's pick): two rounds over the candidates (forward, then backward, so clock drift favours
 * none), the minimum per candidate, and the fastest is taken only when it beats the heuristic's first
 * pick by at least 1 % (noise does not flip the choice between equally fast algorithms). The timing runs
 * write D (and aux) with the real call's arguments, which the real call that follows overwrites; with
 * beta != 0 and C = D (accumulating in place) D is saved before and restored after. With C != D
 * (matmul_fwd_res out of place) C is an input like A and B: every timing run reads the same C and rewrites
 * D, so nothing needs saving. A call whose output overlaps one of its inputs (A, B, or a C other than D)
 * is not tuned. The choice is then cached with the plan like the heuristic's. */
typedef struct {
    uintptr_t lo, hi;
} span_t;

static span_t span_of(const void *p, int rows, int cols, int ld, size_t es) {
    span_t s = {0, 0};
    if (!p || rows <= 0 || cols <= 0) return s;
    s.lo = (uintptr_t)p;
    s.hi = s.lo + ((size_t)(cols - 1) * (size_t)ld + (size_t)rows) * es;
    return s;
}

static int span_overlap(span_t a, span_t b) {
    return a.lo < b.hi && b.lo < a.hi;
}

static size_t type_size(cudaDataType_t t) {
    return t == CUDA_R_32F ? 4 : t == CUDA_R_8F_E4M3 ? 1 : 2;
}

/* ms per call of `algo` over `reps` back-to-back calls; < 0 when cuBLASLt refuses it */
static float gemm_time(dg_cuda_t *c, dg_gemm_plan_t *p, const gemm_call_t *g,
                       const cublasLtMatmulAlgo_t *algo, int reps, cudaEvent_t e0, cudaEvent_t e1) {
    const float alpha = 1.f, beta = g->beta;
    if (cudaEventRecord(e0, c->stream) != cudaSuccess) return -1.f;
    for (int r = 0; r < reps; r++) {
        cublasStatus_t st = cublasLtMatmul(c->lt, p->desc, &alpha, g->A, p->la, g->B, p->lb, &beta, gemm_c(g),
                                           p->lc, g->D, p->lc, algo, c->lt_ws, c->lt_ws_bytes, c->stream);
        if (st != CUBLAS_STATUS_SUCCESS) return -1.f;
    }
    float ms = -1.f;
    if (cudaEventRecord(e1, c->stream) != cudaSuccess || cudaEventSynchronize(e1) != cudaSuccess ||
        cudaEventElapsedTime(&ms, e0, e1) != cudaSuccess)
        return -1.f;
    return ms / (float)reps;
}

/* The device tag of the tuning table: what makes cuBLASLt's candidate list the same (GPU model, compute
 * capability, SM count, cuBLASLt version); no spaces. */
static const char *tune_tag(dg_cuda_t *c) {
    if (!c->tune_tag[0]) {
        char nm[64];
        const char *src = c->name[0] ? c->name : "gpu";
        size_t len = strlen(src) < sizeof nm - 1 ? strlen(src) : sizeof nm - 1;
        memcpy(nm, src, len);
        nm[len] = 0;
        for (char *q = nm; *q; q++)
            if (!((*q >= 'a' && *q <= 'z') || (*q >= 'A' && *q <= 'Z') || (*q >= '0' && *q <= '9') ||
                  *q == '-' || *q == '.'))
                *q = '_';
        snprintf(c->tune_tag, sizeof c->tune_tag, "%s/sm%d%d/%dsms/cublasLt%zu", nm, c->cc_major, c->cc_minor,
                 c->sm_count, (size_t)cublasLtGetVersion());
    }
    return c->tune_tag;
}

static void tune_key(const dg_cuda_t *c, const dg_gemm_plan_t *p, int *key) {
    static_assert(sizeof(dg_gemm_key_t) == (DG_GEMM_TUNE_KEY_N - 1) * sizeof(int), "key layout");
    memcpy(key, &p->key, sizeof p->key);
    key[DG_GEMM_TUNE_KEY_N - 1] = (int)(c->lt_ws_bytes >> 20); /* the workspace bounds the candidates */
}

static void tune_take(dg_gemm_plan_t *p, const cublasLtMatmulHeuristicResult_t *res, int pick) {
    p->algo = res[pick].algo;
    p->ws_bytes = res[pick].workspaceSize;
}

static dg_status_t gemm_tune(dg_cuda_t *c, dg_gemm_plan_t *p, const gemm_call_t *g,
                             const cublasLtMatmulHeuristicResult_t *res, int found) {
    int key[DG_GEMM_TUNE_KEY_N];
    tune_key(c, p, key);
    dg_gemm_tune_entry_t hit;
    if (dg_gemm_tune_lookup(tune_tag(c), key, &hit)) {
        if (hit.found == found && hit.pick < found && res[hit.pick].state == CUBLAS_STATUS_SUCCESS &&
            res[hit.pick].workspaceSize <= c->lt_ws_bytes &&
            dg_gemm_tune_hash(&res[hit.pick].algo, sizeof res[hit.pick].algo) == hit.algo_hash) {
            tune_take(p, res, hit.pick);
            DG_LOG_DEBUG("cuda backend: GEMM m=%d n=%d k=%d: candidate %d of %d from the tuning table", g->m,
                         g->n, g->k, hit.pick, found);
            return DG_OK;
        }
        DG_LOG_INFO(
            "cuda backend: GEMM m=%d n=%d k=%d: the tuning table's entry no longer matches cuBLASLt's "
            "candidates; timing again",
            g->m, g->n, g->k);
    }
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    DG_CUDA_CHECK(cudaStreamIsCapturing(c->stream, &cs));
    if (cs != cudaStreamCaptureStatusNone) {
        DG_LOG_DEBUG("cuda backend: GEMM m=%d n=%d k=%d first seen during a CUDA Graph capture: not tuned",
                     g->m, g->n, g->k);
        return DG_OK;
    }
    const size_t es_ab = type_size(g->abtype), es_d = type_size(g->dtype);
    const span_t sa = span_of(g->A, g->transa ? g->k : g->m, g->transa ? g->m : g->k, g->lda, es_ab);
    const span_t sb = span_of(g->B, g->transb ? g->n : g->k, g->transb ? g->k : g->n, g->ldb, es_ab);
    const span_t sd = span_of(g->D, g->m, g->n, g->ldd, es_d);
    const span_t sx = span_of(g->aux, g->m, g->n, g->aux_ld, es_d); /* aux: D's (the act) dtype */
    /* C other than D: an input the timing runs must not change (C = D with beta != 0 is saved below) */
    const int c_in_place = gemm_c(g) == g->D;
    const span_t sc = c_in_place ? span_t{0, 0} : span_of(gemm_c(g), g->m, g->n, g->ldd, es_d);
    if (span_overlap(sd, sa) || span_overlap(sd, sb) || span_overlap(sx, sa) || span_overlap(sx, sb) ||
        (g->aux && span_overlap(sd, sx)) || span_overlap(sd, sc) || span_overlap(sx, sc)) {
        DG_LOG_DEBUG("cuda backend: GEMM m=%d n=%d k=%d writes over an input: not tuned", g->m, g->n, g->k);
        return DG_OK;
    }
    const size_t dbytes = sd.hi - sd.lo;
    void *save = NULL;
    if (g->beta != 0.f && c_in_place) {
        DG_CUDA_CHECK(cudaMalloc(&save, dbytes));
        dg_cuda_mem_add(c, dbytes);
        DG_CUDA_CHECK(cudaMemcpyAsync(save, g->D, dbytes, cudaMemcpyDeviceToDevice, c->stream));
    }
    cudaEvent_t e0 = NULL, e1 = NULL;
    DG_CUDA_CHECK(cudaEventCreate(&e0));
    DG_CUDA_CHECK(cudaEventCreate(&e1));
    float best[DG_GEMM_TUNE_MAX];
    int n = found < DG_GEMM_TUNE_MAX ? found : DG_GEMM_TUNE_MAX;
    for (int i = 0; i < n; i++)
        best[i] =
            res[i].state == CUBLAS_STATUS_SUCCESS && res[i].workspaceSize <= c->lt_ws_bytes ? INFINITY : -1.f;
    /* repetitions: enough for ~0.5 ms per measurement, from one warm-up call of the heuristic's pick */
    float t0 = gemm_time(c, p, g, &res[0].algo, 1, e0, e1);
    int reps = 2;
    if (t0 > 0.f) reps = (int)fminf(50.f, fmaxf(2.f, ceilf(0.5f / t0)));
    for (int round = 0; round < 2 && t0 > 0.f; round++)
        for (int j = 0; j < n; j++) {
            const int i = round == 0 ? j : n - 1 - j;
            if (best[i] < 0.f) continue;
            if (round == 0) (void)gemm_time(c, p, g, &res[i].algo, 1, e0, e1); /* first-use costs */
            float t = gemm_time(c, p, g, &res[i].algo, reps, e0, e1);
            if (t < 0.f) {
                (void)cudaGetLastError();
                best[i] = -1.f;
            } else if (t < best[i]) {
                best[i] = t;
            }
        }
    int pick = 0;
    if (t0 > 0.f && best[0] > 0.f)
        for (int i = 1; i < n; i++)
            if (best[i] > 0.f && best[i] < best[pick]) pick = i;
    if (pick != 0 && !(best[pick] <= 0.99f * best[0])) pick = 0;
    cudaError_t ee = cudaSuccess;
    if (save) {
        ee = cudaMemcpyAsync(g->D, save, dbytes, cudaMemcpyDeviceToDevice, c->stream);
        if (ee == cudaSuccess) ee = cudaStreamSynchronize(c->stream);
        cudaFree(save);
        dg_cuda_mem_sub(c, dbytes);
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    if (ee != cudaSuccess)
        return DG_ERR(DG_ERR_RUNTIME, "cuda backend: GEMM tuning: %s", cudaGetErrorString(ee));
    if (!(t0 > 0.f) || !(best[0] > 0.f)) {
        DG_LOG_DEBUG("cuda backend: GEMM m=%d n=%d k=%d: the heuristic's pick did not run in tuning", g->m,
                     g->n, g->k);
        return DG_OK;
    }
    tune_take(p, res, pick);
    dg_gemm_tune_entry_t e;
    memset(&e, 0, sizeof e);
    snprintf(e.tag, sizeof e.tag, "%s", tune_tag(c));
    memcpy(e.key, key, sizeof e.key);
    e.pick = pick;
    e.found = found;
    e.algo_hash = dg_gemm_tune_hash(&res[pick].algo, sizeof res[pick].algo);
    e.ms_first = best[0];
    e.ms_pick = best[pick];
    dg_gemm_tune_record(&e);
    DG_LOG_INFO("cuda backend: GEMM tuned m=%d n=%d k=%d ta=%d tb=%d epi=%d beta=%d: heuristic pick %.4f ms, "
                "candidate %d of %d %.4f ms (%.3fx)",
                g->m, g->n, g->k, g->transa, g->transb, (int)g->epi, g->beta != 0.f, best[0], pick, n,
                best[pick], best[0] / best[pick]);
    return DG_OK;
}

/* FP8 operands' dequantization scales: device pointers, set on the descriptor before every call (the
 * operands live in the FP8 block, whose address may change when it grows). */
static dg_status_t set_scales(dg_gemm_plan_t *p, const gemm_call_t *g) {
    if (!g->a_scale) return DG_OK;
    DG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &g->a_scale,
                                                   sizeof g->a_scale));
    DG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &g->b_scale,
                                                   sizeof g->b_scale));
    return DG_OK;
}

static dg_status_t plan_build(dg_cuda_t *c, dg_gemm_plan_t *p, const gemm_call_t *g) {
    const dg_gemm_key_t *k = &p->key;
    DG_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = g->transa ? CUBLAS_OP_T : CUBLAS_OP_N, tb = g->transb ? CUBLAS_OP_T : CUBLAS_OP_N;
    DG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    DG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    uint32_t epi = (uint32_t)g->epi;
    DG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
    if (g->bias)
        DG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g->bias,
                                                       sizeof g->bias));
    DG_TRY(set_scales(p, g));
    if (g->aux) {
        int64_t ld = g->aux_ld;
        DG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                                       &g->aux, sizeof g->aux));
        DG_CUBLAS_CHECK(
            cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof ld));
    }
    DG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->la, g->abtype, g->transa ? g->k : g->m,
                                               g->transa ? g->m : g->k, g->lda));
    DG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->lb, g->abtype, g->transb ? g->n : g->k,
                                               g->transb ? g->k : g->n, g->ldb));
    DG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->lc, g->dtype, g->m, g->n, g->ldd));

    cublasLtMatmulPreference_t pref = NULL;
    DG_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    uint64_t ws = c->lt_ws_bytes;
    uint32_t aa = (uint32_t)k->align_a, ab = (uint32_t)k->align_b, ac = (uint32_t)k->align_c;
    cublasStatus_t st =
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aa,
                                                  sizeof aa);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ab,
                                                  sizeof ab);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ac,
                                                  sizeof ac);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ac,
                                                  sizeof ac);
    if (st != CUBLAS_STATUS_SUCCESS) {
        cublasLtMatmulPreferenceDestroy(pref);
        return dg_cublas_fail(st, "cublasLtMatmulPreferenceSetAttribute", __FILE__, __LINE__);
    }
    cublasLtMatmulHeuristicResult_t res[DG_GEMM_TUNE_MAX];
    memset(res, 0, sizeof res);
    int found = 0;
    const int want = c->gemm_tune ? DG_GEMM_TUNE_MAX : 1;
    st = cublasLtMatmulAlgoGetHeuristic(c->lt, p->desc, p->la, p->lb, p->lc, p->lc, pref, want, res, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    p->supported = (st == CUBLAS_STATUS_SUCCESS && found > 0 && res[0].state == CUBLAS_STATUS_SUCCESS);
    if (p->supported) {
        p->algo = res[0].algo;
        p->ws_bytes = res[0].workspaceSize;
        if (c->gemm_tune && found > 1) DG_TRY(gemm_tune(c, p, g, res, found));
    }
    DG_LOG_DEBUG("cuda backend: GEMM plan m=%d n=%d k=%d ta=%d tb=%d epi=%d -> %s", g->m, g->n, g->k,
                 g->transa, g->transb, (int)g->epi, p->supported ? "cuBLASLt" : "unsupported");
    return DG_OK;
}

/* Finds or builds the plan for `g`. *plan is NULL-free; (*plan)->supported says whether it can run. */
static dg_status_t plan_get(dg_cuda_t *c, const gemm_call_t *g, dg_gemm_plan_t **plan) {
    dg_gemm_key_t key;
    memset(&key, 0, sizeof key);
    key.m = g->m;
    key.n = g->n;
    key.k = g->k;
    key.transa = g->transa;
    key.transb = g->transb;
    key.lda = g->lda;
    key.ldb = g->ldb;
    key.ldd = g->ldd;
    key.atype = (int)g->abtype;
    key.ctype = (int)g->dtype;
    key.epilogue = (int)g->epi;
    key.beta_nonzero = g->beta != 0.f;
    key.compute = (int)CUBLAS_COMPUTE_32F;
    key.align_a = align_class(g->A);
    key.align_b = align_class(g->B);
    /* C and D share one layout and one alignment preference: the weaker of the two (C = D: D's) */
    key.align_c = align_class(g->D) < align_class(gemm_c(g)) ? align_class(g->D) : align_class(gemm_c(g));
    key.align_bias = g->bias ? align_class(g->bias) : 0;
    key.align_aux = g->aux ? align_class(g->aux) : 0;
    for (int i = 0; i < c->n_plans; i++)
        if (memcmp(&c->plans[i].key, &key, sizeof key) == 0) {
            *plan = &c->plans[i];
            return DG_OK;
        }
    if (c->n_plans == c->cap_plans) {
        int cap = c->cap_plans ? 2 * c->cap_plans : 32;
        dg_gemm_plan_t *np = (dg_gemm_plan_t *)realloc(c->plans, (size_t)cap * sizeof *np);
        DG_ASSERT(np != NULL);
        c->plans = np;
        c->cap_plans = cap;
    }
    dg_gemm_plan_t *p = &c->plans[c->n_plans];
    memset(p, 0, sizeof *p);
    p->key = key;
    dg_status_t s = plan_build(c, p, g);
    if (s != DG_OK) {
        if (p->la) cublasLtMatrixLayoutDestroy(p->la);
        if (p->lb) cublasLtMatrixLayoutDestroy(p->lb);
        if (p->lc) cublasLtMatrixLayoutDestroy(p->lc);
        if (p->desc) cublasLtMatmulDescDestroy(p->desc);
        return s;
    }
    c->n_plans++;
    *plan = p;
    return DG_OK;
}

/* Runs `g` if cuBLASLt supports it; *ran = 0 (and nothing queued) otherwise. */
static dg_status_t gemm_try(dg_cuda_t *c, const gemm_call_t *g, int *ran) {
    dg_gemm_plan_t *p = NULL;
    *ran = 0;
    DG_TRY(plan_get(c, g, &p));
    if (!p->supported) return DG_OK;
    if (g->bias)
        DG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g->bias,
                                                       sizeof g->bias));
    if (g->aux)
        DG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                                       &g->aux, sizeof g->aux));
    DG_TRY(set_scales(p, g));
    const float alpha = 1.f, beta = g->beta;
    cublasStatus_t st = cublasLtMatmul(c->lt, p->desc, &alpha, g->A, p->la, g->B, p->lb, &beta, gemm_c(g),
                                       p->lc, g->D, p->lc, &p->algo, c->lt_ws, c->lt_ws_bytes, c->stream);
    if (st == CUBLAS_STATUS_NOT_SUPPORTED) { /* the heuristic's pick refused this call: remember, fall back */
        DG_LOG_DEBUG("cuda backend: cuBLASLt refused m=%d n=%d k=%d epi=%d at run time", g->m, g->n, g->k,
                     (int)g->epi);
        p->supported = 0;
        return DG_OK;
    }
    if (st != CUBLAS_STATUS_SUCCESS) return dg_cublas_fail(st, "cublasLtMatmul", __FILE__, __LINE__);
    *ran = 1;
    return DG_OK;
}

/* Last resort when cuBLASLt offers no algorithm (exotic leading dimensions or alignments): a plain
 * shared-memory tiled GEMM, column-major like cuBLAS, f32 accumulation, fixed order. Slow but exact. */
#define FB_TILE 16
template <typename TA, typename TD>
__global__ void gemm_fallback_kernel(int m, int n, int k, int ta, int tb, const TA *A, int lda, const TA *B,
                                     int ldb, const TD *Cm, TD *D, int ldd, float beta) {
    __shared__ float as[FB_TILE][FB_TILE + 1], bs[FB_TILE][FB_TILE + 1];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int i = blockIdx.x * FB_TILE + tx, j = blockIdx.y * FB_TILE + ty;
    float acc = 0.f;
    for (int p0 = 0; p0 < k; p0 += FB_TILE) {
        /* as[r][q] = op(A)[blockrow + r][p0 + q], bs[q][cidx] = op(B)[p0 + q][blockcol + cidx] */
        const int ar = blockIdx.x * FB_TILE + tx, ap = p0 + ty;
        float av = 0.f;
        if (ar < m && ap < k) av = dg_to_f(ta ? A[(size_t)ar * lda + ap] : A[(size_t)ap * lda + ar]);
        as[tx][ty] = av;
        const int bp = p0 + tx, bc = blockIdx.y * FB_TILE + ty;
        float bv = 0.f;
        if (bp < k && bc < n) bv = dg_to_f(tb ? B[(size_t)bp * ldb + bc] : B[(size_t)bc * ldb + bp]);
        bs[tx][ty] = bv;
        __syncthreads();
#pragma unroll
        for (int q = 0; q < FB_TILE; q++)
            acc += as[tx][q] * bs[q][ty];
        __syncthreads();
    }
    if (i < m && j < n) {
        const size_t at = (size_t)j * ldd + i;
        D[at] = dg_from_f<TD>(beta != 0.f ? acc + beta * dg_to_f(Cm[at]) : acc);
    }
}

template <typename TA, typename TD> static dg_status_t gemm_fallback_t(dg_cuda_t *c, const gemm_call_t *g) {
    dim3 grid((g->m + FB_TILE - 1) / FB_TILE, (g->n + FB_TILE - 1) / FB_TILE), block(FB_TILE, FB_TILE);
    gemm_fallback_kernel<TA, TD><<<grid, block, 0, c->stream>>>(
        g->m, g->n, g->k, g->transa, g->transb, (const TA *)g->A, g->lda, (const TA *)g->B, g->ldb,
        (const TD *)gemm_c(g), (TD *)g->D, g->ldd, g->beta);
    DG_CUDA_LAUNCH_CHECK();
    return DG_OK;
}

template <typename TA> static dg_status_t gemm_fallback_a(dg_cuda_t *c, const gemm_call_t *g) {
    if (g->dtype == CUDA_R_32F) return gemm_fallback_t<TA, float>(c, g);
    return gemm_fallback_t<TA, TA>(c, g);
}

static dg_status_t gemm_must(dg_cuda_t *c, const gemm_call_t *g, const char *what) {
    int ran = 0;
    DG_TRY(gemm_try(c, g, &ran));
    if (ran) return DG_OK;
    if (g->m > 65535 * FB_TILE || g->n > 65535 * FB_TILE)
        return DG_ERR(
            DG_ERR_RUNTIME,
            "cuda backend %s: cuBLASLt has no algorithm for m=%d n=%d k=%d and the shape is too large for "
            "the fallback kernel; hint: check the shapes and the buffers' alignment",
            what, g->m, g->n, g->k);
    if (g->abtype == CUDA_R_32F) return gemm_fallback_t<float, float>(c, g);
    if (g->abtype == CUDA_R_16BF) return gemm_fallback_a<dg_bf16>(c, g);
    return gemm_fallback_a<dg_f16>(c, g);
}

/* ---- FP8 operands (train.precision=fp8; fp8.cu quantizes) ----
 *
 * cuBLASLt runs E4M3 x E4M3 GEMMs only in the TN form (A transposed, B not) with k and the leading
 * dimensions multiples of 16. The forward GEMM is TN already: A = the weight, B = the input, both
 * quantized as they are. The input-gradient GEMM (NN in bf16: A = w) takes the weight's transposed copy
 * [C, OC] as a transposed A and the output gradient as B. The weight-gradient GEMM stays bf16: its
 * operands would both need transposed copies (two more passes over the largest activations) and its
 * reduction runs over all N tokens of the micro-batch. Where cuBLASLt refuses an FP8 call, that call runs
 * in bf16 (counted in fp8_refused, logged once; a refused fused epilogue first falls back to the plain FP8
 * GEMM and the epilogue's own kernels); shapes off the multiples of 16 (e.g. lm_head with an
 * unpadded vocabulary) run in bf16 without trying. */
typedef struct {
    const uint8_t *a, *b;
    int lda, ldb;
    const float *sa, *sb;
} fp8_ops_t;

static int fp8_eligible(const dg_cuda_t *c, int N, int C, int OC) {
    return c->fp8 && c->act == DG_BF16 && N % 16 == 0 && C % 16 == 0 && OC % 16 == 0;
}

static size_t up256(size_t b) {
    return (b + 255) & ~(size_t)255;
}

/* Quantizes the weight w[OC, C] (as it is for the forward, transposed for the input gradient) and the
 * activation x[N, K] (K = C forward, OC backward) into the FP8 block. */
static dg_status_t fp8_prepare(dg_cuda_t *c, fp8_ops_t *f, const void *w, int transpose_w, const void *x,
                               int N, int C, int OC) {
    const int K = transpose_w ? OC : C;
    const size_t wb = up256((size_t)OC * C), xb = up256((size_t)N * K);
    void *blk = NULL;
    DG_TRY(dg_cuda_fp8_scratch(c, 512 + wb + xb, &blk));
    float *sw = (float *)blk, *sx = (float *)((char *)blk + 256);
    uint8_t *qw = (uint8_t *)blk + 512, *qx = qw + wb;
    DG_TRY(dg_cuda_fp8_quantize(c, transpose_w ? NULL : qw, transpose_w ? qw : NULL, w, OC, C, sw));
    DG_TRY(dg_cuda_fp8_quantize(c, qx, NULL, x, N, K, sx));
    f->a = qw;
    f->lda = transpose_w ? OC : C;
    f->b = qx;
    f->ldb = K;
    f->sa = sw; /* the inverse scales, at each slot's 256-byte aligned start */
    f->sb = sx;
    return DG_OK;
}

/* gemm_try with the FP8 operands of `f` in place of g's A and B (f NULL: g as it is, in bf16). A fused
 * call cuBLASLt refuses in FP8 is not retried in bf16: the caller's unfused path follows (FP8 GEMM, then
 * the epilogue's kernels), which gemm_must8 runs in bf16 only when even the plain FP8 GEMM is refused. */
static dg_status_t gemm_try8(dg_cuda_t *c, const gemm_call_t *g, const fp8_ops_t *f, int *ran) {
    if (!f) return gemm_try(c, g, ran);
    gemm_call_t q = *g;
    q.transa = 1;
    q.transb = 0;
    q.A = f->a;
    q.lda = f->lda;
    q.B = f->b;
    q.ldb = f->ldb;
    q.abtype = CUDA_R_8F_E4M3;
    q.a_scale = f->sa;
    q.b_scale = f->sb;
    DG_TRY(gemm_try(c, &q, ran));
    if (*ran)
        c->fp8_gemms++;
    else
        DG_LOG_DEBUG("cuda backend: no FP8 algorithm for m=%d n=%d k=%d epilogue %d", g->m, g->n, g->k,
                     (int)g->epi);
    return DG_OK;
}

static dg_status_t gemm_must8(dg_cuda_t *c, const gemm_call_t *g, const fp8_ops_t *f, const char *what) {
    int ran = 0;
    if (f) {
        DG_TRY(gemm_try8(c, g, f, &ran));
        if (ran) return DG_OK;
        if (c->fp8_refused++ == 0)
            DG_LOG_WARN(
                "cuda backend: cuBLASLt has no FP8 algorithm for %s m=%d n=%d k=%d; such GEMMs run in "
                "bf16 (train.precision=fp8, docs/cuda.md)",
                what, g->m, g->n, g->k);
    }
    return gemm_must(c, g, what);
}

/* The forward GEMM of a linear layer: out(OC x N) = wᵀ(OC x C) · inp(C x N), column-major, beta = 0. */
static gemm_call_t fwd_call(const dg_cuda_t *c, void *out, const void *inp, const void *w, int N, int C,
                            int OC) {
    gemm_call_t g;
    memset(&g, 0, sizeof g);
    g.transa = 1;
    g.transb = 0;
    g.m = OC;
    g.n = N;
    g.k = C;
    g.A = w;
    g.lda = C;
    g.B = inp;
    g.ldb = C;
    g.D = out;
    g.ldd = OC;
    g.abtype = g.dtype = cuda_type(c->act);
    g.beta = 0.f;
    g.epi = CUBLASLT_EPILOGUE_DEFAULT;
    return g;
}

dg_status_t dg_cuda_matmul_fwd(dg_cuda_t *c, void *out, void *pre, const void *inp, const void *w,
                               const void *bias, int N, int C, int OC, dg_epilogue_t epi) {
    const int gelu = epi == DG_EPI_GELU;
    gemm_call_t g = fwd_call(c, out, inp, w, N, C, OC);
    fp8_ops_t f8, *f = NULL;
    if (fp8_eligible(c, N, C, OC)) {
        DG_TRY(fp8_prepare(c, &f8, w, 0, inp, N, C, OC));
        f = &f8;
    }
    /* f32 is the exact reference mode: there GELU runs as our own kernel (the tanh form of the CPU
     * backend) rather than cuBLASLt's epilogue, whose GELU formula is not documented precisely. */
    const int fuse_gelu = gelu && c->act != DG_F32 && OC % 8 == 0;
    if (c->fused_epilogues && (bias || fuse_gelu)) {
        gemm_call_t e = g;
        if (fuse_gelu) {
            e.epi = bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
            e.aux = pre;
            e.aux_ld = OC;
        } else {
            e.epi = CUBLASLT_EPILOGUE_BIAS;
        }
        e.bias = (void *)bias;
        int ran = 0;
        DG_TRY(gemm_try8(c, &e, f, &ran));
        if (ran) {
            if (gelu && !fuse_gelu) return dg_cuda_bias_gelu(c, out, pre, NULL, N, OC, 1);
            return DG_OK;
        }
    }
    g.epi = CUBLASLT_EPILOGUE_DEFAULT;
    DG_TRY(gemm_must8(c, &g, f, "matmul_fwd"));
    return dg_cuda_bias_gelu(c, out, pre, bias, N, OC, gelu);
}

/* out = inp·wᵀ + bias + res. The residual is cuBLASLt's C (beta = 1; C = D when out == res), the bias the
 * BIAS epilogue's, which cuBLASLt adds to A·B + beta·C: one GEMM reads res as its tiles are written,
 * instead of the product going to memory and an add kernel reading it and res back. f32 too (the exact
 * reference mode stays a cuBLASLt f32 GEMM; only the rounding of the sum differs from matmul_fwd + add).
 * Where cuBLASLt has no algorithm, or DG_CUDA_FUSED_EPILOGUES=0: matmul_fwd, then the add kernel (in
 * place through scratch, since res is still needed after the product is written). */
dg_status_t dg_cuda_matmul_fwd_res(dg_cuda_t *c, void *out, const void *inp, const void *w, const void *bias,
                                   const void *res, int N, int C, int OC) {
    if (c->fused_epilogues) {
        gemm_call_t e = fwd_call(c, out, inp, w, N, C, OC);
        e.C = res;
        e.beta = 1.f;
        e.epi = bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
        e.bias = (void *)bias;
        fp8_ops_t f8, *f = NULL;
        if (fp8_eligible(c, N, C, OC)) {
            DG_TRY(fp8_prepare(c, &f8, w, 0, inp, N, C, OC));
            f = &f8;
        }
        int ran = 0;
        DG_TRY(gemm_try8(c, &e, f, &ran));
        if (ran) return DG_OK;
    }
    void *prod = out;
    if (out == res) DG_TRY(dg_cuda_scratch(c, (size_t)N * OC * dg_dtype_size(c->act), &prod));
    DG_TRY(dg_cuda_matmul_fwd(c, prod, NULL, inp, w, bias, N, C, OC, DG_EPI_NONE));
    return dg_cuda_add(c, out, prod, res, (size_t)N * OC);
}

/* The input-gradient GEMM of a linear layer: dinp(C x N) = w(C x OC) · dout(OC x N), column-major. */
static gemm_call_t dinp_call(const dg_cuda_t *c, void *dinp, const void *dout, const void *w, int N, int C,
                             int OC, float beta) {
    gemm_call_t g;
    memset(&g, 0, sizeof g);
    g.m = C;
    g.n = N;
    g.k = OC;
    g.A = w;
    g.lda = C;
    g.B = dout;
    g.ldb = OC;
    g.D = dinp;
    g.ldd = C;
    g.abtype = g.dtype = cuda_type(c->act);
    g.beta = beta;
    g.epi = CUBLASLT_EPILOGUE_DEFAULT;
    return g;
}

dg_status_t dg_cuda_matmul_bwd(dg_cuda_t *c, void *dinp, float *dw, float *dbias, const void *dout,
                               const void *inp, const void *w, int N, int C, int OC, int acc) {
    const cudaDataType_t at = cuda_type(c->act);
    if (dinp) {
        gemm_call_t g = dinp_call(c, dinp, dout, w, N, C, OC, acc ? 1.f : 0.f);
        fp8_ops_t f8, *f = NULL;
        if (fp8_eligible(c, N, C, OC)) {
            DG_TRY(fp8_prepare(c, &f8, w, 1, dout, N, C, OC));
            f = &f8;
        }
        DG_TRY(gemm_must8(c, &g, f, "matmul_bwd (input gradient)"));
    }
    if (dw) {
        /* dw(C x OC) += inp(C x N) · dout(OC x N)ᵀ, f32 accumulate in place */
        gemm_call_t g;
        memset(&g, 0, sizeof g);
        g.transb = 1;
        g.m = C;
        g.n = OC;
        g.k = N;
        g.A = inp;
        g.lda = C;
        g.B = dout;
        g.ldb = OC;
        g.D = dw;
        g.ldd = C;
        g.abtype = at;
        g.dtype = CUDA_R_32F;
        g.beta = 1.f;
        g.epi = CUBLASLT_EPILOGUE_DEFAULT;
        DG_TRY(gemm_must(c, &g, "matmul_bwd (weight gradient)"));
    }
    if (dbias) DG_TRY(dg_cuda_colsum_acc(c, dbias, dout, N, OC));
    return DG_OK;
}

/* dpre[N,C] (acc) = (dout · w) ⊙ gelu'(pre), dw += doutᵀ · inp, dbias += colsum(dout).
 * The weight (and bias) gradient runs first, so dpre may overwrite inp (the GELU output, dead after it).
 * bf16/f16 with acc = 0 and C % 8 == 0 (the aux leading dimension must be a multiple of 8): the input
 * gradient is one GEMM with the DGELU epilogue, aux = pre (same layout as D: column-major C x N, ld C,
 * in the act dtype, which is cuBLASLt's default aux type). Elsewhere — f32 (the exact reference mode, as
 * in the forward: our tanh-form kernel, not cuBLASLt's GELU), acc = 1 (cuBLASLt would apply the
 * derivative to dout·w + beta·C, not add after it), DG_CUDA_FUSED_EPILOGUES=0, DG_CUDA_FUSED_DGELU=0,
 * or when cuBLASLt has no algorithm — the plain GEMM writes dpre (acc = 1: scratch) and the gelu_bwd
 * kernel applies the derivative in place (acc = 1: adds into dpre). DGELU_BGRAD is not used: it would
 * give the NEXT layer's (mlp.fc's) bias gradient, which that layer's matmul_bwd already computes. */
dg_status_t dg_cuda_matmul_bwd_dgelu(dg_cuda_t *c, void *dpre, float *dw, float *dbias, const void *dout,
                                     const void *inp, const void *w, const void *pre, int N, int C, int OC,
                                     int acc) {
    DG_TRY(dg_cuda_matmul_bwd(c, NULL, dw, dbias, dout, inp, w, N, C, OC, 0));
    gemm_call_t g = dinp_call(c, dpre, dout, w, N, C, OC, 0.f);
    fp8_ops_t f8, *f = NULL;
    if (fp8_eligible(c, N, C, OC)) {
        DG_TRY(fp8_prepare(c, &f8, w, 1, dout, N, C, OC));
        f = &f8;
    }
    if (c->fused_epilogues && c->fused_dgelu && c->act != DG_F32 && !acc && C % 8 == 0) {
        gemm_call_t e = g;
        e.epi = CUBLASLT_EPILOGUE_DGELU;
        e.aux = (void *)pre;
        e.aux_ld = C;
        int ran = 0;
        DG_TRY(gemm_try8(c, &e, f, &ran));
        if (ran) return DG_OK;
    }
    if (acc) {
        void *scr = NULL;
        DG_TRY(dg_cuda_scratch(c, (size_t)N * C * dg_dtype_size(c->act), &scr));
        g.D = scr;
    }
    DG_TRY(gemm_must8(c, &g, f, "matmul_bwd_dgelu (input gradient)"));
    return dg_cuda_gelu_bwd(c, dpre, pre, g.D, (size_t)N * C, acc);
}
