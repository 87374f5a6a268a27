/* fsdp.c — the device mesh and its communicators, the [parallel] options, the model on the mesh and the
 * DTensor-style placement view (see fsdp.h). The sharding itself is graph rewriting in src/graph
 * (shard.c: the FSDP pass; model.c: tensor-parallel builder rules and the optimizer-phase collectives).
 */
#include "fsdp.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "dg_mpi.h"

void dg_fsdp_opts_default(dg_fsdp_opts_t *o) {
    memset(o, 0, sizeof *o);
    o->timeout_s = 120;
    o->bucket_mb = 25;
    o->prefetch_budget_mb = 256;
    o->overlap = 1;
    o->reshard_after_forward = 1;
    snprintf(o->comm, sizeof o->comm, "auto");
}

void dg_fsdp_opts_from_config(const dg_config_t *cfg, dg_fsdp_opts_t *o) {
    dg_fsdp_opts_default(o);
    /* a little below the watchdog's limit: a peer stuck while the others wait inside a collective is
     * then reported by the collective (naming it, the step and the ranks that did not arrive) rather
     * than by the watchdog's generic "no progress" (which still catches stalls outside collectives) */
    o->timeout_s = 0.9 * cfg->health.timeout_s;
    o->bucket_mb = cfg->parallel.bucket_mb;
    o->prefetch_budget_mb = cfg->parallel.prefetch_budget_mb;
    o->overlap = cfg->parallel.overlap;
    o->reshard_after_forward = cfg->parallel.reshard_after_forward;
    snprintf(o->comm, sizeof o->comm, "%s", cfg->parallel.comm);
    o->rs_mpi = strcmp(cfg->parallel.reduce_scatter, "mpi") == 0;
    if (strcmp(cfg->train.recompute, "gelu") == 0) o->model_flags |= DG_MODEL_RECOMPUTE_GELU;
}

static size_t mb_bytes(double mb) {
    return mb > 0 ? (size_t)(mb * 1048576.0) : 0;
}

dg_status_t dg_fsdp_create(MPI_Comm world, const dg_mesh_shape_t *mesh, const dg_fsdp_opts_t *o,
                           dg_fsdp_t **out) {
    *out = NULL;
    dg_fsdp_opts_t def;
    if (!o) {
        dg_fsdp_opts_default(&def);
        o = &def;
    }
    if (strcmp(o->comm, "auto") != 0 && strcmp(o->comm, "mpi") != 0)
        return DG_ERR(
            DG_ERR_USAGE,
            "parallel.comm = %s: sharded and tensor-parallel training run their collectives through "
            "the mpi comm backend in this build (use auto or mpi)",
            o->comm);
    if (!(o->bucket_mb >= 0) || !(o->prefetch_budget_mb >= 0))
        return DG_ERR(DG_ERR_USAGE,
                      "parallel.bucket_mb = %g and parallel.prefetch_budget_mb = %g must be >= 0",
                      o->bucket_mb, o->prefetch_budget_mb);
    int rank = 0, world_size = 1;
    DG_MPI_CHECK(MPI_Comm_rank(world, &rank));
    DG_MPI_CHECK(MPI_Comm_size(world, &world_size));
    for (int d = 0; d < DG_MESH_NDIM; d++)
        if (mesh->size[d] < 1)
            return DG_ERR(DG_ERR_USAGE, "parallel.mesh: %s = %d must be >= 1", dg_mesh_dim_name(d),
                          mesh->size[d]);
    if (dg_mesh_world(mesh) != world_size) {
        char buf[128];
        dg_mesh_format(mesh, buf, sizeof buf);
        return DG_ERR(DG_ERR_USAGE, "parallel.mesh = %s needs %d ranks, but the job has %d", buf,
                      dg_mesh_world(mesh), world_size);
    }
    dg_fsdp_t *f = dg_xcalloc(1, sizeof *f);
    f->mesh = *mesh;
    f->rank = rank;
    f->world = world_size;
    f->opts = *o;
    dg_mesh_coords(mesh, rank, f->coord);
    dg_model_parallel_default(&f->par);
    f->par.mesh = *mesh;
    memcpy(f->par.coord, f->coord, sizeof f->coord);
    f->par.bucket_bytes = mb_bytes(o->bucket_mb);
    f->par.prefetch_bytes = mb_bytes(o->prefetch_budget_mb);
    f->par.overlap = o->overlap != 0;
    f->par.reshard_after_forward = o->reshard_after_forward != 0;
    if (!o->plan_only && world_size > 1) {
        dg_comm_opts_t co;
        dg_comm_opts_default(&co);
        co.timeout_s = o->timeout_s > 0 ? o->timeout_s : 365.0 * 86400.0;
        co.rs_mpi = o->rs_mpi;
        dg_status_t st = dg_comm_mesh_create(world, mesh, DG_COMM_MPI, -1, NULL, &co, &f->comms);
        if (st != DG_OK) {
            free(f);
            return st;
        }
        for (int d = 0; d < DG_MESH_NDIM; d++)
            f->par.comm[d] = mesh->size[d] > 1 ? f->comms->dim[d] : NULL;
    }
    *out = f;
    return DG_OK;
}

void dg_fsdp_free(dg_fsdp_t *f) {
    if (!f) return;
    dg_comm_mesh_free(f->comms);
    free(f);
}

