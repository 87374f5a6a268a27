/* data.c — the trainer's data (train_impl.h): the training and validation sets and their loaders, the
 * checks that one step (and one validation batch) fits the data, reading a step's micro-batches ahead of
 * the collectives that use them, the agreement on such a read, and the validation pass. */
#include <stdlib.h>
#include <string.h>

#include "train_impl.h"

/* The globs of the training and validation shards ("" val: none). */
dg_status_t trn_data_globs(const dg_config_t *c, char *train_glob, char *val_glob, size_t cap) {
    snprintf(train_glob, cap, "%s", c->data.train);
    snprintf(val_glob, cap, "%s", c->data.val);
    if (!c->data.train[0]) {
        char dir[DG_CFG_STR + 16];
        snprintf(dir, sizeof dir, "%s/data", c->run.dir);
        /* every rank may call it: the builder serialises on a lock file and renames atomically */
        DG_TRY(dg_data_default_paths(dir, train_glob, val_glob, cap));
        /* keep the embedded val split only when no val glob was given */
        if (c->data.val[0]) snprintf(val_glob, cap, "%s", c->data.val);
    }
    return DG_OK;
}

typedef struct {
    const char *set, *key, *glob; /* "training", "data.train", its value ("" = the embedded default) */
    const char *effect, *remedy;  /* what one batch would do; the ways out after the global_batch bound */
} data_set_t;

/* The usage error for a data set of n samples, fewer than one global batch. */
static dg_status_t data_too_small(const data_set_t *d, int64_t global_batch, int seq_len, int64_t n) {
    return DG_ERR(DG_ERR_USAGE,
                  "train.global_batch = %lld is larger than the %s data: %s (%s) yields %lld samples of "
                  "seq_len+1 = %d tokens, so %s; use train.global_batch <= %lld, %s",
                  (long long)global_batch, d->set, d->key, d->glob[0] ? d->glob : "the embedded default data",
                  (long long)n, seq_len + 1, d->effect, (long long)n, d->remedy);
}

/* One step reads global_batch consecutive positions of the sample order; more than the data set holds
 * would read samples twice within a step (train.global_batch = 1e9 on the default data planned a
 * 192-day step). Validation must fit one batch; val_batches batches are cut to what the set holds, so
 * an evaluation never counts a sample twice. n_val < 0: no validation. */
dg_status_t trn_check_data_fits(const dg_config_t *c, int64_t global_batch, int seq_len, int64_t n_train,
                                int64_t n_val, int64_t *val_batches) {
    if (global_batch > n_train) {
        char effect[96];
        snprintf(effect, sizeof effect, "one step would read every sample %.1f times",
                 (double)global_batch / (double)n_train);
        const data_set_t d = {"training", "data.train", c->data.train, effect,
                              "more data, or a smaller model.seq_len"};
        return data_too_small(&d, global_batch, seq_len, n_train);
    }
    *val_batches = c->data.val_batches;
    if (n_val < 0) return DG_OK;
    if (global_batch > n_val) {
        const data_set_t d = {"validation", "data.val", c->data.val,
                              "one validation batch would count samples twice",
                              "more validation data, or data.val_every = 0"};
        return data_too_small(&d, global_batch, seq_len, n_val);
    }
    if (c->data.val_batches * global_batch > n_val) *val_batches = n_val / global_batch;
    return DG_OK;
}

dg_status_t trn_open_data(trainer_t *tr) {
    const dg_config_t *c = tr->cfg;
    char train_glob[4096], val_glob[4096];
    DG_TRY(trn_data_globs(c, train_glob, val_glob, sizeof train_glob));
    snprintf(tr->train_glob, sizeof tr->train_glob, "%s", train_glob);
    DG_TRY(dg_dataset_open(train_glob, tr->desc.seq_len, tr->desc.vocab_size, &tr->train_ds));
    DG_TRY(dg_loader_create(tr->train_ds, (uint64_t)c->run.seed, c->data.shuffle, &tr->train_ld));
    if (val_glob[0] && c->data.val_every > 0) {
        DG_TRY(dg_dataset_open(val_glob, tr->desc.seq_len, tr->desc.vocab_size, &tr->val_ds));
        DG_TRY(dg_loader_create(tr->val_ds, (uint64_t)c->run.seed, 0, &tr->val_ld));
    }
    DG_TRY(trn_check_data_fits(c, tr->global_batch, tr->desc.seq_len, dg_dataset_n_samples(tr->train_ds),
                               tr->val_ds ? dg_dataset_n_samples(tr->val_ds) : -1, &tr->val_batches));
    if (!val_glob[0] && c->data.val_every > 0) {
        /* data.train without data.val: no held-out data, so say so loudly instead of skipping silently */
        if (tr->rank == 0)
            DG_LOG_WARN(
                "no validation: data.train is set but data.val is empty, so no val_loss is reported; "
                "set data.val to a glob of held-out shards (dgprep writes them) or data.val_every = 0 "
                "to silence this");
        DG_METRICS_EVENT(tr->metrics, "health", DG_JS("kind", "no_validation"),
                         DG_JS("detail", "data.val is empty; set data.val to held-out shards"));
    }
    if (tr->val_batches < c->data.val_batches && tr->rank == 0)
        DG_LOG_WARN(
            "data.val_batches = %lld x train.global_batch = %lld needs %lld validation samples but the "
            "validation data has %lld: each evaluation reads %lld batch%s (every sample at most once)",
            (long long)c->data.val_batches, (long long)tr->global_batch,
            (long long)(c->data.val_batches * tr->global_batch), (long long)dg_dataset_n_samples(tr->val_ds),
            (long long)tr->val_batches, tr->val_batches == 1 ? "" : "es");
    return DG_OK;
}

