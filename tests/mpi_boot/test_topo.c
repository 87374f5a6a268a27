/* test_topo.c — topology discovery and per-rank choice on machines that are not here: the project's two
 * hand-written hwloc XML descriptions and one exported from the GPU machine (tests/mpi_boot/data), and
 * when present the real machines of ../shared/topologies. Checks sockets/cores/NUMA counts, which PCI devices
 * are GPUs and NICs, each GPU's NUMA node and nearby cores, NVLink bandwidth, the GPU and cpuset each local
 * rank gets, $HWLOC_XMLFILE, CUDA_VISIBLE_DEVICES, XML export, and bad XML input. No MPI.
 *
 *   test_topo DATA_DIR [SHARED_TOPOLOGIES_DIR]
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dg_check.h"
#include "mpi_boot.h"

static char g_data[1024];

static const char *path_of(const char *name) {
    static char buf[4][1200];
    static int k;
    char *p = buf[k++ % 4];
    snprintf(p, 1200, "%s/%s", g_data, name);
    return p;
}

/* what local rank lr of ls gets: gpu index, cpuset list text, numa */
static void choose(hwloc_topology_t topo, const dg_node_topo_t *t, int lr, int ls, int bind, int *gpu,
                   char *cpus, int *numa) {
    hwloc_bitmap_t set = hwloc_bitmap_alloc();
    CHECK(dg_topo_choose(topo, t, lr, ls, bind, gpu, set, numa) == DG_OK);
    hwloc_bitmap_list_snprintf(cpus, 256, set);
    hwloc_bitmap_free(set);
}

static void expect_rank(hwloc_topology_t topo, const dg_node_topo_t *t, int lr, int ls, int want_gpu,
                        const char *want_cpus, int want_numa, int line) {
    int gpu = -2, numa = -2;
    char cpus[256];
    choose(topo, t, lr, ls, 1, &gpu, cpus, &numa);
    dg_checks++;
    if (gpu != want_gpu || strcmp(cpus, want_cpus) != 0 || numa != want_numa) {
        dg_fails++;
        fprintf(
            stderr,
            "FAIL test_topo.c:%d: local rank %d/%d got gpu %d cpus %s numa %d, want gpu %d cpus %s numa %d\n",
            line, lr, ls, gpu, cpus, numa, want_gpu, want_cpus, want_numa);
    }
}
#define EXPECT_RANK(topo, t, lr, ls, g, c, n) expect_rank(topo, t, lr, ls, g, c, n, __LINE__)

/* A machine of tests/mpi_boot/data as a test expects it: its file, host name and counts (nics < 0: the
 * test checks the NICs itself) */
typedef struct {
    const char *file, *host;
    int sockets, cores, pus, numa, gpus, nics;
} machine_t;

/* Loads m's file into *t and *topo and checks its host name and counts */
static void load_machine(const machine_t *m, dg_node_topo_t *t, hwloc_topology_t *topo) {
    CHECK(dg_topo_load(path_of(m->file), t, topo) == DG_OK, "loading %s", m->file);
    CHECK_STR(t->host, m->host);
    CHECK(t->n_sockets == m->sockets && t->n_cores == m->cores && t->n_pus == m->pus && t->n_numa == m->numa,
          "%s: %d sockets, %d cores, %d PUs, %d NUMA nodes", m->file, t->n_sockets, t->n_cores, t->n_pus,
          t->n_numa);
    CHECK(t->n_gpus == m->gpus && (m->nics < 0 || t->n_nics == m->nics), "%s: %d GPUs, %d NICs", m->file,
          t->n_gpus, t->n_nics);
}

/* The end of a test of a loaded machine */
static void free_machine(dg_node_topo_t *t, hwloc_topology_t topo) {
    dg_topo_free(t);
    hwloc_topology_destroy(topo);
}

