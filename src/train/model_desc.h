/* model_desc.h — the model sizes of a config (train, dgckpt, tools and tests share it). */
#ifndef DG_TRAIN_MODEL_DESC_H
#define DG_TRAIN_MODEL_DESC_H

#include "config.h"
#include "dg_model.h"

/* The [model] section resolved against its preset (dg_model_desc_resolve); DG_ERR_USAGE with a one-line
 * message for an unknown preset or inconsistent sizes. */
dg_status_t dg_train_model_desc(const dg_config_t *cfg, dg_model_desc_t *out);

#endif /* DG_TRAIN_MODEL_DESC_H */
