/* dg_hf.h — model weights in and out of dgtrain (issue 22 items 2 and 3): Hugging Face GPT-2 directories
 * (config.json + model.safetensors), llm.c checkpoints (gpt2_124M.bin style), and model.init.
 *
 * Layouts (docs/checkpoint-format.md, "Hugging Face and llm.c weights"): dgtrain stores every matrix as
 * [out, in] and the token embedding with padded_vocab rows (rows >= vocab_size zero). Hugging Face's
 * GPT-2 uses Conv1D, [in, out], for c_attn, c_proj, c_fc and mlp.c_proj, and exactly vocab_size rows of
 * wte (lm_head.weight tied to it). llm.c stores [out, in] like dgtrain, with its own padded vocabulary.
 * The q/k/v order of c_attn's output columns is dgtrain's qkv row order (q, then k, then v; heads
 * contiguous inside each).
 *
 * Error model: DG_ERR_USAGE with one line naming the file and what is wrong for every bad input (a
 * missing file, a malformed safetensors header, a wrong llm.c magic, a model shape that differs from the
 * run's, naming the field); DG_ERR_RUNTIME for I/O failures of the machine.
 */
#ifndef DG_HF_H
#define DG_HF_H

#include <stddef.h>
#include <stdint.h>

#include "dg_common.h"
#include "dg_model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------- safetensors ---------------- */

typedef struct dg_st_tensor {
    char name[256];
    char dtype[8]; /* "F32", "F16", "BF16" (the dtypes read_f32 converts), or another name */
    int ndim;
    int64_t shape[4];
    uint64_t begin, end; /* byte offsets into the data block */
} dg_st_tensor_t;

/* A safetensors file, mapped read-only. */
typedef struct dg_st_file {
    char path[4096];
    int n;
    dg_st_tensor_t *t;
    const uint8_t *data; /* the data block (after the 8-byte length and the JSON header) */
    uint64_t data_len;
    void *map;
    size_t map_len;
} dg_st_file_t;

/* Maps `path` and parses its header: 8-byte little-endian length N, then N bytes of JSON (one object per
 * tensor with dtype, shape and data_offsets; an optional "__metadata__" object of strings). Checks that
 * every tensor's byte range lies inside the file and matches its shape and dtype. DG_ERR_USAGE naming
 * the file for a missing file or a bad header. */
dg_status_t dg_st_open(const char *path, dg_st_file_t *out);
void dg_st_close(dg_st_file_t *f);
/* The tensor of that name, or NULL. */
const dg_st_tensor_t *dg_st_find(const dg_st_file_t *f, const char *name);
/* Tensor t as numel f32 values (F32 copied, F16 / BF16 widened exactly); DG_ERR_USAGE for another dtype. */
dg_status_t dg_st_read_f32(const dg_st_file_t *f, const dg_st_tensor_t *t, float *out);

/* One tensor to write: F32, shape[0..ndim), data holds prod(shape) floats. */
typedef struct dg_st_out {
    const char *name;
    int ndim;
    int64_t shape[2];
    const float *data;
} dg_st_out_t;
/* Writes a safetensors file of F32 tensors (in the given order, data block 8-byte aligned) with
 * __metadata__ {"format": "pt"} to `path` (not atomic: callers write into a temporary directory). */
dg_status_t dg_st_write(const char *path, const dg_st_out_t *t, int n);

/* ---------------- the name map ---------------- */

/* How a dgtrain tensor becomes its Hugging Face counterpart. */
typedef enum {
    DG_HF_PLAIN = 0,     /* the same values and shape */
    DG_HF_TRANSPOSE = 1, /* Conv1D: HF [in, out] = dgtrain [out, in] transposed */
    DG_HF_VOCAB = 2,     /* wte: HF has vocab_size rows, dgtrain padded_vocab (the rest zero) */
    DG_HF_POS = 3        /* wpe: HF has n_positions rows, dgtrain seq_len (n_positions >= seq_len on load) */
} dg_hf_layout_t;
/* The Hugging Face name ("transformer.h.0.attn.c_attn.weight") of dgtrain parameter `name`
 * ("h.0.attn.qkv.weight") into hf[cap] and its layout; -1 for a name that is not a GPT-2 parameter. */
int dg_hf_name(const char *name, char *hf, size_t cap);

