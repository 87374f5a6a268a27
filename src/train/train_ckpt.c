/* train_ckpt.c — the trainer's checkpoints: the tensors this rank contributes, staging of the model state,
 * the loss-spike and scaler state in the metadata, saving (synchronous or through the asynchronous
 * writer, with the storage-failure policy), resume at start, and the loss-spike rollback.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dg_env.h"
#include "dg_hf.h"
#include "train_impl.h"

/* The checkpoint's view of this rank's state: every parameter and both AdamW moments are global
 * datasets; this rank contributes the hyperslab pieces of its local shard (FSDP rows, tp segments), and
 * exactly one rank writes each piece (replicas over dp_replicate and tp-replicated tensors are read by
 * all but written once). A rank with no piece of a tensor lists an empty one, so every rank names the
 * tensors in the same order. Any mesh can load what any other wrote. */
dg_status_t trn_build_ckpt_tensors(trainer_t *tr) {
    int n = tr->n_params;
    tr->ckpt_t = dg_xcalloc((size_t)n * 3 * DG_MODEL_MAX_PIECES, sizeof(dg_ckpt_tensor_t));
    tr->ckpt_off = dg_xcalloc((size_t)n * 3 * DG_MODEL_MAX_PIECES, sizeof(size_t));
    tr->ckpt_paths = dg_xcalloc((size_t)n * 3, sizeof(char *));
    tr->n_ckpt = 0;
    for (int i = 0; i < n; i++) {
        const dg_param_info_t *p = trn_param(tr, i);
        dg_model_piece_t pc[DG_MODEL_MAX_PIECES];
        int np = trn_param_pieces(tr, i, pc);
        int owner = trn_param_owner(tr, i);
        for (int w = 0; w < 3; w++) {
            int k = i * 3 + w;
            size_t local = trn_param_flat_offset(tr, i); /* this rank's piece in host_flat[w] */
            char path[512];
            if (w == 0)
                snprintf(path, sizeof path, "model/%s", p->name);
            else
                snprintf(path, sizeof path, "optim/%s/%s", p->name, w == 1 ? "m" : "v");
            tr->ckpt_paths[k] = dg_xstrdup(path);
            for (int j = 0; j < (np ? np : 1); j++) {
                dg_ckpt_tensor_t *t = &tr->ckpt_t[tr->n_ckpt++];
                t->path = tr->ckpt_paths[k];
                t->ndim = p->ndim;
                for (int d = 0; d < p->ndim; d++) {
                    t->gshape[d] = p->shape[d];
                    t->start[d] = np ? pc[j].start[d] : 0;
                    t->count[d] = np ? pc[j].count[d] : 0;
                }
                t->owner = owner && np > 0;
                /* t->data points into host_flat[w] once it exists (trn_host_state) */
                tr->ckpt_off[tr->n_ckpt - 1] = (size_t)w << 60 | (local + (np ? pc[j].offset : 0));
            }
        }
    }
    return DG_OK;
}

/* The three page-locked flat buffers (param, m, v) the checkpoint tensors point into, made on first use:
 * the first save, a resume that reads a file, a rollback. Pinning 3 x 4 bytes per parameter takes about
 * a second at 124M parameters (cudaHostAlloc), time a run that never saves need not wait for before its
 * first step. Zeroed: alignment gaps stay zero on a resume, and the pages exist. */
dg_status_t trn_host_state(trainer_t *tr) {
    if (tr->host_flat[0]) return DG_OK;
    size_t flat = trn_flat_numel(tr);
    for (int w = 0; w < 3; w++) {
        dg_status_t s =
            tr->be->ops->host_alloc(tr->be, (flat + 1) * sizeof(float), (void **)&tr->host_flat[w]);
        if (s != DG_OK) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", dg_last_error());
            for (int k = 0; k < w; k++) {
                tr->be->ops->host_free(tr->be, tr->host_flat[k]);
                tr->host_flat[k] = NULL;
            }
            tr->host_flat[w] = NULL;
            return DG_ERR(s, "page-locked host copy of the model state for checkpoints: %s", msg);
        }
        memset(tr->host_flat[w], 0, (flat + 1) * sizeof(float));
    }
    const size_t mask = ((size_t)1 << 60) - 1;
    for (int k = 0; k < tr->n_ckpt; k++)
        tr->ckpt_t[k].data = tr->host_flat[tr->ckpt_off[k] >> 60] + (tr->ckpt_off[k] & mask);
    return DG_OK;
}