static void test_node_a(void) {
    dg_node_topo_t t;
    hwloc_topology_t topo;
    /* 8 GPUs: the ASPEED VGA is not one */
    load_machine(&(const machine_t){"node-2s-8gpu-4ib.xml", "gpunode-a", 2, 32, 64, 2, 8, -1}, &t, &topo);
    static const char *bus[8] = {"0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0",
                                 "0000:9a:00.0", "0000:ab:00.0", "0000:ba:00.0", "0000:db:00.0"};
    for (int g = 0; g < 8 && g < t.n_gpus; g++) {
        CHECK_STR(t.gpus[g].pci_busid, bus[g]);
        CHECK(t.gpus[g].numa == g / 4);
        CHECK_STR(t.gpus[g].cpuset, g < 4 ? "0-15,32-47" : "16-31,48-63");
        CHECK(t.gpus[g].cuda_index == g);
        CHECK_STR(t.gpus[g].name, "NVIDIA H100 80GB HBM3");
    }
    CHECK(t.n_nics == 5);
    static const char *nic[5][4] = {{"eno1", "0000:04:00.0", "eth", "0"},
                                    {"mlx5_0", "0000:19:00.0", "ib", "0"},
                                    {"mlx5_1", "0000:3b:00.0", "ib", "0"},
                                    {"mlx5_2", "0000:9b:00.0", "ib", "1"},
                                    {"mlx5_3", "0000:bb:00.0", "ib", "1"}};
    for (int k = 0; k < 5 && k < t.n_nics; k++) {
        CHECK_STR(t.nics[k].name, nic[k][0]);
        CHECK_STR(t.nics[k].pci_busid, nic[k][1]);
        CHECK_STR(t.nics[k].kind, nic[k][2]);
        CHECK(t.nics[k].numa == atoi(nic[k][3]));
    }
    CHECK(t.nvlink_bw != NULL);
    if (t.nvlink_bw) {
        for (int a = 0; a < 8; a++)
            for (int b = 0; b < 8; b++) {
                double want = a == b ? 0 : a / 2 == b / 2 ? 100 : a / 4 == b / 4 ? 50 : 0;
                CHECK(t.nvlink_bw[a * 8 + b] == want);
            }
    }
    /* one rank per GPU: each rank gets a quarter of its GPU's socket */
    EXPECT_RANK(topo, &t, 0, 8, 0, "0-3,32-35", 0);
    EXPECT_RANK(topo, &t, 3, 8, 3, "12-15,44-47", 0);
    EXPECT_RANK(topo, &t, 5, 8, 5, "20-23,52-55", 1);
    EXPECT_RANK(topo, &t, 7, 8, 7, "28-31,60-63", 1);
    /* two ranks per GPU: the 8 ranks near a socket share its 16 cores, two cores each */
    EXPECT_RANK(topo, &t, 0, 16, 0, "0-1,32-33", 0);
    EXPECT_RANK(topo, &t, 8, 16, 0, "8-9,40-41", 0);
    EXPECT_RANK(topo, &t, 12, 16, 4, "24-25,56-57", 1);
    /* fewer ranks than GPUs: GPUs 0 and 1, both on socket 0 */
    EXPECT_RANK(topo, &t, 1, 2, 1, "8-15,40-47", 0);
    /* bind = none: the whole machine, no single NUMA node */
    int gpu, numa;
    char cpus[256];
    choose(topo, &t, 2, 8, 0, &gpu, cpus, &numa);
    CHECK(gpu == 2);
    CHECK_STR(cpus, "0-63");
    CHECK(numa == -1);

    /* export and reload: the same machine */
    char out[256];
    snprintf(out, sizeof out, "/tmp/dg_topo_export.%d.xml", (int)getpid());
    CHECK(dg_topo_export_xml(path_of("node-2s-8gpu-4ib.xml"), out) == DG_OK);
    dg_node_topo_t t2;
    CHECK(dg_topo_load(out, &t2, NULL) == DG_OK);
    CHECK(t2.n_gpus == 8 && t2.n_nics == 5 && t2.n_cores == 32 && t2.n_numa == 2);
    for (int g = 0; g < 8 && g < t2.n_gpus; g++)
        CHECK_STR(t2.gpus[g].cpuset, t.gpus[g].cpuset);
    CHECK(t2.nvlink_bw && t2.nvlink_bw[1] == 100);
    CHECK_STR(t2.host, "gpunode-a");
    dg_topo_free(&t2);
    unlink(out);
    free_machine(&t, topo);
}

