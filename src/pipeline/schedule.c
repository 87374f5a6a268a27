/* schedule.c — the 1F1B and interleaved 1F1B schedules as per-rank action lists, and their validator
 * (pipeline.h, docs/parallelism.md §Schedules). */
#include <stdlib.h>
#include <string.h>

#include "pipeline.h"

static const char *k_op_names[] = {"F", "B", "send_act", "recv_act", "send_grad", "recv_grad"};

const char *dg_pp_op_name(int op) {
    DG_ASSERT(op >= 0 && op <= DG_PP_RECV_GRAD);
    return k_op_names[op];
}

static int is_comm(int op) {
    return op >= DG_PP_SEND_ACT;
}
static int is_send(int op) {
    return op == DG_PP_SEND_ACT || op == DG_PP_SEND_GRAD;
}
/* the channel a message travels on: 0 activations, 1 gradients */
static int chan(int op) {
    return op == DG_PP_SEND_GRAD || op == DG_PP_RECV_GRAD;
}

typedef struct {
    dg_pp_action_t *a;
    int n, cap;
} list_t;

static void push(list_t *l, dg_pp_action_t x) {
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 64;
        l->a = realloc(l->a, (size_t)l->cap * sizeof *l->a);
        DG_ASSERT(l->a != NULL);
    }
    l->a[l->n++] = x;
}

/* The compute order of rank s, and each action's slot: between two slots, the sends of the first and
 * the receives of the second form one group. 1F1B: every action is a slot of its own. Interleaved: the
 * forward and backward of a steady-state step share one (their four messages are one batch, as in
 * Megatron-LM), so that the receives of a step are posted a step ahead. */
static int compute_order(int kind, int p, int v, int m, int s, dg_pp_action_t *out, int *slot) {
    int n = 0, sl = 0;
    if (kind == DG_PP_1F1B) {
        int w = p - s - 1 < m ? p - s - 1 : m;
        for (int i = 0; i < w; i++)
            slot[n] = sl++, out[n++] = (dg_pp_action_t){DG_PP_FWD, i, s, -1, 0};
        for (int i = 0; i < m - w; i++) {
            slot[n] = sl++, out[n++] = (dg_pp_action_t){DG_PP_FWD, w + i, s, -1, 0};
            slot[n] = sl++, out[n++] = (dg_pp_action_t){DG_PP_BWD, i, s, -1, 0};
        }
        for (int i = m - w; i < m; i++)
            slot[n] = sl++, out[n++] = (dg_pp_action_t){DG_PP_BWD, i, s, -1, 0};
        return n;
    }
    /* interleaved: the k-th chunk-forward is table[k] = (mb, local chunk); micro-batches in groups of p
     * (the remainder of m / p joins the first group: every group is at least p long, so a chunk's input
     * has come round the ring when the rank gets to it, and none is longer than the first, whose length
     * sets the warm-up, so a backward never overtakes its forward), each group through local chunk 0,
     * then 1, ...; the k-th chunk-backward is the same entry with the local chunk reversed */
    int total = m * v, g = p;
    int *tmb = dg_xmalloc((size_t)total * sizeof(int)), *tch = dg_xmalloc((size_t)total * sizeof(int));
    int k = 0, g0 = 0;
    for (int start = 0; start < m;) {
        int end = start == 0 ? g + m % g : start + g;
        if (!g0) g0 = end - start;
        for (int j = 0; j < v; j++)
            for (int mb = start; mb < end; mb++)
                tmb[k] = mb, tch[k] = j, k++;
        start = end;
    }
    int w = 2 * (p - s - 1) + (v - 1) * g0;
    if (w > total) w = total;
#define FWD_K(k)                                                                                             \
    (dg_pp_action_t) {                                                                                       \
        DG_PP_FWD, tmb[k], tch[k] * p + s, -1, 0                                                             \
    }
#define BWD_K(k)                                                                                             \
    (dg_pp_action_t) {                                                                                       \
        DG_PP_BWD, tmb[k], (v - 1 - tch[k]) * p + s, -1, 0                                                   \
    }
    for (int i = 0; i < w; i++)
        slot[n] = sl++, out[n++] = FWD_K(i);
    for (int i = 0; i < total - w; i++) {
        slot[n] = sl, out[n++] = FWD_K(w + i);
        slot[n] = sl++, out[n++] = BWD_K(i);
    }
    for (int i = total - w; i < total; i++)
        slot[n] = sl++, out[n++] = BWD_K(i);
#undef FWD_K
#undef BWD_K
    free(tmb);
    free(tch);
    return n;
}

