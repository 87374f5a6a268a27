#!/usr/bin/env python3
"""PyTorch eager reference for the CPU benchmark: the same GPT-2-family model, batch and thread count as
the dgtrain run it is compared with (bench/cpu/run.sh), or PyTorch's own default thread count
(--threads 0). Prints one JSON line with tokens/s.

Model: bench/lib/gpt2_torch.py (dgtrain's GPT-2); AdamW (fused=False, foreach default) with the same
hyper-parameters.
A training step = zero_grad + forward + backward + clip_grad_norm_ + optimizer.step, as in dgtrain.
"""
import argparse, json, os, sys, time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
from gpt2_torch import GPT  # noqa: E402 (bench/lib: the model, shared with bench/gpu/torch_gpt2.py)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--d-model", type=int, required=True)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, required=True, help="sequences per step (no accumulation)")
    ap.add_argument("--threads", type=int, required=True,
                    help="torch.set_num_threads; 0 = leave PyTorch's own default")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    torch.manual_seed(1337)
    m = GPT(a.layers, a.heads, a.d_model, a.seq_len, a.vocab)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    times = []
    for s in range(a.warmup + a.steps):
        idx = torch.randint(0, a.vocab, (a.batch, a.seq_len), generator=g)
        tgt = torch.randint(0, a.vocab, (a.batch, a.seq_len), generator=g)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = m(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        dt = time.perf_counter() - t0
        if s >= a.warmup:
            times.append(dt)
    times.sort()
    med = times[len(times) // 2]
    print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                      "tok_per_s": a.batch * a.seq_len / med, "step_ms": med * 1e3,
                      "best_tok_per_s": a.batch * a.seq_len / times[0], "loss": float(loss)}))


if __name__ == "__main__":
    main()
