/* llmc.c — llm.c checkpoints (train_gpt2.c's gpt2_124M.bin): a 256 x int32 header, then the 16
 * parameter tensors in fp32, in llm.c's order (dg_hf.h). */
#include <stdio.h>
#include <string.h>

#include "model_io_impl.h"

/* Floats of the 16 tensors: wte, wpe, ln1w, ln1b, qkvw, qkvb, attprojw, attprojb, ln2w, ln2b, fcw, fcb,
 * fcprojw, fcprojb, lnfw, lnfb. */
uint64_t dg_llmc_sizes(const dg_llmc_file_t *f, uint64_t sz[16]) {
    uint64_t C = (uint64_t)f->channels, L = (uint64_t)f->n_layer;
    const uint64_t s[16] = {(uint64_t)f->padded_vocab * C,
                            (uint64_t)f->max_t * C,
                            L * C,
                            L * C,
                            L * 3 * C * C,
                            L * 3 * C,
                            L * C * C,
                            L * C,
                            L * C,
                            L * C,
                            L * 4 * C * C,
                            L * 4 * C,
                            L * 4 * C * C,
                            L * C,
                            C,
                            C};
    uint64_t total = 0;
    for (int i = 0; i < 16; i++)
        total += (sz[i] = s[i]);
    return total;
}

static dg_status_t llmc_check(dg_llmc_file_t *f, const int32_t *h, size_t len) {
    if (len < 256 * 4)
        return DG_ERR(DG_ERR_USAGE, "%s: %zu bytes, shorter than llm.c's 1024-byte header", f->path, len);
    if (h[0] != DG_LLMC_MAGIC)
        return DG_ERR(DG_ERR_USAGE, "%s: bad magic %d (an llm.c model checkpoint starts with %d)", f->path,
                      h[0], DG_LLMC_MAGIC);
    if (h[1] == 5)
        return DG_ERR(DG_ERR_USAGE,
                      "%s: llm.c version 5 (bf16 weights) is not supported; write the checkpoint in fp32 "
                      "(version 3)",
                      f->path);
    if (h[1] != 3)
        return DG_ERR(DG_ERR_USAGE, "%s: llm.c version %d is not supported (allowed: 3, fp32)", f->path,
                      h[1]);
    f->max_t = h[2], f->vocab = h[3], f->n_layer = h[4], f->n_head = h[5], f->channels = h[6];
    f->padded_vocab = h[7];
    if (f->max_t < 1 || f->vocab < 1 || f->n_layer < 1 || f->n_head < 1 || f->channels < 1 ||
        f->padded_vocab < f->vocab)
        return DG_ERR(
            DG_ERR_USAGE,
            "%s: bad llm.c sizes (maxT %d, V %d, L %d, NH %d, C %d, Vp %d: all must be >= 1, Vp >= V)",
            f->path, f->max_t, f->vocab, f->n_layer, f->n_head, f->channels, f->padded_vocab);
    uint64_t sz[16], total = dg_llmc_sizes(f, sz);
    if ((uint64_t)len != 1024 + total * 4)
        return DG_ERR(DG_ERR_USAGE,
                      "%s: %zu bytes, but its header's sizes need %llu (1024 + 4 x %llu parameters)", f->path,
                      len, (unsigned long long)(1024 + total * 4), (unsigned long long)total);
    return DG_OK;
}

dg_status_t dg_llmc_open(const char *path, dg_llmc_file_t *out) {
    *out = (dg_llmc_file_t){0};
    snprintf(out->path, sizeof out->path, "%s", path);
    DG_TRY(dg_mio_map(path, "an llm.c model checkpoint", &out->map, &out->map_len));
    dg_status_t s = llmc_check(out, out->map, out->map_len);
    if (s == DG_OK)
        out->params = (const float *)((const char *)out->map + 1024); /* the floats after the header */
    else
        dg_llmc_close(out);
    return s;
}

void dg_llmc_close(dg_llmc_file_t *f) {
    dg_mio_unmap(f->map, f->map_len);
    f->map = NULL;
    f->params = NULL;
}
