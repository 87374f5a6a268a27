/* loader.c — the sample order and the rank split. The order of epoch e is a keyed pseudo-random
 * permutation evaluated per position (a Feistel network on the next even power of two with
 * cycle-walking), so any position of any epoch is found in O(1) time and memory: resuming mid-epoch,
 * at another world size, on a billion-sample data set, costs nothing and needs no stored table.
 * Everything is integer arithmetic, so the order is identical on every machine. */
#include "data.h"
#include "data_impl.h"

#include <stdlib.h>

struct dg_loader {
    const dg_dataset_t *ds;
    uint64_t seed;
    int shuffle;
    int64_t n; /* samples per epoch */
    dg_loader_state_t st;
};

/* splitmix64's finaliser: a strong 64-bit mixer, used both to derive round keys and as the round
 * function. */
static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

enum { FEISTEL_ROUNDS = 6 };

int64_t dg_data_permute(int64_t index, int64_t n, uint64_t seed, int64_t epoch) {
    DG_ASSERTF(n >= 1 && index >= 0 && index < n, "index %lld of %lld", (long long)index, (long long)n);
    if (n == 1) return 0;
    int bits = 64 - __builtin_clzll((unsigned long long)(n - 1)); /* bits to write n-1 */
    bits += bits & 1;                                             /* balanced halves */
    int half = bits / 2;
    uint64_t mask = (1ULL << half) - 1;
    uint64_t keys[FEISTEL_ROUNDS];
    uint64_t k = mix64(seed ^ 0x6a09e667f3bcc909ULL) ^ mix64((uint64_t)epoch + 0x9e3779b97f4a7c15ULL);
    for (int r = 0; r < FEISTEL_ROUNDS; r++) {
        k = mix64(k + 0x9e3779b97f4a7c15ULL);
        keys[r] = k;
    }
    /* The network permutes [0, 2^bits); walking the cycle until we land back inside [0, n) restricts
     * it to a permutation of [0, n). The domain is < 4n, so on average fewer than 4 passes. */
    uint64_t x = (uint64_t)index;
    do {
        uint64_t L = x >> half, R = x & mask;
        for (int r = 0; r < FEISTEL_ROUNDS; r++) {
            uint64_t nl = R;
            R = L ^ (mix64(R ^ keys[r]) & mask);
            L = nl;
        }
        x = (L << half) | R;
    } while (x >= (uint64_t)n);
    return (int64_t)x;
}

dg_status_t dg_loader_create(const dg_dataset_t *ds, uint64_t seed, int shuffle, dg_loader_t **out) {
    *out = NULL;
    if (!ds) return DG_ERR(DG_ERR_USAGE, "data loader: no data set");
    dg_loader_t *ld = dg_xcalloc(1, sizeof *ld);
    ld->ds = ds;
    ld->seed = seed;
    ld->shuffle = shuffle != 0;
    ld->n = dg_dataset_n_samples(ds);
    DG_ASSERT(ld->n >= 1); /* dg_dataset_open refuses empty data sets */
    *out = ld;
    return DG_OK;
}

void dg_loader_free(dg_loader_t *ld) {
    free(ld);
}

void dg_loader_get_state(const dg_loader_t *ld, dg_loader_state_t *st) {
    *st = ld->st;
}

dg_status_t dg_loader_set_state(dg_loader_t *ld, const dg_loader_state_t *st) {
    if (st->epoch < 0)
        return DG_ERR(DG_ERR_USAGE, "data loader state: negative epoch %lld", (long long)st->epoch);
    if (st->cursor < 0 || st->cursor >= ld->n)
        return DG_ERR(
            DG_ERR_USAGE,
            "data loader state: cursor %lld outside this data set's %lld samples per epoch (did the "
            "data or model.seq_len change since the checkpoint?)",
            (long long)st->cursor, (long long)ld->n);
    ld->st = *st;
    return DG_OK;
}

void dg_loader_reset(dg_loader_t *ld) {
    ld->st = (dg_loader_state_t){0, 0, 0};
}

int64_t dg_loader_sample_at(const dg_loader_t *ld, int64_t offset, int64_t *epoch_out) {
    DG_ASSERT(offset >= 0);
    int64_t p = ld->st.cursor + offset;
    int64_t epoch = ld->st.epoch + p / ld->n;
    int64_t idx = p % ld->n;
    if (epoch_out) *epoch_out = epoch;
    return ld->shuffle ? dg_data_permute(idx, ld->n, ld->seed, epoch) : idx;
}

dg_status_t dg_loader_fill(const dg_loader_t *ld, int micro_step, int dp_rank, int dp_size, int micro_batch,
                           int32_t *tokens, int32_t *targets) {
    if (micro_step < 0 || dp_size < 1 || dp_rank < 0 || dp_rank >= dp_size || micro_batch < 1)
        return DG_ERR(DG_ERR_USAGE,
                      "data loader: bad batch slot (micro_step %d, dp_rank %d, dp_size %d, micro_batch %d)",
                      micro_step, dp_rank, dp_size, micro_batch);
    int T = dg_dataset_seq_len(ld->ds);
    int64_t first = ((int64_t)micro_step * dp_size + dp_rank) * micro_batch;
    /* each shard read from is re-checked (size, header) once per micro-batch, after its reads */
    enum { MAX_TRACKED = 64 };
    int touched[MAX_TRACKED], n_touched = 0;
    for (int i = 0; i < micro_batch; i++) {
        int64_t id = dg_loader_sample_at(ld, first + i, NULL);
        int shard = 0;
        DG_TRY(dg_dataset__read_sample(ld->ds, id, tokens ? tokens + (size_t)i * T : NULL,
                                       targets ? targets + (size_t)i * T : NULL, &shard));
        int seen = 0;
        for (int k = 0; k < n_touched && !seen; k++)
            seen = touched[k] == shard;
        if (seen) continue;
        if (n_touched == MAX_TRACKED) {
            for (int k = 0; k < n_touched; k++)
                DG_TRY(dg_dataset__check_shard(ld->ds, touched[k]));
            n_touched = 0;
        }
        touched[n_touched++] = shard;
    }
    for (int k = 0; k < n_touched; k++)
        DG_TRY(dg_dataset__check_shard(ld->ds, touched[k]));
    return DG_OK;
}

void dg_loader_advance(dg_loader_t *ld, int64_t global_batch) {
    DG_ASSERT(global_batch >= 0);
    int64_t p = ld->st.cursor + global_batch;
    ld->st.epoch += p / ld->n;
    ld->st.cursor = p % ld->n;
    ld->st.samples_seen += (uint64_t)global_batch;
}
