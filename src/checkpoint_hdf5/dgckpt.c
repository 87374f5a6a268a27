/* dgckpt.c — the checkpoint tool: list a directory, show one file, verify it end to end, diff two
 * checkpoints dataset by dataset, export weights as safetensors, and tell which file resume=auto
 * would take. Exit codes (like diff(1)): 0 success / intact / identical, 1 damaged or different,
 * 2 usage or I/O error. */
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "checkpoint.h"
#include "ckpt_state.h"
#include "config.h"
#include "data.h"
#include "dg_env.h"
#include "dg_hf.h"
#include "model_desc.h"
#include "tokenizer.h"

enum { EX_OK = 0, EX_BAD = 1, EX_ERR = 2 };

static void usage(FILE *f) {
    fprintf(
        f,
        "usage: dgckpt COMMAND ...\n"
        "  list DIR                 checkpoints in DIR, newest first, with a structural check\n"
        "  show FILE [--config]     attributes, state, datasets (shape, bytes, hash, where stored), base "
        "chain\n"
        "  verify FILE [--quiet] [--data GLOB]\n"
        "                           read everything: chunk checksums, content hashes, links, and the "
        "training\n"
        "                           state against its stored config and its data (found from the config, or\n"
        "                           GLOB); exit 1 if damaged or impossible\n"
        "  diff A B                 max |a-b| per dataset; exit 0 only when every dataset is bitwise "
        "identical\n"
        "  export FILE OUT [--all]  write the model/ weights (every tensor with --all) as safetensors (F32)\n"
        "  export --format hf FILE DIR [--tokenizer TOKDIR|none]\n"
        "                           write a Hugging Face GPT-2 directory (model.safetensors, config.json;\n"
        "                           GPT-2's vocab.json + merges.txt copied from TOKDIR; without it, written\n"
        "                           from GPT-2's ranks when the run's data was made with them; none: no\n"
        "                           tokenizer files); --format dgtrain\n"
        "                           is the default (the line above)\n"
        "  resolve DIR|FILE [--full] print the checkpoint resume=auto would take (\"\" when none)\n"
        "exit codes: 0 ok/identical, 1 damaged/different, 2 usage or I/O error\n");
}

static void human(double b, char *buf, size_t cap) {
    const char *u[] = {"B", "kB", "MB", "GB", "TB"};
    int i = 0;
    while (b >= 1000 && i < 4)
        b /= 1000, i++;
    snprintf(buf, cap, i ? "%.1f %s" : "%.0f %s", b, u[i]);
}

static int cmd_list(const char *dir) {
    dg_ckpt_dir_entry_t *e = NULL;
    int n = 0;
    char latest[256] = "";
    if (dg_ckpt_list_dir(dir, &e, &n, latest) != DG_OK) {
        fprintf(stderr, "dgckpt: %s\n", dg_last_error());
        return EX_ERR;
    }
    FILE *probe = fopen(dir, "r");
    if (!probe) {
        fprintf(stderr, "dgckpt: cannot open directory %s\n", dir);
        free(e);
        return EX_ERR;
    }
    fclose(probe);
    if (n == 0) {
        printf("%s: no checkpoints\n", dir);
        free(e);
        return EX_OK;
    }
    printf("%10s  %-26s %10s %6s  %-16s %s\n", "STEP", "FILE", "SIZE", "WORLD", "KIND", "STATUS");
    for (int i = 0; i < n; i++) {
        char sz[32], path[4400], kind[64] = "-", world[16] = "-", status[600];
        human((double)e[i].bytes, sz, sizeof sz);
        snprintf(path, sizeof path, "%s/%s", dir, e[i].name);
        if (e[i].partial) {
            snprintf(kind, sizeof kind, "interrupted save");
            snprintf(status, sizeof status, "-");
        } else {
            dg_ckpt_info_t info;
            if (dg_ckpt_info_read(path, &info) == DG_OK) {
                int linked = 0;
                for (int k = 0; k < info.n_entries; k++)
                    linked += info.entries[k].origin[0] != 0;
                if (linked)
                    snprintf(kind, sizeof kind, "incr (%d linked)", linked);
                else
                    snprintf(kind, sizeof kind, "full");
                snprintf(world, sizeof world, "%d", info.meta.world_size);
                dg_ckpt_info_destroy(&info);
            }
            if (dg_ckpt_check(path) == DG_OK)
                snprintf(status, sizeof status, "ok");
            else
                snprintf(status, sizeof status, "DAMAGED: %.500s", dg_last_error());
        }
        printf("%10lld  %-26s %10s %6s  %-16s %s%s\n", (long long)e[i].step, e[i].name, sz, world, kind,
               status, strcmp(e[i].name, latest) == 0 ? "  <- LATEST" : "");
    }
    if (!latest[0]) printf("(no usable LATEST file in %s)\n", dir);
    free(e);
    return EX_OK;
}

