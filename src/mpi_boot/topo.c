/* topo.c — hwloc topology of one node: loading (live, $HWLOC_XMLFILE or an XML file), the summary
 * dgtrain needs (sockets, cores, NUMA nodes, GPUs and NICs with their locality, NVLink bandwidth),
 * XML export, and the per-local-rank choice of GPU and CPU set. No MPI here: the planner calls these
 * on XML descriptions of machines that are not here.
 */
#define _GNU_SOURCE
#include "mpi_boot_impl.h"

#include <hwloc/export.h>
#include <stdlib.h>
#include <unistd.h>

void dg_boot_bitmap_list(char *buf, size_t cap, hwloc_const_bitmap_t set) {
    if (hwloc_bitmap_iszero(set)) {
        snprintf(buf, cap, "-");
        return;
    }
    if (hwloc_bitmap_list_snprintf(buf, cap, set) < 0) snprintf(buf, cap, "?");
}

/* ---- classifying PCI devices ---- */

static int is_gpu_subtype(const char *st) {
    static const char *gpu_subtypes[] = {"CUDA", "NVML", "OpenCL", "RSMI", "LevelZero"};
    if (!st) return 0;
    for (size_t i = 0; i < sizeof gpu_subtypes / sizeof *gpu_subtypes; i++)
        if (strcmp(st, gpu_subtypes[i]) == 0) return 1;
    return 0;
}

/* A GPU is a PCI device with a compute OS device (CUDA, NVML, OpenCL, ROCm SMI, Level Zero) below it,
 * or — when the topology has no such OS devices (no vendor plugins) — an NVIDIA VGA or 3D controller,
 * or an AMD "display other"/accelerator class device (Instinct). AMD/ATI VGA-class devices without a
 * compute device are left out (servers carry an ATI ES1000 as BMC graphics), and DRM "card" devices
 * alone do not count either: a BMC's VGA has one too. */
static int pci_is_gpu(hwloc_obj_t pci) {
    for (hwloc_obj_t c = pci->io_first_child; c; c = c->next_sibling)
        if (c->type == HWLOC_OBJ_OS_DEVICE &&
            (c->attr->osdev.type == HWLOC_OBJ_OSDEV_GPU || c->attr->osdev.type == HWLOC_OBJ_OSDEV_COPROC) &&
            is_gpu_subtype(c->subtype))
            return 1;
    unsigned cls = pci->attr->pcidev.class_id, ven = pci->attr->pcidev.vendor_id;
    if (ven == 0x10de) return cls == 0x0300 || cls == 0x0302;
    if (ven == 0x1002) return cls == 0x0380 || cls == 0x1200;
    return 0;
}

static int pci_is_nic(hwloc_obj_t pci) {
    for (hwloc_obj_t c = pci->io_first_child; c; c = c->next_sibling)
        if (c->type == HWLOC_OBJ_OS_DEVICE && (c->attr->osdev.type == HWLOC_OBJ_OSDEV_NETWORK ||
                                               c->attr->osdev.type == HWLOC_OBJ_OSDEV_OPENFABRICS))
            return 1;
    return (pci->attr->pcidev.class_id >> 8) == 0x02; /* network controller class */
}

static void pci_busid(hwloc_obj_t pci, char *buf, size_t cap) {
    snprintf(buf, cap, "%04x:%02x:%02x.%01x", (unsigned)pci->attr->pcidev.domain, pci->attr->pcidev.bus,
             pci->attr->pcidev.dev, pci->attr->pcidev.func);
}

static unsigned long pci_key(hwloc_obj_t pci) {
    const struct hwloc_pcidev_attr_s *a = &pci->attr->pcidev;
    return ((unsigned long)a->domain << 24) | ((unsigned long)a->bus << 16) | ((unsigned long)a->dev << 8) |
           a->func;
}

static int cmp_pci(const void *a, const void *b) {
    unsigned long ka = pci_key(*(hwloc_obj_t const *)a), kb = pci_key(*(hwloc_obj_t const *)b);
    return ka < kb ? -1 : ka > kb;
}

