/* train.c — the training loop (see train.h for the step anatomy).
 *
 * Everything that may fail on one rank only (opening data, reading a checkpoint, a non-finite loss) is
 * agreed on by all ranks before anyone enters the next collective, so a failure never leaves a peer
 * waiting: setup steps end in dg_boot_agree, and every step starts with one small all-reduce that
 * carries both the stop-signal flag and any local error.
 */
#define _GNU_SOURCE
#include "train.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "plot.h"
#include "train_impl.h"

static void trainer_free(trainer_t *tr) {
    trn_trace_free(tr);
    trn_sla_free(tr);
    if (tr->writer) dg_ckpt_writer_free(tr->writer);
    dg_health_free(tr->health);
#ifdef DG_HAVE_CUDA
    dg_cuda_probe_free(tr->cuda_probe); /* after the monitor: no poll runs any more */
#endif
    if (tr->progress) dg_progress_free(tr->progress);
    if (tr->metrics) dg_metrics_close(tr->metrics);
    for (int k = 0; tr->ckpt_paths && k < tr->n_params * 3; k++)
        free(tr->ckpt_paths[k]);
    for (int w = 0; w < 3; w++)
        if (tr->host_flat[w]) tr->be->ops->host_free(tr->be, tr->host_flat[w]);
    free(tr->ckpt_paths);
    free(tr->ckpt_t);
    free(tr->ckpt_off);
    free(tr->frozen);
    dg_stab_free(&tr->stab);
    if (tr->val_ld) dg_loader_free(tr->val_ld);
    if (tr->train_ld) dg_loader_free(tr->train_ld);
    if (tr->val_ds) dg_dataset_free(tr->val_ds);
    if (tr->train_ds) dg_dataset_free(tr->train_ds);
    if (tr->pp)
        trn_pp_free(tr); /* its chunk models, tr->model among them */
    else if (tr->model)
        dg_model_free(tr->model);
    dg_fsdp_free(tr->fsdp); /* after the model: its executor holds the comms */
    dg_backend_free(tr->be);
}

/* A collective that failed or timed out inside the model (DG_ERR_PEER, naming the collective, the
 * group, the step and the ranks that did not arrive) leaves its communicator unusable and peers possibly
 * stuck inside it: no agreement can follow, so the job ends here on every rank with exit code 3. */
static void comm_failure(trainer_t *tr, dg_status_t st) {
    if (st != DG_ERR_PEER) return;
    char msg[2048];
    snprintf(msg, sizeof msg, "%s", dg_last_error());
    DG_LOG_ERROR("%s; ending the job on every rank (exit 3)", msg);
    DG_METRICS_EVENT(tr->metrics, "done", DG_JI("step", tr->step), DG_JS("reason", "error"),
                     DG_JS("error", msg), DG_JI("exit_code", DG_ERR_PEER));
    dg_metrics_close(tr->metrics);
    tr->metrics = NULL;
    dg_fsdp_abort(tr->fsdp, DG_ERR_PEER);
}

/* ------------------------------------------------------------------------------------------------ */
/* The loop                                                                                          */
/* ------------------------------------------------------------------------------------------------ */

/* The one agreement per step, [local error, pending signal], before any model collective. Returns 1 when
 * the loop must stop: an error anywhere (*st set; DG_ERR_PEER on the ranks that did not fail themselves)
 * or a signal (*stop_sig). */
static int step_agreement(trainer_t *tr, dg_status_t *st, int *stop_sig) {
    int local[3] = {*st, dg_signals_pending(), tr->sla.pending}, agreed[3];
    dg_health_set_wait_activity(tr->health, tr->step, "step agreement");
    if (MPI_Allreduce(local, agreed, 3, MPI_INT, MPI_MAX, tr->comm) != MPI_SUCCESS) {
        *st = DG_ERR(DG_ERR_PEER, "step agreement all-reduce failed at step %lld", (long long)tr->step);
        return 1;
    }
    if (agreed[0]) {
        if (!*st)
            /* DG_ERR_PEER: the failing rank's own error (of higher severity) is the one dg_boot_agree
             * reports, with its exit code */
            *st = DG_ERR(DG_ERR_PEER, "another rank failed at step %lld (see its log)", (long long)tr->step);
        return 1;
    }
    if (agreed[1]) {
        *stop_sig = agreed[1];
        return 1;
    }
    tr->sla.pending = 0;
    tr->sla.agreed = agreed[2]; /* the SLA Level-2 action every rank takes now (train_sla.h) */
    return 0;
}

