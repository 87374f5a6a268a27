/* ckpt_state.h — what the scalar state of a dgtrain checkpoint may hold: the checks of step, tokens,
 * loader, scaler and the trainer's key/value pairs against the schedule and batch of the run that wrote
 * it (its stored config), the model (tokens per sample) and, when given, the training data. dgtrain runs
 * them on every resume and rollback candidate (a violation rejects the file like damage does: fall back
 * to the previous checkpoint), and `dgckpt verify` runs them too. The allowed ranges are listed in
 * docs/checkpoint-format.md, "Allowed values". The generic checks every checkpoint passes
 * (dg_ckpt_meta_check: step >= 0, ...) are the checkpoint module's; these add what only the trainer
 * knows.
 */
#ifndef DG_CKPT_STATE_H
#define DG_CKPT_STATE_H

#include <stddef.h>
#include <stdint.h>

#include "checkpoint.h"
#include "data.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The key/value pair that records where the current run segment began (fresh start or resume): four
 * integers "step samples_seen epoch cursor". Every step since then consumed global_batch samples of the
 * segment's config, which makes tokens, samples_seen and the loader position checkable exactly. */
#define DG_TRAIN_KV_SEGMENT "segment"
/* The tokenizer the run's data was made with (dg_dataset_tokenizer_str: "bytes" or "bpe:<fingerprint>");
 * absent when the shards record none. */
#define DG_TRAIN_KV_TOKENIZER "tokenizer"

typedef struct dg_train_ckpt_ref {
    int seq_len;              /* tokens per sample of the model (0: take model.seq_len of the stored config
                                 when it sets one, else skip the token checks) */
    const dg_dataset_t *data; /* the training data to check the loader against (NULL: not checked) */
    const char *data_name;    /* how messages name it (its glob) */
} dg_train_ckpt_ref_t;

/* Check m against `ref` and against the config stored in m. Applies to checkpoints of dgtrain's training
 * loop (they carry the key/value pair "precision"); others get only a note. Returns the number of violations
 * (the first `cap` in v). `note` (may be NULL) gets a line about checks that could not run (e.g. the stored
 * config does not parse, the data is another data set), "" otherwise. */
int dg_train_ckpt_check(const dg_ckpt_meta_t *m, const dg_train_ckpt_ref_t *ref, dg_ckpt_violation_t *v,
                        int cap, char *note, size_t note_cap);

/* The same as a dg_ckpt_meta_check_fn (ctx: a dg_train_ckpt_ref_t), for dg_ckpt_resume_checked. */
dg_status_t dg_train_ckpt_check_fn(void *ctx, const char *path, const dg_ckpt_meta_t *m);

#ifdef __cplusplus
}
#endif
#endif /* DG_CKPT_STATE_H */
