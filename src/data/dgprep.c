/* dgprep.c — the `dgprep` command: turn text files (or directories of them) into llm.c train and val
 * shards for dgtrain, of bytes (vocabulary 256) or of GPT-2 BPE ids (vocabulary 50257, src/tokenizer).
 * All the work is in dg_data_prep (prep.c); this file is argument parsing, loading the tokenizer and
 * the report. Every failure is one line on stderr and exit 1. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data.h"
#include "tokenizer.h"
#include "dg_env.h"

static void usage(FILE *f) {
    fprintf(
        f,
        "usage: dgprep --out DIR [--tokenizer bytes|gpt2] [--val-fraction F] [--name NAME]\n"
        "              [--shard-tokens N] [--quiet] [GPT-2 OPTIONS] FILE|DIR...\n"
        "\n"
        "Turn text into llm.c token shards for dgtrain:\n"
        "  DIR/NAME_train_000000.bin ...  and  DIR/NAME_val_000000.bin ...\n"
        "Files are read in the order given (a directory's regular files in name order; symlinks, hidden\n"
        "files, binary files and duplicates inside a directory are skipped). The last F of each file,\n"
        "from a line start, goes to the val split.\n"
        "  --tokenizer bytes  (default) each byte is one token (vocabulary 256); files joined line-wise\n"
        "  --tokenizer gpt2   GPT-2 BPE ids (vocabulary 50257, as tiktoken's \"gpt2\"); each document is\n"
        "                     <|endoftext|> (50256) then its ids, as llm.c's data preparation does\n"
        "\n"
        "  --out DIR          output directory (created if missing)\n"
        "  --val-fraction F   fraction of each file for validation, 0 <= F < 1 (default 0.1)\n"
        "  --name NAME        output file prefix (default 'default')\n"
        "  --shard-tokens N   at most N tokens per shard (default 100000000)\n"
        "  --quiet            no notes or progress on stderr\n"
        "  --help, --version\n"
        "GPT-2 options:\n"
        "  --docs file        a document is the train part, and the val part, of each file (default)\n"
        "  --docs blank-line  a document ends after each blank line (\"\\n\\n\"), as llm.c's "
        "tinyshakespeare\n"
        "  --vocab FILE       the .tiktoken ranks file (default: $%s, else %s in\n"
        "                     <dgprep's dir>/../share/dgtrain, %s, /usr/share/dgtrain)\n"
        "  --hf-tokenizer DIR a Hugging Face GPT-2 tokenizer's DIR/vocab.json + DIR/merges.txt instead\n"
        "  --threads N        encoding threads (default: the CPUs this process may use)\n"
        "  --chunk-bytes N    cut long documents at safe points into ~N-byte pieces for the threads\n"
        "                     (default 1048576; the ids do not depend on it)\n"
        "\n"
        "A file is refused as binary when it has a NUL byte or more than %d%% control characters.\n"
        "GPT-2: invalid UTF-8 is replaced as Python's decode(errors='replace') does (each maximal invalid\n"
        "sequence becomes U+FFFD), counted and reported. Then set model.vocab_size and data.train /\n"
        "data.val as printed at the end.\n",
        DG_TOKENIZER_ENV, DG_TOKENIZER_GPT2_FILE, DG_TOKENIZER_SHARE_DIR, DG_PREP_MAX_CONTROL_PERCENT);
}

static int fail(const char *msg) {
    fprintf(stderr, "%s\n", msg);
    return 1;
}

/* "--opt value" or "--opt=value": the value, or NULL (with *err set) when it is missing. */
static const char *opt_value(int argc, char **argv, int *i, const char *name, int *err) {
    const char *a = argv[*i];
    size_t n = strlen(name);
    if (strncmp(a, name, n) != 0) return NULL;
    if (a[n] == '=') return a + n + 1;
    if (a[n] != 0) return NULL;
    if (*i + 1 >= argc) {
        fprintf(stderr, "dgprep: %s needs a value (see dgprep --help)\n", name);
        *err = 1;
        return NULL;
    }
    return argv[++*i];
}