/* os index of the single NUMA node in `nodeset`, or -1 */
static int single_numa(hwloc_const_nodeset_t nodeset) {
    return nodeset && hwloc_bitmap_weight(nodeset) == 1 ? hwloc_bitmap_first(nodeset) : -1;
}

static void locality(hwloc_topology_t topo, hwloc_obj_t pci, int *numa, char *cpuset, size_t cap) {
    hwloc_obj_t anc = hwloc_get_non_io_ancestor_obj(topo, pci);
    *numa = anc ? single_numa(anc->nodeset) : -1;
    if (anc && anc->cpuset)
        dg_boot_bitmap_list(cpuset, cap, anc->cpuset);
    else
        snprintf(cpuset, cap, "-");
}

/* The PCI device an object belongs to (itself, or the parent of an OS device), or NULL. */
static hwloc_obj_t pci_of(hwloc_obj_t o) {
    while (o && o->type == HWLOC_OBJ_OS_DEVICE)
        o = o->parent;
    return o && o->type == HWLOC_OBJ_PCI_DEVICE ? o : NULL;
}

/* ---- NVLink bandwidth ---- */

static void fill_nvlink(hwloc_topology_t topo, dg_node_topo_t *t, hwloc_obj_t *gpu_pci) {
    unsigned nr = 1;
    struct hwloc_distances_s *d = NULL;
    if (t->n_gpus == 0 || hwloc_distances_get_by_name(topo, "NVLinkBandwidth", &nr, &d, 0) < 0 || nr == 0 ||
        !d)
        return;
    unsigned n = d->nbobjs;
    int *gidx = dg_xmalloc(n * sizeof *gidx);
    int *is_switch = dg_xcalloc(n, sizeof *is_switch);
    for (unsigned i = 0; i < n; i++) {
        gidx[i] = -1;
        hwloc_obj_t p = pci_of(d->objs[i]);
        for (int g = 0; p && g < t->n_gpus; g++)
            if (gpu_pci[g] == p) gidx[i] = g;
        /* anything else that is an I/O object (NVSwitch) relays traffic; CPU packages do not */
        if (gidx[i] < 0 && d->objs[i] &&
            (d->objs[i]->type == HWLOC_OBJ_PCI_DEVICE || d->objs[i]->type == HWLOC_OBJ_OS_DEVICE))
            is_switch[i] = 1;
    }
    int G = t->n_gpus;
    double *bw = dg_xcalloc((size_t)G * G, sizeof *bw);
    for (unsigned i = 0; i < n; i++)
        for (unsigned j = 0; j < n; j++)
            if (gidx[i] >= 0 && gidx[j] >= 0 && gidx[i] != gidx[j])
                bw[gidx[i] * G + gidx[j]] += (double)d->values[i * n + j] / 1000.0; /* MB/s -> GB/s */
    /* switches: union-find over switch-to-switch links, then per component each GPU's total link
     * bandwidth into it; a pair of GPUs on one fabric gets the smaller of the two */
    int *comp = dg_xmalloc(n * sizeof *comp);
    for (unsigned i = 0; i < n; i++)
        comp[i] = (int)i;
    for (unsigned i = 0; i < n; i++)
        for (unsigned j = 0; j < n; j++)
            if (is_switch[i] && is_switch[j] && (d->values[i * n + j] || d->values[j * n + i])) {
                int a = (int)i, b = (int)j;
                while (comp[a] != a)
                    a = comp[a];
                while (comp[b] != b)
                    b = comp[b];
                if (a != b) comp[a < b ? b : a] = a < b ? a : b;
            }
    double *into = dg_xcalloc((size_t)G * n, sizeof *into); /* into[g*n + component root] */
    int any_switch = 0;
    for (unsigned i = 0; i < n; i++) {
        if (gidx[i] < 0) continue;
        for (unsigned s = 0; s < n; s++) {
            if (!is_switch[s] || !d->values[i * n + s]) continue;
            int r = (int)s;
            while (comp[r] != r)
                r = comp[r];
            into[gidx[i] * n + (unsigned)r] += (double)d->values[i * n + s] / 1000.0;
            any_switch = 1;
        }
    }
    if (any_switch)
        for (int a = 0; a < G; a++)
            for (int b = 0; b < G; b++) {
                if (a == b) continue;
                for (unsigned r = 0; r < n; r++) {
                    double x = into[a * n + r], y = into[b * n + r];
                    bw[a * G + b] += x < y ? x : y;
                }
            }
    t->nvlink_bw = bw;
    free(into);
    free(comp);
    free(is_switch);
    free(gidx);
    hwloc_distances_release(topo, d);
}

