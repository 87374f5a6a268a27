/* hf_logits.c — test-only: dgtrain's own logits and greedy tokens for a checkpoint, the reference that
 * tests/model/test_hf.py compares transformers against.
 *   hf_logits CKPT T0,T1,...,Tk NGREEDY
 * Builds the model of the checkpoint's stored config on the CPU backend (fp32, micro-batch 1), sets every
 * model/ tensor from the file (dg_ckpt_read_dataset: no Hugging Face code involved), and prints one JSON
 * object: "logits" (for each prompt position p, the vocab_size logits at p after one forward over the
 * prompt) and "greedy" (NGREEDY tokens, each the argmax of the logits at the last position of the
 * sequence so far). Exit 0, or 2 with a one-line error. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "checkpoint.h"
#include "config.h"
#include "model_desc.h"

static int fail(const char *what) {
    fprintf(stderr, "hf_logits: %s: %s\n", what, dg_last_error());
    return 2;
}

static dg_status_t load(dg_model_t *m, const char *ckpt) {
    for (int i = 0; i < dg_model_n_tensors(m); i++) {
        const dg_param_info_t *p = dg_model_param(m, i);
        char dset[300];
        snprintf(dset, sizeof dset, "model/%s", p->name);
        float *data = NULL;
        int64_t n = 0;
        DG_TRY(dg_ckpt_read_dataset(ckpt, dset, &data, &n));
        dg_status_t s = (size_t)n == p->numel ? dg_model_set_tensor(m, i, DG_STATE_PARAM, data)
                                              : DG_ERR(DG_ERR_USAGE, "%s: size mismatch", dset);
        free(data);
        DG_TRY(s);
    }
    return DG_OK;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: hf_logits CKPT T0,T1,... NGREEDY\n");
        return 2;
    }
    dg_ckpt_info_t info;
    if (dg_ckpt_info_read(argv[1], &info)) return fail("checkpoint");
    dg_config_t cfg;
    dg_model_desc_t d;
    const char *text = info.meta.config_text ? info.meta.config_text : "";
    if (dg_config_load_buffer(&cfg, argv[1], text, strlen(text), 0, NULL) || dg_train_model_desc(&cfg, &d))
        return fail("stored config");
    dg_ckpt_info_destroy(&info);
    int32_t *tok = calloc((size_t)d.seq_len, sizeof *tok);
    int n = 0, ngreedy = atoi(argv[3]);
    for (char *save = NULL, *t = strtok_r(argv[2], ",", &save); t; t = strtok_r(NULL, ",", &save))
        if (n < d.seq_len) tok[n++] = atoi(t);
    if (n == 0 || n + ngreedy > d.seq_len) {
        fprintf(stderr, "hf_logits: need 1 <= prompt + NGREEDY <= seq_len %d\n", d.seq_len);
        return 2;
    }
    dg_backend_config_t bc;
    memset(&bc, 0, sizeof bc);
    bc.threads = 1;
    bc.act_dtype = DG_F32;
    dg_backend_t *be = NULL;
    dg_model_t *m = NULL;
    if (dg_backend_cpu_create(&bc, &be)) return fail("backend");
    if (dg_model_create(&d, be, 1, 1, &m)) return fail("model");
    if (load(m, argv[1])) return fail("load");
    float *lg = malloc((size_t)d.vocab_size * sizeof *lg);
    printf("{\"logits\": [");
    for (int p = 0; p < n; p++) {
        if (dg_model_logits(m, tok, p, lg)) return fail("logits");
        printf("%s[", p ? ", " : "");
        for (int v = 0; v < d.vocab_size; v++)
            printf("%s%.9g", v ? ", " : "", lg[v]);
        printf("]");
    }
    printf("], \"greedy\": [");
    for (int g = 0; g < ngreedy; g++) {
        if (dg_model_logits(m, tok, n - 1, lg)) return fail("logits");
        int best = 0;
        for (int v = 1; v < d.vocab_size; v++)
            if (lg[v] > lg[best]) best = v;
        tok[n++] = best;
        printf("%s%d", g ? ", " : "", best);
    }
    printf("]}\n");
    free(lg);
    free(tok);
    dg_model_free(m);
    be->ops->destroy(be);
    return 0;
}