/* 1 when checkpoint.resume may read a file: an explicit path, or auto with anything in the directory. */
static int may_read_checkpoint(const trainer_t *tr) {
    const char *mode = tr->cfg->checkpoint.resume;
    if (strcmp(mode, "never") == 0) return 0;
    if (strcmp(mode, "auto") != 0) return 1;
    DIR *d = opendir(tr->ckpt_dir);
    if (!d) return 0;
    int any = 0;
    for (struct dirent *e; !any && (e = readdir(d));)
        any = e->d_name[0] != '.';
    closedir(d);
    return any;
}

static const int k_state_of[3] = {DG_STATE_PARAM, DG_STATE_ADAM_M, DG_STATE_ADAM_V};

/* The whole local state in three copies (one per flat buffer) into page-locked memory. */
static dg_status_t pull_state(trainer_t *tr) {
    DG_TRY(trn_host_state(tr));
    for (int w = 0; w < 3; w++)
        DG_TRY(trn_get_flat(tr, k_state_of[w], tr->host_flat[w]));
    return DG_OK;
}

static dg_status_t push_state(trainer_t *tr) {
    for (int w = 0; w < 3; w++)
        DG_TRY(trn_set_flat(tr, k_state_of[w], tr->host_flat[w]));
    return DG_OK;
}

/* The loss-spike detector's state travels in the checkpoint's key/value table so that a resumed run
 * makes the same skip decisions: "spike_state" = "window n pos consecutive", then the window's float32
 * values as hex words, SPIKE_PER_KV per "spike_window_K" entry. */
#define SPIKE_PER_KV 48
static void save_spike_state(trainer_t *tr, dg_ckpt_meta_t *m) {
    int64_t W = tr->cfg->train.spike_window;
    if (tr->cfg->train.spike_factor <= 0 || W <= 0) return;
    char buf[448];
    snprintf(buf, sizeof buf, "%lld %lld %lld %lld", (long long)W, (long long)tr->stab.win_n,
             (long long)tr->stab.win_pos, (long long)tr->stab.consecutive_spikes);
    if (dg_ckpt_meta_set_kv(m, "spike_state", buf) != DG_OK) return;
    for (int64_t k = 0; k * SPIKE_PER_KV < W; k++) {
        size_t len = 0;
        for (int64_t i = k * SPIKE_PER_KV; i < W && i < (k + 1) * SPIKE_PER_KV; i++) {
            uint32_t u;
            memcpy(&u, &tr->stab.window[i], sizeof u);
            len += (size_t)snprintf(buf + len, sizeof buf - len, "%08x", u);
        }
        char key[32];
        snprintf(key, sizeof key, "spike_window_%lld", (long long)k);
        if (dg_ckpt_meta_set_kv(m, key, buf) != DG_OK) {
            DG_LOG_WARN("checkpoint: loss-spike window too long to store (%s); a resume starts it empty",
                        dg_last_error());
            dg_ckpt_meta_set_kv(m, "spike_state", "");
            return;
        }
    }
}

/* Restores what save_spike_state wrote; a missing or mismatching state leaves the detector empty. */
static void load_spike_state(trainer_t *tr, const dg_ckpt_meta_t *m) {
    int64_t W = tr->cfg->train.spike_window;
    const char *st = dg_ckpt_meta_get_kv(m, "spike_state");
    if (tr->cfg->train.spike_factor <= 0 || W <= 0 || !st || !st[0]) return;
    long long w, n, pos, cons;
    if (sscanf(st, "%lld %lld %lld %lld", &w, &n, &pos, &cons) != 4 || w != W || n < 0 || n > W || pos < 0 ||
        pos >= W) {
        DG_LOG_WARN(
            "checkpoint: loss-spike state '%s' does not fit train.spike_window=%lld; starting it empty", st,
            (long long)W);
        return;
    }
    for (int64_t k = 0; k * SPIKE_PER_KV < W; k++) {
        char key[32];
        snprintf(key, sizeof key, "spike_window_%lld", (long long)k);
        const char *hex = dg_ckpt_meta_get_kv(m, key);
        for (int64_t i = k * SPIKE_PER_KV; i < W && i < (k + 1) * SPIKE_PER_KV; i++) {
            unsigned u = 0;
            size_t at = (size_t)(8 * (i - k * SPIKE_PER_KV));
            if (!hex || strlen(hex) < at + 8 || sscanf(hex + at, "%8x", &u) != 1) {
                DG_LOG_WARN("checkpoint: loss-spike window entry %s is damaged; starting it empty", key);
                tr->stab.win_n = tr->stab.win_pos = tr->stab.consecutive_spikes = 0;
                return;
            }
            uint32_t u32 = u;
            memcpy(&tr->stab.window[i], &u32, sizeof u32);
        }
    }
    tr->stab.win_n = n;
    tr->stab.win_pos = pos;
    tr->stab.consecutive_spikes = cons;
}