static void test_node_b(void) {
    dg_node_topo_t t;
    hwloc_topology_t topo;
    /* 4 GPUs: neither the ASPEED nor the ATI ES1000 VGA is one */
    load_machine(&(const machine_t){"node-2s-snc-4gpu.xml", "gpunode-b", 2, 24, 24, 4, 4, -1}, &t, &topo);
    static const int numa_of[4] = {1, 1, 2, 3};
    static const char *cpus_of[4] = {"6-11", "6-11", "12-17", "18-23"};
    for (int g = 0; g < 4 && g < t.n_gpus; g++) {
        CHECK(t.gpus[g].numa == numa_of[g]);
        CHECK_STR(t.gpus[g].cpuset, cpus_of[g]);
        CHECK(t.gpus[g].cuda_index == g); /* no CUDA device list: PCI bus order */
        CHECK_STR(t.gpus[g].name, "PCI 10de:2330");
    }
    CHECK(t.nvlink_bw == NULL);
    CHECK(t.n_nics == 2);
    if (t.n_nics == 2) {
        CHECK_STR(t.nics[0].name, "pci:0000:06:00.0");
        CHECK_STR(t.nics[0].kind, "eth");
        CHECK(t.nics[0].numa == 0);
        CHECK_STR(t.nics[1].name, "pci:0000:e1:00.0");
        CHECK_STR(t.nics[1].kind, "ib");
        CHECK(t.nics[1].numa == 3);
    }
    /* 4 ranks: GPUs 0 and 1 share NUMA node 1's six cores; GPUs 2 and 3 have a NUMA node each */
    EXPECT_RANK(topo, &t, 0, 4, 0, "6-8", 1);
    EXPECT_RANK(topo, &t, 1, 4, 1, "9-11", 1);
    EXPECT_RANK(topo, &t, 2, 4, 2, "12-17", 2);
    EXPECT_RANK(topo, &t, 3, 4, 3, "18-23", 3);
    /* 8 ranks: four ranks near NUMA 1 split 6 cores 1/2/1/2 in local-rank order */
    EXPECT_RANK(topo, &t, 0, 8, 0, "6", 1);
    EXPECT_RANK(topo, &t, 1, 8, 1, "7-8", 1);
    EXPECT_RANK(topo, &t, 4, 8, 0, "9", 1);
    EXPECT_RANK(topo, &t, 5, 8, 1, "10-11", 1);
    EXPECT_RANK(topo, &t, 6, 8, 2, "15-17", 2);
    /* 40 ranks: more ranks near NUMA 3 (10) than it has cores (6): each still gets one core */
    EXPECT_RANK(topo, &t, 39, 40, 3, "23", 3);
    EXPECT_RANK(topo, &t, 3, 40, 3, "18", 3);

    /* CUDA_VISIBLE_DEVICES on an XML declared to be this machine: devices 3 and 1, in that order */
    setenv("HWLOC_THISSYSTEM", "1", 1);
    setenv("CUDA_VISIBLE_DEVICES", "3,1", 1);
    dg_node_topo_t tv;
    hwloc_topology_t topov;
    CHECK(dg_topo_load(path_of("node-2s-snc-4gpu.xml"), &tv, &topov) == DG_OK);
    CHECK(tv.gpus[0].cuda_index == -1 && tv.gpus[1].cuda_index == 1 && tv.gpus[2].cuda_index == -1 &&
          tv.gpus[3].cuda_index == 0);
    EXPECT_RANK(topov, &tv, 0, 2, 3, "18-23", 3);
    EXPECT_RANK(topov, &tv, 1, 2, 1, "6-11", 1);
    free_machine(&tv, topov);
    /* without HWLOC_THISSYSTEM an XML is another machine: this process's CUDA_VISIBLE_DEVICES is ignored */
    unsetenv("HWLOC_THISSYSTEM");
    CHECK(dg_topo_load(path_of("node-2s-snc-4gpu.xml"), &tv, NULL) == DG_OK);
    CHECK(tv.gpus[0].cuda_index == 0 && tv.gpus[3].cuda_index == 3);
    dg_topo_free(&tv);
    unsetenv("CUDA_VISIBLE_DEVICES");

    free_machine(&t, topo);
}

