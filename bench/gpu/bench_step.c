/* bench_step.c — where the time of one GPU training step goes: the same GPT step (zero-grad, forward,
 * backward, clip + AdamW) run through the graph executor on the CUDA backend three ways:
 *
 *   api    the model API exactly as dgtrain's loop calls it (dg_model_zero_grad, _forward_backward,
 *          _optimizer_step): eager launches plus the loop's host waits for the loss and norm read-backs
 *          (fence waits after the forward and after the clip factor; syncs after the backward and after
 *          the AdamW with DG_SYNC_HOST_READS=1), then one wait for the step's end (the timing event);
 *   eager  the same schedule replayed eagerly with no host sync inside the step (a second executor on the
 *          model's graph and plan): launch-bound time;
 *   graph  that schedule captured once as one CUDA Graph on the backend's stream and replayed: what the
 *          executor's CUDA-Graph capture (docs/cuda.md) would run.
 *
 * api - eager is the cost of the host syncs; eager - graph the launch gaps the capture buys back;
 * graph vs the kernel sum of bench/kernels/bench_backend_cuda the rest. Steps are timed with CUDA
 * events on the backend's stream (median of --steps after --warmup). Random tokens; the learning rate
 * and step number are baked into the captured graph (fine for timing: see docs/cuda.md for what the real
 * capture must move to device memory).
 *
 *   bench_step [--preset gpt2-124m] [--B 32] [--precision bf16|fp8|...] [--steps 10] [--warmup 3] [--json
 * FILE] Exit 77 without a GPU. It reads the graph module's executor API (src/graph/graph.h), as its tests do.
 */
#define _GNU_SOURCE
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "dg_model.h"
#include "graph.h"
#include "train_util.h"

#define BENCH_WHO "bench_step"
#include "../lib/bench_check.h"
#include "../lib/bench_train.h"

/* The whole step through an executor with no host synchronisation. */
static dg_status_t run_step(dg_exec_t *ex) {
    DG_TRY(dg_exec_run_phase(ex, DG_PHASE_ZERO));
    DG_TRY(dg_exec_run_phase(ex, DG_PHASE_FWD));
    DG_TRY(dg_exec_run_phase(ex, DG_PHASE_BWD));
    return dg_exec_run_phase(ex, DG_PHASE_OPT);
}