/* ---- CUDA_VISIBLE_DEVICES ---- */

/* Narrow cuda_index to the devices CUDA_VISIBLE_DEVICES lists by index (they then count from 0 in
 * list order). UUID or MIG entries cannot be matched without NVML: left as is, with a note. */
static void apply_cuda_visible(dg_node_topo_t *t) {
    const char *env = getenv("CUDA_VISIBLE_DEVICES");
    if (!env) return;
    int map[DG_TOPO_MAX_GPUS], n = 0;
    char buf[512];
    snprintf(buf, sizeof buf, "%s", env);
    char *save = NULL;
    for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        char *end = NULL;
        long v = strtol(tok, &end, 10);
        if (end == tok || *end || v < 0) {
            DG_LOG_DEBUG("CUDA_VISIBLE_DEVICES='%s' is not a list of indices; GPU indices left as enumerated",
                         env);
            return;
        }
        if (n < DG_TOPO_MAX_GPUS) map[n++] = (int)v;
    }
    for (int g = 0; g < t->n_gpus; g++) {
        int idx = -1;
        for (int k = 0; k < n; k++)
            if (map[k] == t->gpus[g].cuda_index) {
                idx = k;
                break;
            }
        t->gpus[g].cuda_index = idx;
    }
}

/* ---- loading ---- */

static const char *xml_source(const char *path) {
    if (path && *path) return path;
    const char *env = getenv("HWLOC_XMLFILE");
    return env && *env ? env : NULL;
}