dg_status_t dg_pp_schedule_build(int kind, int p, int v, int64_t m64, dg_pp_schedule_t *o) {
    memset(o, 0, sizeof *o);
    if (kind != DG_PP_1F1B && kind != DG_PP_INTERLEAVED)
        return DG_ERR(DG_ERR_USAGE, "pipeline: unknown schedule %d", kind);
    if (p < 1 || v < 1 || (int64_t)p * v > DG_PP_MAX_CHUNKS)
        return DG_ERR(DG_ERR_USAGE, "pipeline: pp=%d x pp_virtual=%d must be between 1 and %d chunks", p, v,
                      DG_PP_MAX_CHUNKS);
    if (kind == DG_PP_1F1B && v != 1)
        return DG_ERR(DG_ERR_USAGE,
                      "pipeline: the 1f1b schedule has one stage per rank (pp_virtual=1, got %d)", v);
    if (kind == DG_PP_INTERLEAVED && (v < 2 || p < 2))
        return DG_ERR(DG_ERR_USAGE,
                      "pipeline: the interleaved schedule needs pp >= 2 and pp_virtual >= 2 (got pp=%d, "
                      "pp_virtual=%d; with one chunk per rank it is 1f1b)",
                      p, v);
    if (m64 < p)
        return DG_ERR(DG_ERR_USAGE,
                      "pipeline: %lld micro-batches cannot fill %d stages (parallel.pp_microbatches >= pp)",
                      (long long)m64, p);
    /* the schedule is a list of 2 x m x virt actions per rank: a global batch of 1e9 samples at
     * micro_batch 1 would plan 40 GB of them */
    if (m64 > DG_PP_MAX_MICRO)
        return DG_ERR(DG_ERR_USAGE,
                      "pipeline: %lld micro-batches per step is more than the schedule's %d "
                      "(train.global_batch / (train.micro_batch x data-parallel ranks)); raise "
                      "train.micro_batch",
                      (long long)m64, DG_PP_MAX_MICRO);
    const int m = (int)m64;
    o->kind = kind;
    o->pp = p;
    o->virt = v;
    o->m = m;
    const int nc = p * v;
    dg_pp_action_t *comp = dg_xmalloc((size_t)2 * m * v * sizeof *comp);
    int *slot = dg_xmalloc((size_t)2 * m * v * sizeof(int));
    for (int s = 0; s < p; s++) {
        int nk = compute_order(kind, p, v, m, s, comp, slot);
        list_t l = {0};
        int grp = 0;
        for (int k = 0; k <= nk;) {
            /* the gap before slot [k, e): the sends of the slot before, the receives of this one */
            int e = k;
            while (e < nk && slot[e] == slot[k])
                e++;
            int b = k;
            while (b > 0 && slot[b - 1] == slot[k - 1])
                b--;
            int opened = 0;
            for (int i = b; i < k; i++) {
                dg_pp_action_t x = comp[i];
                if (x.op == DG_PP_FWD && x.chunk < nc - 1) {
                    if (!opened++) grp++;
                    push(&l, (dg_pp_action_t){DG_PP_SEND_ACT, x.mb, x.chunk, (x.chunk + 1) % p, grp});
                }
                if (x.op == DG_PP_BWD && x.chunk > 0) {
                    if (!opened++) grp++;
                    push(&l, (dg_pp_action_t){DG_PP_SEND_GRAD, x.mb, x.chunk, (x.chunk - 1) % p, grp});
                }
            }
            for (int i = k; i < e; i++) {
                dg_pp_action_t x = comp[i];
                if (x.op == DG_PP_FWD && x.chunk > 0) {
                    if (!opened++) grp++;
                    push(&l, (dg_pp_action_t){DG_PP_RECV_ACT, x.mb, x.chunk, (x.chunk - 1) % p, grp});
                }
                if (x.op == DG_PP_BWD && x.chunk < nc - 1) {
                    if (!opened++) grp++;
                    push(&l, (dg_pp_action_t){DG_PP_RECV_GRAD, x.mb, x.chunk, (x.chunk + 1) % p, grp});
                }
            }
            for (int i = k; i < e; i++)
                push(&l, comp[i]);
            if (k == nk) break;
            k = e;
        }
        o->n[s] = l.n;
        o->act[s] = l.a;
    }
    free(slot);
    free(comp);
    return DG_OK;
}

void dg_pp_schedule_free(dg_pp_schedule_t *s) {
    for (int r = 0; r < s->pp && r < DG_PP_MAX_CHUNKS; r++) {
        free(s->act[r]);
        s->act[r] = NULL;
    }
    s->pp = 0;
}

