/* graph_tokps.c — throughput and time-to-loss of the graph on the CPU backend (label `bench`).
 *
 * 1. tokens/s of forward+backward(+AdamW) for a preset (default tiny, micro_batch 8), with the time split
 *    into forward, backward and optimizer phases, and the model FLOP rate.
 * 2. --train: the default training recipe (global batch 16 = 2 micro-batches of 8, lr 3e-3, 20 warmup
 *    steps then cosine to 10%, weight decay 0.1, clip 1.0, betas 0.9/0.95) on byte-level text read from
 *    --text files (default: every file in /usr/share/common-licenses), printing the loss as it goes and the
 * wall time at which it first drops below --target (2.5). It samples random windows with a fixed seed.
 *
 * usage: graph_tokps [--preset NAME] [--micro-batch B] [--seconds S] [--train] [--steps N] [--target L]
 *                    [--text FILE ...]
 */
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../lib/bench_train.h"
#include "dg_model.h"
#include "graph.h"

static void die(const char *what) {
    fprintf(stderr, "graph_tokps: %s: %s\n", what, dg_last_error());
    exit(1);
}

static unsigned char *read_texts(int nfiles, char **files, size_t *len) {
    size_t cap = 1 << 20, n = 0;
    unsigned char *buf = malloc(cap);
    char path[4096];
    DIR *dir = NULL;
    if (nfiles == 0) dir = opendir("/usr/share/common-licenses");
    for (int i = 0;; i++) {
        const char *p;
        if (dir) {
            struct dirent *e = readdir(dir);
            if (!e) break;
            if (e->d_name[0] == '.') continue;
            snprintf(path, sizeof path, "/usr/share/common-licenses/%s", e->d_name);
            p = path;
        } else {
            if (i >= nfiles) break;
            p = files[i];
        }
        FILE *f = fopen(p, "rb");
        if (!f) continue;
        size_t r;
        while ((r = fread(buf + n, 1, cap - n, f)) > 0) {
            n += r;
            if (n == cap) buf = realloc(buf, cap *= 2);
        }
        fclose(f);
    }
    if (dir) closedir(dir);
    *len = n;
    return buf;
}

