#!/usr/bin/env python3
"""torch_kernels.py - the reference for bench_backend_cuda: times the same ops at the same shapes in
PyTorch (bf16, eager kernels: cuBLAS, flash SDPA, fused AdamW) in the same run, and prints the CUDA
backend's time, PyTorch's time and the ratio for each op.

    python3 torch_kernels.py --ours bench.json [--iters 20]

The ratio is PyTorch time / our time (> 1: ours is faster). Weight-gradient GEMMs in PyTorch write bf16
and are then added to an f32 buffer, as autograd with f32 master weights would; ours accumulate in f32
inside the GEMM.
"""
import argparse
import json
import sys

import torch
import torch.nn.functional as F


def timeit(fn, iters):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", required=True)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    ours = json.load(open(a.ours))
    B, T = ours["B"], ours["T"]
    C, NH, V, Vp, N = 768, 12, 50257, 50304, ours["B"] * ours["T"]
    dt = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[ours["act"]]
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, s=1.0, dtype=dt):
        return (torch.rand(*shape, device=dev, generator=g, dtype=torch.float32) * 2 - 1).mul_(s).to(dtype)

    tok = (torch.arange(N, device=dev) * 7919 + 13) % V
    wte, wpe = rnd(Vp, C, s=0.05), rnd(T, C, s=0.05)
    x, dy = rnd(N, C), rnd(N, C, s=0.1)
    lnw, lnb = rnd(C) + 1, rnd(C, s=0.1)
    w3, b3, w1 = rnd(3 * C, C, s=0.03), rnd(3 * C, s=0.02), rnd(C, C, s=0.03)
    w4, b4, wp = rnd(4 * C, C, s=0.03), rnd(4 * C, s=0.02), rnd(C, 4 * C, s=0.03)
    h4, dh4 = rnd(N, 4 * C), rnd(N, 4 * C, s=0.1)
    qkv = rnd(B, T, 3 * C)
    gw = torch.zeros(4 * C * C, device=dev)
    it = a.iters
    t = {}
    t["encoder_fwd"] = timeit(lambda: F.embedding(tok, wte) + wpe.repeat(B, 1), it)
    gte = torch.zeros(Vp, C, device=dev)
    t["encoder_bwd"] = timeit(lambda: torch.ops.aten.embedding_dense_backward(dy, tok, Vp, -1, False), it)
    t["layernorm_fwd"] = timeit(lambda: F.layer_norm(x, (C,), lnw, lnb, 1e-5), it)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, (C,), lnw, lnb, 1e-5)
    t["layernorm_bwd"] = timeit(
        lambda: torch.ops.aten.native_layer_norm_backward(dy, x, (C,), mean, rstd, lnw, lnb, [True, True, True]), it)

    def mm_bwd(dout, inp, w, bias):
        def f():
            dout @ w
            gw[: w.numel()].view_as(w).add_(dout.t() @ inp)
            if bias:
                dout.sum(0)
        return f

    d3 = rnd(N, 3 * C, s=0.1)
    t["matmul_fwd qkv"] = timeit(lambda: F.linear(x, w3, b3), it)
    t["matmul_bwd qkv"] = timeit(mm_bwd(d3, x, w3, True), it)
    t["matmul_fwd attproj"] = timeit(lambda: F.linear(x, w1, b3[:C]), it)
    t["matmul_bwd attproj"] = timeit(mm_bwd(dy, x, w1, True), it)
    t["matmul_fwd fc+gelu"] = timeit(lambda: F.gelu(F.linear(x, w4, b4), approximate="tanh"), it)
    t["matmul_bwd fc"] = timeit(mm_bwd(dh4, x, w4, True), it)
    t["matmul_fwd fcproj"] = timeit(lambda: F.linear(h4, wp, b3[:C]), it)
    t["matmul_bwd fcproj"] = timeit(mm_bwd(dy, h4, wp, True), it)
    t["gelu_bwd"] = timeit(lambda: torch.ops.aten.gelu_backward(dh4, h4, approximate="tanh"), it)
    out = torch.empty_like(x)
    t["add (residual)"] = timeit(lambda: torch.add(x, dy, out=out), it)
    t["accumulate (residual grad)"] = timeit(lambda: out.add_(dy), it)
    q, k, v = qkv.view(B, T, 3, NH, C // NH).permute(2, 0, 3, 1, 4).unbind(0)
    t["attention_fwd"] = timeit(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), it)
    qg, kg, vg = (z.detach().requires_grad_() for z in (q, k, v))
    o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
    do = torch.randn_like(o)
    t["attention_bwd"] = timeit(lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True), it)
    t["matmul_fwd lm_head"] = timeit(lambda: x @ wte.t(), it)
    logits = (x @ wte.t())[:, :V]
    t["crossentropy_fwd"] = timeit(lambda: F.cross_entropy(logits, tok), it)
    lg = logits.detach().requires_grad_()
    loss = F.cross_entropy(lg, tok)
    t["crossentropy_bwd"] = timeit(lambda: torch.autograd.grad(loss, lg, retain_graph=True), it)
    dlog = rnd(N, Vp, s=0.01)
    t["matmul_bwd lm_head"] = timeit(lambda: (dlog @ wte, gte.add_(dlog.t() @ x)), it)
    del logits, lg, loss, dlog
    npar = 124475904
    p = torch.nn.Parameter(torch.rand(npar, device=dev) * 0.1)
    p.grad = torch.rand(npar, device=dev) * 0.01
    opt = torch.optim.AdamW([p], lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=True)
    t["sumsq_f32 (all grads)"] = timeit(lambda: torch.linalg.vector_norm(p.grad), it)
    t["adamw (all params)"] = timeit(lambda: opt.step(), it)

    print(f"\nPyTorch {torch.__version__} eager reference, same shapes (B={B} T={T}, {ours['act']})")
    print(f"{'op':<28} {'ours ms':>9} {'torch ms':>9} {'torch/ours':>11}")
    ours_sum = torch_sum = 0.0
    for r in ours["ops"]:
        name = r["name"]
        if name not in t:
            continue
        ours_sum += r["ms"] * r["per_step"]
        torch_sum += t[name] * r["per_step"]
        print(f"{name:<28} {r['ms']:9.4f} {t[name]:9.4f} {t[name] / r['ms']:11.2f}")
    print(f"{'one step (sum, x per step)':<28} {ours_sum:9.2f} {torch_sum:9.2f} {torch_sum / ours_sum:11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
