/* check_train.c — a short real training run over the whole allocation:
 *   train.match   the K-rank run's per-step losses against a 1-rank reference of the same global batch
 *                 (same config, seed and data; the reference accumulates K micro-batches where the
 *                 K-rank run has one per rank), within validate.train_loss_rtol (docs/design.md §5: fp32
 *                 within 1e-5 relative)
 *   train.resume  the K-rank run checkpoints half-way; a second K-rank run resumes from that file and
 *                 must reproduce the first run's losses for the remaining steps within
 *                 validate.train_resume_rtol (0 = bit for bit, which docs/design.md §4 promises)
 *   train.recovery  the resumed run's recovery time (its `recovery` event: process start to the first
 *                 step, split into boot, checkpoint read and plan build) against ref.train.recovery, or
 *                 without one against the run's own SLA objective sla.recovery_time; the training
 *                 governor's own verdict (a recovery_time `sla` event) fails it too (docs/sla.md)
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

#include "dg_json_read.h"
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

/* The resumed run's recovery event and the training governor's verdict on it (metrics.jsonl). */
typedef struct {
    int found;                              /* a recovery event was written */
    double total_s, boot_s, read_s, plan_s; /* its recovery_time_s, boot_s, checkpoint_read_s, plan_build_s */
    double lost_steps;                      /* -1 unknown */
    int sla_level;                          /* the highest level of a recovery_time sla event, 0 none */
    double sla_target;                      /* that event's bound */
} recovery_t;

static dg_status_t read_recovery(const char *path, recovery_t *out) {
    memset(out, 0, sizeof *out);
    FILE *f = fopen(path, "r");
    if (!f) return DG_ERR(DG_ERR_RUNTIME, "cannot read %s (the resumed run wrote no metrics)", path);
    char *line = NULL;
    size_t cap = 0;
    dg_jl_obj *o = dg_xmalloc(sizeof *o);
    while (getline(&line, &cap, f) > 0) {
        if (dg_jl_parse(line, o) != 0) continue;
        const dg_jl_field *ev = dg_jl_get(o, "event");
        if (!ev || !ev->is_str) continue;
#define NUM(k) (dg_jl_get(o, k) && !dg_jl_get(o, k)->is_str ? dg_jl_get(o, k)->num : NAN)
        if (strcmp(ev->str, "recovery") == 0) {
            out->found = 1;
            out->total_s = NUM("recovery_time_s"), out->boot_s = NUM("boot_s");
            out->read_s = NUM("checkpoint_read_s"), out->plan_s = NUM("plan_build_s");
            out->lost_steps = NUM("lost_steps");
        } else if (strcmp(ev->str, "sla") == 0) {
            const dg_jl_field *ob = dg_jl_get(o, "objective");
            double lv = NUM("level");
            if (ob && ob->is_str && strcmp(ob->str, "recovery_time") == 0 && lv > out->sla_level) {
                out->sla_level = (int)lv;
                out->sla_target = NUM("target");
            }
        }
#undef NUM
    }
    free(o);
    free(line);
    fclose(f);
    return DG_OK;
}

/* train.recovery (rank 0): the resumed run's recovery time and its SLA verdict. sla_ref: the training
 * config's sla.recovery_time, the reference when the SLA file has no ref.train.recovery. */