static dg_status_t summarize(hwloc_topology_t topo, const char *xml, dg_node_topo_t *t) {
    hwloc_obj_t root = hwloc_get_root_obj(topo);
    const char *hn = hwloc_obj_get_info_by_name(root, "HostName");
    if (xml && hn)
        snprintf(t->host, sizeof t->host, "%s", hn);
    else if (xml) {
        const char *base = strrchr(xml, '/');
        snprintf(t->host, sizeof t->host, "%s", base ? base + 1 : xml);
    } else {
        if (gethostname(t->host, sizeof t->host - 1) != 0) snprintf(t->host, sizeof t->host, "unknown");
        t->host[sizeof t->host - 1] = 0;
    }
    t->n_sockets = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_PACKAGE);
    t->n_cores = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE);
    t->n_pus = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_PU);
    t->n_numa = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE);
    if (t->n_cores <= 0) t->n_cores = t->n_pus; /* some descriptions have no Core level */

    int npci = 0;
    for (hwloc_obj_t p = NULL; (p = hwloc_get_next_pcidev(topo, p));)
        npci++;
    hwloc_obj_t *pcis = dg_xcalloc((size_t)npci, sizeof *pcis);
    int k = 0;
    for (hwloc_obj_t p = NULL; (p = hwloc_get_next_pcidev(topo, p));)
        pcis[k++] = p;
    qsort(pcis, (size_t)npci, sizeof *pcis, cmp_pci);

    hwloc_obj_t gpu_pci[DG_TOPO_MAX_GPUS];
    int cuda_listed[DG_TOPO_MAX_GPUS] = {0};
    int per_vendor[2] = {0, 0}, dropped_gpus = 0, dropped_nics = 0;
    for (int i = 0; i < npci; i++) {
        hwloc_obj_t p = pcis[i];
        if (pci_is_gpu(p)) {
            if (t->n_gpus == DG_TOPO_MAX_GPUS) {
                dropped_gpus++;
                continue;
            }
            dg_gpu_info_t *g = &t->gpus[t->n_gpus];
            gpu_pci[t->n_gpus++] = p;
            pci_busid(p, g->pci_busid, sizeof g->pci_busid);
            locality(topo, p, &g->numa, g->cpuset, sizeof g->cpuset);
            const char *model = NULL;
            int cuda = -1;
            for (hwloc_obj_t c = p->io_first_child; c; c = c->next_sibling) {
                if (c->type != HWLOC_OBJ_OS_DEVICE) continue;
                const char *m = hwloc_obj_get_info_by_name(c, "GPUModel");
                if (m && !model) model = m;
                if (c->name && strncmp(c->name, "cuda", 4) == 0) {
                    char *end = NULL;
                    long v = strtol(c->name + 4, &end, 10);
                    if (end != c->name + 4 && !*end) cuda = (int)v;
                }
            }
            if (!model) model = hwloc_obj_get_info_by_name(p, "PCIDevice");
            if (model)
                snprintf(g->name, sizeof g->name, "%s", model);
            else
                snprintf(g->name, sizeof g->name, "PCI %04x:%04x", p->attr->pcidev.vendor_id,
                         p->attr->pcidev.device_id);
            /* without a CUDA OS device: the index CUDA gives with CUDA_DEVICE_ORDER=PCI_BUS_ID */
            int v = p->attr->pcidev.vendor_id == 0x10de ? 0 : 1;
            g->cuda_index = cuda >= 0 ? cuda : per_vendor[v];
            cuda_listed[t->n_gpus - 1] = cuda >= 0;
            per_vendor[v]++;
        } else if (pci_is_nic(p)) {
            if (t->n_nics == DG_TOPO_MAX_NICS) {
                dropped_nics++;
                continue;
            }
            dg_nic_info_t *nic = &t->nics[t->n_nics++];
            char bus[32];
            pci_busid(p, bus, sizeof bus);
            memcpy(nic->pci_busid, bus, sizeof bus);
            char cpus[256];
            locality(topo, p, &nic->numa, cpus, sizeof cpus);
            const char *net = NULL, *ofed = NULL, *link = NULL;
            for (hwloc_obj_t c = p->io_first_child; c; c = c->next_sibling) {
                if (c->type != HWLOC_OBJ_OS_DEVICE || !c->name) continue;
                if (c->attr->osdev.type == HWLOC_OBJ_OSDEV_OPENFABRICS && !ofed) {
                    ofed = c->name;
                    link = hwloc_obj_get_info_by_name(c, "Port1LinkLayer");
                }
                if (c->attr->osdev.type == HWLOC_OBJ_OSDEV_NETWORK && !net) net = c->name;
            }
            unsigned cls = p->attr->pcidev.class_id;
            if (ofed)
                snprintf(nic->kind, sizeof nic->kind, "%s",
                         link && strcmp(link, "Ethernet") == 0 ? "roce" : "ib");
            else
                snprintf(nic->kind, sizeof nic->kind, "%s",
                         cls == 0x0207   ? "ib"
                         : cls == 0x0200 ? "eth"
                                         : "net");
            if (ofed || net)
                snprintf(nic->name, sizeof nic->name, "%s", ofed ? ofed : net);
            else
                snprintf(nic->name, sizeof nic->name, "pci:%.27s", bus);
        }
    }
    /* when CUDA's own enumeration is in the topology, a GPU it did not list is not a CUDA device here */
    int any_cuda = 0;
    for (int g = 0; g < t->n_gpus; g++)
        any_cuda |= cuda_listed[g];
    for (int g = 0; any_cuda && g < t->n_gpus; g++)
        if (!cuda_listed[g]) t->gpus[g].cuda_index = -1;
    if (dropped_gpus || dropped_nics)
        DG_LOG_WARN("topology of %s: %d GPU(s) and %d NIC(s) beyond the first %d/%d are not reported",
                    t->host, dropped_gpus, dropped_nics, DG_TOPO_MAX_GPUS, DG_TOPO_MAX_NICS);
    fill_nvlink(topo, t, gpu_pci);
    free(pcis);
    return DG_OK;
}

