/* sample_cli.c — `dgtrain sample` (dg_sample.h): flags, checkpoint and tokenizer resolution, the backend,
 * then streaming generation or --bench, with the figures of docs/sampling.md. */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <mpi.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "checkpoint.h"
#include "config.h"
#include "dg_infer.h"
#include "dg_json.h"
#include "dg_sample.h"
#include "dg_sampler.h"
#include "sample_impl.h"
#include "tokenizer.h"

/* ---------------- flags ---------------- */

static void usage(FILE *f) {
    fprintf(
        f,
        "usage: dgtrain sample CKPT_OR_RUN_DIR (--prompt TEXT | --prompt-file FILE) [options]\n"
        "\n"
        "Generates text from a checkpoint (a step_*.h5 file, a checkpoint directory, or a run directory:\n"
        "its latest good checkpoint, as checkpoint.resume=auto picks it), streaming it to stdout; the\n"
        "figures (warm-up, first-token latency, tokens/s) go to stderr.\n"
        "\n"
        "options:\n"
        "  --tokens N          tokens to generate (default 64; stops earlier at <|endoftext|> or a full\n"
        "                      context of seq_len)\n"
        "  --temperature T     >= 0, 0 = greedy (default 1)\n"
        "  --top-k K           keep the K most likely tokens, 0 = all (default 0)\n"
        "  --top-p P           nucleus: the most likely tokens up to probability P, in (0, 1] (default 1)\n"
        "  --seed S            RNG seed (splitmix64; default 1): the same seed gives the same text\n"
        "  --device cpu|cuda   default: the run's parallel.backend (auto: cuda when usable)\n"
        "  --tokenizer auto|byte|gpt2  default auto: what the run's data used (docs/sampling.md)\n"
        "  --ignore-eos        do not stop at <|endoftext|>\n"
        "  --json              one JSON object on stdout (text, token ids, figures) instead\n"
        "  --bench N           run N prompts (the given one, or built-in ones of varied lengths) and\n"
        "                      report p50/p99 first-token latency and tokens/s\n"
        "exit codes: 0 done; 2 bad input (flags, no checkpoint, prompt too long) or failure\n");
}

static dg_status_t parse_i(const char *flag, const char *v, long lo, long hi, int *out) {
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (!*v || *end || errno || x < lo || x > hi)
        return DG_ERR(DG_ERR_USAGE, "%s '%s': expected an integer in [%ld, %ld]", flag, v, lo, hi);
    *out = (int)x;
    return DG_OK;
}

static dg_status_t parse_d(const char *flag, const char *v, double *out) {
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (!*v || *end || errno || !isfinite(x))
        return DG_ERR(DG_ERR_USAGE, "%s '%s': expected a finite number", flag, v);
    *out = x;
    return DG_OK;
}

static dg_status_t parse_u64(const char *flag, const char *v, uint64_t *out) {
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 0);
    if (!*v || *end || errno || v[0] == '-')
        return DG_ERR(DG_ERR_USAGE, "%s '%s': expected an unsigned 64-bit integer", flag, v);
    *out = (uint64_t)x;
    return DG_OK;
}

/* --flag VALUE or --flag=VALUE: *val is set when argv[*i] is `name`, advancing *i past a separate value. */
static int flag_value(int argc, char **argv, int *i, const char *name, const char **val, dg_status_t *err) {
    const char *a = argv[*i];
    size_t n = strlen(name);
    if (strncmp(a, name, n) != 0) return 0;
    if (a[n] == '=') {
        *val = a + n + 1;
        return 1;
    }
    if (a[n] != 0) return 0;
    if (*i + 1 >= argc) {
        *err = DG_ERR(DG_ERR_USAGE, "%s: expected a value after it", name);
        return 1;
    }
    *val = argv[++*i];
    return 1;
}

static dg_status_t set_value(sample_opts_t *o, const char *name, const char *v) {
    if (strcmp(name, "--prompt") == 0)
        o->prompt = v;
    else if (strcmp(name, "--prompt-file") == 0)
        o->prompt_file = v;
    else if (strcmp(name, "--tokens") == 0)
        return parse_i(name, v, 1, 1L << 30, &o->tokens);
    else if (strcmp(name, "--temperature") == 0) {
        DG_TRY(parse_d(name, v, &o->temperature));
        if (o->temperature < 0)
            return DG_ERR(DG_ERR_USAGE, "--temperature %s: expected >= 0 (0 = greedy)", v);
    } else if (strcmp(name, "--top-k") == 0)
        return parse_i(name, v, 0, 1L << 30, &o->top_k);
    else if (strcmp(name, "--top-p") == 0) {
        DG_TRY(parse_d(name, v, &o->top_p));
        if (!(o->top_p > 0 && o->top_p <= 1))
            return DG_ERR(DG_ERR_USAGE, "--top-p %s: expected a value in (0, 1] (1 = no limit)", v);
    } else if (strcmp(name, "--seed") == 0)
        return parse_u64(name, v, &o->seed);
    else if (strcmp(name, "--device") == 0) {
        if (strcmp(v, "cpu") != 0 && strcmp(v, "cuda") != 0)
            return DG_ERR(DG_ERR_USAGE, "--device '%s': expected cpu or cuda", v);
        o->device = v;
    } else if (strcmp(name, "--tokenizer") == 0) {
        if (strcmp(v, "auto") != 0 && strcmp(v, "byte") != 0 && strcmp(v, "gpt2") != 0)
            return DG_ERR(DG_ERR_USAGE, "--tokenizer '%s': expected auto, byte or gpt2", v);
        o->tokenizer = v;
    } else if (strcmp(name, "--bench") == 0)
        return parse_i(name, v, 1, 100000, &o->bench);
    return DG_OK;
}

