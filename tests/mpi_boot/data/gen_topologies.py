#!/usr/bin/env python3
"""gen_topologies.py — writes the hwloc 2.x XML descriptions of two GPU nodes that are not here, used by
the mpi_boot tests to check the GPU/NIC discovery, GPU-to-NUMA and GPU-to-core locality and binding:

  node-2s-8gpu-4ib.xml  "gpunode-a": 2 sockets x 16 cores x 2 hyperthreads (PU os index c and c+32),
                        one NUMA node per socket, 4 NVIDIA GPUs and 2 InfiniBand NICs per socket (CUDA,
                        NVML and OpenFabrics OS devices), one Ethernet NIC on socket 0, a BMC VGA, and an
                        NVLinkBandwidth matrix (pairs 0-1, 2-3, 4-5, 6-7 at 100 GB/s, other GPUs of the
                        same socket at 50 GB/s, none across sockets).
  node-2s-snc-4gpu.xml  "gpunode-b": 2 sockets, each split in two NUMA domains (sub-NUMA clustering, as
                        Group objects) of 6 cores, no hyperthreads; 4 NVIDIA GPUs seen as PCI devices only
                        (no vendor plugin: no OS devices, no names): GPUs 0 and 1 on NUMA 1, GPU 2 on NUMA 2,
                        GPU 3 on NUMA 3; an ATI ES1000 and an ASPEED VGA on NUMA 0 (not GPUs); one
                        Ethernet and one InfiniBand NIC without OS devices.

The files are checked in; run this only to change them:  python3 gen_topologies.py [outdir]
(h200-vm-1gpu.xml beside them is not generated: `dgtrain --export-topology` wrote it on the GPU machine.)
"""
import os
import sys


def mask(bits):
    """hwloc bitmap text: 32-bit hex words, most significant first, comma separated."""
    v = 0
    for b in bits:
        v |= 1 << b
    words = []
    while True:
        words.append(v & 0xFFFFFFFF)
        v >>= 32
        if not v:
            break
    return ",".join("0x%08x" % w for w in reversed(words))


class Writer:
    def __init__(self):
        self.lines = []
        self.gp = 0

    def next_gp(self):
        self.gp += 1
        return self.gp

    def emit(self, depth, text):
        self.lines.append("  " * depth + text)


def sets(cpus, nodes):
    c, n = mask(cpus), mask(nodes)
    return 'cpuset="%s" complete_cpuset="%s" nodeset="%s" complete_nodeset="%s"' % (c, c, n, n)


