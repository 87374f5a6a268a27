/* cluster.c — the cluster model behind the planner: link classes between ranks, the defaults table of
 * bandwidths and latencies, and cluster description files for clusters that are not here. */
#define _GNU_SOURCE
#include <ini.h>
#include <libgen.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "planner.h"

static const char *k_link_names[DG_LINK_NCLASS] = {"same_device", "nvlink",       "pcie_switch",
                                                   "same_socket", "cross_socket", "network"};

const char *dg_link_class_name(int cls) {
    DG_ASSERT(cls >= 0 && cls < DG_LINK_NCLASS);
    return k_link_names[cls];
}

/* Datasheet-level numbers, per direction, for one rank's stream (docs/planning.md gives the sources):
 *  GPU: NVLink 4 (H100/H200 SXM) 900 GB/s bidirectional -> 450; PCIe Gen5 x16 64 GB/s raw, ~50 sustained
 *  through a switch, ~40 through the root complex; cross-socket (UPI/xGMI, host-staged) ~25; network:
 *  one NDR InfiniBand port 400 Gb/s = 50 GB/s, ~45 sustained.
 *  CPU ranks: MPI shared-memory transport (copy in, copy out) ~8 GB/s within a socket, ~5 across. */
void dg_cluster_default_links(dg_link_param_t link[DG_LINK_NCLASS], int gpu_mode) {
    if (gpu_mode) {
        link[DG_LINK_SAME_DEVICE] = (dg_link_param_t){1000.0, 1.0};
        link[DG_LINK_NVLINK] = (dg_link_param_t){450.0, 2.0};
        link[DG_LINK_PCIE_SWITCH] = (dg_link_param_t){50.0, 3.0};
        link[DG_LINK_SAME_SOCKET] = (dg_link_param_t){40.0, 4.0};
        link[DG_LINK_CROSS_SOCKET] = (dg_link_param_t){25.0, 6.0};
        link[DG_LINK_NETWORK] = (dg_link_param_t){45.0, 6.0};
    } else {
        link[DG_LINK_SAME_DEVICE] = (dg_link_param_t){20.0, 0.5};
        link[DG_LINK_NVLINK] = (dg_link_param_t){8.0, 1.0}; /* unused for CPU ranks */
        link[DG_LINK_PCIE_SWITCH] = (dg_link_param_t){8.0, 1.0};
        link[DG_LINK_SAME_SOCKET] = (dg_link_param_t){8.0, 1.0};
        link[DG_LINK_CROSS_SOCKET] = (dg_link_param_t){5.0, 1.5};
        link[DG_LINK_NETWORK] = (dg_link_param_t){12.0, 5.0};
    }
}

/* Memory and dense bf16 peak of a GPU by model name (substring match). */
static void gpu_budget(const char *name, double *mem, double *peak) {
    static const struct {
        const char *key;
        double gib, tflops;
    } k[] = {{"H200", 141, 989}, {"H100", 80, 989}, {"A100", 80, 312}, {"V100", 32, 125}, {"P100", 16, 21}};
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++)
        if (strcasestr(name, k[i].key)) {
            *mem = k[i].gib * 1073741824.0;
            *peak = k[i].tflops * 1e12;
            return;
        }
    *mem = 80.0 * 1073741824.0;
    *peak = 989e12;
}

/* Top-most PCI-to-PCI bridge above a GPU: GPUs below the same one share a PCIe switch. */
static int switch_id(hwloc_topology_t topo, const char *busid) {
    if (!topo) return -1;
    hwloc_obj_t o = hwloc_get_pcidev_by_busidstring(topo, busid);
    int id = -1;
    for (o = o ? o->parent : NULL; o && o->type == HWLOC_OBJ_BRIDGE; o = o->parent)
        if (o->attr->bridge.upstream_type == HWLOC_OBJ_BRIDGE_PCI) id = (int)o->gp_index;
    return id;
}

static int socket_of_numa(hwloc_topology_t topo, int numa_os) {
    if (!topo || numa_os < 0) return numa_os < 0 ? 0 : numa_os;
    hwloc_obj_t n = hwloc_get_numanode_obj_by_os_index(topo, (unsigned)numa_os);
    if (!n) return 0;
    hwloc_obj_t p = hwloc_get_ancestor_obj_by_type(topo, HWLOC_OBJ_PACKAGE, n);
    if (!p && n->cpuset)
        p = hwloc_get_next_obj_covering_cpuset_by_type(topo, n->cpuset, HWLOC_OBJ_PACKAGE, NULL);
    return p ? (int)p->logical_index : 0;
}