static dg_status_t parse_args(int argc, char **argv, sample_opts_t *o) {
    static const char *const valued[] = {"--prompt", "--prompt-file", "--tokens", "--temperature", "--top-k",
                                         "--top-p",  "--seed",        "--device", "--tokenizer",   "--bench"};
    memset(o, 0, sizeof *o);
    o->tokens = 64;
    o->temperature = 1.0;
    o->top_p = 1.0;
    o->seed = 1;
    o->tokenizer = "auto";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = NULL;
        dg_status_t err = DG_OK;
        int hit = 0;
        for (size_t k = 0; !hit && k < sizeof valued / sizeof *valued; k++)
            if (flag_value(argc, argv, &i, valued[k], &v, &err)) {
                hit = 1;
                if (err == DG_OK) err = set_value(o, valued[k], v);
            }
        if (hit) {
            if (err != DG_OK) return err;
        } else if (strcmp(a, "--json") == 0)
            o->json = 1;
        else if (strcmp(a, "--ignore-eos") == 0)
            o->ignore_eos = 1;
        else if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0)
            o->help = 1;
        else if (a[0] == '-' && a[1])
            return DG_ERR(DG_ERR_USAGE, "unknown option '%s' (dgtrain sample --help)", a);
        else if (o->src)
            return DG_ERR(DG_ERR_USAGE, "more than one checkpoint given ('%s' and '%s')", o->src, a);
        else
            o->src = a;
    }
    if (o->help) return DG_OK;
    if (!o->src)
        return DG_ERR(DG_ERR_USAGE, "no checkpoint given: dgtrain sample CKPT_OR_RUN_DIR --prompt TEXT");
    if (o->prompt && o->prompt_file) return DG_ERR(DG_ERR_USAGE, "give --prompt or --prompt-file, not both");
    if (!o->prompt && !o->prompt_file && !o->bench)
        return DG_ERR(DG_ERR_USAGE, "no prompt: give --prompt TEXT or --prompt-file FILE");
    return DG_OK;
}

/* ---------------- output ---------------- */

static void print_figures(const sample_ctx_t *c, const sample_gen_t *g) {
    fprintf(stderr, "\n[sample] checkpoint %s (step %" PRId64 "), device %s (%s), tokenizer %s\n", c->ckpt,
            c->step, c->device, dg_dtype_name(c->be->act_dtype), c->tok_why);
    fprintf(stderr, "[sample] warm-up %.1f ms (load + build, no inference)\n", c->warm_ms);
    fprintf(stderr, "[sample] first-token latency %.2f ms (prompt of %d tokens)\n", g->first_ms, g->prompt_n);
    if (g->n > 1)
        fprintf(stderr, "[sample] %d tokens, %.1f tokens/s after the first; stopped: %s\n", g->n, g->tps,
                g->stop);
    else
        fprintf(stderr, "[sample] %d token; stopped: %s\n", g->n, g->stop);
}

static void print_json(const sample_ctx_t *c, const sample_gen_t *g) {
    printf("{\"checkpoint\":");
    dg_json_fputs(stdout, c->ckpt);
    printf(",\"step\":%" PRId64
           ",\"device\":\"%s\",\"dtype\":\"%s\",\"tokenizer\":\"%s\",\"prompt_tokens\":%d,"
           "\"text\":",
           c->step, c->device, dg_dtype_name(c->be->act_dtype), c->tok.name, g->prompt_n);
    dg_json_fputs(stdout, g->text ? g->text : "");
    printf(",\"token_ids\":[");
    for (int i = 0; i < g->n; i++)
        printf("%s%d", i ? "," : "", (int)g->ids[i]);
    printf("],\"generated\":%d,\"stop\":\"%s\",\"warmup_ms\":%.3f,\"first_token_ms\":%.3f,\"tokens_per_s\":",
           g->n, g->stop, c->warm_ms, g->first_ms);
    if (g->n > 1)
        printf("%.3f}\n", g->tps);
    else
        printf("null}\n");
    fflush(stdout);
}

/* ---------------- main ---------------- */

static dg_status_t run(const sample_opts_t *o) {
    sample_ctx_t c;
    dg_status_t s = dg_sample_setup(o, &c);
    if (s == DG_OK && o->bench) s = dg_sample_bench(&c, o);
    if (s == DG_OK && !o->bench) {
        char *text = NULL;
        size_t len = 0;
        if (o->prompt_file)
            s = dg_sample_read_file(o->prompt_file, &text, &len);
        else
            len = strlen(o->prompt), text = dg_xstrdup(o->prompt);
        sample_gen_t g = {0};
        if (s == DG_OK) s = dg_sample_generate(&c, o, text, len, !o->json, &g);
        if (s == DG_OK) {
            if (o->json)
                print_json(&c, &g);
            else
                print_figures(&c, &g);
        }
        dg_sample_gen_free(&g);
        free(text);
    }
    dg_sample_teardown(&c);
    return s;
}

int dg_sample_main(int argc, char **argv) {
    sample_opts_t o;
    dg_status_t s = parse_args(argc, argv, &o);
    if (s == DG_OK && o.help) {
        usage(stdout);
        return 0;
    }
    if (s != DG_OK) {
        fprintf(stderr, "dgtrain sample: error: %s\n", dg_last_error());
        return 2;
    }
    int provided = 0;
    if (MPI_Init_thread(NULL, NULL, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS) {
        fprintf(stderr, "dgtrain sample: error: MPI_Init_thread failed (the checkpoint reader needs MPI)\n");
        return 2;
    }
    s = run(&o);
    if (s != DG_OK) fprintf(stderr, "dgtrain sample: error: %s\n", dg_last_error());
    MPI_Finalize();
    return s == DG_OK ? 0 : 2;
}
