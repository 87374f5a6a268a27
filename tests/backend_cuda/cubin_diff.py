#!/usr/bin/env python3
"""cubin_diff.py — do two cubins hold the same machine code for the kernels they share?

    cubin_diff.py OLD.cubin NEW.cubin ['REGEX=>REPL' ...]

For every kernel of NEW: its machine code (.text.<kernel>), relocations, attributes (.nv.info.<kernel>,
with the symbol index in EIATTR_PARAM_CBANK masked, since symbol numbering follows the file's other
kernels), shared-memory and constant-bank sizes, and its register / frame / stack figures (the global
.nv.info) must equal those of the kernel of OLD with the same demangled name after the REGEX=>REPL
rewrites (for kernels renamed, or that lost a template parameter). Prints one line per kernel and the
number of OLD's kernels that NEW no longer has; exits 1 when a kernel differs or is new. No GPU needed:
tests/backend_cuda/cubin_diff.sh compiles the cubins of a git revision and of the work tree and runs this.
Plain ELF64 parsing (struct), no third-party module.
"""
import re
import struct
import subprocess
import sys

EIATTR_PARAM_CBANK = 0x0A
EIATTR_REGCOUNT = 0x2F


def sections(blob):
    shoff, = struct.unpack_from("<Q", blob, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", blob, 0x3A)
    hdrs = [struct.unpack_from("<IIQQQQIIQQ", blob, shoff + i * shentsize) for i in range(shnum)]
    strtab = hdrs[shstrndx]
    out = {}
    for h in hdrs:
        name_off, stype, _flags, _addr, off, size, link, _info, _align, entsize = h
        end = blob.index(b"\0", strtab[4] + name_off)
        name = blob[strtab[4] + name_off:end].decode()
        data = b"" if stype == 8 else blob[off:off + size]  # SHT_NOBITS
        out[name] = {"type": stype, "size": size, "data": data, "link": link, "entsize": entsize}
    return out, hdrs


def symbols(secs, hdrs, blob):
    st = secs[".symtab"]
    strsec = hdrs[st["link"]]
    names = []
    for i in range(0, len(st["data"]), 24):
        name_off, = struct.unpack_from("<I", st["data"], i)
        start = strsec[4] + name_off
        names.append(blob[start:blob.index(b"\0", start)].decode())
    return names


def entries(b):
    i, out = 0, []
    while i < len(b):
        fmt, attr = b[i], b[i + 1]
        if fmt == 4:  # EIFMT_SVAL: a 16-bit size, then the value
            sz, = struct.unpack_from("<H", b, i + 2)
            out.append((attr, bytes(b[i + 4:i + 4 + sz])))
            i += 4 + sz
        else:
            out.append((attr, bytes(b[i + 2:i + 4])))
            i += 4
    return out


def kernels(path):
    blob = open(path, "rb").read()
    secs, hdrs = sections(blob)
    syms = symbols(secs, hdrs, blob)
    ks = [n[len(".text."):] for n in secs if n.startswith(".text.")]
    dem = subprocess.run(["c++filt"], input="\n".join(ks), capture_output=True, text=True).stdout.split("\n")
    glob = {}
    for attr, d in entries(secs[".nv.info"]["data"]) if ".nv.info" in secs else []:
        if len(d) == 8:
            sym, val = struct.unpack("<II", d)
            glob.setdefault(syms[sym], []).append((attr, val))
    res = {}
    for k, name in zip(ks, dem):
        d = {"text": secs[".text." + k]["data"], "global": sorted(glob.get(k, []))}
        info = secs.get(".nv.info." + k)
        if info:
            d["info"] = [(a, b"\0\0\0\0" + v[4:] if a == EIATTR_PARAM_CBANK else v) for a, v in entries(info["data"])]
        for pre in (".nv.shared.", ".nv.constant0."):
            s = secs.get(pre + k)
            d[pre] = s["size"] if s else None
        rel, rows = secs.get(".rel.text." + k) or secs.get(".rela.text." + k), []
        if rel:
            step = rel["entsize"] or 16
            for i in range(0, len(rel["data"]), step):
                off, inf = struct.unpack_from("<QQ", rel["data"], i)
                rows.append((off, inf & 0xFFFFFFFF, syms[inf >> 32]))
        d["rel"] = rows
        res[name] = d
    return res


def main():
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    old, new = kernels(sys.argv[1]), kernels(sys.argv[2])
    rules = [a.split("=>", 1) for a in sys.argv[3:]]

    def norm(name):
        for a, b in rules:
            name = re.sub(a, b, name)
        return name

    oldn = {}
    for k, v in old.items():
        oldn.setdefault(norm(k), v)
    bad = 0
    for k, v in sorted(new.items()):
        o = oldn.get(k)
        if o is None:
            print("NEW ", k)
            bad += 1
            continue
        diffs = [f for f in v if v[f] != o.get(f)]
        regs = [val for a, val in v["global"] if a == EIATTR_REGCOUNT]
        print("SAME" if not diffs else "DIFF(%s)" % ",".join(diffs), k, "[%d bytes, %s registers]" % (len(v["text"]), regs))
        bad += bool(diffs)
    gone = sorted(set(oldn) - set(new))
    print("%s: %d kernels identical, %d differ or are new; %d of the old kernels are gone"
          % (sys.argv[2].rsplit("/", 1)[-1], len(new) - bad, bad, len(gone)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