/* Each file this one links to: how many datasets, and whether it is there and readable. */
static void print_links(const char *file, const dg_ckpt_info_t *info) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", file);
    char *sl = strrchr(dir, '/');
    if (sl)
        *sl = 0;
    else
        snprintf(dir, sizeof dir, ".");
    char bases[4096];
    snprintf(bases, sizeof bases, "%s", info->bases);
    for (char *save = NULL, *b = strtok_r(bases, " ", &save); b; b = strtok_r(NULL, " ", &save)) {
        int cnt = 0;
        for (int i = 0; i < info->n_entries; i++)
            cnt += strcmp(info->entries[i].origin, b) == 0;
        char p[4400], state[700];
        snprintf(p, sizeof p, "%s/%s", dir, b);
        dg_ckpt_info_t bi;
        if (dg_ckpt_info_read(p, &bi) == DG_OK) {
            snprintf(state, sizeof state, "present, step %lld%s", (long long)bi.meta.step,
                     bi.base[0] ? ", itself incremental" : "");
            dg_ckpt_info_destroy(&bi);
        } else {
            snprintf(state, sizeof state, "UNUSABLE: %.600s", dg_last_error());
        }
        printf("chain      %d datasets -> %s (%s)\n", cnt, b, state);
    }
}

static int cmd_show(const char *file, int show_config) {
    dg_ckpt_info_t info;
    if (dg_ckpt_info_read(file, &info) != DG_OK) {
        fprintf(stderr, "dgckpt: %s\n", dg_last_error());
        return EX_BAD;
    }
    const dg_ckpt_meta_t *m = &info.meta;
    char b1[32], b2[32], b3[32];
    human((double)info.file_bytes, b1, sizeof b1);
    printf("file       %s (%s on disk)\n", file, b1);
    printf("format     %s v%d, written by dgtrain %s at %s\n", DG_CKPT_FORMAT_NAME, m->format_version,
           m->version, m->created);
    printf("step       %lld\ntokens     %lld\n", (long long)m->step, (long long)m->tokens);
    printf("world      %d ranks, mesh %s\n", m->world_size, m->mesh[0] ? m->mesh : "(none)");
    printf("loader     epoch %lld, cursor %lld, samples seen %llu\n", (long long)m->loader.epoch,
           (long long)m->loader.cursor, (unsigned long long)m->loader.samples_seen);
    printf("scaler     scale %g, good steps %lld\n", m->scaler.scale, (long long)m->scaler.good_steps);
    printf("rng        %d words", m->n_rng);
    for (int i = 0; i < m->n_rng; i++)
        printf("%s%016llx", i ? " " : ": ", (unsigned long long)m->rng[i]);
    printf("\n");
    for (int i = 0; i < m->n_kv; i++)
        printf("kv         %s = %s\n", m->kv[i].key, m->kv[i].value);
    if (info.base[0]) {
        printf("base       %s (incremental: unchanged datasets are links)\n", info.base);
        print_links(file, &info);
    } else {
        printf("base       (none: a full checkpoint)\n");
    }
    int lines = 0;
    for (const char *c = m->config_text; c && *c; c++)
        lines += *c == '\n';
    printf("config     %d lines%s\n", lines, show_config ? ":" : " (show --config prints them)");
    if (show_config && m->config_text) printf("%s%s", m->config_text, lines ? "" : "\n");
    int64_t tot = 0, linked = 0;
    for (int i = 0; i < info.n_entries; i++) {
        int64_t nb = 4;
        for (int d = 0; d < info.entries[i].ndim; d++)
            nb *= info.entries[i].shape[d];
        tot += nb;
        if (info.entries[i].origin[0]) linked += nb;
    }
    human((double)tot, b1, sizeof b1);
    human((double)(tot - linked), b2, sizeof b2);
    human((double)linked, b3, sizeof b3);
    printf("datasets   %d (%s of fp32 tensors: %s stored here, %s linked)\n", info.n_entries, b1, b2, b3);
    for (int i = 0; i < info.n_entries; i++) {
        const dg_ckpt_entry_t *e = &info.entries[i];
        char shp[128], sz[32];
        int64_t nb = 4;
        for (int d = 0; d < e->ndim; d++)
            nb *= e->shape[d];
        dg_ckpt_shape_str(e->ndim, e->shape, shp, sizeof shp);
        human((double)nb, sz, sizeof sz);
        printf("  /%-46s %-18s %10s  xxh3 %016llx  %s%s\n", e->path, shp, sz, (unsigned long long)e->hash,
               e->origin[0] ? "-> " : "stored", e->origin);
    }
    dg_ckpt_info_destroy(&info);
    return EX_OK;
}