/* After a step: validation every data.val_every steps (and at the last), a periodic checkpoint, and the
 * asynchronous writer's report. An error is agreed at the top of the next iteration. */
static dg_status_t after_step(trainer_t *tr) {
    const dg_config_t *c = tr->cfg;
    dg_status_t st;
    if (dg_stab_pausing(&tr->stab)) return DG_OK; /* a confirmed spike: nothing saved until the rollback */
    if (tr->val_ld && c->data.val_every > 0 &&
        (tr->step % c->data.val_every == 0 || tr->step == c->train.steps)) {
        double vl = 0;
        DG_TRY(trn_run_validation(tr, &vl));
        dg_stab_note_val(&tr->stab, vl);
        DG_METRICS_EVENT(tr->metrics, "val", DG_JI("step", tr->step), DG_JF("loss", vl),
                         DG_JI("batches", tr->val_batches));
        dg_progress_note(tr->progress, "step %lld: val loss %.4f", (long long)tr->step, vl);
        tr->sla.exclude_next = 1;
    }
    if (c->checkpoint.every > 0 && tr->step % c->checkpoint.every == 0 && tr->step < c->train.steps) {
        double t0 = dg_now_s();
        st = trn_save_checkpoint(tr, 0);
        trn_sla_note_save(tr, dg_now_s() - t0, st == DG_OK && tr->ckpt_failures == 0);
        if (st) return st;
    }
    if (tr->writer) {
        dg_ckpt_async_result_t ar = {0};
        if (dg_ckpt_writer_poll(tr->writer, &ar) == 1) trn_report_async(tr, &ar);
    }
    return DG_OK;
}

/* The forward and backward of every micro-batch of step `step` (0-based; the first `chunk` are in tok/tgt,
 * later chunks are read and agreed here); *loss_sum: the sum of the micro-batches' mean losses. */
static dg_status_t forward_backward_all(trainer_t *tr, int64_t step, int chunk, int32_t *tok, int32_t *tgt,
                                        float dloss, double *loss_sum) {
    size_t n_tok = (size_t)tr->micro_batch * tr->desc.seq_len;
    if (tr->pp) return trn_pp_forward_backward(tr, tok, tgt, dloss, loss_sum); /* all micro-steps in tok */
    dg_status_t st = DG_OK;
    for (int j = 0; j < tr->accum && !st; j++) {
        if (j > 0 && j % chunk == 0) {
            dg_health_set_activity(tr->health, step, "reading data");
            int n = tr->accum - j < chunk ? tr->accum - j : chunk;
            st = trn_agree_data(tr, trn_fill_micro_steps(tr, tr->train_ld, j, n, tok, tgt));
            if (st) break;
        }
        float l = 0;
        size_t at = (size_t)(j % chunk) * n_tok;
        dg_health_set_activity(tr->health, step, "forward_backward");
        st = dg_model_forward_backward(tr->model, tok + at, tgt + at, dloss, &l);
        *loss_sum += l;
    }
    return st;
}

/* The AdamW update of step `step` (0-based) at learning rate lr; *gnorm: the gradient norm (non-finite:
 * the model skipped the update). */
static dg_status_t optimizer_step(trainer_t *tr, int64_t step, double lr, float *gnorm) {
    const dg_config_t *c = tr->cfg;
    dg_optim_hparams_t h = {.lr = (float)lr,
                            .beta1 = (float)c->train.beta1,
                            .beta2 = (float)c->train.beta2,
                            .eps = (float)c->train.eps,
                            .weight_decay = (float)c->train.weight_decay,
                            .grad_clip = (float)c->train.grad_clip,
                            .t = step + 1,
                            .inv_loss_scale = (float)(1.0 / tr->stab.loss_scale)};
    dg_health_set_activity(tr->health, step, "optimizer");
    if (tr->pp) return trn_pp_optimizer(tr, &h, gnorm);
    return dg_model_optimizer_step(tr->model, &h, gnorm);
}

/* The end of the loop: the final agreement, then the final (or signal-driven) checkpoint; exit 75 after a
 * signal promises a complete checkpoint. */