/* One rank's share of its node's NICs (90% of line rate sustained), capped by one NIC. */
static void apply_nic_share(dg_cluster_t *c) {
    if (c->nics_per_node <= 0) return;
    double share = c->nics_per_node * c->nic_GBps * 0.9 / c->ranks_per_node;
    c->link[DG_LINK_NETWORK].bw_GBps = share < c->nic_GBps * 0.9 ? share : c->nic_GBps * 0.9;
}

dg_status_t dg_cluster_from_topo(const dg_node_topo_t *t, void *hwtopo_v, int n_nodes, int rpn,
                                 dg_cluster_t *c) {
    hwloc_topology_t topo = (hwloc_topology_t)hwtopo_v;
    memset(c, 0, sizeof *c);
    c->gpu_mode = t->n_gpus > 0;
    c->n_gpus = t->n_gpus;
    if (rpn <= 0) rpn = c->gpu_mode ? t->n_gpus : (t->n_cores > 0 ? t->n_cores : 1);
    if (n_nodes < 1) return DG_ERR(DG_ERR_USAGE, "cluster: nodes must be >= 1, got %d", n_nodes);
    if (rpn > DG_PLAN_MAX_LOCAL)
        return DG_ERR(DG_ERR_USAGE, "cluster: %d ranks per node is more than the planner supports (%d)", rpn,
                      DG_PLAN_MAX_LOCAL);
    if (c->gpu_mode && rpn > t->n_gpus)
        return DG_ERR(DG_ERR_USAGE, "cluster: %d ranks per node but the node has %d GPUs (one rank per GPU)",
                      rpn, t->n_gpus);
    c->n_nodes = n_nodes;
    c->ranks_per_node = rpn;
    c->world = n_nodes * rpn;
    dg_cluster_default_links(c->link, c->gpu_mode);
    int sockets = t->n_sockets > 0 ? t->n_sockets : 1;
    for (int l = 0; l < rpn; l++) {
        if (c->gpu_mode) {
            const dg_gpu_info_t *g = &t->gpus[l];
            c->local_gpu[l] = l;
            c->local_numa[l] = g->numa;
            c->local_socket[l] = socket_of_numa(topo, g->numa);
            c->local_switch[l] = switch_id(topo, g->pci_busid);
        } else {
            c->local_gpu[l] = -1;
            c->local_socket[l] = (int)((int64_t)l * sockets / rpn);
            c->local_numa[l] = c->local_socket[l];
            c->local_switch[l] = -1;
        }
    }
    if (t->nvlink_bw && t->n_gpus > 0) {
        size_t nn = (size_t)t->n_gpus * (size_t)t->n_gpus;
        c->nvlink_bw = dg_xmalloc(nn * sizeof(double));
        memcpy(c->nvlink_bw, t->nvlink_bw, nn * sizeof(double));
    }
    c->nics_per_node = 0;
    for (int i = 0; i < t->n_nics; i++)
        if (strcmp(t->nics[i].kind, "ib") == 0) c->nics_per_node++;
    if (!c->nics_per_node) c->nics_per_node = t->n_nics > 0 ? 1 : 0;
    c->nic_GBps = 50.0;
    apply_nic_share(c);
    c->max_pp = c->world; /* pipeline candidates are scored as for a described cluster */
    if (c->gpu_mode) {
        gpu_budget(t->gpus[0].name, &c->mem_per_rank_bytes, &c->peak_flops_per_rank);
        c->max_tp = rpn;
    } else {
        double mem = 0;
        if (topo) mem = (double)hwloc_get_root_obj(topo)->total_memory;
        if (mem <= 0) mem = 16.0 * 1073741824.0;
        c->mem_per_rank_bytes = mem / rpn;
        int cores_per_rank = t->n_cores > rpn ? t->n_cores / rpn : 1;
        c->peak_flops_per_rank = 50e9 * cores_per_rank;
        c->max_tp = rpn;
    }
    snprintf(c->node_desc, sizeof c->node_desc, "%d socket(s), %d cores, %d GPU(s)%s%s, %d NIC(s)",
             t->n_sockets, t->n_cores, t->n_gpus, c->gpu_mode ? " " : "", c->gpu_mode ? t->gpus[0].name : "",
             t->n_nics);
    return DG_OK;
}