int main(int argc, char **argv) {
    const char *preset = "gpt2-124m", *precision = "bf16", *json = NULL;
    int B = 32, steps = 10, warmup = 3;
    void *const dst[] = {&preset, &B, &precision, &steps, &warmup, &json};
    if (bench_args(argc, argv, 1, "--preset=str --B=int --precision=str --steps=int --warmup=int --json=str",
                   dst) < argc) {
        fprintf(stderr, "usage: bench_step [--preset gpt2-124m] [--B 32] [--precision "
                        "fp32|bf16|fp16|fp8] [--steps 10] "
                        "[--warmup 3] [--json FILE]\n");
        return 2;
    }
    if (B < 1 || steps < 1 || warmup < 0 || steps > 1000) {
        fprintf(stderr, "bench_step: bad --B / --steps / --warmup\n");
        return 2;
    }
    dg_backend_config_t bc = {0};
    const int fp8 = !strcmp(precision, "fp8"); /* bf16 activations, the linear layers' GEMMs in FP8 */
    bc.act_dtype = !strcmp(precision, "bf16") || fp8 ? DG_BF16 : !strcmp(precision, "fp16") ? DG_F16 : DG_F32;
    bc.fp8 = fp8;
    dg_backend_t *be = NULL;
    if (dg_backend_cuda_create(&bc, &be) != DG_OK) {
        printf("SKIP: %s\n", dg_last_error());
        return 77;
    }
    dg_model_desc_t d;
    MUST(dg_model_desc_preset(preset, &d));
    const int T = d.seq_len;
    dg_model_t *m = NULL;
    MUST(dg_model_create(&d, be, B, 1337, &m));
    const size_t ntok = (size_t)B * T;
    int32_t *tok = malloc(ntok * sizeof *tok), *tgt = malloc(ntok * sizeof *tgt);
    bench_fill_tokens(tok, ntok, d.vocab_size, 0x243F6A8885A308D3ull);
    for (size_t i = 0; i < ntok; i++)
        tgt[i] = i + 1 < ntok ? tok[i + 1] : tok[0];
    const float dloss = 1.0f / (float)ntok;
    dg_optim_hparams_t h = bench_adamw(6e-4f, 1);
    cudaStream_t st = (cudaStream_t)dg_backend_cuda_stream(be);
    cudaEvent_t e0, e1;
    CU(cudaEventCreate(&e0));
    CU(cudaEventCreate(&e1));
    double *t_api = calloc((size_t)steps, sizeof(double)), *t_eager = calloc((size_t)steps, sizeof(double));
    double *t_graph = calloc((size_t)steps, sizeof(double));
    double *t_fb = calloc((size_t)steps, sizeof(double)), *t_opt = calloc((size_t)steps, sizeof(double));

    /* 1. the model API, as dgtrain's loop drives it (one micro-batch per step) */
    float loss = 0, norm = 0, first_loss = 0;
    for (int i = 0; i < warmup + steps; i++) {
        double w0 = dg_now_s();
        CU(cudaEventRecord(e0, st));
        MUST(dg_model_zero_grad(m));
        MUST(dg_model_forward_backward(m, tok, tgt, dloss, &loss));
        double w1 = dg_now_s();
        h.t = i + 1;
        MUST(dg_model_optimizer_step(m, &h, &norm));
        CU(cudaEventRecord(e1, st));
        CU(cudaEventSynchronize(e1));
        double w2 = dg_now_s();
        float ms = 0;
        CU(cudaEventElapsedTime(&ms, e0, e1));
        if (i == 0) first_loss = loss;
        if (i >= warmup) {
            t_api[i - warmup] = ms;
            t_fb[i - warmup] = (w1 - w0) * 1e3;
            t_opt[i - warmup] = (w2 - w1) * 1e3;
        }
    }
    if (!isfinite(loss) || !isfinite(norm)) {
        fprintf(stderr, "bench_step: non-finite loss %g / grad norm %g\n", (double)loss, (double)norm);
        return 1;
    }

    /* 2. a second executor over the same graph and plan (its own arena, the model's parameters) */
    dg_exec_t *ex = NULL;
    MUST(dg_exec_create(be, dg_model_graph(m), dg_model_plan(m), &ex));
    ex->rt.dloss = dloss;
    ex->rt.lr = h.lr;
    ex->rt.beta1 = h.beta1;
    ex->rt.beta2 = h.beta2;
    ex->rt.eps = h.eps;
    ex->rt.weight_decay = h.weight_decay;
    ex->rt.grad_clip = h.grad_clip;
    ex->rt.grad_extra = 1.0f;
    ex->rt.t = warmup + steps + 1;
    MUST(run_step(ex)); /* sizes the backend's scratch before any capture */
    MUST(be->ops->sync(be));
    for (int i = 0; i < warmup + steps; i++) {
        CU(cudaEventRecord(e0, st));
        MUST(run_step(ex));
        CU(cudaEventRecord(e1, st));
        CU(cudaEventSynchronize(e1));
        float ms = 0;
        CU(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= warmup) t_eager[i - warmup] = ms;
    }
    MUST(be->ops->sync(be));

    /* 3. capture the step once, replay it */
    cudaGraph_t graph = NULL;
    cudaGraphExec_t gexec = NULL;
    double w0 = dg_now_s();
    CU(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    dg_status_t cs = run_step(ex);
    cudaError_t ce = cudaStreamEndCapture(st, &graph);
    if (cs != DG_OK || ce != cudaSuccess) {
        fprintf(stderr, "bench_step: capture failed: %s / %s\n", cs ? dg_last_error() : "ok",
                cudaGetErrorString(ce));
        return 1;
    }
    size_t n_nodes = 0;
    CU(cudaGraphGetNodes(graph, NULL, &n_nodes));
    CU(cudaGraphInstantiate(&gexec, graph, 0));
    double capture_ms = (dg_now_s() - w0) * 1e3;
    for (int i = 0; i < warmup + steps; i++) {
        CU(cudaEventRecord(e0, st));
        CU(cudaGraphLaunch(gexec, st));
        CU(cudaEventRecord(e1, st));
        CU(cudaEventSynchronize(e1));
        float ms = 0;
        CU(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= warmup) t_graph[i - warmup] = ms;
    }
    MUST(be->ops->sync(be)); /* also reports device-side error flags */

    dg_cuda_mem_stats_t mem;
    MUST(dg_backend_cuda_mem_stats(be, &mem));
    double api = bench_median(t_api, steps), eager = bench_median(t_eager, steps),
           gr = bench_median(t_graph, steps);
    double fb = bench_median(t_fb, steps), opt = bench_median(t_opt, steps);
    double fpt = dg_model_flops_per_token(&d);
    double peak = dg_peak_flops_gpu(dg_backend_cuda_device_name(be), precision);
    printf("bench_step: %s, %s, B=%d T=%d (%zu tokens/step), %d ops/step, %zu graph nodes, GPU %s\n", preset,
           precision, B, T, ntok, dg_model_n_ops(m), n_nodes, dg_backend_cuda_device_name(be));
    printf("  loss %.4f (first %.4f), grad norm %.4f\n", (double)loss, (double)first_loss, (double)norm);
    printf("  %-34s %9.3f ms  %9.0f tok/s  MFU %.3f\n", "api (dgtrain's loop, eager)", api,
           ntok / (api * 1e-3), peak > 0 ? ntok / (api * 1e-3) * fpt / peak : NAN);
    printf("  %-34s %9.3f ms  (to forward_backward's return %.3f ms, then to the step's end %.3f ms, host "
           "clock)\n",
           "  of which", fb + opt, fb, opt);
    printf("  %-34s %9.3f ms  %9.0f tok/s\n", "eager, no host sync in the step", eager,
           ntok / (eager * 1e-3));
    printf("  %-34s %9.3f ms  %9.0f tok/s  MFU %.3f\n", "CUDA Graph replay", gr, ntok / (gr * 1e-3),
           peak > 0 ? ntok / (gr * 1e-3) * fpt / peak : NAN);
    printf("  host syncs cost %.3f ms/step, launch gaps %.3f ms/step (%.1f%% of the eager step); capture + "
           "instantiate %.1f ms once\n",
           api - eager, eager - gr, 100.0 * (eager - gr) / eager, capture_ms);
    printf("  backend memory: peak allocated %.2f GiB (two executors' arenas: the model's and this bench's), "
           "device "
           "in use %.2f GiB\n",
           mem.peak_alloc_bytes / 1073741824.0, mem.device_used_bytes / 1073741824.0);
    if (json) {
        FILE *f = fopen(json, "w");
        if (!f) {
            fprintf(stderr, "bench_step: cannot write %s\n", json);
            return 1;
        }
        fprintf(
            f,
            "{\"preset\":\"%s\",\"precision\":\"%s\",\"B\":%d,\"T\":%d,\"tokens_per_step\":%zu,\"ops\":%d,"
            "\"graph_nodes\":%zu,\"gpu\":\"%s\",\"api_ms\":%.4f,\"api_fwdbwd_ms\":%.4f,\"api_opt_ms\":%.4f,"
            "\"eager_ms\":%.4f,\"graph_ms\":%.4f,\"capture_ms\":%.2f,\"flops_per_token\":%.6g,"
            "\"peak_flops\":%.6g,\"loss\":%.6f,\"peak_alloc_bytes\":%zu}\n",
            preset, precision, B, T, ntok, dg_model_n_ops(m), n_nodes, dg_backend_cuda_device_name(be), api,
            fb, opt, eager, gr, capture_ms, fpt, peak, (double)loss, mem.peak_alloc_bytes);
        fclose(f);
    }
    cudaGraphExecDestroy(gexec);
    cudaGraphDestroy(graph);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    dg_exec_free(ex);
    dg_model_free(m);
    dg_backend_free(be);
    free(tok);
    free(tgt);
    free(t_api);
    free(t_eager);
    free(t_graph);
    free(t_fb);
    free(t_opt);
    return 0;
}