static dg_status_t finish_loop(trainer_t *tr, dg_status_t st, int stop_sig) {
    /* an error after the last step's agreement (validation, checkpoint) must be agreed before the final
     * collective save, or the failing rank would leave the others waiting in it */
    int lerr = st, gerr = 0;
    if (MPI_Allreduce(&lerr, &gerr, 1, MPI_INT, MPI_MAX, tr->comm) != MPI_SUCCESS)
        return DG_ERR(DG_ERR_PEER, "final agreement all-reduce failed");
    if (st) return st;
    if (gerr)
        return DG_ERR(DG_ERR_PEER, "another rank failed at step %lld (see its log)", (long long)tr->step);

    /* final (or signal-driven) checkpoint, synchronous; exit 75 promises it, so its failure is exit 4 */
    dg_status_t s = trn_save_checkpoint(tr, 1);
    if (s == DG_ERR_STORAGE && (stop_sig || tr->sla.stop)) {
        char why[1400];
        snprintf(why, sizeof why, "%s", dg_last_error());
        return DG_ERR(DG_ERR_STORAGE,
                      "stopped on %s at step %lld without a complete checkpoint (so not exit 75): %s",
                      stop_sig ? dg_signal_name(stop_sig) : "an SLA action", (long long)tr->step, why);
    }
    if (s) return s;
    if (stop_sig) {
        DG_METRICS_EVENT(tr->metrics, "done", DG_JI("step", tr->step), DG_JS("reason", "signal"),
                         DG_JS("signal", dg_signal_name(stop_sig)), DG_JI("exit_code", DG_ERR_SIGNAL));
        DG_LOG_WARN("stopped on %s at step %lld after a complete checkpoint; exit 75 asks for a requeue",
                    dg_signal_name(stop_sig), (long long)tr->step);
        return DG_ERR(DG_ERR_SIGNAL, "stopped on %s after checkpointing step %lld", dg_signal_name(stop_sig),
                      (long long)tr->step);
    }
    if (tr->sla.stop) {
        int pause = tr->sla.stop == DG_SLA_ACT_PAUSE, code = pause ? DG_ERR_PAUSE : DG_ERR_SIGNAL;
        DG_METRICS_EVENT(tr->metrics, "done", DG_JI("step", tr->step), DG_JS("reason", "sla"),
                         DG_JS("action", dg_sla_action_name((dg_sla_action_t)tr->sla.stop)),
                         DG_JI("exit_code", code));
        return DG_ERR(code, "SLA Level-2 %s at step %lld after a complete checkpoint: exit %d %s",
                      dg_sla_action_name((dg_sla_action_t)tr->sla.stop), (long long)tr->step, code,
                      pause ? "(paused for an operator; not requeued)" : "(asks for a requeue)");
    }
    return DG_OK;
}