dg_status_t dg_topo_load(const char *xml_path_or_null, dg_node_topo_t *out, hwloc_topology_t *keep_or_null) {
    memset(out, 0, sizeof *out);
    if (keep_or_null) *keep_or_null = NULL;
    const char *xml = xml_source(xml_path_or_null);
    if (xml) {
        FILE *f = fopen(xml, "rb");
        if (!f)
            return DG_ERR(DG_ERR_USAGE, "cannot open hwloc topology XML '%s'%s: %s", xml,
                          xml_path_or_null && *xml_path_or_null ? " (topology.xml)" : " ($HWLOC_XMLFILE)",
                          strerror(errno));
        fclose(f);
    }
    hwloc_topology_t topo;
    DG_HWLOC_CHECK(hwloc_topology_init(&topo), "out of memory?");
    /* GPUs and NICs (and the bridges leading to them) are what we need from the I/O tree */
    if (hwloc_topology_set_io_types_filter(topo, HWLOC_TYPE_FILTER_KEEP_IMPORTANT) < 0 ||
        (xml && hwloc_topology_set_xml(topo, xml) < 0) || hwloc_topology_load(topo) < 0) {
        int e = errno;
        hwloc_topology_destroy(topo);
        if (xml)
            return DG_ERR(
                DG_ERR_USAGE,
                "cannot load hwloc topology XML '%s': %s; expected an hwloc 2.x XML file (lstopo --of xml)",
                xml, e ? strerror(e) : "invalid topology");
        return DG_ERR(DG_ERR_RUNTIME,
                      "hwloc could not discover this machine's topology: %s; hint: set "
                      "[topology] xml to an exported description",
                      e ? strerror(e) : "unknown error");
    }
    dg_status_t s = summarize(topo, xml, out);
    /* CUDA_VISIBLE_DEVICES describes this machine: it applies to the live topology, or to an XML file
     * that HWLOC_THISSYSTEM=1 declares to be this machine */
    if (s == DG_OK && hwloc_topology_is_thissystem(topo)) apply_cuda_visible(out);
    if (s != DG_OK || !keep_or_null) {
        hwloc_topology_destroy(topo);
        if (s != DG_OK) dg_topo_free(out);
    } else {
        *keep_or_null = topo;
    }
    return s;
}

void dg_topo_free(dg_node_topo_t *t) {
    if (!t) return;
    free(t->nvlink_bw);
    t->nvlink_bw = NULL;
}

dg_status_t dg_topo_export_xml(const char *xml_in_or_null, const char *out_path) {
    dg_node_topo_t t;
    hwloc_topology_t topo = NULL;
    DG_TRY(dg_topo_load(xml_in_or_null, &t, &topo));
    char *buf = NULL;
    int len = 0;
    dg_status_t s = DG_OK;
    errno = 0;
    if (hwloc_topology_export_xmlbuffer(topo, &buf, &len, 0) < 0 || len < 1)
        s = DG_ERR(DG_ERR_RUNTIME,
                   "hwloc call `hwloc_topology_export_xmlbuffer` failed: %s; hint: was hwloc built "
                   "with XML support?",
                   strerror(errno));
    else
        s = dg_write_file_atomic(out_path, buf, (size_t)len - 1); /* len counts the final NUL */
    if (buf) hwloc_free_xmlbuffer(topo, buf);
    hwloc_topology_destroy(topo);
    dg_topo_free(&t);
    return s;
}

/* ---- GPU and CPU-set choice ---- */