static void fill_meta(trainer_t *tr, dg_ckpt_meta_t *m) {
    dg_ckpt_meta_init(m);
    m->step = tr->step;
    m->tokens = tr->tokens;
    snprintf(m->mesh, sizeof m->mesh, "%s", tr->mesh_str);
    char *ini = dg_config_to_ini(tr->cfg);
    dg_ckpt_meta_set_config(m, ini);
    free(ini);
    dg_loader_state_t ls;
    dg_loader_get_state(tr->train_ld, &ls);
    m->loader.epoch = ls.epoch;
    m->loader.cursor = ls.cursor;
    m->loader.samples_seen = ls.samples_seen;
    m->scaler.scale = tr->stab.loss_scale;
    m->scaler.good_steps = tr->stab.good_steps;
    char fp[32];
    snprintf(fp, sizeof fp, "%016llx", (unsigned long long)dg_dataset_fingerprint(tr->train_ds));
    dg_ckpt_meta_set_kv(m, "data_fingerprint", fp);
    char attempt[32];
    snprintf(attempt, sizeof attempt, "%lld", (long long)tr->attempt);
    dg_ckpt_meta_set_kv(m, "run_id", tr->run_id);
    dg_ckpt_meta_set_kv(m, "attempt", attempt);
    char tok[64];
    dg_dataset_tokenizer_str(tr->train_ds, tok, sizeof tok); /* for export and sampling: docs/data.md */
    if (tok[0]) dg_ckpt_meta_set_kv(m, DG_TRAIN_KV_TOKENIZER, tok);
    dg_ckpt_meta_set_kv(m, "backend", tr->backend_name);
    dg_ckpt_meta_set_kv(m, "precision", tr->cfg->train.precision);
    char seg[128];
    snprintf(seg, sizeof seg, "%lld %llu %lld %lld", (long long)tr->seg_step,
             (unsigned long long)tr->seg_samples, (long long)tr->seg_epoch, (long long)tr->seg_cursor);
    dg_ckpt_meta_set_kv(m, DG_TRAIN_KV_SEGMENT, seg);
    save_spike_state(tr, m);
    if (isfinite(tr->stab.last_val)) { /* the spike confirmation's reference, exactly */
        uint64_t u;
        memcpy(&u, &tr->stab.last_val, sizeof u);
        char hex[24];
        snprintf(hex, sizeof hex, "%016llx", (unsigned long long)u);
        dg_ckpt_meta_set_kv(m, "val_last", hex);
    }
}

/* The stability state a checkpoint carries: the fp16 scaler, the spike window, the last validation loss
 * (a missing or damaged "val_last": none). */
static void load_stab_state(trainer_t *tr, const dg_ckpt_meta_t *m) {
    if (trn_is_fp16(tr->cfg)) { /* the loss scaler belongs to fp16 runs: another precision starts without */
        tr->stab.loss_scale = m->scaler.scale > 0 ? m->scaler.scale : tr->cfg->train.loss_scale_init;
        tr->stab.good_steps = m->scaler.good_steps;
    }
    tr->stab.win_n = tr->stab.win_pos = tr->stab.consecutive_spikes = 0;
    load_spike_state(tr, m);
    const char *hex = dg_ckpt_meta_get_kv(m, "val_last");
    unsigned long long u = 0;
    tr->stab.last_val = NAN;
    if (hex && strlen(hex) == 16 && sscanf(hex, "%16llx", &u) == 1) {
        uint64_t u64 = u;
        memcpy(&tr->stab.last_val, &u64, sizeof u64);
    }
    /* the recent-norm and overflow windows start empty, on a resume and a rollback alike */
    tr->stab.cv_n = tr->stab.cv_pos = tr->stab.ov_n = tr->stab.ov_pos = tr->stab.over_run = 0;
}

