/* data.h — token data for dgtrain: llm.c-format token shards (read with pread and validated), the
 * world-size-independent sample loader, the text-to-shard builder behind `dgprep`, and the embedded
 * default data set. The full rules (sample layout, shuffle, rank split, epoch wrap) are in docs/data.md.
 *
 * Shard format (llm.c): a header of 256 little-endian int32 — [0] magic 20240520, [1] version 1,
 * [2] token count N — then N uint16 tokens. The file size must be exactly 1024 + 2*N bytes.
 *
 * Samples: the shards matched by a glob, sorted by name, are each cut into non-overlapping windows of
 * seq_len+1 tokens; window s of a shard starts at token s*seq_len (consecutive windows share one token,
 * the last target of one being the first input of the next). A shard of N tokens yields (N-1)/seq_len
 * samples; samples never cross shards. Global sample ids number the samples of shard 0, then shard 1...
 *
 * Loader: epoch e visits all S samples in the order perm_e (identity when unshuffled; otherwise a
 * keyed pseudo-random permutation of (seed, e) computed per index, so no O(S) table is kept). The
 * state is {epoch, cursor} — the position in that order — plus a sample counter, and nothing else: it
 * does not depend on the number of ranks, so a run can resume at any world size. One optimizer step
 * consumes the next global_batch positions; see dg_loader_fill for which rank gets which.
 *
 * Shards are untrusted input: every defect is refused with DG_ERR_USAGE and a one-line message naming
 * the file and the byte or token offset; nothing is read out of bounds. Shards are read with pread and
 * never memory-mapped, so a shard truncated or rewritten while a run reads it is a DG_ERR_RUNTIME
 * naming the file and the offset, never a SIGBUS (docs/data.md, "Shards that change under a run").
 */
#ifndef DG_DATA_H
#define DG_DATA_H

#include <stddef.h>
#include <stdint.h>

#include "dg_common.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DG_SHARD_MAGIC 20240520
#define DG_SHARD_VERSION 1
#define DG_SHARD_HEADER_INTS 256
#define DG_SHARD_HEADER_BYTES (DG_SHARD_HEADER_INTS * 4)
/* uint16 tokens: no vocabulary can be larger than this. */
#define DG_SHARD_MAX_VOCAB 65536
/* Which tokenizer made a shard (docs/data.md, "Shard header"): dgprep writes header int 3 = the tag
 * 'dgtk', int 4 = the kind, ints 5-6 = the tokenizer's fingerprint (dg_tokenizer_fingerprint, low word
 * first; 0 for bytes). llm.c leaves these ints 0 and ignores them; a shard without the tag is of an
 * unknown tokenizer. */
#define DG_SHARD_TOK_TAG 0x6b746764 /* "dgtk" little-endian */
#define DG_SHARD_TOK_UNKNOWN 0
#define DG_SHARD_TOK_BYTES 1 /* one token per byte, vocabulary 256 */
#define DG_SHARD_TOK_BPE 2   /* a byte-level BPE tokenizer (GPT-2's, or the one its fingerprint names) */

/* ---------------- dataset: the validated shards of one glob ---------------- */

typedef struct dg_dataset dg_dataset_t;

/* Open every file matching `glob` (sorted by name), read-only, and validate it: magic, version, exact
 * size, and every token < vocab_size (one sequential scan). Each shard keeps its descriptor until
 * dg_dataset_free (the soft limit on open files is raised to the hard one if the set needs it). seq_len >= 1,
 * 1 <= vocab_size <= 65536. Errors (DG_ERR_USAGE; DG_ERR_RUNTIME for I/O failures): no file
 * matches, a file cannot be opened, is empty, is too short for the header, has a bad magic or
 * version, a negative token count, a size that disagrees with the header, a token out of range, or
 * the whole set yields no sample of seq_len+1 tokens. */
dg_status_t dg_dataset_open(const char *glob, int seq_len, int vocab_size, dg_dataset_t **out);
void dg_dataset_free(dg_dataset_t *ds);
/* The number of samples `glob` yields at seq_len, from the headers and sizes alone (no token scan: cheap
 * on any data set, for --dry-run). The same errors as dg_dataset_open except the token range. */
dg_status_t dg_dataset_probe(const char *glob, int seq_len, int64_t *n_samples);

int64_t dg_dataset_n_samples(const dg_dataset_t *ds);
int64_t dg_dataset_n_tokens(const dg_dataset_t *ds); /* all tokens of all shards */
int dg_dataset_n_shards(const dg_dataset_t *ds);
const char *dg_dataset_shard_path(const dg_dataset_t *ds, int i);
int dg_dataset_seq_len(const dg_dataset_t *ds);
/* 64-bit fingerprint of the shard list (base names and token counts, in order) and seq_len: stored
 * with a checkpoint so a resume can tell whether the data set changed under it. */
