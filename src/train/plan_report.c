/* plan_report.c — `dgtrain --plan-only` and `--dry-run` (train.h): the planner's table, this rank's graph
 * and placements on the mesh (a plan-only model: no communicators, no tensors), the activation arena at
 * every train.recompute level, the memory-fit verdict and the data-size check; rank 0 prints. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "train_impl.h"

/* The planner's table (or JSON object) for --plan-only / --dry-run, rendered by rank 0 into a malloc'd
 * string; "" on other ranks. Planning for a described cluster (topology.cluster) needs no real ranks. */
static dg_status_t planner_text(dg_boot_t *boot, const dg_config_t *cfg, int json, char **text_out) {
    *text_out = dg_xstrdup("");
    if (boot->world_rank != 0) return DG_OK;
    dg_model_desc_t d;
    DG_TRY(dg_train_model_desc(cfg, &d));
    dg_cluster_t cl;
    dg_plan_result_t pr;
    DG_TRY(trn_run_planner(boot, cfg, &d, DG_TRAIN_MAX_TP, &cl, &pr));
    char *buf = NULL;
    size_t cap = 0;
    FILE *mem = open_memstream(&buf, &cap);
    DG_ASSERT(mem != NULL);
    dg_plan_print(&pr, &cl, mem, json, json ? 0 : 12);
    fclose(mem);
    free(*text_out);
    *text_out = buf;
    dg_plan_result_free(&pr);
    dg_cluster_free(&cl);
    return DG_OK;
}

/* Each rank renders its text; rank 0 prints them in rank order, after `head` (JSON: the planner object). */
static dg_status_t gather_print(dg_boot_t *boot, const char *head, const char *text, FILE *out, int json) {
    int len = (int)strlen(text) + 1;
    int *lens = NULL, *displs = NULL;
    char *all = NULL;
    if (boot->world_rank == 0) {
        lens = dg_xcalloc((size_t)boot->world_size, sizeof(int));
        displs = dg_xcalloc((size_t)boot->world_size, sizeof(int));
    }
    DG_MPI_CHECK(MPI_Gather(&len, 1, MPI_INT, lens, 1, MPI_INT, 0, boot->world));
    if (boot->world_rank == 0) {
        int tot = 0;
        for (int r = 0; r < boot->world_size; r++)
            displs[r] = tot, tot += lens[r];
        all = dg_xmalloc((size_t)tot);
    }
    DG_MPI_CHECK(MPI_Gatherv(text, len, MPI_CHAR, all, lens, displs, MPI_CHAR, 0, boot->world));
    if (boot->world_rank == 0) {
        if (json)
            fprintf(out, "{\"planner\":%s,\"ranks\":[", head && head[0] ? head : "null");
        else if (head)
            fputs(head, out);
        for (int r = 0; r < boot->world_size; r++) {
            if (json)
                fprintf(out, "%s{\"rank\":%d,\"plan\":%s}", r ? "," : "", r, all + displs[r]);
            else
                fprintf(out, "==== rank %d ====\n%s", r, all + displs[r]);
        }
        if (json) fprintf(out, "]}\n");
        fflush(out);
    }
    free(lens);
    free(displs);
    free(all);
    return DG_OK;
}

/* What plan_model made (any part of it, after a failure). */
static void plan_free(trainer_t *tr, dg_backend_t *be) {
    if (tr->model) dg_model_free(tr->model);
    dg_fsdp_free(tr->fsdp);
    dg_backend_free(be);
}

static dg_status_t plan_model(dg_boot_t *boot, const dg_config_t *cfg, trainer_t *tr, dg_backend_t **be) {
    tr->boot = boot;
    tr->cfg = cfg;
    tr->comm = boot->world;
    tr->rank = boot->world_rank;
    tr->world = boot->world_size;
    DG_TRY(trn_pick_mesh(tr));
    DG_TRY(dg_train_model_desc(cfg, &tr->desc));
    DG_TRY(trn_batch_arithmetic(tr));
    dg_backend_config_t bc = {0};
    bc.act_dtype = DG_F32;
    DG_TRY(dg_backend_cpu_create(&bc, be));
    /* this rank's graph on the mesh (collectives, waits, local shard sizes), without communicators */
    dg_fsdp_opts_t fo;
    dg_fsdp_opts_from_config(cfg, &fo);
    fo.plan_only = 1;
    DG_TRY(dg_fsdp_create(tr->comm, &tr->mesh, &fo, &tr->fsdp));
    return dg_fsdp_model_create(tr->fsdp, &tr->desc, *be, tr->micro_batch, (uint64_t)cfg->run.seed,
                                DG_MODEL_PLAN_ONLY, &tr->model);
}

/* The planned activation arena of this rank's graph at every train.recompute level (plan-only models,
 * DG_RECOMPUTE_NONE .. DG_RECOMPUTE_FULL), for --dry-run. */
