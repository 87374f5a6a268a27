/* observe.c — who a run is and what it looks like from outside: the run identity every metrics and log
 * line carries (run id, attempt, Slurm job id, step) and the Prometheus textfile RUN_DIR/metrics.prom
 * (docs/design.md §1 "Run identity", README "Monitoring").
 *
 * The run id is made at a run's first start (16 hex digits from getrandom) and kept in RUN_DIR/run.json
 * ({"run_id", "attempt", "slurm_job_id", "time"}, rewritten atomically at every start) and in every
 * checkpoint (keys run_id and attempt), so a requeue or a resume in the same run directory is the same
 * run, one attempt further; a checkpoint resumed into a new run directory brings its run id along
 * (trn_adopt_run_identity). */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "dg_json.h"
#include "dg_json_read.h"
#include "train_impl.h"

static void new_run_id(char *out, size_t cap) {
    uint64_t r = 0;
    if (getrandom(&r, sizeof r, 0) != (ssize_t)sizeof r) { /* no entropy source: time and pid */
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        r = (uint64_t)ts.tv_sec * 1000000007ull ^ (uint64_t)ts.tv_nsec * 2654435761ull ^ (uint64_t)getpid();
    }
    snprintf(out, cap, "%016" PRIx64, r);
}

/* RUN_DIR/run.json of an earlier start: 1 and its fields when present and well formed, else 0. */
static int read_run_json(const char *path, char *run_id, size_t cap, int64_t *attempt) {
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char line[1024];
    int ok = fgets(line, sizeof line, f) != NULL;
    fclose(f);
    dg_jl_obj o;
    if (!ok || dg_jl_parse(line, &o) != 0) return 0;
    const dg_jl_field *id = dg_jl_get(&o, "run_id"), *at = dg_jl_get(&o, "attempt");
    if (!id || !id->is_str || !id->str[0] || !at || at->is_str || !(at->num >= 1)) return 0;
    if (strlen(id->str) >= cap) return 0;
    memcpy(run_id, id->str, strlen(id->str) + 1);
    *attempt = (int64_t)at->num;
    return 1;
}

static dg_status_t write_run_json(const trainer_t *tr) {
    char path[DG_CFG_STR + 16], text[512];
    snprintf(path, sizeof path, "%s/run.json", tr->cfg->run.dir);
    char *id = dg_json_quote_dup(tr->run_id), *job = dg_json_quote_dup(tr->slurm_job);
    int n =
        snprintf(text, sizeof text, "{\"run_id\":%s,\"attempt\":%lld,\"slurm_job_id\":%s,\"time\":%lld}\n",
                 id, (long long)tr->attempt, job, (long long)time(NULL));
    free(id);
    free(job);
    return dg_write_file_atomic(path, text, (size_t)n);
}

/* Every rank gets rank 0's identity; then the metrics and log lines carry it. */
static dg_status_t share_identity(trainer_t *tr) {
    char buf[sizeof tr->run_id + 24];
    memcpy(buf, tr->run_id, sizeof tr->run_id);
    memcpy(buf + sizeof tr->run_id, &tr->attempt, sizeof tr->attempt);
    if (MPI_Bcast(buf, (int)sizeof buf, MPI_BYTE, 0, tr->comm) != MPI_SUCCESS)
        return DG_ERR(DG_ERR_PEER, "run identity broadcast failed");
    memcpy(tr->run_id, buf, sizeof tr->run_id);
    memcpy(&tr->attempt, buf + sizeof tr->run_id, sizeof tr->attempt);
    dg_metrics_set_context(tr->metrics, tr->run_id, tr->attempt, tr->slurm_job);
    char ctx[160];
    if (tr->slurm_job[0])
        snprintf(ctx, sizeof ctx, "run %s attempt %lld job %s", tr->run_id, (long long)tr->attempt,
                 tr->slurm_job);
    else
        snprintf(ctx, sizeof ctx, "run %s attempt %lld", tr->run_id, (long long)tr->attempt);
    dg_log_set_context(ctx);
    return DG_OK;
}

dg_status_t trn_run_identity(trainer_t *tr) {
    const char *job = getenv("SLURM_JOB_ID");
    snprintf(tr->slurm_job, sizeof tr->slurm_job, "%s", job ? job : "");
    dg_status_t s = DG_OK;
    if (tr->rank == 0) {
        char path[DG_CFG_STR + 16];
        snprintf(path, sizeof path, "%s/run.json", tr->cfg->run.dir);
        int64_t prev = 0;
        tr->run_dir_known = read_run_json(path, tr->run_id, sizeof tr->run_id, &prev);
        if (!tr->run_dir_known) new_run_id(tr->run_id, sizeof tr->run_id);
        tr->attempt = prev + 1;
        s = write_run_json(tr);
    }
    int known = tr->run_dir_known;
    MPI_Bcast(&known, 1, MPI_INT, 0, tr->comm);
    tr->run_dir_known = known;
    dg_status_t t = share_identity(tr);
    return s ? s : t;
}

