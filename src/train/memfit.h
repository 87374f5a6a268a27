/* memfit.h — the trainer's memory-fit check before the large allocations (docs/planning.md §Memory).
 *
 * dg_memfit_input fills the estimator's input from the config, model and mesh. dg_memfit_check is
 * collective over `world`: every rank reads what it has (host: min(MemAvailable, cgroup) / ranks on its
 * node; GPU: cudaMemGetInfo free), capped by parallel.memory_limit_mb; the minimum over the ranks is
 * compared with the estimate, so every rank returns the same status and the same one-line message
 * (DG_ERR_USAGE: needed GiB with breakdown, available GiB and its source, the mesh, micro-batch and a
 * setting that would fit). line_out (may be NULL) gets the verdict line either way. */
#ifndef DG_MEMFIT_H
#define DG_MEMFIT_H

#include <mpi.h>
#include <stddef.h>

#include "config.h"
#include "dg_memory.h"
#include "dg_mesh.h"
#include "dg_model.h"

void dg_memfit_input(const dg_config_t *c, const dg_model_desc_t *d, const dg_mesh_shape_t *m,
                     int micro_batch, int gpu, dg_mem_in_t *in);
dg_status_t dg_memfit_check(MPI_Comm world, int local_size, const dg_config_t *c, const dg_mem_in_t *in,
                            const char *mesh_str, char *line_out, size_t cap);

#endif
