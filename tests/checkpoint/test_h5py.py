#!/usr/bin/env python3
"""test_h5py.py SYNTH SEED INCR — read dgtrain checkpoints with h5py alone (no dgtrain code):
SYNTH, written by `ckpt_driver save --seed SEED`: root attributes, /state, the manifest, chunking and
the Fletcher32 filter of every dataset, and every value against the driver's formula, bitwise.
INCR, an incremental checkpoint: its external links are followed by h5py (run from another directory)
and give the same data as the file that holds it; the manifest records where each dataset lives."""
import os
import sys

import h5py
import numpy as np

from synth_state import fnv1a


def expected(path, shape, seed):
    n = int(np.prod(shape))
    idx = np.arange(n, dtype=np.uint64)
    u = (idx * np.uint64(2654435761) + np.uint64(fnv1a(path)) + np.uint64(seed * 97)) % np.uint64(2**32)
    return (u.astype(np.float64) / 4294967296.0 - 0.5).astype(np.float32).reshape(shape)


def fail(msg):
    sys.exit("test_h5py: " + msg)


def check_synth(fname, seed):
    with h5py.File(fname, "r") as f:
        a = f.attrs
        if a["format"] != "dgtrain-checkpoint" or int(a["format_version"]) != 1:
            fail(f"format attributes {a['format']!r} {a['format_version']!r}")
        if int(a["step"]) != 5 or int(a["tokens"]) != 640 or int(a["world_size"]) != 2:
            fail(f"step/tokens/world {a['step']} {a['tokens']} {a['world_size']}")
        if f"seed = {seed}" not in a["config"] or not a["created"].endswith("Z") or a["mesh"].count("=") != 3:
            fail(f"config/created/mesh: {a['config']!r} {a['created']!r} {a['mesh']!r}")
        st = f["state"].attrs
        if int(st["loader_cursor"]) != 40 or int(st["loader_samples_seen"]) != 40 or float(st["scaler_scale"]) != 1024.0:
            fail("state attributes")
        if list(st["rng"]) != [0x0123456789ABCDEF ^ seed, 5, 2**64 - 1]:
            fail(f"rng {list(st['rng'])}")
        if f["state/kv"].attrs["note"] != "synthetic state":
            fail("kv")
        man = f["manifest"][...]
        if set(man.dtype.names) != {"path", "ndim", "shape", "xxh3", "origin"} or len(man) != 54:
            fail(f"manifest {man.dtype.names} {len(man)}")
        n = 0
        for row in man:
            path = row["path"].decode()
            shape = tuple(int(x) for x in row["shape"][: row["ndim"]])
            d = f[path]
            if d.shape != shape or d.dtype != np.float32 or not d.fletcher32 or d.chunks is None:
                fail(f"{path}: shape {d.shape} dtype {d.dtype} fletcher32 {d.fletcher32} chunks {d.chunks}")
            if int(d.attrs["xxh3"]) != int(row["xxh3"]):
                fail(f"{path}: xxh3 attribute differs from the manifest")
            got = d[...]
            if not np.array_equal(got.view(np.uint32), expected(path, shape, seed).view(np.uint32)):
                fail(f"{path}: values differ from the formula")
            n += got.size
    print(f"h5py: {fname}: 54 datasets, {n} values bitwise as written")


def check_incr(fname):
    base_dir = os.path.dirname(os.path.abspath(fname))
    linked = 0
    with h5py.File(fname, "r") as f:
        for row in f["manifest"][...]:
            path, origin = row["path"].decode(), row["origin"].decode()
            link = f.get(path, getlink=True)
            if origin:
                if not isinstance(link, h5py.ExternalLink) or link.filename != origin:
                    fail(f"{path}: manifest says {origin}, link is {link!r}")
                with h5py.File(os.path.join(base_dir, origin), "r") as g:
                    if not np.array_equal(f[path][...], g[path][...]):
                        fail(f"{path}: the link and its target disagree")
                linked += 1
            elif not isinstance(link, h5py.HardLink):
                fail(f"{path}: expected data in the file, found {link!r}")
    if linked == 0:
        fail(f"{fname} has no linked datasets")
    print(f"h5py: {fname}: {linked} external links followed from {os.getcwd()}")


check_synth(sys.argv[1], int(sys.argv[2]))
check_incr(sys.argv[3])