void dg_cluster_free(dg_cluster_t *c) {
    free(c->nvlink_bw);
    c->nvlink_bw = NULL;
}

int dg_cluster_link(const dg_cluster_t *c, int a, int b) {
    int rpn = c->ranks_per_node;
    if (a / rpn != b / rpn) return DG_LINK_NETWORK;
    int la = a % rpn, lb = b % rpn;
    if (la == lb) return DG_LINK_SAME_DEVICE;
    if (c->gpu_mode) {
        int ga = c->local_gpu[la], gb = c->local_gpu[lb];
        if (c->nvlink_bw && c->nvlink_bw[ga * c->n_gpus + gb] > 0) return DG_LINK_NVLINK;
        if (c->local_switch[la] >= 0 && c->local_switch[la] == c->local_switch[lb])
            return DG_LINK_PCIE_SWITCH;
    }
    return c->local_socket[la] == c->local_socket[lb] ? DG_LINK_SAME_SOCKET : DG_LINK_CROSS_SOCKET;
}

/* ---------------- cluster description files ---------------- */

typedef struct {
    char node_xml[DG_CFG_STR];
    int nodes, rpn, nics;
    double nic_gbps, mem_gib, peak_tflops;
    char nvlink[16];
    double link_gbps[DG_LINK_NCLASS], link_us[DG_LINK_NCLASS];
    char err[512];
    int line;
} cluster_file_t;

static int parse_num(const char *v, double *out) {
    char *end = NULL;
    double d = strtod(v, &end);
    if (!*v || *end || !isfinite(d) || d < 0) return 0;
    *out = d;
    return 1;
}

static int cluster_ini_handler(void *user, const char *section, const char *name, const char *value) {
    cluster_file_t *f = user;
    double d = 0;
    if (f->err[0]) return 0;
    if (strcmp(section, "cluster") == 0) {
        if (strcmp(name, "node_xml") == 0) {
            snprintf(f->node_xml, sizeof f->node_xml, "%s", value);
            return 1;
        }
        if (strcmp(name, "nvlink") == 0) {
            if (strcmp(value, "auto") && strcmp(value, "all") && strcmp(value, "none")) {
                snprintf(f->err, sizeof f->err, "[cluster] nvlink: expected auto, all or none, got '%s'",
                         value);
                return 0;
            }
            snprintf(f->nvlink, sizeof f->nvlink, "%s", value);
            return 1;
        }
        if (!parse_num(value, &d)) {
            snprintf(f->err, sizeof f->err, "[cluster] %s: expected a non-negative number, got '%s'", name,
                     value);
            return 0;
        }
        if (strcmp(name, "nodes") == 0)
            f->nodes = (int)d;
        else if (strcmp(name, "ranks_per_node") == 0)
            f->rpn = (int)d;
        else if (strcmp(name, "nics_per_node") == 0)
            f->nics = (int)d;
        else if (strcmp(name, "nic_gbps") == 0)
            f->nic_gbps = d;
        else if (strcmp(name, "mem_gib") == 0)
            f->mem_gib = d;
        else if (strcmp(name, "peak_tflops") == 0)
            f->peak_tflops = d;
        else {
            snprintf(f->err, sizeof f->err,
                     "unknown key [cluster] %s (expected node_xml, nodes, ranks_per_node, nics_per_node, "
                     "nic_gbps, "
                     "nvlink, mem_gib, peak_tflops)",
                     name);
            return 0;
        }
        return 1;
    }
    if (strcmp(section, "links") == 0) {
        for (int k = 1; k < DG_LINK_NCLASS; k++) {
            size_t L = strlen(k_link_names[k]);
            if (strncmp(name, k_link_names[k], L) != 0 || name[L] != '_') continue;
            if (!parse_num(value, &d) || d <= 0) {
                snprintf(f->err, sizeof f->err, "[links] %s: expected a positive number, got '%s'", name,
                         value);
                return 0;
            }
            if (strcmp(name + L + 1, "gbps") == 0)
                f->link_gbps[k] = d;
            else if (strcmp(name + L + 1, "us") == 0)
                f->link_us[k] = d;
            else
                break;
            return 1;
        }
        snprintf(
            f->err, sizeof f->err,
            "unknown key [links] %s (expected <class>_gbps or <class>_us, class one of nvlink, pcie_switch, "
            "same_socket, cross_socket, network)",
            name);
        return 0;
    }
    snprintf(f->err, sizeof f->err, "unknown section [%s] (expected [cluster] or [links])", section);
    return 0;
}

