/* check_train.c — a short real training run over the whole allocation:
 *   train.match   the K-rank run's per-step losses against a 1-rank reference of the same global batch
 *                 (same config, seed and data; the reference accumulates K micro-batches where the
 *                 K-rank run has one per rank), within validate.train_loss_rtol (docs/design.md §5: fp32
 *                 within 1e-5 relative)
 *   train.resume  the K-rank run checkpoints half-way; a second K-rank run resumes from that file and
 *                 must reproduce the first run's losses for the remaining steps within
 *                 validate.train_resume_rtol (0 = bit for bit, which docs/design.md §4 promises)
 *
 * The reference runs inside the same job: rank 0 trains alone on a boot description whose world is a
 * duplicate of MPI_COMM_SELF (sharing rank 0's topology and GPU), while the other ranks sleep in a
 * non-blocking barrier. No second launch is needed, and under Slurm the reference uses the same node
 * and binding the job was given.
 *
 * Order: the K-rank run first (its half-way checkpoint feeds the resume run), then the reference, then
 * the resume run. Everything is written under <run dir>/train/{world,reference,resume}; each run has
 * the usual metrics.jsonl, which is what is compared.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "validate_impl.h"
#ifdef DG_VALIDATE_HAVE_TRAIN
#include "train.h"
#endif

/* Losses by step from a metrics.jsonl (the last "step" event of each step wins). */
typedef struct {
    int n;          /* highest step seen */
    double *loss;   /* [1..n], NAN where missing */
    int resumed_at; /* step of a "resume" event, -1 if none */
} losses_t;

static dg_status_t read_losses(const char *path, int max_step, losses_t *out) {
    memset(out, 0, sizeof *out);
    out->resumed_at = -1;
    out->loss = dg_xmalloc((size_t)(max_step + 1) * sizeof(double));
    for (int i = 0; i <= max_step; i++)
        out->loss[i] = NAN;
    FILE *f = fopen(path, "r");
    if (!f) return DG_ERR(DG_ERR_RUNTIME, "cannot read %s (the training run wrote no metrics)", path);
    char line[8192];
    while (fgets(line, sizeof line, f)) {
        const char *ev = strstr(line, "\"event\":\"");
        if (!ev) continue;
        ev += 9;
        int step = -1;
        const char *sp = strstr(line, "\"step\":");
        if (sp) step = atoi(sp + 7);
        if (strncmp(ev, "resume\"", 7) == 0) {
            out->resumed_at = step;
        } else if (strncmp(ev, "step\"", 5) == 0 && step >= 1 && step <= max_step) {
            const char *lp = strstr(line, "\"loss\":");
            out->loss[step] = lp ? strtod(lp + 7, NULL) : NAN;
            if (step > out->n) out->n = step;
        }
    }
    fclose(f);
    return DG_OK;
}

#ifdef DG_VALIDATE_HAVE_TRAIN

static dg_status_t make_config(vctx_t *c, dg_config_t *cfg, const char *dir, int global_batch,
                               const char *resume, int ckpt_every) {
    const dg_sla_settings_t *s = c->set;
    /* validate.train_config (or dgtrain's defaults with the tiny preset), then what the check needs */
    DG_TRY(dg_config_load(cfg, s->train_config[0] ? s->train_config : NULL, 0, NULL));
    struct {
        const char *k;
        char val[DG_CFG_STR + 64];
    } kv[16];
    int n = 0;
#define KV(key, ...) (kv[n].k = (key), snprintf(kv[n].val, sizeof kv[n].val, __VA_ARGS__), n++)
    KV("run.dir", "%s", dir);
    if (!s->train_config[0]) KV("model.preset", "tiny");
    KV("train.steps", "%d", s->train_steps);
    KV("train.global_batch", "%d", global_batch);
    KV("train.micro_batch", "%d", s->train_micro_batch);
    KV("data.val_every", "0");
    KV("checkpoint.every", "%d", ckpt_every);
    KV("checkpoint.keep", "100");
    KV("checkpoint.async", "false");
    KV("checkpoint.dir", "%s", "");
    KV("checkpoint.resume", "%s", resume);
    /* the topology and binding the suite measured with */
    KV("topology.xml", "%s", c->cfg->topology.xml);
    KV("topology.bind", "%s", c->cfg->topology.bind);
#undef KV
    for (int i = 0; i < n; i++)
        DG_TRY(dg_config_set(cfg, kv[i].k, kv[i].val, "dgvalidate"));
    return dg_config_validate(cfg);
}