/* The training data the checkpoint was written with, for the loader checks: --data GLOB, else the stored
 * config's data.train, else the default data under its run.dir (or next to the checkpoint directory).
 * A data set found on its own is used only when its fingerprint matches; --data is used anyway (as
 * dgtrain would: the cursor must fit it). NULL with a note when none is usable. */
static dg_dataset_t *find_data(const dg_ckpt_meta_t *m, const char *file, int seq_len, const char *given,
                               char *name, size_t cap, char *note, size_t note_cap) {
    note[0] = 0;
    if (seq_len <= 0) {
        snprintf(note, note_cap, "no /model/wpe to take seq_len from: loader not checked against the data");
        return NULL;
    }
    dg_dataset_t *ds = NULL;
    if (given) {
        snprintf(name, cap, "%s", given);
        if (dg_dataset_open(given, seq_len, DG_SHARD_MAX_VOCAB, &ds) != DG_OK) {
            snprintf(note, note_cap, "--data %s: %s", given, dg_last_error());
            return NULL;
        }
        return ds;
    }
    char cand[3][4200];
    int nc = 0;
    dg_config_t *cfg = dg_xcalloc(1, sizeof *cfg);
    if (m->config_text && dg_config_load_buffer(cfg, "stored config", m->config_text, strlen(m->config_text),
                                                0, NULL) == DG_OK) {
        if (cfg->data.train[0]) {
            snprintf(cand[nc++], sizeof cand[0], "%s", cfg->data.train);
        } else {
            snprintf(cand[nc++], sizeof cand[0], "%.4000s/data/default_train_*.bin", cfg->run.dir);
            char dir[4096];
            snprintf(dir, sizeof dir, "%s", file);
            char *sl = strrchr(dir, '/');
            snprintf(cand[nc++], sizeof cand[0], "%.4000s/../data/default_train_*.bin",
                     sl ? (*sl = 0, dir) : ".");
        }
    }
    dg_clear_error();
    free(cfg);
    const char *fp = dg_ckpt_meta_get_kv(m, "data_fingerprint");
    for (int i = 0; i < nc; i++) {
        if (dg_dataset_open(cand[i], seq_len, DG_SHARD_MAX_VOCAB, &ds) != DG_OK) {
            dg_clear_error();
            continue;
        }
        char now[32];
        snprintf(now, sizeof now, "%016llx", (unsigned long long)dg_dataset_fingerprint(ds));
        if (fp && strcmp(fp, now) == 0) {
            snprintf(name, cap, "%.4100s", cand[i]);
            return ds;
        }
        snprintf(note, note_cap, "%.900s is not the data it was written with (fingerprint %s, it says %.20s)",
                 cand[i], now, fp ? fp : "none");
        dg_dataset_free(ds);
        ds = NULL;
    }
    if (!note[0])
        snprintf(note, note_cap,
                 "its training data is not reachable from here (%.900s): loader not checked against "
                 "the data; give it with --data GLOB",
                 nc ? cand[0] : "no stored config");
    note[note_cap - 1] = 0;
    return NULL;
}

