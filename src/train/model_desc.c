/* model_desc.c — the model sizes of a config (model_desc.h). */
#include "model_desc.h"

dg_status_t dg_train_model_desc(const dg_config_t *c, dg_model_desc_t *out) {
    dg_model_spec_t sp = {c->model.preset,  c->model.n_layer, c->model.n_head,
                          c->model.d_model, c->model.seq_len, c->model.vocab_size};
    return dg_model_desc_resolve(&sp, out);
}