uint64_t dg_dataset_fingerprint(const dg_dataset_t *ds);
/* The tokenizer every shard of the set records: DG_SHARD_TOK_BYTES or DG_SHARD_TOK_BPE with its
 * fingerprint in *fp (0 for bytes); DG_SHARD_TOK_UNKNOWN (fp 0) when a shard records none (llm.c's own
 * shards) or the shards disagree. `fp` may be NULL. */
int dg_dataset_tokenizer(const dg_dataset_t *ds, uint64_t *fp);
/* "bytes", "bpe:<16 hex digits>" or "" (unknown): the form checkpoints store (DG_TRAIN_KV_TOKENIZER). */
void dg_dataset_tokenizer_str(const dg_dataset_t *ds, char *buf, size_t cap);

/* Copy sample `sample` (0 <= sample < n_samples) as int32: tokens[0..seq_len) are the inputs and
 * targets[0..seq_len) the same window shifted by one. Either pointer may be NULL. Reads the shard with
 * pread and checks that it is still the file validated at open: DG_ERR_RUNTIME naming the file and the
 * byte offset when it was truncated (a short read, or a size that changed), its header rewritten, a
 * token is now >= vocab_size, or the read fails (EIO). */
dg_status_t dg_dataset_get_sample(const dg_dataset_t *ds, int64_t sample, int32_t *tokens, int32_t *targets);

/* ---------------- loader: which samples each rank reads at each step ---------------- */

typedef struct dg_loader dg_loader_t;

/* The complete, world-size-independent loader state (what a checkpoint stores).
 * epoch: the epoch of the next sample; cursor: the position of the next sample in that epoch's
 * order, 0 <= cursor < n_samples; samples_seen: global samples consumed since the run began. */
typedef struct dg_loader_state {
    int64_t epoch, cursor;
    uint64_t samples_seen;
} dg_loader_state_t;

/* A loader over `ds` (borrowed: it must outlive the loader). shuffle = 0: every epoch reads the
 * samples in id order (use this for validation). The state starts at {0, 0, 0}. */
dg_status_t dg_loader_create(const dg_dataset_t *ds, uint64_t seed, int shuffle, dg_loader_t **out);
void dg_loader_free(dg_loader_t *ld);

void dg_loader_get_state(const dg_loader_t *ld, dg_loader_state_t *st);
/* Restore a saved state. DG_ERR_USAGE when it cannot belong to this data set (negative epoch, or
 * cursor outside [0, n_samples) — e.g. the data changed since the checkpoint). */
dg_status_t dg_loader_set_state(dg_loader_t *ld, const dg_loader_state_t *st);
/* Back to {0, 0, 0}: the validation loader calls this before every evaluation so each one reads the
 * same first batches. */
void dg_loader_reset(dg_loader_t *ld);

/* Fill one micro-batch for data-parallel rank `dp_rank` of `dp_size` at micro-step `micro_step` of
 * the current optimizer step: `micro_batch` samples, row i being the sample at position
 *     cursor + (micro_step * dp_size + dp_rank) * micro_batch + i
 * of the epoch order. With global_batch = dp_size * micro_batch * k and micro-steps 0..k-1, the ranks
 * together read positions cursor .. cursor+global_batch-1 — the same global batch at every dp_size.
 * A position p >= n_samples continues into the next epoch(s) (epoch + p / S, index p % S), so a
 * batch may straddle an epoch boundary. tokens and targets are [micro_batch, seq_len] int32.
 * DG_ERR_USAGE on bad arguments (negative indices, dp_rank >= dp_size, micro_batch < 1); the errors of
 * dg_dataset_get_sample (DG_ERR_RUNTIME) when a shard changed under the run. */
dg_status_t dg_loader_fill(const dg_loader_t *ld, int micro_step, int dp_rank, int dp_size, int micro_batch,
                           int32_t *tokens, int32_t *targets);
/* The global sample id at offset `offset` >= 0 from the cursor, and the epoch it belongs to (either
 * output may be NULL). dg_loader_fill reads exactly these samples; exposed for tests and tools. */
int64_t dg_loader_sample_at(const dg_loader_t *ld, int64_t offset, int64_t *epoch_out);
/* End of an optimizer step: move the cursor past the global_batch positions consumed (wrapping the
 * epoch as above) and add them to samples_seen. */
void dg_loader_advance(dg_loader_t *ld, int64_t global_batch);

/* Epoch permutation: the position -> sample-id map of epoch `epoch` for n samples (a bijection of
 * [0, n)). Exposed for tests. */
int64_t dg_data_permute(int64_t index, int64_t n, uint64_t seed, int64_t epoch);

/* ---------------- text -> byte-level shards (dgprep and the default data) ---------------- */