static int cmd_verify(const char *file, int quiet, const char *data_glob) {
    int bad = 0;
    dg_status_t s = dg_ckpt_verify(file, quiet ? NULL : stdout, &bad);
    char first[2048];
    snprintf(first, sizeof first, "%s", s ? dg_last_error() : "");
    /* the trainer's state against its stored config and, when reachable, its data */
    dg_ckpt_info_t info;
    int nv = 0;
    if (dg_ckpt_info_read(file, &info) == DG_OK) {
        int seq_len = 0;
        for (int i = 0; i < info.n_entries; i++)
            if (!strcmp(info.entries[i].path, "model/wpe") && info.entries[i].ndim == 2)
                seq_len = (int)info.entries[i].shape[0];
        char dname[4200] = "", dnote[1200] = "", note[1200] = "";
        dg_dataset_t *ds =
            find_data(&info.meta, file, seq_len, data_glob, dname, sizeof dname, dnote, sizeof dnote);
        dg_train_ckpt_ref_t ref = {seq_len, ds, dname};
        dg_ckpt_violation_t v[DG_CKPT_MAX_VIOLATIONS];
        nv = dg_train_ckpt_check(&info.meta, &ref, v, DG_CKPT_MAX_VIOLATIONS, note, sizeof note);
        for (int i = 0; i < nv && i < DG_CKPT_MAX_VIOLATIONS; i++)
            printf("BAD   %s: state: %s = %s (allowed: %s)\n", file, v[i].field, v[i].value, v[i].allowed);
        if (!quiet) {
            if (dnote[0]) printf("note  %s: %s\n", file, dnote);
            if (note[0]) printf("note  %s: %s\n", file, note);
            printf("%s: training state against its stored config%s%s: %d impossible value%s\n", file,
                   ds ? " and the data " : "", ds ? dname : "", nv, nv == 1 ? "" : "s");
        }
        if (nv && !s) {
            dg_ckpt_violations_error(file, v, nv);
            snprintf(first, sizeof first, "%s", dg_last_error());
        }
        if (ds) dg_dataset_free(ds);
        dg_ckpt_info_destroy(&info);
    }
    if (s || nv) {
        fprintf(stderr, "dgckpt: verify failed: %s\n", first);
        return EX_BAD;
    }
    if (quiet) printf("%s: ok\n", file);
    return EX_OK;
}

static int entry_cmp(const void *a, const void *b) {
    return strcmp(((const dg_ckpt_entry_t *)a)->path, ((const dg_ckpt_entry_t *)b)->path);
}

