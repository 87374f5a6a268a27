/* report.c — the --dry-run / --topology report: rank 0 gathers one record per rank (host, node, local
 * rank, GPU, NUMA node, bound cpuset) and one topology summary per node (from its local rank 0), and
 * prints them as aligned tables or as one JSON object.
 */
#include "mpi_boot_impl.h"

#include <stdlib.h>

typedef struct {
    int rank, node_id, local_rank, gpu, cuda_index, numa;
    char host[DG_HOST_MAX];
    char busid[32];
    char cpuset[256];
    char bind[64];
} rank_rec_t;

/* what a node leader sends: its topology summary with the NVLink matrix inlined */
typedef struct {
    dg_node_topo_t topo; /* nvlink_bw pointer is meaningless on the receiver */
    int has_nvlink;
    double nvlink[DG_TOPO_MAX_GPUS * DG_TOPO_MAX_GPUS];
    char source[DG_CFG_STR];
} node_rec_t;

/* "3", or `none` for a negative value (no GPU, several NUMA nodes) */
static void num_or(char *buf, size_t cap, int v, const char *none) {
    if (v >= 0)
        snprintf(buf, cap, "%d", v);
    else
        snprintf(buf, cap, "%s", none);
}

static void print_rank_table(FILE *out, const rank_rec_t *r, int n) {
    int wh = 4, wc = 6, wb = 7;
    for (int i = 0; i < n; i++) {
        int l = (int)strlen(r[i].host);
        if (l > wh) wh = l;
        l = (int)strlen(r[i].cpuset);
        if (l > wc) wc = l;
        l = (int)strlen(r[i].bind);
        if (l > wb) wb = l;
    }
    fprintf(out, "%5s  %-*s  %4s  %5s  %4s  %-12s  %4s  %-*s  %s\n", "rank", wh, "host", "node", "local",
            "gpu", "pci bus id", "numa", wc, "cpuset", "binding");
    for (int i = 0; i < n; i++) {
        char gpu[16], numa[16];
        num_or(gpu, sizeof gpu, r[i].gpu, "-");
        num_or(numa, sizeof numa, r[i].numa, "many");
        fprintf(out, "%5d  %-*s  %4d  %5d  %4s  %-12s  %4s  %-*s  %s\n", r[i].rank, wh, r[i].host,
                r[i].node_id, r[i].local_rank, gpu, r[i].gpu >= 0 ? r[i].busid : "-", numa, wc, r[i].cpuset,
                r[i].bind);
    }
}

static void print_node(FILE *out, int id, const char *host, const node_rec_t *nr) {
    const dg_node_topo_t *t = &nr->topo;
    int live = strcmp(nr->source, "live") == 0;
    fprintf(out, "node %d (%s): %d socket%s, %d cores, %d PUs, %d NUMA node%s, %d GPU%s, %d NIC%s; topology ",
            id, host, t->n_sockets, t->n_sockets == 1 ? "" : "s", t->n_cores, t->n_pus, t->n_numa,
            t->n_numa == 1 ? "" : "s", t->n_gpus, t->n_gpus == 1 ? "" : "s", t->n_nics,
            t->n_nics == 1 ? "" : "s");
    if (live)
        fprintf(out, "live\n");
    else
        fprintf(out, "from %s (host %s)\n", nr->source, t->host);
    int wc = 4;
    for (int g = 0; g < t->n_gpus; g++)
        if ((int)strlen(t->gpus[g].cpuset) > wc) wc = (int)strlen(t->gpus[g].cpuset);
    for (int g = 0; g < t->n_gpus; g++) {
        const dg_gpu_info_t *x = &t->gpus[g];
        char cuda[16], numa[16];
        num_or(cuda, sizeof cuda, x->cuda_index, "-");
        num_or(numa, sizeof numa, x->numa, "many");
        fprintf(out, "  gpu %-2d %s  cuda %-2s numa %-4s cpus %-*s  %s\n", g, x->pci_busid, cuda, numa, wc,
                x->cpuset, x->name);
    }
    for (int k = 0; k < t->n_nics; k++) {
        const dg_nic_info_t *x = &t->nics[k];
        char numa[16];
        num_or(numa, sizeof numa, x->numa, "many");
        fprintf(out, "  nic %-2d %s  %-4s numa %-4s %s\n", k, x->pci_busid, x->kind, numa, x->name);
    }
    if (nr->has_nvlink) {
        fprintf(out, "  nvlink GB/s:");
        for (int b = 0; b < t->n_gpus; b++)
            fprintf(out, " %5d", b);
        fprintf(out, "\n");
        for (int a = 0; a < t->n_gpus; a++) {
            fprintf(out, "  %11d:", a);
            for (int b = 0; b < t->n_gpus; b++)
                fprintf(out, " %5.0f", nr->nvlink[a * t->n_gpus + b]);
            fprintf(out, "\n");
        }
    }
}