/* opt's value v as a whole number in [lo, hi] (`range`: the interval as the message shows it); a message
 * and *err = 1 when it is not. */
static long long int_value(const char *opt, const char *v, long long lo, long long hi, const char *range,
                           int *err) {
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (errno || end == v || *end || x < lo || x > hi) {
        fprintf(stderr, "dgprep: %s expects an integer in %s, got '%s'\n", opt, range, v);
        *err = 1;
    }
    return x;
}

/* v, which must be one of the choices a and b; a message and *err = 1 when it is neither. */
static const char *choice_value(const char *opt, const char *v, const char *a, const char *b, int *err) {
    if (strcmp(v, a) && strcmp(v, b)) {
        fprintf(stderr, "dgprep: %s expects '%s' or '%s', got '%s'\n", opt, a, b, v);
        *err = 1;
    }
    return v;
}

int main(int argc, char **argv) {
    const char *out = NULL, *name = "default", *tok_kind = "bytes", *vocab = NULL, *hf = NULL, *docs = NULL;
    int threads = 0;
    long long chunk = 0;
    double frac = 0.1;
    long long shard_tokens = 100000000LL;
    int quiet = 0, err = 0;
    const char **inputs = calloc((size_t)argc, sizeof *inputs);
    if (!inputs) return fail("dgprep: out of memory");
    if (dg_env_check(stderr) != DG_OK) {
        free(inputs);
        return fail(dg_last_error());
    }
    int n_in = 0, only_files = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (only_files || a[0] != '-' || a[1] == 0) {
            inputs[n_in++] = a;
        } else if (!strcmp(a, "--")) {
            only_files = 1;
        } else if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            free(inputs);
            return 0;
        } else if (!strcmp(a, "--version")) {
            printf("dgprep (dgtrain) %s\n", DG_VERSION_STRING);
            free(inputs);
            return 0;
        } else if (!strcmp(a, "--quiet") || !strcmp(a, "-q")) {
            quiet = 1;
        } else if ((v = opt_value(argc, argv, &i, "--out", &err)) != NULL) {
            out = v;
        } else if ((v = opt_value(argc, argv, &i, "--name", &err)) != NULL) {
            name = v;
        } else if ((v = opt_value(argc, argv, &i, "--val-fraction", &err)) != NULL) {
            char *end;
            errno = 0;
            frac = strtod(v, &end);
            if (errno || end == v || *end || !(frac >= 0 && frac < 1)) {
                fprintf(stderr, "dgprep: --val-fraction expects a number with 0 <= F < 1, got '%s'\n", v);
                err = 1;
            }
        } else if ((v = opt_value(argc, argv, &i, "--shard-tokens", &err)) != NULL) {
            shard_tokens = int_value("--shard-tokens", v, 1, 2147483647LL, "[1, 2147483647]", &err);
        } else if ((v = opt_value(argc, argv, &i, "--tokenizer", &err)) != NULL) {
            tok_kind = choice_value("--tokenizer", v, "bytes", "gpt2", &err);
        } else if ((v = opt_value(argc, argv, &i, "--docs", &err)) != NULL) {
            docs = choice_value("--docs", v, "file", "blank-line", &err);
        } else if ((v = opt_value(argc, argv, &i, "--vocab", &err)) != NULL) {
            vocab = v;
        } else if ((v = opt_value(argc, argv, &i, "--hf-tokenizer", &err)) != NULL) {
            hf = v;
        } else if ((v = opt_value(argc, argv, &i, "--threads", &err)) != NULL) {
            threads = (int)int_value("--threads", v, 1, 4096, "[1, 4096]", &err);
        } else if ((v = opt_value(argc, argv, &i, "--chunk-bytes", &err)) != NULL) {
            chunk = int_value("--chunk-bytes", v, 1, 1LL << 40, "[1, 2^40]", &err);
        } else if (!err) {
            fprintf(stderr, "dgprep: unknown option '%s' (see dgprep --help)\n", a);
            err = 1;
        }
        if (err) {
            free(inputs);
            return 1;
        }
    }
    if (!out) {
        free(inputs);
        return fail("dgprep: --out DIR is required (see dgprep --help)");
    }
    if (n_in == 0) {
        free(inputs);
        return fail("dgprep: no input files given (see dgprep --help)");
    }
    int gpt2 = !strcmp(tok_kind, "gpt2");
    const char *needs = vocab   ? "--vocab"
                        : hf    ? "--hf-tokenizer"
                        : docs  ? "--docs"
                        : chunk ? "--chunk-bytes"
                                : NULL;
    if (!gpt2 && needs) {
        free(inputs);
        fprintf(stderr, "dgprep: %s needs --tokenizer gpt2\n", needs);
        return 1;
    }
    if (vocab && hf) {
        free(inputs);
        return fail("dgprep: give --vocab FILE or --hf-tokenizer DIR, not both");
    }
    dg_tokenizer_t *tok = NULL;
    if (gpt2) {
        if (!dg_tokenizer_can_encode()) {
            free(inputs);
            return fail(
                "dgprep: --tokenizer gpt2 is not available: this dgprep was built without PCRE2 (install "
                "libpcre2-dev, e.g. with scripts/setup.sh, and rebuild)");
        }
        char path[4096];
        dg_status_t ls =
            hf ? dg_tokenizer_load_hf(hf, &tok) : dg_tokenizer_find_gpt2(vocab, path, sizeof path);
        if (ls == DG_OK && !hf) ls = dg_tokenizer_load_tiktoken(path, &tok);
        if (ls != DG_OK) {
            free(inputs);
            fprintf(stderr, "dgprep: %s\n", dg_last_error());
            return 1;
        }
    }

    dg_prep_opts_t o = {.inputs = inputs,
                        .n_inputs = n_in,
                        .out_dir = out,
                        .name = name,
                        .val_fraction = frac,
                        .shard_tokens = shard_tokens,
                        .quiet = quiet,
                        .who = "dgprep",
                        .tokenizer = tok,
                        .docs =
                            docs && !strcmp(docs, "blank-line") ? DG_PREP_DOCS_BLANK_LINE : DG_PREP_DOCS_FILE,
                        .threads = threads,
                        .chunk_bytes = chunk};
    dg_prep_result_t r;
    dg_status_t s = dg_data_prep(&o, &r);
    free(inputs);
    if (s != DG_OK) {
        dg_tokenizer_free(tok);
        return fail(dg_last_error());
    }
    printf("dgprep: %d file%s (%lld bytes%s) -> %lld train tokens in %d shard%s, %lld val tokens in %d "
           "shard%s\n",
           r.n_files, r.n_files == 1 ? "" : "s", (long long)r.in_bytes, r.n_skipped ? ", some skipped" : "",
           (long long)r.train_tokens, r.train_shards, r.train_shards == 1 ? "" : "s", (long long)r.val_tokens,
           r.val_shards, r.val_shards == 1 ? "" : "s");
    if (tok) {
        printf("  GPT-2 BPE (%s): %lld document%s, each preceded by <|endoftext|> (%d)\n",
               dg_tokenizer_source(tok), (long long)r.n_docs, r.n_docs == 1 ? "" : "s",
               dg_tokenizer_eot(tok));
        if (r.invalid_utf8)
            printf("  invalid UTF-8: %lld sequence%s replaced by U+FFFD (the first in %s)\n",
                   (long long)r.invalid_utf8, r.invalid_utf8 == 1 ? "" : "s", r.first_invalid);
        dg_tokenizer_free(tok);
    }
    printf("  model.vocab_size = %d\n  data.train = %s\n", r.vocab_size, r.train_glob);
    if (r.val_glob[0])
        printf("  data.val = %s\n", r.val_glob);
    else
        printf("  (no val split: --val-fraction is 0 or the input too small)\n");
    return 0;
}
