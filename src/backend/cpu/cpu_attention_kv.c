/* cpu_attention_kv.c — backend.h's attention_kv_fwd (v1.12) on the CPU backend: a block of new query rows
 * against the key/value cache of one sequence, for the KV-cache decoder (src/model/infer.c).
 *
 * One (head, query row) pair is one task; each is independent, so results do not depend on the thread
 * count. The scores of a row are kept in this worker's scratch (cap floats), every sum runs over the keys
 * in increasing order, and the exponentials use expf: deterministic, and within f32 rounding of
 * attention_fwd for the same rows.
 */
#include <math.h>
#include <string.h>

#include "backend_cpu_impl.h"

typedef struct {
    float *out, *kc, *vc;
    const float *qkv;
    int p0, n, cap, C, NH;
    float *scratch; /* cap floats per worker */
} kv_arg_t;

static void kv_task(void *argp, int task, int worker) {
    const kv_arg_t *a = argp;
    const int C = a->C, hs = C / a->NH, i = task / a->NH, h = task % a->NH, L = a->p0 + i + 1;
    const float scale = 1.0f / sqrtf((float)hs);
    const float *q = a->qkv + (size_t)i * 3 * C + (size_t)h * hs;
    float *s = a->scratch + (size_t)worker * a->cap;
    float mx = -INFINITY;
    for (int j = 0; j < L; j++) {
        const float *k = a->kc + (size_t)j * C + (size_t)h * hs;
        float dot = 0.0f;
        for (int d = 0; d < hs; d++)
            dot += q[d] * k[d];
        s[j] = dot * scale;
        if (s[j] > mx) mx = s[j];
    }
    float sum = 0.0f;
    for (int j = 0; j < L; j++) {
        s[j] = expf(s[j] - mx);
        sum += s[j];
    }
    const float inv = 1.0f / sum;
    float *o = a->out + (size_t)i * C + (size_t)h * hs;
    for (int d = 0; d < hs; d++)
        o[d] = 0.0f;
    for (int j = 0; j < L; j++) {
        const float *v = a->vc + (size_t)j * C + (size_t)h * hs;
        const float w = s[j] * inv;
        for (int d = 0; d < hs; d++)
            o[d] += w * v[d];
    }
}

dg_status_t dg_cpu_attention_kv_fwd(dg_backend_t *be, void *out, void *kcache, void *vcache, const void *qkv,
                                    int p0, int n, int cap, int C, int NH) {
    const char *op = "attention_kv_fwd";
    DG_CPU_NONNULLS(op, out, kcache, vcache, qkv);
    DG_CPU_POSITIVE(op, n);
    DG_CPU_POSITIVE(op, C);
    DG_CPU_POSITIVE(op, NH);
    if (C % NH != 0)
        return DG_ERR(DG_ERR_USAGE, "cpu backend: %s: C=%d is not divisible by NH=%d heads", op, C, NH);
    if (p0 < 0 || cap < 1 || p0 + n > cap)
        return DG_ERR(DG_ERR_USAGE, "cpu backend: %s: positions [%d, %d) do not fit a cache of %d rows", op,
                      p0, p0 + n, cap);
    dg_cpu_t *cpu = dg_cpu_of(be);
    const float *x = qkv;
    float *kc = kcache, *vc = vcache;
    for (int i = 0; i < n; i++) {
        memcpy(kc + (size_t)(p0 + i) * C, x + (size_t)i * 3 * C + C, (size_t)C * sizeof(float));
        memcpy(vc + (size_t)(p0 + i) * C, x + (size_t)i * 3 * C + 2 * (size_t)C, (size_t)C * sizeof(float));
    }
    float *scratch = dg_cpu_scratch(cpu, (size_t)cpu->nt * (size_t)cap * sizeof(float));
    if (!scratch) return dg_last_error_code();
    kv_arg_t a = {out, kc, vc, x, p0, n, cap, C, NH, scratch};
    dg_cpu_run(cpu, n * NH, kv_task, &a);
    return DG_OK;
}