static void json_node(FILE *out, int id, const char *host, const node_rec_t *nr) {
    const dg_node_topo_t *t = &nr->topo;
    fprintf(out, "{\"node\":%d,\"host\":", id);
    dg_boot_json_string(out, host);
    fprintf(out, ",\"topology\":");
    dg_boot_json_string(out, nr->source);
    fprintf(out, ",\"topology_host\":");
    dg_boot_json_string(out, t->host);
    fprintf(out, ",\"sockets\":%d,\"cores\":%d,\"pus\":%d,\"numa_nodes\":%d,\"gpus\":[", t->n_sockets,
            t->n_cores, t->n_pus, t->n_numa);
    for (int g = 0; g < t->n_gpus; g++) {
        const dg_gpu_info_t *x = &t->gpus[g];
        fprintf(out, "%s{\"index\":%d,\"pci_busid\":", g ? "," : "", g);
        dg_boot_json_string(out, x->pci_busid);
        fprintf(out, ",\"name\":");
        dg_boot_json_string(out, x->name);
        fprintf(out, ",\"numa\":%d,\"cpuset\":", x->numa);
        dg_boot_json_string(out, x->cpuset);
        fprintf(out, ",\"cuda_index\":%d}", x->cuda_index);
    }
    fprintf(out, "],\"nics\":[");
    for (int k = 0; k < t->n_nics; k++) {
        const dg_nic_info_t *x = &t->nics[k];
        fprintf(out, "%s{\"name\":", k ? "," : "");
        dg_boot_json_string(out, x->name);
        fprintf(out, ",\"pci_busid\":");
        dg_boot_json_string(out, x->pci_busid);
        fprintf(out, ",\"numa\":%d,\"kind\":", x->numa);
        dg_boot_json_string(out, x->kind);
        fprintf(out, "}");
    }
    fprintf(out, "],\"nvlink_gbps\":");
    if (!nr->has_nvlink) {
        fprintf(out, "null");
    } else {
        fprintf(out, "[");
        for (int a = 0; a < t->n_gpus; a++) {
            fprintf(out, "%s[", a ? "," : "");
            for (int b = 0; b < t->n_gpus; b++)
                fprintf(out, "%s%.17g", b ? "," : "", nr->nvlink[a * t->n_gpus + b]);
            fprintf(out, "]");
        }
        fprintf(out, "]");
    }
    fprintf(out, "}");
}