dg_status_t dg_cluster_load(const char *path, int world, dg_cluster_t *out) {
    cluster_file_t f;
    memset(&f, 0, sizeof f);
    f.nodes = 1;
    snprintf(f.nvlink, sizeof f.nvlink, "auto");
    FILE *fp = fopen(path, "r");
    if (!fp) return DG_ERR(DG_ERR_USAGE, "cannot open cluster description %s", path);
    int rc = ini_parse_file(fp, cluster_ini_handler, &f);
    fclose(fp);
    if (f.err[0]) return DG_ERR(DG_ERR_USAGE, "%s:%d: %s", path, rc > 0 ? rc : 0, f.err);
    if (rc != 0)
        return DG_ERR(DG_ERR_USAGE, "%s:%d: malformed line (expected key = value or [section])", path, rc);
    if (!f.node_xml[0]) return DG_ERR(DG_ERR_USAGE, "%s: [cluster] node_xml is required", path);
    char xml[2 * DG_CFG_STR + 2];
    if (f.node_xml[0] == '/') {
        snprintf(xml, sizeof xml, "%s", f.node_xml);
    } else {
        char dirbuf[DG_CFG_STR];
        snprintf(dirbuf, sizeof dirbuf, "%s", path);
        snprintf(xml, sizeof xml, "%s/%s", dirname(dirbuf), f.node_xml);
    }
    dg_node_topo_t t;
    hwloc_topology_t topo = NULL;
    dg_status_t s = dg_topo_load(xml, &t, &topo);
    if (s) {
        char why[1024]; /* copied first: DG_ERR formats into the buffer dg_last_error() returns */
        snprintf(why, sizeof why, "%s", dg_last_error());
        return DG_ERR(DG_ERR_USAGE, "%s: node_xml: %s", path, why);
    }
    int rpn = f.rpn > 0 ? f.rpn : (t.n_gpus > 0 ? t.n_gpus : (t.n_cores > 0 ? t.n_cores : 1));
    int nodes = f.nodes;
    if (world > 0) {
        if (world % rpn)
            s = DG_ERR(DG_ERR_USAGE, "%s: world size %d does not fill whole nodes of %d ranks", path, world,
                       rpn);
        nodes = world / rpn;
    }
    if (!s) s = dg_cluster_from_topo(&t, topo, nodes, rpn, out);
    if (!s) {
        if (strcmp(f.nvlink, "none") == 0) {
            free(out->nvlink_bw);
            out->nvlink_bw = NULL;
        } else if (strcmp(f.nvlink, "all") == 0 && out->n_gpus > 0) {
            free(out->nvlink_bw);
            out->nvlink_bw = dg_xcalloc((size_t)out->n_gpus * (size_t)out->n_gpus, sizeof(double));
            for (int i = 0; i < out->n_gpus; i++)
                for (int j = 0; j < out->n_gpus; j++)
                    out->nvlink_bw[i * out->n_gpus + j] = i == j ? 0 : out->link[DG_LINK_NVLINK].bw_GBps;
        }
        out->max_pp = out->world; /* planning only: pipeline candidates are scored */
        if (f.nics > 0) out->nics_per_node = f.nics;
        if (f.nic_gbps > 0) out->nic_GBps = f.nic_gbps / 8.0;
        if (f.mem_gib > 0) out->mem_per_rank_bytes = f.mem_gib * 1073741824.0;
        if (f.peak_tflops > 0) out->peak_flops_per_rank = f.peak_tflops * 1e12;
        for (int k = 1; k < DG_LINK_NCLASS; k++) {
            if (f.link_gbps[k] > 0) out->link[k].bw_GBps = f.link_gbps[k] / 8.0;
            if (f.link_us[k] > 0) out->link[k].lat_us = f.link_us[k];
        }
        if (f.link_gbps[DG_LINK_NETWORK] <= 0) apply_nic_share(out);
        const char *base = strrchr(xml, '/');
        char desc[512];
        snprintf(desc, sizeof desc, "%d x [%s] (%.80s), %d NIC(s) x %.0f Gb/s", nodes, out->node_desc,
                 base ? base + 1 : xml, out->nics_per_node, out->nic_GBps * 8);
        memcpy(out->node_desc, desc, sizeof out->node_desc - 1);
        out->node_desc[sizeof out->node_desc - 1] = 0;
    }
    dg_topo_free(&t);
    if (topo) hwloc_topology_destroy(topo);
    return s;
}