dg_status_t dg_fsdp_model_create(dg_fsdp_t *f, const dg_model_desc_t *d, dg_backend_t *be, int micro_batch,
                                 uint64_t seed, int flags, dg_model_t **out) {
    if (f->opts.plan_only && f->world > 1 && !(flags & DG_MODEL_PLAN_ONLY))
        return DG_ERR(DG_ERR_USAGE,
                      "fsdp: created plan-only (no communicators): the model can only be planned");
    return dg_model_create_parallel(d, be, micro_batch, seed, flags | f->opts.model_flags, &f->par, out);
}

void dg_fsdp_abort(dg_fsdp_t *f, int code) {
    if (f && f->comms) dg_comm_abort(f->comms->world, code);
    MPI_Abort(MPI_COMM_WORLD, code);
    abort(); /* MPI_Abort does not return; keeps noreturn honest if it ever did */
}

/* ---------------- placements ---------------- */

void dg_fsdp_placements(const dg_model_t *m, int i, dg_placement_t out[DG_MESH_NDIM]) {
    const dg_model_parallel_t *p = dg_model_parallel(m);
    const dg_param_info_t *pi = dg_model_param(m, i);
    for (int d = 0; d < DG_MESH_NDIM; d++)
        out[d] = (dg_placement_t){DG_PLACE_REPLICATE, 0};
    if (!pi) return;
    if (p->mesh.size[DG_MESH_DP_SHARD] > 1) out[DG_MESH_DP_SHARD] = (dg_placement_t){DG_PLACE_SHARD, 0};
    if (p->mesh.size[DG_MESH_TP] > 1 && pi->tp_dim >= 0)
        out[DG_MESH_TP] = (dg_placement_t){DG_PLACE_SHARD, pi->tp_dim};
}

void dg_fsdp_placement_str(const dg_placement_t *p, char *buf, size_t cap) {
    switch (p->kind) {
    case DG_PLACE_SHARD:
        snprintf(buf, cap, "Shard(%d)", p->dim);
        break;
    case DG_PLACE_PARTIAL:
        snprintf(buf, cap, "Partial(sum)");
        break;
    default:
        snprintf(buf, cap, "Replicate");
        break;
    }
}

size_t dg_fsdp_state_bytes(const dg_model_t *m) {
    return dg_model_state_bytes(m);
}

dg_status_t dg_fsdp_print_placements(const dg_model_t *m, FILE *out, int json) {
    int n = dg_model_n_tensors(m);
    if (json) fputc('[', out);
    for (int i = 0; i < n; i++) {
        const dg_param_info_t *pi = dg_model_param(m, i);
        dg_placement_t pl[DG_MESH_NDIM];
        dg_fsdp_placements(m, i, pl);
        char ps[DG_MESH_NDIM][24], shape[48], pieces[256] = "";
        for (int d = 0; d < DG_MESH_NDIM; d++)
            dg_fsdp_placement_str(&pl[d], ps[d], sizeof ps[d]);
        if (pi->ndim == 2)
            snprintf(shape, sizeof shape, "[%" PRId64 ",%" PRId64 "]", pi->shape[0], pi->shape[1]);
        else
            snprintf(shape, sizeof shape, "[%" PRId64 "]", pi->shape[0]);
        dg_model_piece_t pc[DG_MODEL_MAX_PIECES];
        int np = dg_model_local_pieces(m, i, pc);
        size_t k = 0;
        for (int j = 0; j < np && k < sizeof pieces; j++) {
            if (pi->ndim == 2)
                k += (size_t)snprintf(pieces + k, sizeof pieces - k,
                                      json ? "%s[[%" PRId64 ",%" PRId64 "],[%" PRId64 ",%" PRId64 "]]"
                                           : "%s[%" PRId64 ":%" PRId64 ", %" PRId64 ":%" PRId64 "]",
                                      j ? (json ? "," : " ") : "", pc[j].start[0],
                                      pc[j].start[0] + pc[j].count[0], pc[j].start[1],
                                      pc[j].start[1] + pc[j].count[1]);
            else
                k += (size_t)snprintf(pieces + k, sizeof pieces - k,
                                      json ? "%s[[%" PRId64 ",%" PRId64 "]]" : "%s[%" PRId64 ":%" PRId64 "]",
                                      j ? (json ? "," : " ") : "", pc[j].start[0],
                                      pc[j].start[0] + pc[j].count[0]);
        }
        if (json)
            fprintf(
                out,
                "%s\n "
                "{\"name\":\"%s\",\"shape\":%s,\"placements\":{\"dp_replicate\":\"%s\",\"dp_shard\":\"%s\","
                "\"tp\":\"%s\"},\"local_elems\":%zu,\"owner\":%d,\"pieces\":[%s]}",
                i ? "," : "", pi->name, shape, ps[0], ps[1], ps[2], dg_model_local_numel(m, i),
                dg_model_piece_owner(m, i), pieces);
        else
            fprintf(out, "  %-26s %-12s %-10s %-10s %-10s %9zu  %s%s\n", pi->name, shape, ps[0], ps[1], ps[2],
                    dg_model_local_numel(m, i), np ? pieces : "(padding only)",
                    dg_model_piece_owner(m, i) ? "" : "  (replica)");
    }
    if (json) fputs("\n]", out);
    return ferror(out) ? DG_ERR(DG_ERR_RUNTIME, "fsdp: writing the placement table failed") : DG_OK;
}
