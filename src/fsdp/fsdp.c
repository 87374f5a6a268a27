/* fsdp.c — the device mesh and its communicators, the [parallel] options, the model on the mesh and the
 * DTensor-style placement view (see fsdp.h). The sharding itself is graph rewriting: src/graph/shard.c
 * (the FSDP pass), src/model/gpt2.c (tensor-parallel builder rules) and src/model/model.c (the
 * optimizer-phase collectives).
 */
#include "fsdp.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "dg_mpi.h"

void dg_fsdp_opts_default(dg_fsdp_opts_t *o) {
    *o = (dg_fsdp_opts_t){.timeout_s = 120,
                          .bucket_mb = 25,
                          .prefetch_budget_mb = 256,
                          .overlap = 1,
                          .reshard_after_forward = 1,
                          .cuda_device = -1};
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
    o->nccl_nonblocking = cfg->parallel.nccl_nonblocking;
    if (cfg->train.recompute_id == DG_RECOMPUTE_GELU) o->model_flags |= DG_MODEL_RECOMPUTE_GELU;
    if (cfg->train.recompute_id == DG_RECOMPUTE_SELECTIVE) o->model_flags |= DG_MODEL_RECOMPUTE_SELECTIVE;
    if (cfg->train.recompute_id == DG_RECOMPUTE_FULL) o->model_flags |= DG_MODEL_RECOMPUTE_FULL;
    o->reduce_dtype = cfg->train.reduce_dtype_id == DG_REDUCE_BF16 ? DG_BF16 : DG_F32;
}

/* parallel.comm -> the comm backend, the same answer on every rank: nccl needs every rank on the CUDA
 * backend with a GPU no other rank of its node uses (NCCL refuses two ranks on one GPU) and a build with
 * NCCL. Collective over world. *nccl_out = 1 for nccl; why receives the reason for the log. */
static dg_status_t choose_comm(MPI_Comm world, const dg_fsdp_opts_t *o, int *nccl_out, char *why,
                               size_t cap) {
    *nccl_out = 0;
    if (strcmp(o->comm, "mpi") == 0) {
        snprintf(why, cap, "parallel.comm = mpi");
        return DG_OK;
    }
    int rank = 0;
    DG_MPI_CHECK(MPI_Comm_rank(world, &rank));
    MPI_Comm node = MPI_COMM_NULL;
    DG_MPI_CHECK(MPI_Comm_split_type(world, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node));
    int nl = 1;
    MPI_Comm_size(node, &nl);
    char mine[80];
    if (o->gpu_id[0])
        snprintf(mine, sizeof mine, "%s", o->gpu_id);
    else
        snprintf(mine, sizeof mine, "cuda:%d", o->cuda_device);
    char *all = dg_xcalloc((size_t)nl, sizeof mine);
    int rc = MPI_Allgather(mine, (int)sizeof mine, MPI_CHAR, all, (int)sizeof mine, MPI_CHAR, node);
    MPI_Comm_free(&node);
    if (rc != MPI_SUCCESS) {
        free(all);
        DG_MPI_CHECK(rc);
    }
    int shared = 0;
    for (int i = 0; i < nl && o->cuda_device >= 0; i++)
        for (int j = i + 1; j < nl; j++)
            if (strcmp(all + (size_t)i * sizeof mine, all + (size_t)j * sizeof mine) == 0) shared = 1;
    free(all);
#ifdef DG_HAVE_CUDA
    int built = 1;
#else
    int built = 0;
#endif
    /* ranks not on the CUDA backend, ranks sharing a GPU (counted per rank that sees a duplicate) */
    int local[2] = {o->cuda_device < 0, shared}, sum[2] = {0, 0};
    DG_MPI_CHECK(MPI_Allreduce(local, sum, 2, MPI_INT, MPI_SUM, world));
    if (!built)
        snprintf(why, cap, "this dgtrain was built without CUDA/NCCL");
    else if (sum[0])
        snprintf(why, cap, "%d rank(s) do not run on the CUDA backend", sum[0]);
    else if (sum[1])
        snprintf(why, cap, "%d rank(s) share their GPU with another rank of the node (NCCL refuses that)",
                 sum[1]);
    else {
        snprintf(why, cap, "every rank has a GPU of its own");
        *nccl_out = 1;
        return DG_OK;
    }
    if (strcmp(o->comm, "nccl") == 0)
        return DG_ERR(DG_ERR_USAGE,
                      "parallel.comm = nccl cannot run here: %s; hint: parallel.comm = mpi (or auto)", why);
    return DG_OK;
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
    if (strcmp(o->comm, "auto") != 0 && strcmp(o->comm, "mpi") != 0 && strcmp(o->comm, "nccl") != 0)
        return DG_ERR(DG_ERR_USAGE, "parallel.comm = %s: expected auto, mpi or nccl", o->comm);
    if (o->reduce_dtype != DG_F32 && o->reduce_dtype != DG_BF16)
        return DG_ERR(DG_ERR_USAGE, "train.reduce_dtype = %s: expected fp32 or bf16",
                      dg_dtype_name(o->reduce_dtype));
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
    f->par.reduce_dtype = o->reduce_dtype;
    if (o->reduce_dtype != DG_F32 && rank == 0) {
        if (mesh->size[DG_MESH_DP_REPLICATE] * mesh->size[DG_MESH_DP_SHARD] > 1)
            DG_LOG_INFO("train.reduce_dtype = %s: the gradient reduce-scatters / all-reduces move %s (cast "
                        "from and back to the f32 gradients around each)",
                        dg_dtype_name(o->reduce_dtype), dg_dtype_name(o->reduce_dtype));
        else
            DG_LOG_INFO("train.reduce_dtype = %s has no effect: the mesh has no data-parallel dimension "
                        "(no gradient reduction to make)",
                        dg_dtype_name(o->reduce_dtype));
    }
    snprintf(f->comm_backend, sizeof f->comm_backend, "none");
    if (!o->plan_only && world_size > 1) {
        int nccl = 0;
        dg_status_t st = choose_comm(world, o, &nccl, f->comm_why, sizeof f->comm_why);
        if (st != DG_OK) {
            free(f);
            return st;
        }
        dg_comm_opts_t co;
        dg_comm_opts_default(&co);
        co.timeout_s = o->timeout_s > 0 ? o->timeout_s : 365.0 * 86400.0;
        co.rs_mpi = o->rs_mpi;
        co.nccl_nonblocking = o->nccl_nonblocking;
        /* nccl: the world comm makes its own stream (NULL) on this rank's device, and its per-dimension
         * splits share it; the executor links it to the compute backend's stream with event edges */
        st = dg_comm_mesh_create(world, mesh, nccl ? DG_COMM_NCCL : DG_COMM_MPI, nccl ? o->cuda_device : -1,
                                 NULL, &co, &f->comms);
        if (st != DG_OK) {
            free(f);
            return st;
        }
        snprintf(f->comm_backend, sizeof f->comm_backend, "%s", nccl ? "nccl" : "mpi");
        if (rank == 0)
            DG_LOG_INFO("parallel.comm = %s: collectives over %s (%s)", o->comm, f->comm_backend,
                        f->comm_why);
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