/* A real machine: the H200 GPU VM dgtrain ran on, exported there with --export-topology (hwloc 2.10, no
 * vendor plugins: the GPU is known by its PCI class only). */
static void test_h200(void) {
    dg_node_topo_t t;
    hwloc_topology_t topo;
    load_machine(&(const machine_t){"h200-vm-1gpu.xml", "vm", 1, 16, 16, 1, 1, 1}, &t, &topo);
    if (t.n_gpus == 1) {
        CHECK_STR(t.gpus[0].pci_busid, "0000:00:06.0");
        CHECK_STR(t.gpus[0].name, "PCI 10de:2335");
        CHECK(t.gpus[0].cuda_index == 0 && t.gpus[0].numa == 0);
        CHECK_STR(t.gpus[0].cpuset, "0-15");
    }
    /* two ranks share the one GPU and split its 16 cores */
    EXPECT_RANK(topo, &t, 0, 2, 0, "0-7", 0);
    EXPECT_RANK(topo, &t, 1, 2, 0, "8-15", 0);
    free_machine(&t, topo);
}

static void test_env_and_errors(void) {
    dg_node_topo_t t;
    setenv("HWLOC_XMLFILE", path_of("node-2s-8gpu-4ib.xml"), 1);
    CHECK(dg_topo_load(NULL, &t, NULL) == DG_OK);
    CHECK_STR(t.host, "gpunode-a");
    dg_topo_free(&t);
    /* an explicit file beats the environment */
    CHECK(dg_topo_load(path_of("node-2s-snc-4gpu.xml"), &t, NULL) == DG_OK);
    CHECK_STR(t.host, "gpunode-b");
    dg_topo_free(&t);
    setenv("HWLOC_XMLFILE", "/nonexistent/topo.xml", 1);
    CHECK(dg_topo_load(NULL, &t, NULL) == DG_ERR_USAGE);
    CHECK_STR(dg_last_error(),
              "cannot open hwloc topology XML '/nonexistent/topo.xml' ($HWLOC_XMLFILE): No such file or "
              "directory");
    unsetenv("HWLOC_XMLFILE");

    CHECK(dg_topo_load("/nonexistent/t.xml", &t, NULL) == DG_ERR_USAGE);
    CHECK_STR(
        dg_last_error(),
        "cannot open hwloc topology XML '/nonexistent/t.xml' (topology.xml): No such file or directory");
    char bad[256];
    snprintf(bad, sizeof bad, "/tmp/dg_topo_bad.%d.xml", (int)getpid());
    FILE *f = fopen(bad, "w");
    fputs("<?xml version=\"1.0\"?>\n<topology version=\"2.0\">\n  <object type=\"Machine\" cpuset=\"0x1\"",
          f);
    fclose(f);
    CHECK(dg_topo_load(bad, &t, NULL) == DG_ERR_USAGE);
    char want[512];
    snprintf(want, sizeof want, "cannot load hwloc topology XML '%s': ", bad);
    CHECK(strncmp(dg_last_error(), want, strlen(want)) == 0);
    CHECK(strstr(dg_last_error(), "expected an hwloc 2.x XML file") != NULL);
    f = fopen(bad, "w");
    fputs("this is not XML at all\n", f);
    fclose(f);
    CHECK(dg_topo_load(bad, &t, NULL) == DG_ERR_USAGE);
    CHECK(strncmp(dg_last_error(), want, strlen(want)) == 0);
    unlink(bad);

    /* the live machine */
    CHECK(dg_topo_load(NULL, &t, NULL) == DG_OK);
    char host[256] = "";
    gethostname(host, sizeof host - 1);
    CHECK_STR(t.host, host);
    CHECK(t.n_pus >= 1 && t.n_cores >= 1 && t.n_numa >= 1 && t.n_sockets >= 1);
    dg_topo_free(&t);
}

