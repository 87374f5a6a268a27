/* dg_infer.h — GPT-2 inference with a key/value cache (issue 22.4): the decoder behind `dgtrain sample`.
 *
 * The same GPT-2 as src/model/gpt2.c (pre-layernorm blocks, GELU MLP, tied output head; the parameter
 * names and shapes of graph.h's dg_param_info_t), run for ONE sequence through the backend vtable only,
 * so the same code runs on the CPU and CUDA backends. Parameters live on the device in the backend's act
 * dtype (fp32 on CPU). dg_infer_feed runs a block of new positions in one pass (the prompt: prefill;
 * one token: a decode step): each layer writes the block's keys and values into its cache rows and the
 * new rows attend to every cached row (backend attention_kv_fwd, contract v1.12), so a new token costs
 * one position, not the whole prefix. dg_infer_recompute is the no-cache reference: the whole prefix
 * again through the training kernel attention_fwd.
 *
 * An engine is single-threaded (one backend queue) and holds at most seq_len positions; it needs a
 * backend with attention_kv_fwd. Errors: DG_ERR_USAGE for a bad shape, a name it does not know or
 * positions beyond seq_len (the message names the value and the limit); backend errors pass through.
 */
#ifndef DG_INFER_H
#define DG_INFER_H

#include <stdint.h>

#include "backend.h"
#include "dg_common.h"
#include "dg_model.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dg_infer dg_infer_t;

enum {
    /* dg_infer_feed may return the logits of every row of a block (tests), not only the last one: keeps
     * a [seq_len, padded_vocab] logits buffer on the device instead of one row. */
    DG_INFER_ALL_LOGITS = 1
};

/* Allocate parameters (zero until set), caches and activations for d (dg_model_desc_validate rules) on be,
 * which must outlive the engine. */
dg_status_t dg_infer_create(const dg_model_desc_t *d, dg_backend_t *be, int flags, dg_infer_t **out);
void dg_infer_free(dg_infer_t *e);

/* Parameters, in graph.h's order and names ("wte", "wpe", "h.<l>.ln_1.weight", ..., "ln_f.bias"). */
int dg_infer_n_tensors(const dg_infer_t *e);
const char *dg_infer_tensor_name(const dg_infer_t *e, int i); /* NULL out of range */
size_t dg_infer_tensor_numel(const dg_infer_t *e, int i);     /* full global shape, e.g. wte: Vp * C */
/* Set parameter i from a full fp32 host tensor (cast to the act dtype on the device). */
dg_status_t dg_infer_set_tensor(dg_infer_t *e, int i, const float *host);

const dg_model_desc_t *dg_infer_desc(const dg_infer_t *e);
int dg_infer_pos(const dg_infer_t *e); /* positions in the cache */
void dg_infer_reset(dg_infer_t *e);    /* forget the sequence (pos = 0); parameters stay */

/* Run ids[0, n) at positions [pos, pos + n) against the cache, then pos += n. logits (host, may be NULL)
 * gets vocab_size floats: of the last new row, or of every new row ([n, vocab_size], needs
 * DG_INFER_ALL_LOGITS) when all_rows. DG_ERR_USAGE when pos + n > seq_len or an id is not in
 * [0, vocab_size); the cache is unchanged then. */
dg_status_t dg_infer_feed(dg_infer_t *e, const int32_t *ids, int n, int all_rows, float *logits);

/* No cache: run ids[0, n) from position 0 with attention_fwd over the whole block, logits of the last row
 * (vocab_size floats). Leaves the cache and pos alone. */
dg_status_t dg_infer_recompute(dg_infer_t *e, const int32_t *ids, int n, float *logits);

#ifdef __cplusplus
}
#endif
#endif /* DG_INFER_H */