static dg_status_t train_loop(trainer_t *tr) {
    const dg_config_t *c = tr->cfg;
    const int T = tr->desc.seq_len;
    size_t n_tok = (size_t)tr->micro_batch * T;
    const int chunk = trn_data_chunk(tr);
    int32_t *tok = dg_xmalloc((size_t)chunk * n_tok * sizeof(int32_t));
    int32_t *tgt = dg_xmalloc((size_t)chunk * n_tok * sizeof(int32_t));
    const double dloss_base = 1.0 / ((double)tr->global_batch * T);
    dg_status_t st = DG_OK;
    int stop_sig = 0;

    while (tr->step < c->train.steps) {
        /* this step's data (its first chunk: all of it unless the step is huge) is read before the step
         * agreement, so a failed read stops every rank there, before any model collective */
        if (!st) {
            dg_health_set_activity(tr->health, tr->step, "reading data");
            st = trn_fill_micro_steps(tr, tr->train_ld, 0, chunk, tok, tgt);
        }
        if (step_agreement(tr, &st, &stop_sig)) break;
        if (tr->sla.agreed && trn_sla_act(tr, &st)) break;
        if (st) continue; /* a failed SLA checkpoint or rollback: agreed at the top of the next iteration */
        if (tr->trace && (st = trn_trace_boundary(tr)) != DG_OK) continue;

        dg_model_comm_stats_t cs;
        dg_model_comm_stats(tr->model, &cs, 1); /* this step's gradient-sync latency from here */
        trn_sla_mem_begin(tr);                  /* and its peak of device memory */
        double t0 = dg_now_s();
        int64_t step = tr->step;                /* 0-based index of the step being taken */
        dg_model_set_step(tr->model, step + 1); /* named by collective timeouts */
        dg_health_set_activity(tr->health, step, "zero_grad");
        st = tr->pp ? trn_pp_zero_grad(tr) : dg_model_zero_grad(tr->model);
        double loss_sum = 0;
        if (!st)
            st = forward_backward_all(tr, step, chunk, tok, tgt, (float)(dloss_base * tr->stab.loss_scale),
                                      &loss_sum);
        comm_failure(tr, st);
        if (st) continue; /* agreed at the top of the next iteration */
        trn_sla_test_slow(tr, step);

        double loss_pair[1] = {trn_has_loss(tr) ? loss_sum / tr->accum : 0.0}, loss_glob[1];
        dg_health_set_wait_activity(tr->health, step, "all-reduce loss");
        if (MPI_Allreduce(loss_pair, loss_glob, 1, MPI_DOUBLE, MPI_SUM, tr->comm) != MPI_SUCCESS) {
            st = DG_ERR(DG_ERR_PEER, "loss all-reduce failed at step %lld", (long long)step);
            break;
        }
        double loss = trn_hook_loss(step + 1, loss_glob[0] / trn_loss_ranks(tr));
        tr->iters++;

        dg_stab_verdict_t v = dg_stab_judge(&tr->stab, step + 1, loss);
        if (v.spike && (st = trn_spike_check(tr, step + 1))) continue; /* validation; agreed at the top */
        double lr = dg_lr_at(step, c->train.steps, c->train.lr, c->train.warmup_steps, c->train.min_lr_ratio);
        float gnorm = NAN;
        double overflow = NAN;
        if (!v.skip) {
            st = trn_hook_grad(tr, step + 1);
            if (!st) st = optimizer_step(tr, step, lr, &gnorm);
            st = trn_overflow_rate(tr, st, gnorm, &overflow); /* every rank: agrees on st and the norm */
            comm_failure(tr, st);
            if (st) continue;
        }
        dg_stab_account(&tr->stab, step + 1, loss, gnorm, overflow, &v);

        dg_loader_advance(tr->train_ld, tr->global_batch);
        tr->step++;
        tr->tokens += tr->global_batch * T;
        double dt = dg_now_s() - t0;
        double tps = (double)(tr->global_batch * T) / dt;
        dg_step_metrics_t sm = {.step = tr->step,
                                .loss = loss,
                                .lr = lr,
                                .grad_norm = gnorm,
                                .tokens = tr->tokens,
                                .tok_per_s = tps,
                                .step_ms = dt * 1e3,
                                .mfu = dg_mfu(tps / tr->world, tr->flops_per_token, tr->peak_flops),
                                .overflow_rate = isnan(overflow) ? NAN : tr->stab.overflow_rate,
                                .overflow_rate_mean = tr->stab.overflow_mean};
        dg_model_comm_stats(tr->model, &cs, 0);
        sm.grad_sync_ms = 1e3 * cs.grad_sync_s;
        dg_metrics_step(tr->metrics, &sm);
        trn_trace_step_mark(tr, tr->step, t0, t0 + dt);
        dg_metrics_set_step(tr->metrics, tr->step);
        dg_log_set_step(tr->step);
        trn_maybe_write_prom(tr, &sm);
        dg_progress_step(tr->progress, tr->step, loss, tps, dt);
        trn_sla_after_step(tr, dt, tps);
        trn_sla_mem_end(tr);
        /* the communication objectives (docs/sla.md): judged on steps above the step-time floor, where a
         * fraction of the step is not scheduling noise of a loaded host */
        if (dt >= c->sla.budget_floor_s) {
            trn_sla_feed(tr, DG_SLA_GRAD_SYNC_LATENCY, cs.grad_sync_s);
            trn_sla_feed(tr, DG_SLA_EXPOSED_COMM, (cs.wait_s + cs.blocking_s) / dt);
        }
        trn_sla_feed_step_health(tr, isnan(overflow) ? NAN : tr->stab.overflow_rate, v.spike);

        if (dg_stab_rollback_due(&tr->stab) || (dg_stab_pausing(&tr->stab) && tr->step >= c->train.steps)) {
            st = trn_stab_rollback(tr, tr->iters); /* no after_step: the checkpoint's step was done */
            continue;
        }
        st = after_step(tr);
    }
    free(tok);
    free(tgt);
    if (!st && tr->trace) trn_trace_step_end(tr, tr->step, 1); /* every rank left the loop in agreement */
    dg_progress_finish(tr->progress);
    return finish_loop(tr, st, stop_sig);
}

/* The start event: the run's shape, its plan (arena, fragmentation, kernels and fusion, plan cache) and
 * where it starts (docs/sla.md "Start-event figures"). */