/* Real machines from ../shared/topologies, when that folder is there. */
static int test_shared(const char *dir) {
    char p[1200];
    dg_node_topo_t t;
    snprintf(p, sizeof p, "%s/dgx2-16gpu-nvswitch.xml", dir);
    if (access(p, R_OK) != 0) return 0;
    CHECK(dg_topo_load(p, &t, NULL) == DG_OK);
    CHECK(t.n_gpus == 16 && t.n_sockets == 2 && t.n_nics == 0);
    for (int g = 0; g < t.n_gpus; g++)
        CHECK(t.gpus[g].numa == g / 8);
    /* 6 NVSwitches per board, 25 GB/s from each GPU to each: 150 GB/s between GPUs of a board; the
     * file has no switch-to-switch links, so none across boards */
    CHECK(t.nvlink_bw && t.nvlink_bw[0 * 16 + 7] == 150 && t.nvlink_bw[8 * 16 + 15] == 150 &&
          t.nvlink_bw[0 * 16 + 8] == 0 && t.nvlink_bw[5 * 16 + 5] == 0);
    dg_topo_free(&t);

    snprintf(p, sizeof p, "%s/power8-2socket-4gpu-nvlink.xml", dir);
    CHECK(dg_topo_load(p, &t, NULL) == DG_OK);
    CHECK(t.n_gpus == 4 && t.n_numa == 2);
    CHECK(t.gpus[0].numa == 0 && t.gpus[1].numa == 0 && t.gpus[2].numa == 1 && t.gpus[3].numa == 1);
    /* GPU-to-CPU NVLinks (to the Package objects) are not GPU-to-GPU bandwidth */
    CHECK(t.nvlink_bw && t.nvlink_bw[0 * 4 + 1] == 40 && t.nvlink_bw[2 * 4 + 3] == 40 &&
          t.nvlink_bw[0 * 4 + 2] == 0);
    dg_topo_free(&t);

    snprintf(p, sizeof p, "%s/xeon-2socket-ib-nic.xml", dir);
    CHECK(dg_topo_load(p, &t, NULL) == DG_OK);
    CHECK(t.n_gpus == 3); /* the ATI ES1000 BMC graphics is not counted */
    CHECK(t.n_nics == 3);
    if (t.n_nics == 3) {
        CHECK_STR(t.nics[2].name, "mlx4_0");
        CHECK_STR(t.nics[2].kind, "ib");
    }
    dg_topo_free(&t);

    snprintf(p, sizeof p, "%s/xeon-2socket-pci.xml", dir);
    CHECK(dg_topo_load(p, &t, NULL) == DG_OK);
    /* CUDA listed only the K40m (cuda0): the other NVIDIA cards are not CUDA devices there; the AMD
     * card counts as a GPU through its OpenCL device but has no CUDA index */
    CHECK(t.n_gpus == 4);
    if (t.n_gpus == 4) {
        CHECK(t.gpus[0].cuda_index == -1 && t.gpus[2].cuda_index == 0 && t.gpus[3].cuda_index == -1);
        CHECK_STR(t.gpus[2].name, "Tesla K40m");
        CHECK(t.gpus[2].numa == 1);
    }
    dg_topo_free(&t);
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: test_topo DATA_DIR [SHARED_TOPOLOGIES_DIR]\n");
        return 2;
    }
    snprintf(g_data, sizeof g_data, "%s", argv[1]);
    unsetenv("HWLOC_XMLFILE");
    unsetenv("CUDA_VISIBLE_DEVICES");
    unsetenv("HWLOC_THISSYSTEM");
    test_node_a();
    test_node_b();
    test_h200();
    test_env_and_errors();
    int shared = argc > 2 ? test_shared(argv[2]) : 0;
    printf("topology tests: %d checks, %d failed%s\n", dg_checks, dg_fails,
           shared ? "" : " (../shared/topologies not found: real-machine files skipped)");
    return dg_fails ? 1 : 0;
}