/* A boot description of rank 0 alone: MPI_COMM_SELF as its world, the rest (host, topology, GPU,
 * binding) shared with the real one. Never finalized: only the two communicators are its own. */
static dg_status_t self_boot(const dg_boot_t *b, dg_boot_t *sb, int *zero) {
    *sb = *b;
    DG_MPI_CHECK(MPI_Comm_dup(MPI_COMM_SELF, &sb->world));
    DG_MPI_CHECK(MPI_Comm_set_errhandler(sb->world, MPI_ERRORS_RETURN));
    DG_MPI_CHECK(MPI_Comm_dup(MPI_COMM_SELF, &sb->node));
    DG_MPI_CHECK(MPI_Comm_set_errhandler(sb->node, MPI_ERRORS_RETURN));
    sb->world_rank = 0;
    sb->world_size = 1;
    sb->local_rank = 0;
    sb->local_size = 1;
    sb->node_id = 0;
    sb->n_nodes = 1;
    sb->owns_mpi = 0;
    sb->hosts = &b->hosts[b->world_rank];
    sb->node_ids = zero;
    sb->local_ranks = zero;
    sb->agreed_code = DG_OK;
    sb->agreed_msg[0] = 0;
    return DG_OK;
}

static double rel(double a, double b) {
    double d = fabs(a - b), m = fabs(b) > fabs(a) ? fabs(b) : fabs(a);
    return m > 0 ? d / m : d;
}