static int cmd_diff(const char *a, const char *b) {
    dg_ckpt_info_t ia, ib;
    if (dg_ckpt_info_read(a, &ia) != DG_OK) {
        fprintf(stderr, "dgckpt: %s\n", dg_last_error());
        return EX_ERR;
    }
    if (dg_ckpt_info_read(b, &ib) != DG_OK) {
        fprintf(stderr, "dgckpt: %s\n", dg_last_error());
        dg_ckpt_info_destroy(&ia);
        return EX_ERR;
    }
    qsort(ia.entries, (size_t)ia.n_entries, sizeof *ia.entries, entry_cmp);
    qsort(ib.entries, (size_t)ib.n_entries, sizeof *ib.entries, entry_cmp);
    int ndiff = 0, nsame = 0, err = 0;
    int i = 0, j = 0;
    while (i < ia.n_entries || j < ib.n_entries) {
        int c = i >= ia.n_entries   ? 1
                : j >= ib.n_entries ? -1
                                    : strcmp(ia.entries[i].path, ib.entries[j].path);
        if (c < 0) {
            printf("/%-48s only in %s\n", ia.entries[i++].path, a);
            ndiff++;
            continue;
        }
        if (c > 0) {
            printf("/%-48s only in %s\n", ib.entries[j++].path, b);
            ndiff++;
            continue;
        }
        const dg_ckpt_entry_t *ea = &ia.entries[i++], *eb = &ib.entries[j++];
        if (dg_ckpt_shape_differs(ea->ndim, ea->shape, eb->ndim, eb->shape)) {
            char sa[128], sb[128];
            dg_ckpt_shape_str(ea->ndim, ea->shape, sa, sizeof sa);
            dg_ckpt_shape_str(eb->ndim, eb->shape, sb, sizeof sb);
            printf("/%-48s shape differs: %s vs %s\n", ea->path, sa, sb);
            ndiff++;
            continue;
        }
        float *da = NULL, *db = NULL;
        int64_t na = 0, nb = 0;
        if (dg_ckpt_read_dataset(a, ea->path, &da, &na) != DG_OK ||
            dg_ckpt_read_dataset(b, eb->path, &db, &nb) != DG_OK) {
            fprintf(stderr, "dgckpt: %s\n", dg_last_error());
            free(da), free(db);
            err = 1;
            break;
        }
        double maxd = 0;
        int64_t nd = 0, nan_mismatch = 0;
        for (int64_t k = 0; k < na && k < nb; k++) {
            if (memcmp(&da[k], &db[k], sizeof(float)) == 0) continue;
            nd++;
            if (isnan(da[k]) || isnan(db[k])) {
                nan_mismatch++;
                continue;
            }
            double d = fabs((double)da[k] - (double)db[k]);
            if (d > maxd) maxd = d;
        }
        if (nd == 0) {
            nsame++;
            printf("/%-48s max|a-b| = 0 (identical)\n", ea->path);
        } else {
            ndiff++;
            printf("/%-48s max|a-b| = %.6g  (%lld of %lld elements differ%s)\n", ea->path, maxd,
                   (long long)nd, (long long)na, nan_mismatch ? ", some NaN" : "");
        }
        free(da), free(db);
    }
    const dg_ckpt_meta_t *ma = &ia.meta, *mb = &ib.meta;
    if (ma->step != mb->step) printf("note: step %lld vs %lld\n", (long long)ma->step, (long long)mb->step);
    if (ma->tokens != mb->tokens)
        printf("note: tokens %lld vs %lld\n", (long long)ma->tokens, (long long)mb->tokens);
    if (ma->loader.epoch != mb->loader.epoch || ma->loader.cursor != mb->loader.cursor ||
        ma->loader.samples_seen != mb->loader.samples_seen)
        printf("note: loader state differs (epoch %lld/%lld, cursor %lld/%lld, samples %llu/%llu)\n",
               (long long)ma->loader.epoch, (long long)mb->loader.epoch, (long long)ma->loader.cursor,
               (long long)mb->loader.cursor, (unsigned long long)ma->loader.samples_seen,
               (unsigned long long)mb->loader.samples_seen);
    if (ma->world_size != mb->world_size)
        printf("note: written by %d vs %d ranks\n", ma->world_size, mb->world_size);
    dg_ckpt_info_destroy(&ia);
    dg_ckpt_info_destroy(&ib);
    if (err) return EX_ERR;
    printf("%d identical, %d different\n", nsame, ndiff);
    return ndiff ? EX_BAD : EX_OK;
}

static int cmd_export(const char *file, const char *out, int all) {
    if (dg_ckpt_export_safetensors(file, out, all) != DG_OK) {
        fprintf(stderr, "dgckpt: %s\n", dg_last_error());
        return dg_last_error_code() == DG_ERR_USAGE ? EX_BAD : EX_ERR;
    }
    printf("wrote %s\n", out);
    return EX_OK;
}

/* dgtrain parameter `name` of the checkpoint (ctx: its path), full and in dgtrain's layout. */
static dg_status_t ckpt_tensor(void *ctx, const char *name, float *out, size_t numel) {
    char dset[300];
    snprintf(dset, sizeof dset, "model/%s", name);
    float *data = NULL;
    int64_t n = 0;
    DG_TRY(dg_ckpt_read_dataset((const char *)ctx, dset, &data, &n));
    dg_status_t s = DG_OK;
    if ((size_t)n != numel)
        s = DG_ERR(DG_ERR_USAGE, "%s: /%s has %lld values, its model config needs %zu", (const char *)ctx,
                   dset, (long long)n, numel);
    else
        memcpy(out, data, numel * sizeof(float));
    free(data);
    return s;
}

/* The tokenizer files an hf export writes when no --tokenizer DIR is given (docs/checkpoint-format.md):
 * the run's data recorded its tokenizer (kv "tokenizer", from the shard headers); when that is GPT-2's
 * ranks as installed here (same fingerprint), they are written in Hugging Face form. *note says what was
 * decided, for the closing line. Returns NULL (no files) with a reason in note otherwise. */
