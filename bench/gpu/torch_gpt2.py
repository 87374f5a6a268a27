#!/usr/bin/env python3
"""torch_gpt2.py — the PyTorch reference of the GPU benchmark (bench/gpu/run.sh): the model dgtrain
trains, at the same batch and precision, written the way a strong PyTorch baseline is.

Model (bench/lib/gpt2_torch.py, as dgtrain's GPT-2 graph): token + position embedding, n_layer pre-LN blocks (LayerNorm, fused qkv
Linear, causal attention through F.scaled_dot_product_attention (flash), output projection, LayerNorm,
4x MLP with tanh-GELU, residuals), final LayerNorm, output head tied to the token embedding with the
vocabulary padded to a multiple of 64 (50304), mean cross-entropy. Precision as dgtrain's bf16 mode:
f32 master weights, bf16 compute (torch.autocast), f32 AdamW state; AdamW fused=True with weight decay
on the matmul weights only; gradient clipping to norm 1. One step = zero_grad + forward + backward +
clip + optimizer.step + loss.item() (dgtrain also reads the loss back every step).

  torch_gpt2.py --mode eager|compile [--batch 32] [--seq-len 1024] [--steps 20] [--warmup 5]
Prints one JSON line: tok_per_s (median step), step_ms, first_step_s (from DG_LAUNCH_T, the launcher's
clock before it started this process, to the end of the first step), peak memory, versions.
"""
import argparse
import json
import os
import sys
import time

T_IMPORT = time.time()
import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
from gpt2_torch import GPT  # noqa: E402 (bench/lib: the model, shared with bench/cpu/torch_ref.py)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["eager", "compile"], required=True)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    a = ap.parse_args()
    launch = float(os.environ.get("DG_LAUNCH_T", T_IMPORT))
    if not torch.cuda.is_available():
        print("torch_gpt2.py: no CUDA device", file=sys.stderr)
        return 77
    dev = torch.device("cuda")
    torch.manual_seed(1337)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    Vp = (a.vocab + 63) // 64 * 64
    model = GPT(a.layers, a.heads, a.d_model, a.seq_len, Vp).to(dev)
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith(("wte", "wpe"))]
    other = [p for n, p in model.named_parameters() if not (p.dim() == 2 and not n.startswith(("wte", "wpe")))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    step_model = torch.compile(model) if a.mode == "compile" else model
    g = torch.Generator(device=dev).manual_seed(1)
    batches = [(torch.randint(0, a.vocab, (a.batch, a.seq_len), device=dev, generator=g),
                torch.randint(0, a.vocab, (a.batch, a.seq_len), device=dev, generator=g)) for _ in range(4)]
    times, first_step_s, loss_v = [], None, None
    for s in range(a.warmup + a.steps):
        idx, tgt = batches[s % len(batches)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            loss = step_model(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_v = loss.item()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if s == 0:
            first_step_s = time.time() - launch
        if s >= a.warmup:
            times.append(dt)
    times.sort()
    med = times[len(times) // 2]
    print(json.dumps({
        "impl": "torch-" + a.mode, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
        "tok_per_s": a.batch * a.seq_len / med, "step_ms": med * 1e3, "step_ms_min": times[0] * 1e3,
        "first_step_s": first_step_s,
        "peak_alloc_bytes": torch.cuda.max_memory_allocated(), "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
        "loss": loss_v, "batch": a.batch, "seq_len": a.seq_len, "steps": a.steps}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