/* The CPU locality of GPU g as a bitmap (the non-I/O ancestor of its PCI device), or NULL. */
static hwloc_const_cpuset_t gpu_locality(hwloc_topology_t topo, const dg_node_topo_t *t, int g) {
    hwloc_obj_t p = hwloc_get_pcidev_by_busidstring(topo, t->gpus[g].pci_busid);
    hwloc_obj_t anc = p ? hwloc_get_non_io_ancestor_obj(topo, p) : NULL;
    return anc ? anc->cpuset : NULL;
}

dg_status_t dg_topo_choose(hwloc_topology_t topo, const dg_node_topo_t *t, int local_rank, int local_size,
                           int bind_auto, int *gpu_out, hwloc_bitmap_t cpuset_out, int *numa_out) {
    DG_ASSERT(local_rank >= 0 && local_rank < local_size);
    /* visible GPUs in CUDA's order, so local rank r gets CUDA device r when there are enough */
    int vis[DG_TOPO_MAX_GPUS], nvis = 0;
    for (int g = 0; g < t->n_gpus; g++)
        if (t->gpus[g].cuda_index >= 0) vis[nvis++] = g;
    for (int i = 1; i < nvis; i++)
        for (int j = i; j > 0 && t->gpus[vis[j]].cuda_index < t->gpus[vis[j - 1]].cuda_index; j--) {
            int x = vis[j];
            vis[j] = vis[j - 1];
            vis[j - 1] = x;
        }
    int my_gpu = nvis ? vis[local_rank % nvis] : -1;
    *gpu_out = my_gpu;
    hwloc_const_cpuset_t allowed = hwloc_topology_get_allowed_cpuset(topo);

    hwloc_bitmap_t domain = hwloc_bitmap_alloc();
    int member = local_rank, members = local_size;
    hwloc_const_cpuset_t loc = my_gpu >= 0 ? gpu_locality(topo, t, my_gpu) : NULL;
    if (loc) {
        hwloc_bitmap_and(domain, loc, allowed);
        member = 0;
        members = 0;
        for (int q = 0; q < local_size; q++) {
            hwloc_const_cpuset_t lq = gpu_locality(topo, t, vis[q % nvis]);
            if (lq && hwloc_bitmap_isequal(lq, loc)) {
                if (q < local_rank) member++;
                members++;
            }
        }
    }
    if (!loc || hwloc_bitmap_iszero(domain)) {
        hwloc_bitmap_copy(domain, allowed);
        member = local_rank;
        members = local_size;
    }

    if (!bind_auto) {
        hwloc_bitmap_copy(cpuset_out, allowed);
    } else {
        hwloc_obj_type_t unit = HWLOC_OBJ_CORE;
        int n = hwloc_get_nbobjs_inside_cpuset_by_type(topo, domain, unit);
        if (n <= 0) {
            unit = HWLOC_OBJ_PU;
            n = hwloc_get_nbobjs_inside_cpuset_by_type(topo, domain, unit);
        }
        hwloc_bitmap_zero(cpuset_out);
        if (n <= 0) {
            hwloc_bitmap_copy(cpuset_out, domain);
        } else {
            int start = (int)((long)member * n / members), end = (int)((long)(member + 1) * n / members);
            if (start >= n) start = n - 1;
            if (end <= start) end = start + 1; /* more ranks than cores: share the one we land on */
            for (int c = start; c < end; c++) {
                hwloc_obj_t o = hwloc_get_obj_inside_cpuset_by_type(topo, domain, unit, (unsigned)c);
                if (o && o->cpuset) hwloc_bitmap_or(cpuset_out, cpuset_out, o->cpuset);
            }
            hwloc_bitmap_and(cpuset_out, cpuset_out, domain);
        }
    }
    hwloc_bitmap_free(domain);
    hwloc_nodeset_t ns = hwloc_bitmap_alloc();
    hwloc_cpuset_to_nodeset(topo, cpuset_out, ns);
    *numa_out = single_numa(ns);
    hwloc_bitmap_free(ns);
    return DG_OK;
}