/* This run segment begins here (the checks of later checkpoints count from it). */
static void begin_segment(trainer_t *tr) {
    dg_loader_state_t ls;
    dg_loader_get_state(tr->train_ld, &ls);
    tr->seg_step = tr->step;
    tr->seg_samples = ls.samples_seen;
    tr->seg_epoch = ls.epoch;
    tr->seg_cursor = ls.cursor;
}

/* The loader and the token count move past n global batches (a rollback's skip; the test hook
 * DG_TEST_RESUME_SKIP_BATCHES does the same after a resume, for the rollback test's reference run). */
static void skip_batches(trainer_t *tr, int64_t n) {
    for (int64_t k = 0; k < n; k++)
        dg_loader_advance(tr->train_ld, tr->global_batch);
    tr->tokens += n * tr->global_batch * tr->desc.seq_len;
}

void trn_ckpt_save_opts(const dg_config_t *cfg, dg_ckpt_save_opts_t *o) {
    dg_ckpt_save_opts_default(o);
    o->keep = (int)cfg->checkpoint.keep;
    o->incremental = cfg->checkpoint.incremental;
    o->threads = (int)cfg->checkpoint.threads;
    o->space_check = cfg->checkpoint.space_check;
}

static void emit_ckpt_event(trainer_t *tr, const dg_ckpt_save_result_t *r, double stall_ms, int async) {
    DG_METRICS_EVENT(tr->metrics, "checkpoint", DG_JI("step", r->step), DG_JS("path", r->path),
                     DG_JI("bytes", r->bytes), DG_JF("seconds", r->seconds), DG_JF("stall_ms", stall_ms),
                     DG_JB("async", async), DG_JI("linked_bytes", r->linked_bytes),
                     DG_JI("threads", r->phases.threads));
    dg_progress_note(tr->progress, "checkpoint step %lld -> %s (%.1f MB, %.2f s, stall %.0f ms)",
                     (long long)r->step, r->path, r->bytes / 1e6, r->seconds, stall_ms);
}

/* A save that failed: counted (checkpoint.max_failures in a row stop the run), logged on every rank,
 * and reported as a `checkpoint` event with ok = false and a `health` event of kind checkpoint_failed
 * that names the space needed when space ran out. LATEST still names the last complete checkpoint. */
static void note_save_failure(trainer_t *tr, int64_t step, const char *err, const dg_ckpt_save_result_t *r,
                              int async) {
    tr->ckpt_failures++;
    snprintf(tr->ckpt_last_error, sizeof tr->ckpt_last_error, "%s", err);
    char latest[256] = "none";
    FILE *f = NULL;
    char lp[sizeof tr->ckpt_dir + 16];
    snprintf(lp, sizeof lp, "%s/LATEST", tr->ckpt_dir);
    if ((f = fopen(lp, "r"))) {
        if (fgets(latest, sizeof latest, f)) latest[strcspn(latest, "\n")] = 0;
        fclose(f);
    }
    const int64_t max = tr->cfg->checkpoint.max_failures;
    /* every rank knows it (its log file says so); rank 0 says it on stderr */
    const dg_log_level_t lv = tr->rank == 0 ? DG_LOG_WARN : DG_LOG_INFO;
    if (r && r->no_space && r->free_bytes < 0)
        dg_log(lv,
               "checkpoint of step %lld not saved: %s ran out of space (%s); it needs about %.1f MB free; "
               "LATEST still names %s; training goes on and the next checkpoint retries (%lld of "
               "checkpoint.max_failures=%lld failed saves in a row)",
               (long long)step, tr->ckpt_dir, err, r->needed_bytes / 1e6, latest,
               (long long)tr->ckpt_failures, (long long)max);
    else if (r && r->no_space)
        dg_log(
            lv,
            "checkpoint of step %lld not saved: %s needs about %.1f MB free, it has %.1f MB; free at least "
            "%.1f MB (or lower checkpoint.keep); LATEST still names %s; training goes on and the next "
            "checkpoint retries (%lld of checkpoint.max_failures=%lld failed saves in a row)",
            (long long)step, tr->ckpt_dir, r->needed_bytes / 1e6, r->free_bytes / 1e6,
            (r->needed_bytes - r->free_bytes) / 1e6, latest, (long long)tr->ckpt_failures, (long long)max);
    else
        dg_log(lv,
               "checkpoint of step %lld not saved (%s); LATEST still names %s; training goes on and the next "
               "checkpoint retries (%lld of checkpoint.max_failures=%lld failed saves in a row)",
               (long long)step, err, latest, (long long)tr->ckpt_failures, (long long)max);
    DG_METRICS_EVENT(tr->metrics, "checkpoint", DG_JI("step", step), DG_JB("ok", 0), DG_JS("error", err),
                     DG_JB("async", async));
    DG_METRICS_EVENT(tr->metrics, "health", DG_JS("kind", "checkpoint_failed"), DG_JI("step", step),
                     DG_JS("reason", r && r->no_space ? "no_space" : "error"), DG_JS("error", err),
                     DG_JI("needed_bytes", r ? r->needed_bytes : 0),
                     DG_JI("free_bytes", r ? r->free_bytes : -1), DG_JS("latest", latest),
                     DG_JI("consecutive", tr->ckpt_failures), DG_JI("max_failures", max));
}