static void check_recovery(vctx_t *c, const char *metrics, const char *sla_ref, double seconds) {
    dg_vcheck_t *k = vc_add(c, "train.recovery");
    k->seconds = seconds;
    recovery_t rv;
    if (read_recovery(metrics, &rv) != DG_OK) {
        k->verdict = DG_VERDICT_ERROR;
        snprintf(k->message, sizeof k->message, "%s", dg_last_error());
        return;
    }
    if (!rv.found) {
        k->verdict = DG_VERDICT_FAIL;
        snprintf(k->message, sizeof k->message, "the resumed run wrote no recovery event (%s)", metrics);
        return;
    }
    dg_sla_ref_t own;
    const dg_sla_ref_t *ref = vc_group_ref(c, "train.recovery", c->type_of_rank, c->size);
    if (!ref && strcmp(sla_ref, "off") != 0 &&
        dg_sla_ref_parse("dgtrain", "sla.recovery_time", sla_ref, DG_DIM_TIME, &own) == DG_OK)
        ref = &own;
    dg_clear_error();
    k->has_value = 1;
    k->value = rv.total_s;
    snprintf(k->unit, sizeof k->unit, "s");
    char tot[32];
    vc_fmt_value(tot, sizeof tot, rv.total_s, DG_DIM_TIME);
    snprintf(k->measured, sizeof k->measured,
             "%s (boot %.3g s, checkpoint read %.3g s, plan build %.3g s); SLA %s", tot, rv.boot_s, rv.read_s,
             rv.plan_s, rv.sla_level ? "violated" : "met");
    if (ref) {
        dg_sla_ref_format(ref, k->reference, sizeof k->reference);
        if (ref == &own)
            snprintf(k->reference + strlen(k->reference), sizeof k->reference - strlen(k->reference),
                     " (sla.recovery_time)");
    } else {
        snprintf(k->reference, sizeof k->reference, "-");
    }
    vbuf_t det = {0};
    vbuf_printf(&det, "{\"recovery_time_s\": ");
    vbuf_json_num(&det, rv.total_s);
    vbuf_printf(&det, ", \"boot_s\": ");
    vbuf_json_num(&det, rv.boot_s);
    vbuf_printf(&det, ", \"checkpoint_read_s\": ");
    vbuf_json_num(&det, rv.read_s);
    vbuf_printf(&det, ", \"plan_build_s\": ");
    vbuf_json_num(&det, rv.plan_s);
    vbuf_printf(&det, ", \"lost_steps\": ");
    vbuf_json_num(&det, rv.lost_steps);
    vbuf_printf(&det, ", \"sla_level\": %d, \"sla_verdict\": \"%s\"}", rv.sla_level,
                rv.sla_level ? "violated" : "met");
    dg_vcheck_set_details(k, det.s);
    vbuf_free(&det);
    if (ref && !dg_sla_ref_ok(ref, rv.total_s)) {
        k->verdict = DG_VERDICT_FAIL;
        snprintf(k->message, sizeof k->message,
                 "the resumed run took %s to its first step (boot %.3g s, checkpoint "
                 "read %.3g s, plan build %.3g s), want %s",
                 tot, rv.boot_s, rv.read_s, rv.plan_s, k->reference);
    } else if (rv.sla_level) {
        k->verdict = DG_VERDICT_FAIL;
        snprintf(k->message, sizeof k->message,
                 "the resumed run's SLA governor judged recovery_time violated (level %d, %s > %.3g s)",
                 rv.sla_level, tot, rv.sla_target);
    } else if (!ref) {
        snprintf(k->message, sizeof k->message,
                 "no reference ref.train.recovery and sla.recovery_time is off: measured only");
    }
}

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
    int want_rec = vc_selected_leaf(c, "train.recovery");
    if (!want_m && !want_r && !want_rec) return DG_OK;
    want_r = want_r || want_rec; /* the recovery is the resumed run's */
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
    char sla_ref[sizeof cfg->sla.recovery_time];
    snprintf(sla_ref, sizeof sla_ref, "%s", cfg->sla.recovery_time);
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
        for (int i = 0; i < 2; i++) {
            if (!(i == 0 ? vc_selected_leaf(c, "train.resume") : want_rec)) continue;
            dg_vcheck_t *k = vc_add(c, i == 0 ? "train.resume" : "train.recovery");
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
    if (want_rec) {
        snprintf(p, sizeof p, "%s/metrics.jsonl", dres);
        check_recovery(c, p, sla_ref, dt);
    }
    if (vc_selected_leaf(c, "train.resume")) {
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
    if (vc_selected_leaf(c, "train.recovery")) vc_skip(c, "train.recovery", "%s", why);
    return DG_OK;
}

#endif