dg_status_t trn_adopt_run_identity(trainer_t *tr, const char *ckpt_run_id, int64_t ckpt_attempt) {
    if (tr->run_dir_known || !ckpt_run_id || !*ckpt_run_id || strcmp(ckpt_run_id, tr->run_id) == 0)
        return DG_OK;
    snprintf(tr->run_id, sizeof tr->run_id, "%s", ckpt_run_id);
    tr->attempt = (ckpt_attempt > 0 ? ckpt_attempt : 0) + 1;
    tr->run_dir_known = 1;
    DG_LOG_INFO("resumed run %s: this is its attempt %lld", tr->run_id, (long long)tr->attempt);
    dg_status_t s = tr->rank == 0 ? write_run_json(tr) : DG_OK;
    dg_status_t t = share_identity(tr);
    return s ? s : t;
}

/* ---------------- metrics.prom ---------------- */

static void prom_escape(char *out, size_t cap, const char *s) {
    size_t k = 0;
    for (; *s && k + 3 < cap; s++) {
        if (*s == '\\' || *s == '"')
            out[k++] = '\\', out[k++] = *s;
        else if (*s == '\n')
            out[k++] = '\\', out[k++] = 'n';
        else
            out[k++] = *s;
    }
    out[k] = 0;
}

static void prom_put(dg_strbuf_t *b, const char *name, const char *type, const char *help, const char *labels,
                     double v) {
    char line[1024];
    int n = snprintf(line, sizeof line, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
    dg_strbuf_append(b, line, (size_t)n);
    if (isnan(v))
        n = snprintf(line, sizeof line, "%s{%s} NaN\n", name, labels);
    else if (isinf(v))
        n = snprintf(line, sizeof line, "%s{%s} %s\n", name, labels, v > 0 ? "+Inf" : "-Inf");
    else
        n = snprintf(line, sizeof line, "%s{%s} %.17g\n", name, labels, v);
    dg_strbuf_append(b, line, (size_t)n);
}

dg_status_t trn_write_prom(const trainer_t *tr, const dg_step_metrics_t *sm) {
    if (tr->rank != 0) return DG_OK;
    char id[96], job[96], labels[256];
    prom_escape(id, sizeof id, tr->run_id);
    prom_escape(job, sizeof job, tr->slurm_job);
    snprintf(labels, sizeof labels, "run_id=\"%s\",slurm_job_id=\"%s\"", id, job);
    dg_strbuf_t b = {0};
    prom_put(&b, "dgtrain_step", "gauge", "Optimizer steps completed.", labels, (double)sm->step);
    prom_put(&b, "dgtrain_steps_planned", "gauge", "train.steps of the run.", labels,
             (double)tr->cfg->train.steps);
    prom_put(&b, "dgtrain_tokens_total", "counter", "Global tokens consumed.", labels, (double)sm->tokens);
    prom_put(&b, "dgtrain_loss", "gauge", "Training loss of the last step.", labels, sm->loss);
    prom_put(&b, "dgtrain_learning_rate", "gauge", "Learning rate of the last step.", labels, sm->lr);
    prom_put(&b, "dgtrain_grad_norm", "gauge", "Global gradient norm of the last step.", labels,
             sm->grad_norm);
    prom_put(&b, "dgtrain_tokens_per_second", "gauge", "Global tokens per second of the last step.", labels,
             sm->tok_per_s);
    prom_put(&b, "dgtrain_step_seconds", "gauge", "Wall time of the last step.", labels, sm->step_ms / 1e3);
    prom_put(&b, "dgtrain_mfu", "gauge", "Model FLOPs utilisation of the last step (NaN: peak unknown).",
             labels, sm->mfu);
    prom_put(&b, "dgtrain_loss_scale", "gauge", "fp16 dynamic loss scale (1 otherwise).", labels,
             tr->stab.loss_scale);
    prom_put(&b, "dgtrain_attempt", "gauge", "Attempt of this run (1 + earlier starts and requeues).", labels,
             (double)tr->attempt);
    prom_put(&b, "dgtrain_world_size", "gauge", "Ranks of this attempt.", labels, (double)tr->world);
    prom_put(&b, "dgtrain_last_update_timestamp_seconds", "gauge", "Unix time this file was written.", labels,
             (double)time(NULL));
    /* temp file and rename, so the collector never reads half a file; no fsync: it is rewritten often
     * and a crash loses nothing that metrics.jsonl does not hold */
    char path[DG_CFG_STR + 16], tmp[DG_CFG_STR + 48];
    snprintf(path, sizeof path, "%s/metrics.prom", tr->cfg->run.dir);
    snprintf(tmp, sizeof tmp, "%s/.metrics.prom.tmp.%d", tr->cfg->run.dir, (int)getpid());
    unlink(tmp);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    dg_status_t s = DG_OK;
    if (fd < 0 || write(fd, b.p, b.len) != (ssize_t)b.len || close(fd) != 0 || rename(tmp, path) != 0) {
        s = DG_ERR(DG_ERR_RUNTIME, "cannot write %s: %s", path, strerror(errno));
        if (fd >= 0) unlink(tmp);
    }
    dg_strbuf_free(&b);
    return s;
}

dg_status_t trn_maybe_write_prom(const trainer_t *tr, const dg_step_metrics_t *sm) {
    static double last = -1e9;
    double now = dg_now_s();
    int due = sm->step % tr->cfg->train.log_every == 0 && now - last >= 1.0; /* at most once a second */
    if (!due && sm->step != tr->cfg->train.steps) return DG_OK;
    last = now;
    dg_status_t s = trn_write_prom(tr, sm);
    if (s) {
        static int warned = 0;
        if (!warned++) DG_LOG_WARN("metrics.prom not updated (warned once): %s", dg_last_error());
        dg_clear_error();
    }
    return s;
}