int main(int argc, char **argv) {
    const char *preset = "tiny";
    int B = 8, train = 0, steps = 300;
    double seconds = 20, target = 2.5;
    char *files[64];
    int nfiles = 0;
    const char *spec = "--preset=str --micro-batch=int --seconds=real --steps=int --target=real --train=flag";
    void *const dst[] = {&preset, &B, &seconds, &steps, &target, &train};
    for (int i = 1; (i = bench_args(argc, argv, i, spec, dst)) < argc; i += 2) {
        if (strcmp(argv[i], "--text") || i + 1 >= argc || nfiles >= 64) {
            fprintf(stderr,
                    "usage: %s [--preset NAME] [--micro-batch B] [--seconds S] [--train] [--steps N] "
                    "[--target L] [--text FILE ...]\n",
                    argv[0]);
            return 1;
        }
        files[nfiles++] = argv[i + 1];
    }
    dg_model_desc_t d;
    if (dg_model_desc_preset(preset, &d)) die("preset");
    dg_backend_config_t bc = {.act_dtype = DG_F32};
    dg_backend_t *be;
    if (dg_backend_cpu_create(&bc, &be)) die("backend");
    dg_model_t *m;
    if (dg_model_create(&d, be, B, 1337, &m)) die("model");
    int T = d.seq_len;
    size_t ntok = (size_t)B * T;
    int32_t *tok = malloc(ntok * sizeof *tok), *tgt = malloc(ntok * sizeof *tgt);
    double flops_tok = dg_model_flops_per_token(&d);
    printf("%s: %llu params, micro_batch %d x seq_len %d, arena %.1f MiB, %.2f MFLOP/token\n", preset,
           (unsigned long long)dg_model_n_params(&d), B, T, dg_model_arena_bytes(m) / 1048576.0,
           flops_tok / 1e6);

    if (!train) {
        uint64_t s = 5;
        for (size_t i = 0; i < ntok; i++) {
            const uint64_t r = bench_lcg(&s);
            tok[i] = (int32_t)((r >> 33) % (uint64_t)d.vocab_size);
            tgt[i] = (int32_t)((r >> 13) % (uint64_t)d.vocab_size);
        }
        dg_optim_hparams_t h = bench_adamw(1e-4f, 1);
        float loss, norm;
        for (int w = 0; w < 2; w++) { /* warm-up: page in the arena and the BLAS buffers */
            if (dg_model_zero_grad(m) || dg_model_forward_backward(m, tok, tgt, 1.0f / (float)ntok, &loss) ||
                dg_model_optimizer_step(m, &h, &norm))
                die("warm-up");
            h.t++;
        }
        double tf = 0, tb = 0, to = 0, t0 = dg_now_s();
        long it = 0;
        while (dg_now_s() - t0 < seconds) {
            double a = dg_now_s();
            if (dg_model_zero_grad(m) || dg_model_forward(m, tok, tgt, &loss)) die("forward");
            double b = dg_now_s();
            if (dg_model_forward_backward(m, tok, tgt, 1.0f / (float)ntok, &loss)) die("forward_backward");
            double c = dg_now_s();
            if (dg_model_optimizer_step(m, &h, &norm)) die("optimizer");
            double e = dg_now_s();
            h.t++;
            tf += b - a;
            tb += (c - b) - (b - a); /* backward = (forward+backward) - forward */
            to += e - c;
            it++;
        }
        /* a training step is forward+backward+optimizer; the separate forward only splits the time */
        double step = (tf + tb + to) / (double)it;
        double tps = (double)ntok / step;
        /* where the time goes: one more step with per-op timing */
        dg_model_set_profiling(m, 1);
        if (dg_model_zero_grad(m) || dg_model_forward_backward(m, tok, tgt, 1.0f / (float)ntok, &loss) ||
            dg_model_optimizer_step(m, &h, &norm))
            die("profiled step");
        printf("per-op time of one profiled step:\n");
        dg_model_print_profile(m, stdout);
        dg_model_set_profiling(m, 0);
        printf("%ld steps: %.1f ms/step (forward %.1f, backward %.1f, optimizer %.1f) -> %.0f tokens/s, "
               "%.1f GFLOP/s\n",
               it, 1e3 * step, 1e3 * tf / (double)it, 1e3 * tb / (double)it, 1e3 * to / (double)it, tps,
               tps * flops_tok / 1e9);
    } else {
        size_t len;
        unsigned char *text = read_texts(nfiles, files, &len);
        if (len < (size_t)T + 2) {
            fprintf(stderr, "graph_tokps: not enough text (%zu bytes)\n", len);
            return 1;
        }
        printf("training on %zu bytes of text, global batch %d sequences (%d micro-batches)\n", len, 2 * B,
               2);
        uint64_t s = 1337;
        double t0 = dg_now_s(), hit = -1;
        float ema = 0;
        for (int st = 1; st <= steps; st++) {
            if (dg_model_zero_grad(m)) die("zero_grad");
            float lsum = 0, loss;
            for (int mb = 0; mb < 2; mb++) {
                for (int b = 0; b < B; b++) {
                    size_t off = (size_t)((bench_lcg(&s) >> 17) % (len - (size_t)T - 1));
                    for (int t = 0; t < T; t++) {
                        tok[b * T + t] = text[off + t];
                        tgt[b * T + t] = text[off + t + 1];
                    }
                }
                if (dg_model_forward_backward(m, tok, tgt, 1.0f / (2.0f * (float)ntok), &loss))
                    die("fwd/bwd");
                lsum += loss / 2;
            }
            double lr = 3e-3;
            if (st <= 20)
                lr *= (double)st / 20;
            else
                lr *= 0.1 + 0.9 * 0.5 * (1 + cos(M_PI * (double)(st - 20) / (double)(steps - 20)));
            const dg_optim_hparams_t h = bench_adamw((float)lr, st);
            float norm;
            if (dg_model_optimizer_step(m, &h, &norm)) die("optimizer");
            ema = st == 1 ? lsum : 0.9f * ema + 0.1f * lsum;
            double now = dg_now_s() - t0;
            if (hit < 0 && lsum < target) hit = now;
            if (st == 1 || st % 10 == 0 || st == steps)
                printf("step %4d  loss %.4f (avg %.4f)  norm %.3f  lr %.2e  %.1f s\n", st, (double)lsum,
                       (double)ema, (double)norm, lr, now);
            if (now > seconds) break;
        }
        if (hit >= 0)
            printf("loss first below %.2f after %.1f s\n", target, hit);
        else
            printf("loss did not reach %.2f\n", target);
        free(text);
    }
    free(tok);
    free(tgt);
    dg_model_free(m);
    dg_backend_free(be);
    return 0;
}
