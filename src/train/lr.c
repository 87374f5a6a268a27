/* lr.c — the learning-rate schedule: linear warmup, then cosine decay to min_ratio * base_lr at the
 * last step (formula in train_util.h and docs/data.md). A pure function of the step, so a resumed run
 * continues the schedule exactly. */
#include "train_util.h"

#include <math.h>

double dg_lr_at(int64_t step, int64_t steps, double base_lr, int64_t warmup, double min_ratio) {
    DG_ASSERTF(step >= 0 && steps >= 1 && warmup >= 0, "step %lld of %lld, warmup %lld", (long long)step,
               (long long)steps, (long long)warmup);
    double min_lr = min_ratio * base_lr;
    if (step < warmup) return base_lr * (double)(step + 1) / (double)warmup;
    if (step >= steps) return min_lr;
    int64_t span = steps - 1 - warmup;
    double p = (double)(step - warmup) / (double)(span > 1 ? span : 1);
    if (p > 1) p = 1;
    return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + cos(M_PI * p));
}