/* The dgtrain parameters of a model of sizes d, in the model's order (graph.h): name and global shape of
 * parameter i (0 <= i < dg_hf_n_params(d)). */
int dg_hf_n_params(const dg_model_desc_t *d);
void dg_hf_param(const dg_model_desc_t *d, int i, char *name, size_t cap, int64_t shape[2], int *ndim);

/* ---------------- config.json ---------------- */

typedef struct dg_hf_config {
    int n_layer, n_head, n_embd, n_positions, vocab_size;
} dg_hf_config_t;
/* Reads DIR/config.json: the five sizes (all required), and refuses what dgtrain's GPT-2 cannot compute:
 * model_type other than gpt2, activation_function other than gelu_new / gelu_pytorch_tanh (dgtrain's
 * tanh GELU), layer_norm_epsilon other than 1e-5, n_inner other than null or 4 * n_embd,
 * tie_word_embeddings false, scale_attn_weights false, scale_attn_by_inverse_layer_idx true. */
dg_status_t dg_hf_config_read(const char *dir, dg_hf_config_t *out);

/* ---------------- export ---------------- */

/* Fills out[numel] with dgtrain parameter `name` in dgtrain's layout (full, padded). */
typedef dg_status_t (*dg_hf_get_fn)(void *ctx, const char *name, float *out, size_t numel);
/* Writes the Hugging Face directory `dir` for a model of sizes d: model.safetensors (HF names, Conv1D
 * layout, vocab_size rows of wte, no lm_head: tied), config.json (GPT2LMHeadModel, n_positions =
 * seq_len, gelu_new, tie_word_embeddings), generation_config.json, and, when tok_dir is not NULL, the
 * tokenizer files copied from tok_dir (vocab.json and merges.txt required, the model's vocab_size must
 * be 50257; tokenizer.json, tokenizer_config.json, special_tokens_map.json copied when present).
 * Atomic: everything goes into dir.tmp.PID, which is renamed to dir; an existing non-empty dir is
 * refused (DG_ERR_USAGE), nothing is left behind on failure. Without tok_dir, a non-NULL `ranks` (a
 * loaded GPT-2-style tokenizer whose vocabulary is the model's vocab_size) is written as vocab.json,
 * merges.txt and tokenizer_config.json (dg_tokenizer_write_hf) instead. */
struct dg_tokenizer;
dg_status_t dg_hf_export(const dg_model_desc_t *d, dg_hf_get_fn get, void *ctx, const char *dir,
                         const char *tok_dir, const struct dg_tokenizer *ranks);

/* ---------------- llm.c checkpoints ---------------- */

/* llm.c's header: 256 int32, [0] magic 20240326, [1] version (3 = fp32), then maxT, V, L, NH, C, Vp. */
#define DG_LLMC_MAGIC 20240326
typedef struct dg_llmc_file {
    char path[4096];
    int max_t, vocab, n_layer, n_head, channels, padded_vocab;
    const float *params; /* the 16 tensors, in llm.c's order */
    void *map;
    size_t map_len;
} dg_llmc_file_t;
/* Maps and checks an llm.c checkpoint (magic, version 3, sizes > 0, file size = header + every tensor);
 * DG_ERR_USAGE naming the file otherwise (version 5, bf16, is refused with its own message). */
dg_status_t dg_llmc_open(const char *path, dg_llmc_file_t *out);
void dg_llmc_close(dg_llmc_file_t *f);

/* ---------------- model.init ---------------- */

/* Config check of model.init: "" (random init), "hf:DIR" or "llmc:FILE" with a non-empty path. Returns 0
 * when good, else 1 with the reason in why[cap]. */
int dg_model_init_check(const char *spec, char *why, size_t cap);

/* Sets the parameters of m (at any mesh: each rank sets its own shards from the full tensors it reads)
 * from the weights `spec` names; "" does nothing. The source's shape must match m's: n_layer, n_head,
 * d_model and vocab_size exactly; the source's positions (HF n_positions, llm.c maxT) >= seq_len (the
 * first seq_len rows are taken). A mismatch is DG_ERR_USAGE naming the field, both values and the key to
 * set. Only DG_STATE_PARAM changes (AdamW moments stay zero). Logs "init: weights from SPEC". */
dg_status_t dg_model_init_weights(dg_model_t *m, const char *spec);

#ifdef __cplusplus
}
#endif
#endif /* DG_HF_H */