static dg_tokenizer_t *run_tokenizer(const char *recorded, char *note, size_t cap) {
    unsigned long long want = 0;
    char path[4096];
    dg_tokenizer_t *tok = NULL;
    if (!recorded || !*recorded) {
        snprintf(note, cap, "no tokenizer files: the run's data records no tokenizer (pass --tokenizer DIR)");
        return NULL;
    }
    if (strcmp(recorded, "bytes") == 0) {
        snprintf(note, cap, "no tokenizer files: the run's data is byte-level (one token per byte)");
        return NULL;
    }
    if (sscanf(recorded, "bpe:%16llx", &want) != 1 ||
        dg_tokenizer_find_gpt2(NULL, path, sizeof path) != DG_OK ||
        dg_tokenizer_load_tiktoken(path, &tok) != DG_OK) {
        snprintf(note, cap, "no tokenizer files: the run's tokenizer (%s) is not available here (%s)",
                 recorded, dg_last_error());
        return NULL;
    }
    if (dg_tokenizer_fingerprint(tok) != want) {
        snprintf(
            note, cap,
            "no tokenizer files: the run's tokenizer (%s) is not GPT-2's ranks in %s (bpe:%016llx); pass "
            "--tokenizer DIR with the tokenizer the data was made with",
            recorded, path, (unsigned long long)dg_tokenizer_fingerprint(tok));
        dg_tokenizer_free(tok);
        return NULL;
    }
    snprintf(note, cap, "tokenizer files from %s (the run's data was made with it)", path);
    return tok;
}

/* export --format hf: the model's sizes come from the config stored in the checkpoint. */
static int cmd_export_hf(const char *file, const char *dir, const char *tok_dir) {
    dg_ckpt_info_t info;
    dg_config_t cfg;
    dg_model_desc_t d;
    dg_status_t s = dg_ckpt_info_read(file, &info);
    if (s) {
        fprintf(stderr, "dgckpt: %s\n", dg_last_error());
        return EX_ERR;
    }
    int auto_tok = !tok_dir, no_tok = tok_dir && strcmp(tok_dir, "none") == 0;
    char tok_note[4600] = "";
    dg_tokenizer_t *ranks = auto_tok ? run_tokenizer(dg_ckpt_meta_get_kv(&info.meta, DG_TRAIN_KV_TOKENIZER),
                                                     tok_note, sizeof tok_note)
                                     : NULL;
    if (no_tok) tok_dir = NULL;
    const char *text = info.meta.config_text ? info.meta.config_text : "";
    s = dg_config_load_buffer(&cfg, file, text, strlen(text), 0, NULL);
    if (!s) s = dg_train_model_desc(&cfg, &d);
    if (s) {
        char why[1024];
        snprintf(why, sizeof why, "%s", dg_last_error());
        s = DG_ERR(DG_ERR_USAGE, "%s: its stored config gives no model shape: %s", file, why);
    }
    dg_ckpt_info_destroy(&info);
    if (!s) s = dg_hf_export(&d, ckpt_tensor, (void *)file, dir, tok_dir, ranks);
    dg_tokenizer_free(ranks);
    if (s) {
        fprintf(stderr, "dgckpt: %s\n", dg_last_error());
        return EX_ERR;
    }
    printf("wrote %s (Hugging Face GPT-2: vocab_size %d, n_positions %d%s)\n", dir, d.vocab_size, d.seq_len,
           tok_dir ? ", tokenizer files" : "");
    if (auto_tok) printf("%s\n", tok_note);
    return EX_OK;
}

static int cmd_resolve(int *argc, char ***argv, const char *what, int full) {
    int provided = 0;
    MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided);
    char out[4096];
    /* a file is checked alone; anything else is searched as resume=auto would (a missing directory
     * means a fresh start: "") */
    struct stat st;
    int is_file = stat(what, &st) == 0 && !S_ISDIR(st.st_mode);
    dg_status_t s = is_file ? dg_ckpt_resolve_resume(MPI_COMM_SELF, NULL, what, full, out, sizeof out)
                            : dg_ckpt_resolve_resume(MPI_COMM_SELF, what, "auto", full, out, sizeof out);
    int rc;
    if (s) {
        fprintf(stderr, "dgckpt: %s\n", dg_last_error());
        rc = s == DG_ERR_USAGE ? EX_BAD : EX_ERR;
    } else {
        printf("%s\n", out);
        rc = EX_OK;
    }
    MPI_Finalize();
    return rc;
}