void trn_report_async(trainer_t *tr, const dg_ckpt_async_result_t *ar) {
    if (!ar->valid) return;
    if (ar->status == DG_OK) {
        tr->ckpt_failures = 0;
        emit_ckpt_event(tr, &ar->res, ar->res.stall_ms, 1);
    } else {
        note_save_failure(tr, ar->res.step, ar->error, &ar->res, 1);
    }
}

/* checkpoint.max_failures saves in a row failed: stop (exit 4; slurm/train.sh does not requeue it). */
static dg_status_t storage_exhausted(trainer_t *tr) {
    return DG_ERR(
        DG_ERR_STORAGE,
        "checkpoints could not be saved %lld times in a row (checkpoint.max_failures=%lld) in %s; the "
        "last failure: %s; stopping with exit code 4 (the newest complete checkpoint, which LATEST "
        "names, is kept: free space there, then run again to resume)",
        (long long)tr->ckpt_failures, (long long)tr->cfg->checkpoint.max_failures, tr->ckpt_dir,
        tr->ckpt_last_error);
}

uint64_t trn_ckpt_progress_source(void *ctx, int *waiting) {
    (void)ctx;
    *waiting = dg_ckpt_waiting();
    return dg_ckpt_progress();
}

void trn_ckpt_abort_hook(void *ctx) {
    (void)ctx;
    dg_ckpt_abort_cleanup();
}

/* Save the current state. sync_only forces a synchronous write (signals, the end of the run), whose
 * failure is returned as DG_ERR_STORAGE (the run cannot end with the checkpoint it promises). A periodic
 * save that fails is noted (note_save_failure) and training goes on: DG_OK, unless that was the
 * checkpoint.max_failures-th failure in a row (DG_ERR_STORAGE). A failure that ends the job anyway (a
 * peer lost in a collective: DG_ERR_PEER) is returned as is.
 * The watchdog judges the save by its progress (dg_health_set_io_activity, docs/checkpoints.md): a save
 * that keeps writing may take as long as it needs. */