/* Micro-steps [j0, j0+n) of the current step into tok/tgt ([n][micro_batch][seq_len] each). The data of
 * a step is read before the collectives that use it (dg_loader_fill can fail on one rank only: a shard
 * truncated under the run), and the caller agrees on the result first, so no rank is left waiting in a
 * model collective for one that stopped. */
dg_status_t trn_fill_micro_steps(trainer_t *tr, const dg_loader_t *ld, int j0, int n, int32_t *tok,
                                 int32_t *tgt) {
    size_t per = (size_t)tr->micro_batch * tr->desc.seq_len;
    for (int k = 0; k < n; k++)
        DG_TRY(dg_loader_fill(ld, j0 + k, tr->dp_rank, tr->dp_size, tr->micro_batch, tok + k * per,
                              tgt + k * per));
    return DG_OK;
}

/* How many micro-steps of data are read ahead at once: the whole step, up to 64 MiB of tokens and
 * targets per rank (beyond that, one extra agreement per chunk of micro-steps). */
int trn_data_chunk(const trainer_t *tr) {
    size_t per = (size_t)tr->micro_batch * tr->desc.seq_len * 2 * sizeof(int32_t);
    size_t n = ((size_t)64 << 20) / (per ? per : 1);
    if (n < 1) n = 1;
    return n < (size_t)tr->accum ? (int)n : tr->accum;
}

/* Agreement on a data read that happened outside the step agreement (later chunks, validation): every
 * rank learns whether any rank failed, before any of them enters the model's collectives. */
dg_status_t trn_agree_data(trainer_t *tr, dg_status_t st) {
    int local = st, global = 0;
    if (MPI_Allreduce(&local, &global, 1, MPI_INT, MPI_MAX, tr->comm) != MPI_SUCCESS)
        return DG_ERR(DG_ERR_PEER, "data agreement all-reduce failed at step %lld", (long long)tr->step);
    if (st) return st;
    if (global)
        return DG_ERR(DG_ERR_PEER, "another rank failed reading its data at step %lld (see its log)",
                      (long long)tr->step);
    return DG_OK;
}

/* Mean validation loss over val_batches global batches (the same samples at any world size). */
dg_status_t trn_run_validation(trainer_t *tr, double *loss_out) {
    dg_health_set_activity(tr->health, tr->step, "validation");
    dg_loader_reset(tr->val_ld);
    size_t per = (size_t)tr->micro_batch * tr->desc.seq_len;
    int chunk = trn_data_chunk(tr);
    int32_t *tok = dg_xmalloc((size_t)chunk * per * sizeof(int32_t));
    int32_t *tgt = dg_xmalloc((size_t)chunk * per * sizeof(int32_t));
    double sum = 0;
    int count = 0;
    dg_status_t s = DG_OK;
    for (int64_t b = 0; b < tr->val_batches && s == DG_OK; b++) {
        for (int j = 0; j < tr->accum && s == DG_OK; j++) {
            if (j % chunk == 0) { /* read, and agree on the read, before the forward's collectives */
                int n = tr->accum - j < chunk ? tr->accum - j : chunk;
                s = trn_agree_data(tr, trn_fill_micro_steps(tr, tr->val_ld, j, n, tok, tgt));
                if (s) break;
            }
            float l = 0;
            size_t at = (size_t)(j % chunk) * per;
            s = tr->pp ? trn_pp_forward(tr, tok + at, tgt + at, &l)
                       : dg_model_forward(tr->model, tok + at, tgt + at, &l);
            sum += l;
            count += trn_has_loss(tr); /* a pipeline's loss is its last stage's */
        }
        dg_loader_advance(tr->val_ld, tr->global_batch);
    }
    free(tok);
    free(tgt);
    if (s) return s;
    double local[2] = {sum, (double)count}, global[2];
    DG_MPI_CHECK(MPI_Allreduce(local, global, 2, MPI_DOUBLE, MPI_SUM, tr->comm));
    *loss_out = global[0] / global[1];
    return DG_OK;
}