static void start_event(trainer_t *tr) {
    double state = 0, arena = 0, live = 0; /* summed over this rank's models (a pipeline's chunks) */
    int64_t ops = 0;
    for (int k = 0; k < trn_n_models(tr); k++) {
        const dg_model_t *mk = trn_model_at(tr, k);
        state += (double)dg_model_state_bytes(mk);
        arena += (double)dg_model_arena_bytes(mk);
        live += (double)dg_model_arena_live_peak_bytes(mk);
        ops += dg_model_n_ops(mk);
    }
    char cfg_hash[32];
    snprintf(cfg_hash, sizeof cfg_hash, "%016llx", (unsigned long long)dg_config_hash(tr->cfg));
    DG_METRICS_EVENT(
        tr->metrics, "start", DG_JI("world_size", tr->world), DG_JS("mesh", tr->mesh_str),
        DG_JS("backend", tr->backend_name), DG_JS("comm", tr->fsdp ? tr->fsdp->comm_backend : "none"),
        DG_JS("config_hash", cfg_hash), DG_JS("precision", tr->cfg->train.precision),
        DG_JI("n_params", (int64_t)dg_model_n_params(&tr->desc)), DG_JI("n_layer", tr->desc.n_layer),
        DG_JI("d_model", tr->desc.d_model), DG_JI("seq_len", tr->desc.seq_len),
        DG_JI("global_batch", tr->global_batch), DG_JI("micro_batch", tr->micro_batch),
        DG_JI("grad_accum", tr->accum), DG_JI("state_bytes_per_rank", (int64_t)state),
        DG_JI("arena_bytes", (int64_t)arena), DG_JI("arena_live_peak_bytes", (int64_t)live),
        DG_JF("memory_planned_bytes", tr->sla.mem_planned),
        DG_JF("arena_fragmentation", arena > 0 ? 1.0 - live / arena : 0.0), DG_JI("ops_per_step", ops),
        DG_JI("kernels_per_step", tr->kernels_fused), DG_JI("kernels_per_step_unfused", tr->kernels_unfused),
        DG_JF("fusion_ratio",
              tr->kernels_fused > 0 ? (double)tr->kernels_unfused / (double)tr->kernels_fused : 0.0),
        DG_JI("start_step", tr->step), DG_JI("steps", tr->cfg->train.steps),
        DG_JS("version", DG_VERSION_STRING),
        DG_JS("plan", tr->plan_reason[0] ? tr->plan_reason : "mesh given by parallel.mesh"),
        DG_JS("plan_cache", dg_model_build_info(tr->model)->cache),
        DG_JS("plan_cache_reason", dg_model_build_info(tr->model)->reason),
        DG_JF("plan_build_s", dg_model_build_info(tr->model)->build_s),
        DG_JF("plan_probe_s", dg_model_build_info(tr->model)->probe_s),
        DG_JF("plan_key_s", dg_model_build_info(tr->model)->key_s),
        DG_JF("graph_freeze_s", dg_now_s() - dg_model_build_info(tr->model)->frozen_at),
        DG_JS("plan_fallback", dg_model_build_info(tr->model)->fallback));
}

/* RUN_DIR/plots/ after the final metrics line of a finished run or of a stop on a signal after a complete
 * checkpoint (rank 0); a failure is a warning, never a failed run. */
static void end_of_run_plots(const char *run_dir) {
    char out[DG_CFG_STR + 8];
    snprintf(out, sizeof out, "%s/plots", run_dir);
    const char *dirs[1] = {run_dir};
    if (dg_plot_dirs(1, dirs, out, NULL) != DG_OK)
        DG_LOG_WARN("plots not written: %s", dg_last_error());
    else
        DG_LOG_INFO("plots written to %s", out);
}