dg_status_t trn_save_checkpoint(trainer_t *tr, int sync_only) {
    dg_health_set_io_activity(tr->health, tr->step, "checkpoint");
    double t0 = dg_now_s();
    /* the background write of the previous checkpoint reads host_flat: it must finish before the pull
     * (its failure is counted like a synchronous one) */
    if (tr->writer) {
        dg_ckpt_async_result_t prev = {0};
        dg_ckpt_writer_wait(tr->writer, &prev);
        trn_report_async(tr, &prev);
        if (prev.valid && prev.status == DG_ERR_PEER) return DG_ERR(DG_ERR_PEER, "%s", prev.error);
    }
    if (!sync_only && tr->ckpt_failures >= tr->cfg->checkpoint.max_failures) return storage_exhausted(tr);
    DG_TRY(pull_state(tr));
    dg_ckpt_meta_t meta;
    fill_meta(tr, &meta);
    dg_status_t s = DG_OK;
    if (tr->writer && !sync_only) {
        /* no second copy: the writer reads the page-locked host_flat, which nothing touches until the
         * next save (which waits above), a rollback (waits first) or the end (waits) */
        double stall = 0;
        s = dg_ckpt_writer_submit_borrowed(tr->writer, &meta, tr->ckpt_t, tr->n_ckpt, t0, &stall, NULL);
        dg_ckpt_meta_destroy(&meta);
        return s;
    }
    dg_ckpt_save_opts_t o;
    trn_ckpt_save_opts(tr->cfg, &o);
    dg_ckpt_save_result_t r;
    s = dg_ckpt_save(tr->comm, tr->ckpt_dir, &meta, tr->ckpt_t, tr->n_ckpt, &o, &r);
    dg_ckpt_meta_destroy(&meta);
    if (s == DG_OK) {
        tr->ckpt_failures = 0;
        emit_ckpt_event(tr, &r, (dg_now_s() - t0) * 1e3, 0);
        return DG_OK;
    }
    if (s == DG_ERR_PEER) return s;
    char err[1024];
    snprintf(err, sizeof err, "%s", dg_last_error()); /* copied: the next DG_ERR writes into that buffer */
    note_save_failure(tr, tr->step, err, &r, 0);
    if (sync_only)
        return DG_ERR(
            DG_ERR_STORAGE,
            "the checkpoint of step %lld could not be saved: %s; stopping with exit code 4 (the newest "
            "complete checkpoint, which LATEST names, is kept)",
            (long long)tr->step, err);
    if (tr->ckpt_failures >= tr->cfg->checkpoint.max_failures) return storage_exhausted(tr);
    return DG_OK;
}

/* Resume per checkpoint.resume. Collective; sets step/tokens/loader/scaler and the model state. Every
 * candidate's scalar state is checked against this run's model and data and against the schedule it was
 * written under (ckpt_state.h) before its tensors are read: an impossible value rejects the file like a
 * checksum failure does (auto: fall back to the previous checkpoint; an explicit file: exit 1). With
 * nothing to resume from, model.init (dg_hf.h) sets the weights of the fresh run; a resume wins over it. */
dg_status_t trn_maybe_resume(trainer_t *tr) {
    dg_health_set_io_activity(tr->health, tr->step, "resume: reading checkpoint");
    dg_ckpt_meta_t meta;
    dg_ckpt_meta_init(&meta);
    char path[4096] = "";
    dg_train_ckpt_ref_t ref = {tr->desc.seq_len, tr->train_ds, tr->train_glob};
    /* a failed pinned allocation on one rank is agreed by the caller (dg_boot_agree) */
    if (may_read_checkpoint(tr)) DG_TRY(trn_host_state(tr));
    dg_status_t s =
        dg_ckpt_resume_checked(tr->comm, tr->ckpt_dir, tr->cfg->checkpoint.resume, dg_train_ckpt_check_fn,
                               &ref, &meta, tr->ckpt_t, tr->n_ckpt, path, sizeof path);
    if (s != DG_OK || !path[0]) {
        dg_ckpt_meta_destroy(&meta);
        return s == DG_OK ? trn_init_weights(tr, tr->cfg->model.init) : s; /* a fresh run */
    }
    if (tr->cfg->model.init[0]) DG_LOG_INFO("init: resuming from %s; model.init ignored", path);
    const char *fp = dg_ckpt_meta_get_kv(&meta, "data_fingerprint");
    char now_fp[32];
    snprintf(now_fp, sizeof now_fp, "%016llx", (unsigned long long)dg_dataset_fingerprint(tr->train_ds));
    if (fp && strcmp(fp, now_fp) != 0)
        DG_LOG_WARN(
            "resuming from %s: the training data changed since it was written (fingerprint %s, now %s); "
            "the sample order continues from the saved cursor",
            path, fp, now_fp);
    s = push_state(tr);
    if (s == DG_OK) {
        tr->step = meta.step;
        tr->tokens = meta.tokens;
        dg_loader_state_t ls = {meta.loader.epoch, meta.loader.cursor, meta.loader.samples_seen};
        s = dg_loader_set_state(tr->train_ld, &ls);
        if (s != DG_OK) {
            /* (checked above; kept for a loader with rules of its own) copied first: DG_ERR writes into
             * the buffer dg_last_error() returns */
            char why[1024];
            snprintf(why, sizeof why, "%s", dg_last_error());
            s = DG_ERR(DG_ERR_USAGE, "checkpoint %s: data-loader state does not fit the data set: %s", path,
                       why);
        }
        load_stab_state(tr, &meta);
        int64_t skip = dg_env_int("DG_TEST_RESUME_SKIP_BATCHES");
        if (s == DG_OK && skip > 0) {
            DG_LOG_WARN("test hook DG_TEST_RESUME_SKIP_BATCHES=%lld: the loader skips %lld global batches",
                        (long long)skip, (long long)skip);
            skip_batches(tr, skip);
        }
        begin_segment(tr);
    }
    if (s == DG_OK) {
        const char *att = dg_ckpt_meta_get_kv(&meta, "attempt");
        s = trn_adopt_run_identity(tr, dg_ckpt_meta_get_kv(&meta, "run_id"), att ? atoll(att) : 0);
        dg_metrics_set_step(tr->metrics, tr->step);
        dg_log_set_step(tr->step);
    }
    if (s == DG_OK) {
        DG_METRICS_EVENT(tr->metrics, "resume", DG_JI("step", tr->step), DG_JS("path", path),
                         DG_JI("from_world_size", meta.world_size), DG_JI("to_world_size", tr->world),
                         DG_JS("from_mesh", meta.mesh), DG_JS("to_mesh", tr->mesh_str),
                         DG_JI("tokens", tr->tokens));
        DG_LOG_INFO("resumed from %s at step %lld (written by %d ranks, now %d)", path, (long long)tr->step,
                    meta.world_size, tr->world);
    }
    dg_ckpt_meta_destroy(&meta);
    return s;
}