dg_status_t dg_boot_report(dg_boot_t *b, int json, FILE *out) {
    DG_ASSERTF(b->have_topo, "dg_boot_report needs dg_boot_topology first");
    int n = b->world_size, root = b->world_rank == 0;

    rank_rec_t mine = {.rank = b->world_rank,
                       .node_id = b->node_id,
                       .local_rank = b->local_rank,
                       .gpu = b->gpu,
                       .cuda_index = b->gpu >= 0 ? b->topo.gpus[b->gpu].cuda_index : -1,
                       .numa = b->numa};
    snprintf(mine.host, sizeof mine.host, "%s", b->host);
    snprintf(mine.busid, sizeof mine.busid, "%s", b->gpu >= 0 ? b->topo.gpus[b->gpu].pci_busid : "-");
    snprintf(mine.cpuset, sizeof mine.cpuset, "%s", b->bound_cpuset);
    snprintf(mine.bind, sizeof mine.bind, "%s", b->bind_status);
    rank_rec_t *all = root ? dg_xcalloc((size_t)n, sizeof *all) : NULL;
    DG_MPI_CHECK(MPI_Gather(&mine, (int)sizeof mine, MPI_BYTE, all, (int)sizeof mine, MPI_BYTE, 0, b->world));

    /* one summary per node, from its leader; everyone else sends nothing */
    node_rec_t *nmine = dg_xcalloc(1, sizeof *nmine);
    int leader = b->local_rank == 0;
    if (leader) {
        nmine->topo = b->topo;
        nmine->topo.nvlink_bw = NULL;
        int G = b->topo.n_gpus;
        if (b->topo.nvlink_bw && G > 0) {
            nmine->has_nvlink = 1;
            memcpy(nmine->nvlink, b->topo.nvlink_bw, (size_t)G * G * sizeof(double));
        }
        snprintf(nmine->source, sizeof nmine->source, "%s", b->topo_source);
    }
    int *counts = NULL, *displs = NULL;
    node_rec_t *nodes = NULL;
    if (root) {
        counts = dg_xcalloc((size_t)n, sizeof *counts);
        displs = dg_xcalloc((size_t)n, sizeof *displs);
        for (int r = 0; r < n; r++) {
            counts[r] = b->local_ranks[r] == 0 ? (int)sizeof(node_rec_t) : 0;
            displs[r] = b->node_ids[r] * (int)sizeof(node_rec_t);
        }
        nodes = dg_xcalloc((size_t)b->n_nodes, sizeof *nodes);
    }
    int rc = MPI_Gatherv(nmine, leader ? (int)sizeof *nmine : 0, MPI_BYTE, nodes, counts, displs, MPI_BYTE, 0,
                         b->world);
    free(nmine);
    free(counts);
    free(displs);
    if (rc != MPI_SUCCESS) {
        free(all);
        free(nodes);
        DG_MPI_CHECK(rc);
    }
    if (root) {
        /* hosts of each node, for the node lines */
        const char **nhost = dg_xcalloc((size_t)b->n_nodes, sizeof *nhost);
        for (int r = 0; r < n; r++)
            if (b->local_ranks[r] == 0) nhost[b->node_ids[r]] = b->hosts[r];
        if (!json) {
            fprintf(out, "world: %d rank%s on %d node%s; MPI: %s; thread level %s\n", n, n == 1 ? "" : "s",
                    b->n_nodes, b->n_nodes == 1 ? "" : "s", b->mpi_version,
                    dg_boot_thread_level_name(b->provided_thread_level));
            print_rank_table(out, all, n);
            for (int k = 0; k < b->n_nodes; k++)
                print_node(out, k, nhost[k], &nodes[k]);
        } else {
            fprintf(out, "{\"world_size\":%d,\"n_nodes\":%d,\"mpi_version\":", n, b->n_nodes);
            dg_boot_json_string(out, b->mpi_version);
            fprintf(out, ",\"thread_level\":");
            dg_boot_json_string(out, dg_boot_thread_level_name(b->provided_thread_level));
            fprintf(out, ",\"ranks\":[");
            for (int r = 0; r < n; r++) {
                const rank_rec_t *x = &all[r];
                fprintf(out, "%s{\"rank\":%d,\"host\":", r ? "," : "", x->rank);
                dg_boot_json_string(out, x->host);
                fprintf(out, ",\"node\":%d,\"local_rank\":%d,\"gpu\":", x->node_id, x->local_rank);
                if (x->gpu < 0) {
                    fprintf(out, "null");
                } else {
                    fprintf(out, "{\"index\":%d,\"pci_busid\":", x->gpu);
                    dg_boot_json_string(out, x->busid);
                    fprintf(out, ",\"cuda_index\":%d}", x->cuda_index);
                }
                fprintf(out, ",\"numa\":%d,\"cpuset\":", x->numa);
                dg_boot_json_string(out, x->cpuset);
                fprintf(out, ",\"binding\":");
                dg_boot_json_string(out, x->bind);
                fprintf(out, "}");
            }
            fprintf(out, "],\"nodes\":[");
            for (int k = 0; k < b->n_nodes; k++) {
                if (k) fprintf(out, ",");
                json_node(out, k, nhost[k], &nodes[k]);
            }
            fprintf(out, "]}");
        }
        fflush(out);
        free(nhost);
    }
    free(all);
    free(nodes);
    return DG_OK;
}