dg_status_t dg_train_run(dg_boot_t *boot, const dg_config_t *cfg) {
    trainer_t tr = {0};
    tr.boot = boot;
    tr.cfg = cfg;
    tr.comm = boot->world;
    tr.rank = boot->world_rank;
    tr.world = boot->world_size;
    dg_signals_install();
    tr.sla.t_entry = dg_now_s();
    /* boot: the process's age at its first run; a later run in the same process (dgvalidate's training
     * check) had no boot of its own, and its recovery counts from here */
    static int runs_in_process = 0;
    tr.sla.boot_s = runs_in_process++ == 0 ? trn_sla_process_age_s() : 0.0;

    dg_status_t s = trn_setup(&tr);
    tr.sla.plan_s = dg_now_s() - tr.sla.t_entry;
    if (s == DG_OK) s = trn_sla_setup(&tr);
    s = dg_boot_agree(boot, s);
    if (s) {
        trainer_free(&tr);
        return s;
    }
    s = trn_setup_monitors(&tr);
    s = dg_boot_agree(boot, s);
    double t_read = dg_now_s();
    if (s == DG_OK) s = dg_boot_agree(boot, trn_maybe_resume(&tr));
    if (s == DG_OK) trn_sla_resumed(&tr, dg_now_s() - t_read);
    if (s) {
        trainer_free(&tr);
        return s;
    }

    start_event(&tr);
    DG_LOG_INFO(
        "training %s (%.2fM params) on %d rank(s), mesh %s, backend %s, %lld steps of %lld x %d tokens",
        cfg->model.preset, dg_model_n_params(&tr.desc) / 1e6, tr.world, tr.mesh_str, tr.backend_name,
        (long long)cfg->train.steps, (long long)tr.global_batch, tr.desc.seq_len);
    tr.progress =
        dg_progress_create(stderr, tr.rank, cfg->train.steps, cfg->train.log_every, DG_PROGRESS_AUTO);

    double t_start = dg_now_s();
    int64_t step0 = tr.step;
    s = train_loop(&tr);
    if (tr.writer) {
        dg_ckpt_async_result_t ar = {0};
        dg_status_t ws = dg_ckpt_writer_wait(tr.writer, &ar);
        trn_report_async(&tr, &ar);
        (void)ws; /* a failed background write is reported; the final synchronous save already succeeded */
    }
    s = dg_boot_agree(boot, s);
    if (s == DG_OK) {
        double el = dg_now_s() - t_start;
        /* GPU memory of this rank (rank 0 writes the line): the backend's peak allocation, comparable to
         * PyTorch's max_memory_allocated, and the device's use now; null on the CPU backend */
        double gpu_peak = NAN, gpu_used = NAN;
        /* host memory: the largest growth of any rank's resident set from the memory-fit check to its
         * peak (what the estimator predicts on CPU ranks, docs/planning.md "Memory"); collective */
        double peak = dg_mem_rss_peak(), growth = tr.rss_at_fit > 0 && peak > 0 ? peak - tr.rss_at_fit : NAN;
        double gmax = NAN;
        if (MPI_Allreduce(&growth, &gmax, 1, MPI_DOUBLE, MPI_MAX, tr.comm) != MPI_SUCCESS) gmax = NAN;
#ifdef DG_HAVE_CUDA
        dg_cuda_mem_stats_t ms;
        if (strcmp(tr.backend_name, "cuda") == 0 && dg_backend_cuda_mem_stats(tr.be, &ms) == DG_OK) {
            gpu_peak = (double)ms.peak_alloc_bytes;
            gpu_used = (double)ms.device_used_bytes;
            DG_LOG_INFO("GPU memory: peak allocated %.2f GiB, device in use %.2f of %.2f GiB",
                        gpu_peak / 1073741824.0, gpu_used / 1073741824.0,
                        ms.device_total_bytes / 1073741824.0);
        }
#endif
        DG_METRICS_EVENT(
            tr.metrics, "done", DG_JI("step", tr.step), DG_JS("reason", "finished"),
            DG_JI("tokens", tr.tokens), DG_JF("seconds", el),
            DG_JF("tok_per_s",
                  el > 0 ? (double)(tr.step - step0) * tr.global_batch * tr.desc.seq_len / el : 0),
            DG_JF("gpu_peak_alloc_bytes", gpu_peak), DG_JF("gpu_used_bytes", gpu_used),
            DG_JF("host_rss_growth_bytes", gmax), DG_JF("memory_peak_ratio", tr.sla.mem_ratio_max),
            DG_JI("exit_code", 0));
    } else if (s != DG_ERR_SIGNAL && s != DG_ERR_PAUSE) { /* a pause wrote its own done event */
        DG_METRICS_EVENT(tr.metrics, "done", DG_JI("step", tr.step), DG_JS("reason", "error"),
                         DG_JS("error", dg_last_error()), DG_JI("exit_code", s));
    }
    if (tr.rank == 0 && (s == DG_OK || s == DG_ERR_SIGNAL || s == DG_ERR_PAUSE))
        end_of_run_plots(cfg->run.dir); /* also a stop */
    trainer_free(&tr);
    return s;
}