int main(int argc, char **argv) {
    dg_log_set_level(DG_LOG_WARN);
    if (dg_env_check(stderr) != DG_OK) {
        fprintf(stderr, "dgckpt: error: %s\n", dg_last_error());
        return EX_BAD;
    }
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "help")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? EX_ERR : EX_OK;
    }
    const char *cmd = argv[1];
    int nargs = argc - 2;
    char **a = argv + 2;
    int flag_config = 0, flag_quiet = 0, flag_all = 0, flag_full = 0, npos = 0;
    const char *pos[4] = {0}, *data_glob = NULL, *format = "dgtrain", *tok_dir = NULL;
    for (int i = 0; i < nargs; i++) {
        if (!strcmp(a[i], "--data") && !strcmp(cmd, "verify")) {
            if (i + 1 >= nargs) {
                fprintf(stderr, "dgckpt verify: --data needs a GLOB of token shards\n");
                return EX_ERR;
            }
            data_glob = a[++i];
        } else if (!strncmp(a[i], "--data=", 7) && !strcmp(cmd, "verify"))
            data_glob = a[i] + 7;
        else if ((!strcmp(a[i], "--format") || !strcmp(a[i], "--tokenizer")) && !strcmp(cmd, "export")) {
            if (i + 1 >= nargs) {
                fprintf(stderr, "dgckpt export: %s needs a value\n", a[i]);
                return EX_ERR;
            }
            if (!strcmp(a[i], "--format"))
                format = a[++i];
            else
                tok_dir = a[++i];
        } else if (!strncmp(a[i], "--format=", 9) && !strcmp(cmd, "export"))
            format = a[i] + 9;
        else if (!strcmp(a[i], "--config"))
            flag_config = 1;
        else if (!strcmp(a[i], "--quiet") || !strcmp(a[i], "-q"))
            flag_quiet = 1;
        else if (!strcmp(a[i], "--all"))
            flag_all = 1;
        else if (!strcmp(a[i], "--full"))
            flag_full = 1;
        else if (a[i][0] == '-' && a[i][1]) {
            fprintf(stderr, "dgckpt %s: unknown option %s\n", cmd, a[i]);
            return EX_ERR;
        } else if (npos < 4)
            pos[npos++] = a[i];
        else {
            fprintf(stderr, "dgckpt %s: too many arguments\n", cmd);
            return EX_ERR;
        }
    }
    struct {
        const char *name;
        int npos;
    } cmds[] = {{"list", 1}, {"show", 1}, {"verify", 1}, {"diff", 2}, {"export", 2}, {"resolve", 1}};
    int known = -1;
    for (int i = 0; i < (int)(sizeof cmds / sizeof cmds[0]); i++)
        if (!strcmp(cmd, cmds[i].name)) known = i;
    if (known < 0) {
        fprintf(stderr, "dgckpt: unknown command '%s'\n", cmd);
        usage(stderr);
        return EX_ERR;
    }
    if (npos != cmds[known].npos) {
        fprintf(stderr, "dgckpt %s: expected %d argument%s, got %d\n", cmd, cmds[known].npos,
                cmds[known].npos > 1 ? "s" : "", npos);
        usage(stderr);
        return EX_ERR;
    }
    if (!strcmp(cmd, "list")) return cmd_list(pos[0]);
    if (!strcmp(cmd, "show")) return cmd_show(pos[0], flag_config);
    if (!strcmp(cmd, "verify")) return cmd_verify(pos[0], flag_quiet, data_glob);
    if (!strcmp(cmd, "diff")) return cmd_diff(pos[0], pos[1]);
    if (!strcmp(cmd, "export") && strcmp(format, "dgtrain") && strcmp(format, "hf")) {
        fprintf(stderr, "dgckpt export: --format '%s' is not known (allowed: dgtrain, hf)\n", format);
        return EX_ERR;
    }
    if (!strcmp(cmd, "export") && (flag_all || tok_dir) && strcmp(format, !flag_all ? "hf" : "dgtrain")) {
        fprintf(stderr, "dgckpt export: %s goes with --format %s\n", flag_all ? "--all" : "--tokenizer",
                flag_all ? "dgtrain" : "hf");
        return EX_ERR;
    }
    if (!strcmp(cmd, "export") && !strcmp(format, "hf")) return cmd_export_hf(pos[0], pos[1], tok_dir);
    if (!strcmp(cmd, "export")) return cmd_export(pos[0], pos[1], flag_all);
    return cmd_resolve(&argc, &argv, pos[0], flag_full);
}