dg_status_t vc_check_train(vctx_t *c) {
    int want_m = vc_selected_leaf(c, "train.match"), want_r = vc_selected_leaf(c, "train.resume");
    if (!want_m && !want_r) return DG_OK;
    const dg_sla_settings_t *s = c->set;
    double t0 = dg_now_s();
    int steps = s->train_steps, half = steps / 2 > 0 ? steps / 2 : 1;
    int gb = s->train_global_batch > 0 ? s->train_global_batch : s->train_micro_batch * c->size;
    char dw[1200], dr[1200], dres[1200], ck[1400];
    snprintf(dw, sizeof dw, "%s/train/world", c->run_dir);
    snprintf(dr, sizeof dr, "%s/train/reference", c->run_dir);
    snprintf(dres, sizeof dres, "%s/train/resume", c->run_dir);
    snprintf(ck, sizeof ck, "%s/checkpoints/step_%08d.h5", dw, half);
    dg_config_t *cfg = dg_xcalloc(1, sizeof *cfg);
    char msg[2048];
    dg_verdict_t fail_v = DG_VERDICT_ERROR;
    const char *stage = "the configuration";

    /* 1. the whole allocation */
    dg_status_t st = make_config(c, cfg, dw, gb, "never", half);
    dg_status_t ag = vc_agree(c, st, msg, sizeof msg);
    if (ag == DG_OK) {
        stage = "the K-rank run";
        if (c->rank == 0)
            DG_LOG_INFO("train: %d steps of global batch %d on %d ranks -> %s", steps, gb, c->size, dw);
        ag = dg_train_run(c->b, cfg); /* agreed inside */
        if (ag != DG_OK) snprintf(msg, sizeof msg, "%s", dg_last_error());
        fail_v = ag == DG_ERR_USAGE ? DG_VERDICT_ERROR : DG_VERDICT_FAIL;
    }
    /* 2. the 1-rank reference on rank 0 */
    if (ag == DG_OK && want_m) {
        stage = "the 1-rank reference";
        st = DG_OK;
        if (c->rank == 0) {
            dg_boot_t sb;
            int zero = 0;
            st = self_boot(c->b, &sb, &zero);
            if (st == DG_OK) st = make_config(c, cfg, dr, gb, "never", 0);
            if (st == DG_OK) {
                DG_LOG_INFO("train: the 1-rank reference (global batch %d) -> %s", gb, dr);
                st = dg_train_run(&sb, cfg);
            }
            if (sb.world != MPI_COMM_NULL) MPI_Comm_free(&sb.world);
            if (sb.node != MPI_COMM_NULL) MPI_Comm_free(&sb.node);
        }
        /* the reference takes as long as it takes (world_size micro-batches per step on one rank); a
         * hang inside it is the business of its own watchdog (health.timeout_s), not of this wait */
        double t = c->timeout_s;
        c->timeout_s = 0;
        dg_status_t bs = vc_quiet_barrier(c, c->b->world, "train reference");
        c->timeout_s = t;
        DG_TRY(bs);
        ag = vc_agree(c, st, msg, sizeof msg);
    }
    /* 3. resume from the half-way checkpoint */
    if (ag == DG_OK && want_r) {
        stage = "the resumed run";
        st = make_config(c, cfg, dres, gb, ck, 0);
        ag = vc_agree(c, st, msg, sizeof msg);
        if (ag == DG_OK) {
            if (c->rank == 0) DG_LOG_INFO("train: resuming %s -> %s", ck, dres);
            ag = dg_train_run(c->b, cfg);
            if (ag != DG_OK) snprintf(msg, sizeof msg, "%s", dg_last_error());
        }
    }
    free(cfg);
    if (c->rank != 0) return DG_OK;

    double dt = dg_now_s() - t0;
    if (ag != DG_OK) {
        if (want_m) {
            dg_vcheck_t *k = vc_add(c, "train.match");
            k->verdict = fail_v;
            k->seconds = dt;
            snprintf(k->message, sizeof k->message, "%s failed: %.1900s", stage, msg);
        }
        if (want_r) {
            dg_vcheck_t *k = vc_add(c, "train.resume");
            k->verdict = fail_v;
            k->seconds = dt;
            snprintf(k->message, sizeof k->message, "%s failed: %.1900s", stage, msg);
        }
        return DG_OK;
    }
    char p[1300];
    losses_t W, R = {0}, X = {0};
    snprintf(p, sizeof p, "%s/metrics.jsonl", dw);
    dg_status_t rs = read_losses(p, steps, &W);
    if (rs == DG_OK && want_m) {
        snprintf(p, sizeof p, "%s/metrics.jsonl", dr);
        rs = read_losses(p, steps, &R);
    }
    if (rs == DG_OK && want_r) {
        snprintf(p, sizeof p, "%s/metrics.jsonl", dres);
        rs = read_losses(p, steps, &X);
    }
    if (want_m) {
        dg_vcheck_t *k = vc_add(c, "train.match");
        k->seconds = dt;
        double worst = 0;
        int worst_step = 0, missing = 0;
        vbuf_t det = {0};
        vbuf_printf(&det, "{\"global_batch\": %d, \"micro_batch\": %d, \"ranks\": %d, \"steps\": [", gb,
                    s->train_micro_batch, c->size);
        for (int i = 1; rs == DG_OK && i <= steps; i++) {
            if (isnan(W.loss[i]) || isnan(R.loss[i])) {
                missing++;
                continue;
            }
            double e = rel(W.loss[i], R.loss[i]);
            if (e > worst) worst = e, worst_step = i;
            vbuf_printf(&det, "%s{\"step\": %d, \"loss\": %.17g, \"reference\": %.17g}", i > 1 ? ", " : "", i,
                        W.loss[i], R.loss[i]);
        }
        vbuf_printf(&det, "]}");
        snprintf(k->measured, sizeof k->measured,
                 "max rel. loss diff %.3g (step %d) over %d steps, %d rank%s vs 1", worst, worst_step, steps,
                 c->size, c->size == 1 ? "" : "s");
        snprintf(k->reference, sizeof k->reference, "<= %.3g", s->train_loss_rtol);
        k->has_value = 1;
        k->value = worst;
        if (rs != DG_OK) {
            k->verdict = DG_VERDICT_ERROR;
            snprintf(k->message, sizeof k->message, "%s", dg_last_error());
        } else if (missing) {
            k->verdict = DG_VERDICT_FAIL;
            snprintf(k->message, sizeof k->message,
                     "%d of %d steps have no loss in one of the runs' metrics.jsonl", missing, steps);
        } else if (worst > s->train_loss_rtol) {
            k->verdict = DG_VERDICT_FAIL;
            char where[1024];
            vc_fmt_all_nodes(c, where, sizeof where);
            snprintf(k->message, sizeof k->message,
                     "the %d-rank run (ranks 0-%d on %.900s) diverges from the 1-rank reference (rank 0, %s) "
                     "at step %d: "
                     "loss %.9g vs %.9g (relative %.3g > %.3g)",
                     c->size, c->size - 1, where, c->b->hosts[0], worst_step, W.loss[worst_step],
                     R.loss[worst_step], worst, s->train_loss_rtol);
        }
        dg_vcheck_set_details(k, det.s);
        vbuf_free(&det);
    }
    if (want_r) {
        char where_all[1024];
        vc_fmt_all_nodes(c, where_all, sizeof where_all);
        dg_vcheck_t *k = vc_add(c, "train.resume");
        k->seconds = dt;
        double worst = 0;
        int worst_step = 0, missing = 0;
        for (int i = half + 1; rs == DG_OK && i <= steps; i++) {
            if (isnan(W.loss[i]) || isnan(X.loss[i])) {
                missing++;
                continue;
            }
            double e = rel(X.loss[i], W.loss[i]);
            if (e > worst) worst = e, worst_step = i;
        }
        snprintf(k->measured, sizeof k->measured,
                 "resumed at step %d; max rel. loss diff %.3g over steps %d-%d", X.resumed_at, worst,
                 half + 1, steps);
        snprintf(k->reference, sizeof k->reference, s->train_resume_rtol == 0 ? "bitwise equal" : "<= %.3g",
                 s->train_resume_rtol);
        k->has_value = 1;
        k->value = worst;
        if (rs != DG_OK) {
            k->verdict = DG_VERDICT_ERROR;
            snprintf(k->message, sizeof k->message, "%s", dg_last_error());
        } else if (X.resumed_at != half) {
            k->verdict = DG_VERDICT_FAIL;
            snprintf(k->message, sizeof k->message,
                     "the run did not resume from %s (resume event at step %d)", ck, X.resumed_at);
        } else if (missing) {
            k->verdict = DG_VERDICT_FAIL;
            snprintf(k->message, sizeof k->message, "%d steps after the resume have no loss", missing);
        } else if (worst > s->train_resume_rtol) {
            k->verdict = DG_VERDICT_FAIL;
            snprintf(k->message, sizeof k->message,
                     "the %d-rank run (ranks 0-%d on %.600s), resumed from %.900s: step %d has loss %.17g "
                     "instead of "
                     "%.17g (relative %.3g)",
                     c->size, c->size - 1, where_all, ck, worst_step, X.loss[worst_step], W.loss[worst_step],
                     worst);
        }
    }
    free(W.loss);
    free(R.loss);
    free(X.loss);
    return DG_OK;
}

#else /* no training loop in this build */

dg_status_t vc_check_train(vctx_t *c) {
    (void)read_losses;
    static const char *why =
        "the training loop is not built into this dgvalidate (no dg_train library when it was "
        "configured): rebuild once src/train provides it";
    if (vc_selected_leaf(c, "train.match")) vc_skip(c, "train.match", "%s", why);
    if (vc_selected_leaf(c, "train.resume")) vc_skip(c, "train.resume", "%s", why);
    return DG_OK;
}

#endif
