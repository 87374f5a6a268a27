/* ckpt_state.c — the trainer's checks of a checkpoint's scalar state (see ckpt_state.h): values a
 * dgtrain run cannot produce, in a file whose checksums all pass (an edited attribute, a file written by
 * a buggy or foreign tool), are refused before they reach the schedule, the loader or the loss scaler. */
#include "ckpt_state.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"

static void add_note(char *note, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void add_note(char *note, size_t cap, const char *fmt, ...) {
    if (!note || cap == 0) return;
    size_t o = strlen(note);
    if (o + 3 >= cap) return;
    if (o) o += (size_t)snprintf(note + o, cap - o, "; ");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(note + o, cap - o, fmt, ap);
    va_end(ap);
}

static int is_hex16(const char *s) {
    if (!s || strlen(s) != 16) return 0;
    for (; *s; s++)
        if (!((*s >= '0' && *s <= '9') || (*s >= 'a' && *s <= 'f'))) return 0;
    return 1;
}

/* The loss-spike detector's state (train.c, save_spike_state): "W n pos consecutive" and the window's
 * float32 values as hex words, 48 per "spike_window_K" pair. */
#define SPIKE_PER_KV 48
static void check_spike(const dg_ckpt_meta_t *m, const dg_config_t *cfg, dg_ckpt_violation_t *v, int cap,
                        int *n) {
    const char *st = dg_ckpt_meta_get_kv(m, "spike_state");
    if (!st || !st[0]) return;
    long long W, cnt, pos, cons;
    char extra;
    if (sscanf(st, "%lld %lld %lld %lld %c", &W, &cnt, &pos, &cons, &extra) != 4 || W < 1) {
        dg_ckpt_violation_add(v, cap, n, "kv spike_state", "four integers \"window n pos consecutive\"",
                              "'%.100s'", st);
        return;
    }
    char why[200];
    if (cfg && cfg->train.spike_window != W) {
        snprintf(why, sizeof why, "window %lld (train.spike_window of the run that wrote it)",
                 (long long)cfg->train.spike_window);
        dg_ckpt_violation_add(v, cap, n, "kv spike_state", why, "window %lld", W);
    }
    if (cnt < 0 || cnt > W) {
        snprintf(why, sizeof why, "n in 0 .. %lld (the window's length)", W);
        dg_ckpt_violation_add(v, cap, n, "kv spike_state", why, "n %lld", cnt);
    }
    if (pos < 0 || pos >= W) {
        snprintf(why, sizeof why, "pos in 0 .. %lld", W - 1);
        dg_ckpt_violation_add(v, cap, n, "kv spike_state", why, "pos %lld", pos);
    }
    if (cons < 0 || cons > m->step) {
        snprintf(why, sizeof why, "consecutive in 0 .. step = %lld (one spike per step at most)",
                 (long long)m->step);
        dg_ckpt_violation_add(v, cap, n, "kv spike_state", why, "consecutive %lld", cons);
    }
    if (cnt < 0 || cnt > W) return;
    for (long long i = 0; i < cnt; i++) {
        char key[32];
        snprintf(key, sizeof key, "spike_window_%lld", i / SPIKE_PER_KV);
        const char *hex = dg_ckpt_meta_get_kv(m, key);
        size_t at = (size_t)(8 * (i % SPIKE_PER_KV));
        unsigned u = 0;
        float f = NAN;
        if (hex && strlen(hex) >= at + 8 && sscanf(hex + at, "%8x", &u) == 1) {
            uint32_t u32 = u;
            memcpy(&f, &u32, sizeof f);
        }
        if (!isfinite(f) || f < 0) {
            char field[64];
            snprintf(field, sizeof field, "kv %s", key);
            dg_ckpt_violation_add(v, cap, n, field,
                                  "losses: finite numbers >= 0 (only accepted losses enter the window)",
                                  "entry %lld = %g", i, (double)f);
            return;
        }
    }
}

int dg_train_ckpt_check(const dg_ckpt_meta_t *m, const dg_train_ckpt_ref_t *ref, dg_ckpt_violation_t *v,
                        int cap, char *note, size_t note_cap) {
    int n = 0;
    char why[320];
    if (note && note_cap) note[0] = 0;
    /* the trainer writes "precision" into every checkpoint: what lacks it was written by another user of
     * the checkpoint module (a tool, a test), whose counters follow rules of its own */
    if (!dg_ckpt_meta_get_kv(m, "precision")) {
        add_note(note, note_cap,
                 "not written by dgtrain's training loop (no kv precision): only the generic checks apply");
        return 0;
    }
    const uint64_t seen = m->loader.samples_seen;
    const int seen_ok = seen <= (uint64_t)INT64_MAX; /* else dg_ckpt_meta_check reports it */

    /* the run that wrote it: its schedule and batch */
    dg_config_t *cfg = dg_xcalloc(1, sizeof *cfg);
    int have_cfg = 0;
    if (m->config_text && m->config_text[0]) {
        have_cfg = dg_config_load_buffer(cfg, "the checkpoint's stored config", m->config_text,
                                         strlen(m->config_text), 0, NULL) == DG_OK;
        if (!have_cfg) {
            add_note(note, note_cap,
                     "its stored config does not parse here (%.200s): schedule and batch not checked",
                     dg_last_error());
            dg_clear_error();
        }
    } else {
        add_note(note, note_cap, "it stores no config: schedule and batch not checked");
    }
    int T = ref ? ref->seq_len : 0;
    if (T <= 0 && have_cfg && cfg->model.seq_len > 0) T = (int)cfg->model.seq_len;

    /* where this run segment began */
    long long s0 = 0, n0 = 0, e0 = 0, c0 = 0;
    int have_seg = 0;
    const char *sg = dg_ckpt_meta_get_kv(m, DG_TRAIN_KV_SEGMENT);
    if (sg) {
        char extra;
        if (sscanf(sg, "%lld %lld %lld %lld %c", &s0, &n0, &e0, &c0, &extra) != 4 || s0 < 0 || n0 < 0 ||
            e0 < 0 || c0 < 0)
            dg_ckpt_violation_add(
                v, cap, &n, "kv segment",
                "four integers >= 0: step, samples seen, epoch and cursor where the run began", "'%.100s'",
                sg);
        else
            have_seg = 1;
    }
    if (m->step < 0)
        have_seg = 0; /* dg_ckpt_meta_check reports the step itself; nothing else follows from it */
    if (have_seg && s0 > m->step) {
        snprintf(why, sizeof why, "a start step <= step = %lld", (long long)m->step);
        dg_ckpt_violation_add(v, cap, &n, "kv segment", why, "step %lld", s0);
        have_seg = 0;
    }
    if (have_seg && seen_ok && (uint64_t)n0 > seen) {
        snprintf(why, sizeof why, "start samples <= loader_samples_seen = %llu", (unsigned long long)seen);
        dg_ckpt_violation_add(v, cap, &n, "kv segment", why, "samples %lld", n0);
        have_seg = 0;
    }

    /* the schedule: a run stops at train.steps (a resume past its end trains nothing and may re-save the
     * step it resumed at, which is where its segment began) */
    if (have_cfg && m->step > cfg->train.steps && !(have_seg && s0 == m->step)) {
        snprintf(why, sizeof why, "0 .. %lld (train.steps of the run that wrote it)",
                 (long long)cfg->train.steps);
        dg_ckpt_violation_add(v, cap, &n, "step", why, "%lld", (long long)m->step);
    }

    /* tokens: every sample the loader hands out is seq_len tokens */
    if (T > 0 && seen_ok && m->tokens >= 0) {
        __int128 want = (__int128)seen * T;
        if ((__int128)m->tokens != want) {
            snprintf(why, sizeof why, "loader_samples_seen x seq_len = %llu x %d = %.0f",
                     (unsigned long long)seen, T, (double)want);
            dg_ckpt_violation_add(v, cap, &n, "tokens", why, "%lld", (long long)m->tokens);
        }
    }

    /* samples: global_batch per step since the segment began */
    if (have_seg && have_cfg && seen_ok) {
        __int128 want = (__int128)n0 + (__int128)(m->step - s0) * cfg->train.global_batch;
        if ((__int128)seen != want) {
            snprintf(
                why, sizeof why,
                "%lld + (step %lld - %lld) x train.global_batch %lld = %.0f (the samples seen when the run "
                "began, plus one global batch per step since)",
                n0, (long long)m->step, s0, (long long)cfg->train.global_batch, (double)want);
            dg_ckpt_violation_add(v, cap, &n, "loader_samples_seen", why, "%llu", (unsigned long long)seen);
        }
    } else if (!have_seg && seen_ok && m->step > 0 && seen < (uint64_t)m->step) {
        snprintf(why, sizeof why, ">= step = %lld (every step reads one sample or more)", (long long)m->step);
        dg_ckpt_violation_add(v, cap, &n, "loader_samples_seen", why, "%llu", (unsigned long long)seen);
    }

    /* the loader against the data */
    const char *fp = dg_ckpt_meta_get_kv(m, "data_fingerprint");
    if (fp && !is_hex16(fp))
        dg_ckpt_violation_add(v, cap, &n, "kv data_fingerprint", "16 hexadecimal digits", "'%.64s'", fp);
    if (ref && ref->data) {
        int64_t S = dg_dataset_n_samples(ref->data);
        const char *dn = ref->data_name ? ref->data_name : "the training data";
        if (m->loader.cursor >= S) {
            snprintf(why, sizeof why, "0 .. %lld (%.200s has %lld samples of %d tokens)", (long long)(S - 1),
                     dn, (long long)S, dg_dataset_seq_len(ref->data));
            dg_ckpt_violation_add(v, cap, &n, "loader_cursor", why, "%lld", (long long)m->loader.cursor);
        }
        char now_fp[32];
        snprintf(now_fp, sizeof now_fp, "%016llx", (unsigned long long)dg_dataset_fingerprint(ref->data));
        int same = fp && strcmp(fp, now_fp) == 0;
        if (!same)
            add_note(note, note_cap,
                     "%.200s is not the data it was written with (fingerprint %s, it says %s): only the "
                     "cursor is checked against it",
                     dn, now_fp, fp ? fp : "none");
        if (same && have_seg && seen_ok && m->loader.epoch >= 0 && m->loader.cursor >= 0) {
            /* within one data set, the position (epoch x samples + cursor) moves as samples_seen does */
            __int128 moved = (__int128)m->loader.epoch * S + m->loader.cursor - ((__int128)e0 * S + c0);
            if (moved != (__int128)seen - n0) {
                snprintf(why, sizeof why,
                         "a position %llu samples past the run's start (epoch %lld, cursor %lld), as samples "
                         "seen grew (%.200s has %lld samples an epoch)",
                         (unsigned long long)(seen - (uint64_t)n0), e0, c0, dn, (long long)S);
                dg_ckpt_violation_add(v, cap, &n, "loader_epoch/loader_cursor", why,
                                      "epoch %lld, cursor %lld", (long long)m->loader.epoch,
                                      (long long)m->loader.cursor);
            }
        }
    }

    /* the loss scaler: fp16 only */
    const char *prec = dg_ckpt_meta_get_kv(m, "precision");
    if (prec && strcmp(prec, "fp16") != 0) {
        if (m->scaler.scale != 1.0) {
            snprintf(why, sizeof why, "1 (train.precision = %.16s uses no loss scale)", prec);
            dg_ckpt_violation_add(v, cap, &n, "scaler_scale", why, "%g", m->scaler.scale);
        }
        if (m->scaler.good_steps != 0) {
            snprintf(why, sizeof why, "0 (train.precision = %.16s uses no loss scale)", prec);
            dg_ckpt_violation_add(v, cap, &n, "scaler_good_steps", why, "%lld",
                                  (long long)m->scaler.good_steps);
        }
    } else if (prec) {
        if (!(m->scaler.scale >= 1.0) || !isfinite(m->scaler.scale))
            dg_ckpt_violation_add(v, cap, &n, "scaler_scale",
                                  "a finite number >= 1 (the dynamic loss scale never drops below 1)", "%g",
                                  m->scaler.scale);
        if (have_cfg && m->scaler.good_steps >= cfg->train.loss_scale_growth_interval) {
            snprintf(why, sizeof why,
                     "0 .. %lld (the scale doubles, and the count restarts, after "
                     "train.loss_scale_growth_interval = %lld good steps)",
                     (long long)cfg->train.loss_scale_growth_interval - 1,
                     (long long)cfg->train.loss_scale_growth_interval);
            dg_ckpt_violation_add(v, cap, &n, "scaler_good_steps", why, "%lld",
                                  (long long)m->scaler.good_steps);
        }
    }

    check_spike(m, have_cfg ? cfg : NULL, v, cap, &n);
    free(cfg);
    return n;
}

dg_status_t dg_train_ckpt_check_fn(void *ctx, const char *path, const dg_ckpt_meta_t *m) {
    dg_ckpt_violation_t v[DG_CKPT_MAX_VIOLATIONS];
    int n = dg_train_ckpt_check(m, ctx, v, DG_CKPT_MAX_VIOLATIONS, NULL, 0);
    return n ? dg_ckpt_violations_error(path, v, n) : DG_OK;
}
