#!/usr/bin/env python3
"""check_safetensors.py FILE SEED MODE — parse a safetensors file written by `dgckpt export` with the
standard library only and check it against the synthetic state of ckpt_driver (`save --seed SEED`):
the header layout (8-byte little-endian length, JSON, 8-byte aligned data block, contiguous offsets in
order), every expected tensor with its dtype and shape, and every value bitwise.
MODE "model": names without the "model/" prefix, model tensors only; "all": every tensor by full path."""
import array
import json
import struct
import sys

from synth_state import fnv1a


def value_of(path, idx, seed):
    """The driver's value_of(): the same integer and double arithmetic, rounded to float32."""
    u = (idx * 2654435761 + fnv1a(path) + seed * 97) % 2**32
    return struct.unpack("<f", struct.pack("<f", u / 4294967296.0 - 0.5))[0]


def model():
    p = [("wte", [97, 24]), ("wpe", [16, 24])]
    for l in range(3):
        p += [(f"h.{l}.attn.w", [24, 72]), (f"h.{l}.attn.b", [72]), (f"h.{l}.mlp.w", [24, 96]), (f"h.{l}.ln.w", [24])]
    p += [("big", [7, 2500]), ("vec", [5000]), ("cube", [3, 5, 70]), ("lnf.w", [24])]
    return p


def main():
    fname, seed, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    raw = open(fname, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n].decode("utf-8"))
    if (8 + n) % 8:
        sys.exit(f"{fname}: data block not 8-byte aligned (header length {n})")
    data = raw[8 + n :]
    meta = header.pop("__metadata__", {})
    if meta.get("format") != "pt" or "step" not in meta:
        sys.exit(f"{fname}: unexpected __metadata__ {meta}")
    want = {}
    for name, shape in model():
        if mode == "model":
            want[name] = ("model/" + name, shape)
        else:
            want["model/" + name] = ("model/" + name, shape)
            for k in ("m", "v"):
                want[f"optim/{name}/{k}"] = (f"optim/{name}/{k}", shape)
    if set(header) != set(want):
        sys.exit(f"{fname}: tensors {sorted(set(header) ^ set(want))[:5]} missing or unexpected")
    # offsets: in sorted-name order, contiguous, covering the data block exactly
    end = 0
    for name in sorted(header, key=lambda k: header[k]["data_offsets"][0]):
        e = header[name]
        b, t = e["data_offsets"]
        if b != end:
            sys.exit(f"{fname}: {name} starts at {b}, expected {end}")
        end = t
    if end != len(data):
        sys.exit(f"{fname}: offsets cover {end} bytes, the data block has {len(data)}")
    bad = 0
    total = 0
    for name, (path, shape) in sorted(want.items()):
        e = header[name]
        if e["dtype"] != "F32" or e["shape"] != shape:
            sys.exit(f"{fname}: {name} is {e['dtype']} {e['shape']}, expected F32 {shape}")
        b, t = e["data_offsets"]
        vals = array.array("f")
        vals.frombytes(data[b:t])
        if sys.byteorder != "little":
            vals.byteswap()
        count = 1
        for d in shape:
            count *= d
        if len(vals) != count:
            sys.exit(f"{fname}: {name} has {len(vals)} values, expected {count}")
        for i, v in enumerate(vals):
            total += 1
            if v != value_of(path, i, seed):
                bad += 1
                if bad <= 3:
                    print(f"mismatch {name}[{i}] = {v!r}, expected {value_of(path, i, seed)!r}")
    print(f"{fname}: {len(want)} tensors, {total} values, {bad} mismatches")
    sys.exit(1 if bad else 0)


main()