/* Text classification rule (docs/data.md): a file is binary (not text) when it contains a NUL byte or
 * when more than 1% of its bytes are control characters other than \t \n \v \f \r and ESC
 * (bytes 0x01-0x1F and 0x7F). Bytes >= 0x80 count as text (UTF-8 and other 8-bit encodings). */
#define DG_PREP_MAX_CONTROL_PERCENT 1

typedef struct dg_prep_opts {
    const char *const *inputs; /* files, or directories (their regular files, sorted by name) */
    int n_inputs;
    const char *out_dir;
    const char *name;     /* output prefix; "default" if NULL */
    double val_fraction;  /* 0 <= f < 1: the tail of each file that goes to the val split */
    int64_t shard_tokens; /* max tokens per shard; <= 0 = 100M (as llm.c) */
    /* Files found inside a directory that are binary, symlinks or exact duplicates of an earlier file
     * are skipped (a note on stderr unless quiet); a binary or empty file named explicitly is an error. */
    int quiet;       /* no progress or notes on stderr */
    const char *who; /* prefix of messages and errors; "dgprep" if NULL */
    /* Tokenizer (src/tokenizer): NULL = byte-level, one token per byte. Otherwise (borrowed, vocabulary
     * <= 65536) each document is <|endoftext|> then its ids, and no newline is appended to files. */
    const struct dg_tokenizer *tokenizer;
    int docs;            /* DG_PREP_DOCS_FILE or DG_PREP_DOCS_BLANK_LINE (tokenizer only) */
    int threads;         /* encoding threads; <= 0 = the CPUs this process may run on */
    int64_t chunk_bytes; /* a long document is cut (at safe points) into pieces of about this many bytes
                          * that threads encode independently; <= 0 = 1 MiB */
} dg_prep_opts_t;

/* What a document is with a tokenizer (docs/data.md): the train part, and the val part, of each file
 * (FILE); or, as llm.c's tinyshakespeare.py, each piece of those parts that ends after "\n\n" (the
 * blank line stays with the text before it) or at the part's end (BLANK_LINE). Empty ones are dropped. */
#define DG_PREP_DOCS_FILE 0
#define DG_PREP_DOCS_BLANK_LINE 1

typedef struct dg_prep_result {
    int n_files;      /* text files used */
    int n_skipped;    /* files skipped inside directories */
    int64_t in_bytes; /* bytes read from the files used */
    int64_t train_tokens, val_tokens;
    int train_shards, val_shards;
    uint64_t content_hash;                 /* xxh64 of the bytes used, in order; identifies the data set */
    int vocab_size;                        /* 256, or the tokenizer's */
    int64_t n_docs;                        /* documents (<|endoftext|> tokens written); 0 without tokenizer */
    int64_t invalid_utf8;                  /* invalid UTF-8 sequences replaced by U+FFFD (tokenizer only) */
    char first_invalid[4200];              /* "FILE at byte N" of the first of them, "" if none */
    char train_glob[4096], val_glob[4096]; /* val_glob is "" when there is no val split */
} dg_prep_result_t;

/* Turn text files into byte-level (vocab 256) shards OUT/NAME_train_000000.bin ... and
 * NAME_val_000000.bin ...: each file's bytes in order (a newline appended if the file lacks one), the
 * last val_fraction of each file (from the next line start) going to val. With opts->tokenizer, the
 * same split into token ids instead: each document's <|endoftext|> and ids, documents encoded on
 * opts->threads threads (the output does not depend on the thread count). Shards are written to
 * temporary names and renamed when complete; stale NAME_{train,val}_NNNNNN.bin beyond the new count
 * are removed. DG_ERR_USAGE for bad input (missing/unreadable/empty/binary file, nothing to read,
 * bad options), DG_ERR_RUNTIME when the output cannot be written. */
dg_status_t dg_data_prep(const dg_prep_opts_t *opts, dg_prep_result_t *res);

/* The embedded default data: byte-level train/val shards built from the license texts every Debian
 * and Ubuntu system ships in /usr/share/common-licenses (regular files, sorted by name, symlinks,
 * duplicates and binary files skipped; val fraction 0.1). Built once into `dir` (created if needed),
 * rebuilt only when the source texts change (a stamp file records their hash); concurrent callers on
 * one machine serialise on a lock file, and files appear by atomic rename, so it is safe for every
 * rank to call it, or for rank 0 to call it while the others wait at a barrier. On success writes the
 * train and val globs (each < cap bytes). DG_ERR_USAGE with a hint to run dgprep when the texts are
 * missing. The environment variable DG_DEFAULT_TEXT_DIR replaces /usr/share/common-licenses (tests). */
dg_status_t dg_data_default_paths(const char *dir, char *train_glob, char *val_glob, size_t cap);
#define DG_DEFAULT_TEXT_DIR "/usr/share/common-licenses"

#ifdef __cplusplus
}
#endif
#endif /* DG_DATA_H */