/* The message an action sends or receives: (gradient?, mb, producing chunk) packed in one integer. */
static int64_t msg_key(const dg_pp_action_t *a, int nc) {
    int grad = a->op == DG_PP_SEND_GRAD || a->op == DG_PP_RECV_GRAD;
    int prod = a->op == DG_PP_RECV_ACT ? a->chunk - 1 : a->op == DG_PP_RECV_GRAD ? a->chunk + 1 : a->chunk;
    return ((int64_t)a->mb * nc + prod) * 2 + grad;
}

static void describe(const dg_pp_action_t *a, char *buf, size_t cap) {
    if (is_comm(a->op))
        snprintf(buf, cap, "%s(mb %d, chunk %d, peer %d)", dg_pp_op_name(a->op), a->mb, a->chunk, a->peer);
    else
        snprintf(buf, cap, "%s(mb %d, chunk %d)", dg_pp_op_name(a->op), a->mb, a->chunk);
}

/* rendezvous replay: every rank advances through compute freely; a group completes when each of its
 * operations has met the peer's matching operation in the group the peer is blocked in */
static dg_status_t replay_blocking(const dg_pp_schedule_t *s) {
    const int p = s->pp, nc = p * s->virt;
    int ip[DG_PP_MAX_CHUNKS] = {0}, done = 0;
    char **matched = dg_xcalloc((size_t)p, sizeof(char *));
    for (int r = 0; r < p; r++)
        matched[r] = dg_xcalloc((size_t)s->n[r] + 1, 1);
    dg_status_t st = DG_OK;
    for (;;) {
        int progress = 0;
        done = 0;
        for (int r = 0; r < p; r++) {
            while (ip[r] < s->n[r] && !is_comm(s->act[r][ip[r]].op))
                ip[r]++, progress = 1;
            if (ip[r] >= s->n[r]) {
                done++;
                continue;
            }
            int g = s->act[r][ip[r]].group, all = 1;
            for (int i = ip[r]; i < s->n[r] && s->act[r][i].group == g && is_comm(s->act[r][i].op); i++) {
                if (matched[r][i]) continue;
                const dg_pp_action_t *a = &s->act[r][i];
                int q = a->peer, hit = 0;
                if (q >= 0 && q < p && ip[q] < s->n[q] && is_comm(s->act[q][ip[q]].op)) {
                    int gq = s->act[q][ip[q]].group;
                    for (int j = ip[q]; j < s->n[q] && s->act[q][j].group == gq && is_comm(s->act[q][j].op);
                         j++) {
                        const dg_pp_action_t *b = &s->act[q][j];
                        if (matched[q][j] || b->peer != r || is_send(b->op) == is_send(a->op) ||
                            msg_key(a, nc) != msg_key(b, nc))
                            continue;
                        matched[r][i] = matched[q][j] = 1;
                        hit = progress = 1;
                        break;
                    }
                }
                if (!hit) all = 0;
            }
            if (all) {
                while (ip[r] < s->n[r] && s->act[r][ip[r]].group == g && is_comm(s->act[r][ip[r]].op))
                    ip[r]++;
                progress = 1;
            }
        }
        if (done == p) break;
        if (!progress) {
            char what[128];
            int r = 0;
            while (ip[r] >= s->n[r])
                r++;
            describe(&s->act[r][ip[r]], what, sizeof what);
            st = DG_ERR(
                DG_ERR_RUNTIME,
                "pipeline schedule: deadlock under blocking point-to-point: rank %d waits at action %d "
                "%s and no peer can meet it",
                r, ip[r], what);
            break;
        }
    }
    for (int r = 0; r < p; r++)
        free(matched[r]);
    free(matched);
    return st;
}