static dg_status_t arena_per_recompute(dg_boot_t *boot, const dg_config_t *cfg, size_t arena[4]) {
    static const char *const names[4] = {"none", "gelu", "selective", "full"};
    dg_config_t *c = dg_xmalloc(sizeof *c);
    dg_status_t s = DG_OK;
    for (int r = 0; r < 4 && s == DG_OK; r++) {
        *c = *cfg;
        c->train.recompute_id = (dg_recompute_t)r;
        snprintf(c->train.recompute, sizeof c->train.recompute, "%s", names[r]);
        trainer_t t = {0};
        dg_backend_t *be = NULL;
        s = plan_model(boot, c, &t, &be);
        if (s == DG_OK) arena[r] = dg_model_arena_bytes(t.model);
        plan_free(&t, be);
    }
    free(c);
    return s;
}

/* plan_model, agreed by all ranks; with by_rc also the arena of each train.recompute choice */
static dg_status_t plan_agreed(dg_boot_t *boot, const dg_config_t *cfg, trainer_t *tr, dg_backend_t **be,
                               size_t by_rc[4]) {
    dg_status_t s = dg_boot_agree(boot, plan_model(boot, cfg, tr, be));
    if (s == DG_OK && by_rc) s = dg_boot_agree(boot, arena_per_recompute(boot, cfg, by_rc));
    return s;
}

dg_status_t dg_train_plan_only(dg_boot_t *boot, const dg_config_t *cfg, int json, FILE *out) {
    trainer_t tr = {0};
    dg_backend_t *be = NULL;
    size_t by_rc[4] = {0};
    dg_status_t s = plan_agreed(boot, cfg, &tr, &be, json ? NULL : by_rc);
    char *buf = NULL;
    size_t cap = 0;
    if (s == DG_OK) {
        FILE *mem = open_memstream(&buf, &cap);
        DG_ASSERT(mem != NULL);
        if (!json)
            fprintf(mem,
                    "mesh %s, coordinates dp_replicate %d, dp_shard %d, tp %d; data-parallel rank %d of %d, "
                    "micro_batch %d x %d accumulation steps\n",
                    tr.mesh_str, tr.fsdp->coord[DG_MESH_DP_REPLICATE], tr.fsdp->coord[DG_MESH_DP_SHARD],
                    tr.fsdp->coord[DG_MESH_TP], tr.dp_rank, tr.dp_size, tr.micro_batch, tr.accum);
        if (!json)
            fprintf(
                mem,
                "activation arena by train.recompute (this is %s): none %zu, gelu %zu, selective %zu, full "
                "%zu bytes\n",
                cfg->train.recompute, by_rc[0], by_rc[1], by_rc[2], by_rc[3]);
        s = dg_model_print_plan(tr.model, mem, json);
        if (s == DG_OK && !json) {
            fprintf(mem, "placements (global shape; dp_replicate, dp_shard, tp; local elements; this rank's "
                         "pieces of the global tensor):\n");
            s = dg_fsdp_print_placements(tr.model, mem, 0);
        }
        fclose(mem);
    }
    s = dg_boot_agree(boot, s);
    char *head = NULL;
    if (s == DG_OK) s = dg_boot_agree(boot, planner_text(boot, cfg, json, &head));
    if (s == DG_OK) s = gather_print(boot, head, buf, out, json);
    free(head);
    free(buf);
    plan_free(&tr, be);
    return s;
}

/* --dry-run's memory-fit verdict (memfit.h), computed for host ranks (the dry run binds no GPU); JSON:
 * a "memory" object. A plan that does not fit is reported, not refused. */
static dg_status_t dg_train_dry_run_memfit(dg_boot_t *boot, const dg_config_t *cfg, trainer_t *tr, int json,
                                           FILE *out) {
    dg_mem_in_t mi;
    dg_memfit_input(cfg, &tr->desc, &tr->mesh, tr->micro_batch, 0, &mi);
    char line[1400];
    dg_status_t v = dg_memfit_check(boot->world, boot->local_size, cfg, &mi, tr->mesh_str, line, sizeof line);
    if (v != DG_OK && v != DG_ERR_USAGE) return v;
    if (boot->world_rank != 0) return DG_OK;
    dg_mem_est_t e;
    dg_mem_estimate(&mi, &e);
    if (json)
        fprintf(out,
                ",\"memory\":{\"fits\":%s,\"estimate_bytes\":%.0f,\"state\":%.0f,\"gathered\":%.0f,"
                "\"activations\":%.0f,\"logits\":%.0f,\"buckets\":%.0f}",
                v == DG_OK ? "true" : "false", e.total, e.state, e.gathered, e.activations, e.logits,
                e.buckets);
    else
        fprintf(out, "  %s\n", line);
    return DG_OK;
}