def numa(w, d, os_index, cpus, mem_gb):
    w.emit(d, '<object type="NUMANode" os_index="%d" %s gp_index="%d" local_memory="%d">'
           % (os_index, sets(cpus, [os_index]), w.next_gp(), mem_gb << 30))
    w.emit(d + 1, '<page_type size="4096" count="%d"/>' % ((mem_gb << 30) // 4096))
    w.emit(d, "</object>")


def core(w, d, core_os, pus, node):
    w.emit(d, '<object type="Core" os_index="%d" %s gp_index="%d">' % (core_os, sets(pus, [node]), w.next_gp()))
    for p in pus:
        w.emit(d + 1, '<object type="PU" os_index="%d" %s gp_index="%d"/>' % (p, sets([p], [node]), w.next_gp()))
    w.emit(d, "</object>")


def pcidev(w, d, busid, cls, ven, dev, infos=(), osdevs=()):
    """osdevs: (name, osdev_type, subtype or None, infos); returns {name: gp_index} of the OS devices."""
    bus = int(busid.split(":")[1], 16)
    gp = {}
    w.emit(d, '<object type="Bridge" gp_index="%d" bridge_type="0-1" depth="0" bridge_pci="0000:[%02x-%02x]">'
           % (w.next_gp(), bus, bus))
    w.emit(d + 1, '<object type="PCIDev" gp_index="%d" pci_busid="%s" pci_type="%04x [%04x:%04x] [%04x:0000] a1" '
           'pci_link_speed="31.507692">' % (w.next_gp(), busid, cls, ven, dev, ven))
    for k, v in infos:
        w.emit(d + 2, '<info name="%s" value="%s"/>' % (k, v))
    for name, typ, sub, oinfos in osdevs:
        g = w.next_gp()
        gp[name] = g
        subattr = ' subtype="%s"' % sub if sub else ""
        if oinfos:
            w.emit(d + 2, '<object type="OSDev" gp_index="%d" name="%s"%s osdev_type="%d">' % (g, name, subattr, typ))
            for k, v in oinfos:
                w.emit(d + 3, '<info name="%s" value="%s"/>' % (k, v))
            w.emit(d + 2, "</object>")
        else:
            w.emit(d + 2, '<object type="OSDev" gp_index="%d" name="%s"%s osdev_type="%d"/>' % (g, name, subattr, typ))
    w.emit(d + 1, "</object>")
    w.emit(d, "</object>")
    return gp


def header(w, host, all_cpus, all_nodes):
    w.emit(0, '<?xml version="1.0" encoding="UTF-8"?>')
    w.emit(0, '<!DOCTYPE topology SYSTEM "hwloc2.dtd">')
    w.emit(0, '<topology version="2.0">')
    c, n = mask(all_cpus), mask(all_nodes)
    w.emit(1, '<object type="Machine" os_index="0" cpuset="%s" complete_cpuset="%s" allowed_cpuset="%s" '
           'nodeset="%s" complete_nodeset="%s" allowed_nodeset="%s" gp_index="%d">'
           % (c, c, c, n, n, n, w.next_gp()))
    for k, v in (("Backend", "Linux"), ("OSName", "Linux"), ("HostName", host), ("Architecture", "x86_64")):
        w.emit(2, '<info name="%s" value="%s"/>' % (k, v))


def values_block(vals):
    out = []
    for i in range(0, len(vals), 10):
        text = " ".join(str(v) for v in vals[i:i + 10]) + " "
        out.append('    <u64values length="%d">%s</u64values>' % (len(text), text))
    return out


def node_a():
    w = Writer()
    header(w, "gpunode-a", range(64), [0, 1])
    gpu_gp = []
    gpu_no = 0
    ib_no = 0
    busids_gpu = [["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0"],
                  ["0000:9a:00.0", "0000:ab:00.0", "0000:ba:00.0", "0000:db:00.0"]]
    busids_ib = [["0000:19:00.0", "0000:3b:00.0"], ["0000:9b:00.0", "0000:bb:00.0"]]
    for s in range(2):
        cores = range(16 * s, 16 * s + 16)
        cpus = [c for c in cores] + [c + 32 for c in cores]
        w.emit(2, '<object type="Package" os_index="%d" %s gp_index="%d">' % (s, sets(cpus, [s]), w.next_gp()))
        w.emit(3, '<info name="CPUModel" value="Example Xeon 16-core"/>')
        numa(w, 3, s, cpus, 256)
        for c in cores:
            core(w, 3, c, [c, c + 32], s)
        for g in range(4):
            gp = pcidev(w, 3, busids_gpu[s][g], 0x0302, 0x10de, 0x2330, [("PCIVendor", "NVIDIA Corporation")],
                        [("cuda%d" % gpu_no, 5, "CUDA", [("GPUModel", "NVIDIA H100 80GB HBM3")]),
                         ("nvml%d" % gpu_no, 1, "NVML", [("GPUModel", "NVIDIA H100 80GB HBM3")])])
            gpu_gp.append(gp["nvml%d" % gpu_no])
            gpu_no += 1
        for k in range(2):
            pcidev(w, 3, busids_ib[s][k], 0x0207, 0x15b3, 0x101b, [("PCIVendor", "Mellanox Technologies")],
                   [("ib%d" % ib_no, 2, None, [("Address", "00:00:10:87:fe:80:00:00")]),
                    ("mlx5_%d" % ib_no, 3, None, [("Port1State", "4"), ("Port1LinkLayer", "InfiniBand")])])
            ib_no += 1
        if s == 0:
            pcidev(w, 3, "0000:04:00.0", 0x0200, 0x8086, 0x1563, [("PCIVendor", "Intel Corporation")],
                   [("eno1", 2, None, [("Address", "3c:ec:ef:00:00:01")])])
            pcidev(w, 3, "0000:03:00.0", 0x0300, 0x1a03, 0x2000, [("PCIVendor", "ASPEED Technology, Inc.")],
                   [("card0", 1, None, [])])
        w.emit(2, "</object>")
    w.emit(1, "</object>")
    # NVLink: pairs at 100 GB/s, same socket 50 GB/s, MB/s as hwloc stores it
    n = 8
    vals = []
    for i in range(n):
        for j in range(n):
            if i == j:
                vals.append(0)
            elif i // 2 == j // 2:
                vals.append(100000)
            elif i // 4 == j // 4:
                vals.append(50000)
            else:
                vals.append(0)
    idx = " ".join("OSDev:%d" % g for g in gpu_gp) + " "
    w.emit(1, '<distances2hetero nbobjs="%d" kind="25" name="NVLinkBandwidth">' % n)
    w.lines.append('    <indexes length="%d">%s</indexes>' % (len(idx), idx))
    w.lines.extend(values_block(vals))
    w.emit(1, "</distances2hetero>")
    w.emit(0, "</topology>")
    return "\n".join(w.lines) + "\n"


def node_b():
    w = Writer()
    header(w, "gpunode-b", range(24), [0, 1, 2, 3])
    gpus_by_numa = {1: ["0000:31:00.0", "0000:4b:00.0"], 2: ["0000:ca:00.0"], 3: ["0000:e3:00.0"]}
    for s in range(2):
        pcpus = list(range(12 * s, 12 * s + 12))
        w.emit(2, '<object type="Package" os_index="%d" %s gp_index="%d">' % (s, sets(pcpus, [2 * s, 2 * s + 1]),
                                                                             w.next_gp()))
        for h in range(2):
            node = 2 * s + h
            cpus = list(range(6 * node, 6 * node + 6))
            w.emit(3, '<object type="Group" %s gp_index="%d" kind="1000" subkind="0">' % (sets(cpus, [node]),
                                                                                           w.next_gp()))
            numa(w, 4, node, cpus, 128)
            for c in cpus:
                core(w, 4, c, [c], node)
            for busid in gpus_by_numa.get(node, []):
                pcidev(w, 4, busid, 0x0302, 0x10de, 0x2330)
            if node == 0:
                pcidev(w, 4, "0000:02:00.0", 0x0300, 0x1a03, 0x2000, [("PCIVendor", "ASPEED Technology, Inc.")])
                pcidev(w, 4, "0000:05:00.0", 0x0300, 0x1002, 0x515e, [("PCIDevice", "ES1000")])
                pcidev(w, 4, "0000:06:00.0", 0x0200, 0x14e4, 0x16d7)
            if node == 3:
                pcidev(w, 4, "0000:e1:00.0", 0x0207, 0x15b3, 0x1021)
            w.emit(3, "</object>")
        w.emit(2, "</object>")
    w.emit(1, "</object>")
    w.emit(0, "</topology>")
    return "\n".join(w.lines) + "\n"


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    for name, text in (("node-2s-8gpu-4ib.xml", node_a()), ("node-2s-snc-4gpu.xml", node_b())):
        with open(os.path.join(out, name), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
