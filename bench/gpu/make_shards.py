#!/usr/bin/env python3
"""make_shards.py — synthetic GPT-2-vocabulary token shards in llm.c's .bin format for the GPU benchmark.

Nothing can be downloaded on the benchmark machine, so the benchmark trains on uniformly random token ids
in [0, 50257) (seeded): the arithmetic per step is identical to real text; only the loss values mean
nothing (they stay near ln 50257 = 10.8). Format: 256 little-endian int32 (magic 20240520, version 1,
token count), then the uint16 tokens.

  make_shards.py OUTDIR [--tokens N] [--vocab V] [--seed S]     writes OUTDIR/bench_train_000.bin, bench_val_000.bin
"""
import argparse
import os
import random
import struct
import sys


def write(path, tokens):
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<256i", *([20240520, 1, len(tokens) // 2] + [0] * 253)))  # uint16 tokens
        f.write(tokens)
    os.replace(path + ".tmp", path)


def tokens_bytes(n, vocab, seed):
    try:
        import numpy as np
        return np.random.default_rng(seed).integers(0, vocab, size=n, dtype=np.uint16).astype("<u2").tobytes()
    except ImportError:
        rng = random.Random(seed)
        return struct.pack("<%dH" % n, *(rng.randrange(vocab) for _ in range(n)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("--tokens", type=int, default=2 * 1024 * 1024)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seed", type=int, default=1337)
    a = ap.parse_args()
    if not (1 <= a.vocab <= 65536) or a.tokens < 2:
        print("make_shards.py: --vocab must be in [1, 65536] and --tokens >= 2", file=sys.stderr)
        return 2
    os.makedirs(a.outdir, exist_ok=True)
    write(os.path.join(a.outdir, "bench_train_000.bin"), tokens_bytes(a.tokens, a.vocab, a.seed))
    write(os.path.join(a.outdir, "bench_val_000.bin"), tokens_bytes(64 * 1024, a.vocab, a.seed + 1))
    print("make_shards.py: %d train tokens (vocab %d) in %s" % (a.tokens, a.vocab, a.outdir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