dg_status_t dg_train_dry_run_report(dg_boot_t *boot, const dg_config_t *cfg, int json, FILE *out) {
    trainer_t tr = {0};
    dg_backend_t *be = NULL;
    size_t by_rc[4] = {0};
    dg_status_t s = plan_agreed(boot, cfg, &tr, &be, by_rc);
    if (s == DG_OK && boot->world_rank == 0) {
        size_t state = dg_model_state_bytes(tr.model), arena = dg_model_arena_bytes(tr.model);
        size_t act = dg_model_activation_bytes_sum(tr.model);
        size_t whole = 0; /* the same state unsharded: f32 master, grad, m, v of every global tensor */
        for (int i = 0; i < dg_model_n_tensors(tr.model); i++)
            whole += 16 * dg_model_param(tr.model, i)->numel;
        if (json) {
            fprintf(
                out,
                "{\"model\":{\"preset\":\"%s\",\"n_layer\":%d,\"n_head\":%d,\"d_model\":%d,\"seq_len\":%d,"
                "\"vocab_size\":%d,\"padded_vocab\":%d,\"n_params\":%llu,\"flops_per_token\":%.6g},"
                "\"mesh\":\"%s\",\"global_batch\":%lld,\"micro_batch\":%d,\"grad_accum\":%d,"
                "\"per_rank_bytes\":{\"params_grads_optimizer\":%zu,\"activation_arena\":%zu,"
                "\"activations_unplanned\":%zu,\"params_grads_optimizer_unsharded\":%zu},"
                "\"activation_arena_by_recompute\":{\"none\":%zu,\"gelu\":%zu,\"selective\":%zu,\"full\":%"
                "zu}",
                cfg->model.preset, tr.desc.n_layer, tr.desc.n_head, tr.desc.d_model, tr.desc.seq_len,
                tr.desc.vocab_size, tr.desc.padded_vocab, (unsigned long long)dg_model_n_params(&tr.desc),
                dg_model_flops_per_token(&tr.desc), tr.mesh_str, (long long)tr.global_batch, tr.micro_batch,
                tr.accum, state, arena, act, whole, by_rc[0], by_rc[1], by_rc[2], by_rc[3]);
        } else {
            fprintf(out, "\nModel and memory plan\n");
            fprintf(out,
                    "  model        %s: %d layers, %d heads, d_model %d, seq_len %d, vocab %d (padded %d)\n",
                    cfg->model.preset, tr.desc.n_layer, tr.desc.n_head, tr.desc.d_model, tr.desc.seq_len,
                    tr.desc.vocab_size, tr.desc.padded_vocab);
            fprintf(out, "  parameters   %.3fM (%.3g GFLOP per token for training)\n",
                    dg_model_n_params(&tr.desc) / 1e6, dg_model_flops_per_token(&tr.desc) / 1e9);
            fprintf(out,
                    "  mesh         %s; global batch %lld = micro_batch %d x %d ranks x %d accumulation\n",
                    tr.mesh_str, (long long)tr.global_batch, tr.micro_batch, tr.dp_size, tr.accum);
            fprintf(out,
                    "  per rank     params+grads+AdamW %.2f MB (unsharded %.2f MB); activation arena %.2f MB "
                    "(%.2f MB unplanned)\n",
                    state / 1e6, whole / 1e6, arena / 1e6, act / 1e6);
            fprintf(out,
                    "  activation arena by train.recompute (this is %s): none %.2f MB, gelu %.2f MB, "
                    "selective %.2f MB, full %.2f MB\n",
                    cfg->train.recompute, by_rc[0] / 1e6, by_rc[1] / 1e6, by_rc[2] / 1e6, by_rc[3] / 1e6);
        }
    }
    char *head = NULL;
    s = dg_boot_agree(boot, s);
    if (s == DG_OK) s = dg_train_dry_run_memfit(boot, cfg, &tr, json, out);
    if (s == DG_OK) s = dg_boot_agree(boot, planner_text(boot, cfg, json, &head));
    if (boot->world_rank == 0 && tr.model) {
        if (json)
            fprintf(out, ",\"planner\":%s}\n", s == DG_OK ? head : "null");
        else if (s == DG_OK)
            fputs(head, out);
        fflush(out);
    }
    free(head);
    plan_free(&tr, be);
    return s;
}

dg_status_t dg_train_dry_run_check(dg_boot_t *boot, const dg_config_t *cfg) {
    if (boot->world_rank != 0) return DG_OK;
    dg_model_desc_t d;
    DG_TRY(dg_train_model_desc(cfg, &d));
    char train_glob[4096], val_glob[4096];
    DG_TRY(trn_data_globs(cfg, train_glob, val_glob, sizeof train_glob));
    int64_t n_train = 0, n_val = -1, val_batches = 0;
    DG_TRY(dg_dataset_probe(train_glob, d.seq_len, &n_train));
    if (val_glob[0] && cfg->data.val_every > 0) DG_TRY(dg_dataset_probe(val_glob, d.seq_len, &n_val));
    return trn_check_data_fits(cfg, cfg->train.global_batch, d.seq_len, n_train, n_val, &val_batches);
}