/* Rolls back to the newest checkpoint (the newest saved before the spike: none is written during a
 * confirmed spike's pause): weights, AdamW moments, step (so the LR schedule and AdamW's step count),
 * fp16 scaler, spike window and last validation loss are the checkpoint's; the data loader is not moved
 * back, so training continues with the data after the window that spiked: the batches from the
 * checkpoint through the pause are skipped (tokens counts them, as consumed). The candidates are checked
 * as on a resume. */
dg_status_t trn_rollback(trainer_t *tr) {
    dg_health_set_io_activity(tr->health, tr->step, "rollback: reading checkpoint");
    if (tr->writer) {
        dg_ckpt_async_result_t prev = {0};
        dg_ckpt_writer_wait(tr->writer, &prev);
        trn_report_async(tr, &prev);
    }
    dg_ckpt_meta_t meta;
    dg_ckpt_meta_init(&meta);
    char path[4096] = "";
    dg_train_ckpt_ref_t ref = {tr->desc.seq_len, tr->train_ds, tr->train_glob};
    DG_TRY(trn_host_state(tr));
    DG_TRY(dg_ckpt_resume_checked(tr->comm, tr->ckpt_dir, "auto", dg_train_ckpt_check_fn, &ref, &meta,
                                  tr->ckpt_t, tr->n_ckpt, path, sizeof path));
    if (!path[0]) {
        dg_ckpt_meta_destroy(&meta);
        return DG_ERR(DG_ERR_RUNTIME,
                      "loss spike at step %lld: no checkpoint to roll back to (set checkpoint.every)",
                      (long long)tr->stab.spike_step);
    }
    DG_TRY(push_state(tr));
    int64_t from = tr->step, skipped = tr->step - meta.step;
    tr->step = meta.step;
    load_stab_state(tr, &meta);
    begin_segment(tr);
    dg_loader_state_t ls;
    dg_loader_get_state(tr->train_ld, &ls);
    DG_METRICS_EVENT(tr->metrics, "health", DG_JS("kind", "rollback"), DG_JI("step", from),
                     DG_JI("spike_step", tr->stab.spike_step), DG_JS("path", path),
                     DG_JI("to_step", meta.step), DG_JI("skipped_batches", skipped),
                     DG_JI("loader_epoch", ls.epoch), DG_JI("loader_cursor", ls.cursor),
                     DG_JI("tokens", tr->tokens));
    DG_LOG_WARN(
        "loss spike at step %lld: rolled back to %s (step %lld); the %lld global batches read since are "
        "skipped",
        (long long)tr->stab.spike_step, path, (long long)meta.step, (long long)skipped);
    dg_ckpt_meta_destroy(&meta);
    return DG_OK;
}