dg_status_t dg_pp_validate(const dg_pp_schedule_t *s) {
    const int p = s->pp, v = s->virt, m = s->m, nc = p * v;
    if (p < 1 || nc > DG_PP_MAX_CHUNKS || m < 1)
        return DG_ERR(DG_ERR_RUNTIME, "pipeline schedule: bad shape pp=%d virt=%d m=%d", p, v, m);
    /* pos[op][mb][chunk]: index of that action on its rank (-1 none) */
    size_t slots = (size_t)6 * m * nc;
    int *pos = dg_xmalloc(slots * sizeof(int));
    char what[128];
    dg_status_t st = DG_OK;
    for (int r = 0; r < p && !st; r++) {
        for (size_t i = 0; i < slots; i++)
            pos[i] = -1;
        for (int i = 0; i < s->n[r] && !st; i++) {
            const dg_pp_action_t *a = &s->act[r][i];
            describe(a, what, sizeof what);
            if (a->op < 0 || a->op > DG_PP_RECV_GRAD || a->mb < 0 || a->mb >= m || a->chunk < 0 ||
                a->chunk >= nc || a->chunk % p != r) {
                st = DG_ERR(DG_ERR_RUNTIME, "pipeline schedule: rank %d action %d %s is out of range", r, i,
                            what);
                break;
            }
            int want_peer = -1;
            if (a->op == DG_PP_SEND_ACT || a->op == DG_PP_RECV_GRAD)
                want_peer = a->chunk + 1 < nc ? (a->chunk + 1) % p : -2;
            if (a->op == DG_PP_RECV_ACT || a->op == DG_PP_SEND_GRAD)
                want_peer = a->chunk > 0 ? (a->chunk - 1) % p : -2;
            if (a->peer != want_peer) {
                st = DG_ERR(DG_ERR_RUNTIME, "pipeline schedule: rank %d action %d %s: peer should be %d", r,
                            i, what, want_peer);
                break;
            }
            int *slot = &pos[((size_t)a->op * m + a->mb) * nc + a->chunk];
            if (*slot >= 0) {
                st = DG_ERR(DG_ERR_RUNTIME, "pipeline schedule: rank %d has %s twice (actions %d and %d)", r,
                            what, *slot, i);
                break;
            }
            *slot = i;
        }
        for (int mb = 0; mb < m && !st; mb++)
            for (int c = r; c < nc && !st; c += p) {
#define POS(op) pos[((size_t)(op)*m + mb) * nc + c]
                int f = POS(DG_PP_FWD), b = POS(DG_PP_BWD);
                const char *bad = NULL;
                if (f < 0 || b < 0)
                    bad = "has no forward or no backward";
                else if (b < f)
                    bad = "runs the backward before the forward";
                else if (c > 0 && !(POS(DG_PP_RECV_ACT) >= 0 && POS(DG_PP_RECV_ACT) < f))
                    bad = "does not receive its input activation before the forward";
                else if (c < nc - 1 && !(POS(DG_PP_SEND_ACT) > f))
                    bad = "does not send its output activation after the forward";
                else if (c < nc - 1 && !(POS(DG_PP_RECV_GRAD) >= 0 && POS(DG_PP_RECV_GRAD) < b))
                    bad = "does not receive its output gradient before the backward";
                else if (c > 0 && !(POS(DG_PP_SEND_GRAD) > b))
                    bad = "does not send its input gradient after the backward";
                else if ((c == 0 && (POS(DG_PP_RECV_ACT) >= 0 || POS(DG_PP_SEND_GRAD) >= 0)) ||
                         (c == nc - 1 && (POS(DG_PP_SEND_ACT) >= 0 || POS(DG_PP_RECV_GRAD) >= 0)))
                    bad = "communicates past the ends of the pipeline";
#undef POS
                if (bad)
                    st = DG_ERR(DG_ERR_RUNTIME, "pipeline schedule: rank %d, micro-batch %d, chunk %d %s", r,
                                mb, c, bad);
            }
    }
    free(pos);
    /* per directed pair and channel (activations, gradients): the sends' order is the receives' order */
    for (int a = 0; a < p && !st; a++)
        for (int b = 0; b < p && !st; b++)
            for (int ch = 0; ch < 2 && !st; ch++) {
                int i = 0, j = 0;
                for (;;) {
                    while (i < s->n[a] && !(is_send(s->act[a][i].op) && s->act[a][i].peer == b &&
                                            chan(s->act[a][i].op) == ch))
                        i++;
                    while (j < s->n[b] && !(is_comm(s->act[b][j].op) && !is_send(s->act[b][j].op) &&
                                            s->act[b][j].peer == a && chan(s->act[b][j].op) == ch))
                        j++;
                    if (i >= s->n[a] && j >= s->n[b]) break;
                    if (i >= s->n[a] || j >= s->n[b] ||
                        msg_key(&s->act[a][i], nc) != msg_key(&s->act[b][j], nc)) {
                        char w2[128] = "nothing";
                        snprintf(what, sizeof what, "nothing");
                        if (i < s->n[a]) describe(&s->act[a][i], what, sizeof what);
                        if (j < s->n[b]) describe(&s->act[b][j], w2, sizeof w2);
                        st = DG_ERR(
                            DG_ERR_RUNTIME,
                            "pipeline schedule: %s from rank %d to rank %d out of order: rank %d sends %s "
                            "(action %d) where rank %d receives %s (action %d)",
                            ch ? "gradients" : "activations", a, b, a, what, i, b, w2, j);
                        break;
                    }
                    i++, j++;
                }
            }
    if (!st) st = replay_blocking(s);
    return st;
}
