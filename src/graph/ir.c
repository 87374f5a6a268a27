/* ir.c — the graph IR: node and graph lifetime, leaves, the generic op constructor that runs an op's
 * shape rule, structural verification, the pass runner, persistent allocation for small graphs, and
 * the schedule printer (the body of `dgtrain --plan-only`).
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "dg_json.h"
#include "graph.h"

dg_status_t dg_err_prefix(dg_status_t st, const char *fmt, ...) {
    char prev[1024], pre[512];
    snprintf(prev, sizeof prev, "%s", dg_last_error());
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(pre, sizeof pre, fmt, ap);
    va_end(ap);
    return DG_ERR(st, "%s: %s", pre, prev);
}

static const char *const phase_names[DG_PHASE_COUNT] = {"fwd", "bwd", "zero", "opt"};

const char *dg_phase_name(dg_phase_t p) {
    return (p >= 0 && p < DG_PHASE_COUNT) ? phase_names[p] : "?";
}

dg_graph_t *dg_graph_create(dg_backend_t *be) {
    DG_ASSERT(be != NULL);
    dg_graph_t *g = dg_xcalloc(1, sizeof *g);
    g->be = be;
    g->act_dtype = be->act_dtype;
    for (int d = 0; d < DG_MESH_NDIM; d++) {
        g->mesh.size[d] = 1;
        g->mesh.order[d] = d;
    }
    g->generation = 1;
    return g;
}

void dg_graph_free(dg_graph_t *g) {
    if (!g) return;
    for (int i = 0; i < g->n; i++)
        free(g->nodes[i]);
    DG_FREE_ALL(g->nodes, g->opt_segs, g->norm_segs, g);
}

dg_status_t dg_graph_error(const dg_graph_t *g) {
    return g->err;
}

void dg_graph_touch(dg_graph_t *g) {
    g->generation++;
}

static void graph_append(dg_graph_t *g, dg_node_t *n) {
    if (g->n == g->cap) {
        g->cap = g->cap ? 2 * g->cap : 256;
        dg_node_t **nn = realloc(g->nodes, (size_t)g->cap * sizeof *nn);
        DG_ASSERT(nn != NULL);
        g->nodes = nn;
    }
    n->id = g->n;
    g->nodes[g->n++] = n;
    g->generation++;
}

size_t dg_node_numel(const dg_node_t *n) {
    size_t e = 1;
    for (int d = 0; d < n->ndim; d++)
        e *= (size_t)n->shape[d];
    return e;
}

int64_t dg_node_rows(const dg_node_t *n) {
    int64_t r = 1;
    for (int d = 0; d + 1 < n->ndim; d++)
        r *= n->shape[d];
    return r;
}

int64_t dg_node_cols(const dg_node_t *n) {
    return n->ndim > 0 ? n->shape[n->ndim - 1] : 1;
}

dg_node_t *dg_node_root(dg_node_t *n) {
    while (n->view_src)
        n = n->view_src;
    return n;
}

const dg_node_t *dg_node_root_c(const dg_node_t *n) {
    while (n->view_src)
        n = n->view_src;
    return n;
}

void dg_node_shape_str(const dg_node_t *n, char *buf, size_t cap) {
    size_t k = 0;
    k += (size_t)snprintf(buf + k, cap - k, "[");
    for (int d = 0; d < n->ndim && k < cap; d++)
        k += (size_t)snprintf(buf + k, cap - k, "%s%" PRId64, d ? "," : "", n->shape[d]);
    if (k < cap) snprintf(buf + k, cap - k, "]");
}

static void node_set_shape(dg_node_t *n, dg_dtype_t dtype, int ndim, const int64_t *shape) {
    DG_ASSERT(ndim >= 0 && ndim <= DG_MAX_DIMS);
    n->dtype = dtype;
    n->ndim = ndim;
    for (int d = 0; d < ndim; d++) {
        n->shape[d] = shape[d];
        n->gshape[d] = shape[d];
    }
    int64_t st = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        n->stride[d] = st;
        st *= shape[d];
    }
    n->nbytes = dg_node_numel(n) * dg_dtype_size(dtype);
}

void dg_node_reshape(dg_node_t *n, int ndim, const int64_t *shape) {
    int64_t g[DG_MAX_DIMS];
    memcpy(g, n->gshape, sizeof g);
    node_set_shape(n, n->dtype, ndim, shape);
    memcpy(n->gshape, g, sizeof g);
}

static dg_node_t *node_new(const char *name, dg_op_kind_t op, dg_phase_t phase) {
    dg_node_t *n = dg_xcalloc(1, sizeof *n);
    size_t len = name ? strlen(name) : 0;
    if (len >= sizeof n->name) len = sizeof n->name - 1; /* long names are cut, never overflow */
    if (len) memcpy(n->name, name, len);
    n->name[len] = 0;
    n->op = op;
    n->phase = phase;
    n->stream = DG_STREAM_COMPUTE;
    n->shard_dim = -1;
    n->param_index = -1;
    return n;
}

dg_node_t *dg_graph_leaf(dg_graph_t *g, const char *name, dg_dtype_t dtype, int ndim, const int64_t *shape,
                         unsigned flags) {
    if (g->err) return NULL;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] <= 0) {
            g->err = DG_ERR(DG_ERR_USAGE, "graph: tensor '%s' has non-positive size %" PRId64 " in dim %d",
                            name, shape[d], d);
            return NULL;
        }
    }
    dg_node_t *n = node_new(name, DG_OP_LEAF, g->cur_phase);
    node_set_shape(n, dtype, ndim, shape);
    n->flags = flags;
    n->storage = DG_STORE_PERSISTENT;
    graph_append(g, n);
    return n;
}

dg_node_t *dg_graph_param(dg_graph_t *g, const char *name, int ndim, const int64_t *shape) {
    if (g->err) return NULL;
    int index = 0;
    for (int i = 0; i < g->n; i++)
        if (g->nodes[i]->flags & DG_NF_PARAM) index++;
    dg_node_t *p = dg_graph_leaf(g, name, g->act_dtype, ndim, shape, DG_NF_PARAM);
    if (!p) return NULL;
    char nm[96];
    if (g->act_dtype == DG_F32) {
        p->master = p; /* the compute copy is the master */
    } else {
        snprintf(nm, sizeof nm, "master.%s", name);
        p->master = dg_graph_leaf(g, nm, DG_F32, ndim, shape, DG_NF_MASTER);
        if (!p->master) return NULL;
        p->master->param_index = index;
    }
    snprintf(nm, sizeof nm, "grad.%s", name);
    p->grad = dg_graph_leaf(g, nm, DG_F32, ndim, shape, DG_NF_GRAD);
    if (!p->grad) return NULL;
    p->param_index = index;
    p->grad->param_index = index;
    p->needs_grad = 1;
    return p;
}

dg_node_t *dg_node_add_side(dg_graph_t *g, dg_node_t *n, const char *suffix, dg_dtype_t dtype, int ndim,
                            const int64_t *shape) {
    (void)g;
    DG_ASSERT(n->n_side < DG_MAX_SIDE);
    char nm[96];
    snprintf(nm, sizeof nm, "%.80s.%.12s", n->name, suffix);
    dg_node_t *s = node_new(nm, DG_OP_SIDE, n->phase);
    node_set_shape(s, dtype, ndim, shape);
    s->storage = DG_STORE_ARENA;
    s->n_src = 1;
    s->src[0] = n;
    s->attr[DG_A_SIDE_IDX] = n->n_side;
    n->side[n->n_side++] = s;
    return s;
}

dg_node_t *dg_graph_add_op(dg_graph_t *g, dg_op_kind_t kind, const char *name, int n_src,
                           dg_node_t *const *src, int n_upd, dg_node_t *const *upd, const int64_t *attr,
                           int n_attr) {
    if (g->err) return NULL;
    const dg_op_def_t *def = dg_op_def(kind);
    DG_ASSERT(def->grad_kind != DG_GRAD_STRUCTURAL);
    DG_ASSERT(n_src <= DG_MAX_SRC && n_upd <= DG_MAX_UPD && n_attr <= DG_MAX_ATTR);
    if (n_src < def->min_src || n_src > def->max_src) {
        g->err = DG_ERR(DG_ERR_USAGE, "graph: op %s '%s' takes %d..%d inputs, got %d", def->name, name,
                        def->min_src, def->max_src, n_src);
        return NULL;
    }
    for (int i = 0; i < n_src; i++) {
        if (!src[i]) {
            g->err = DG_ERR(DG_ERR_USAGE, "graph: op %s '%s': input %d is missing", def->name, name, i);
            return NULL;
        }
        /* a side output is written by its producer: it exists once the producer is in the graph */
        DG_ASSERT(src[i]->id < g->n && g->nodes[src[i]->id] == src[i]);
    }
    for (int i = 0; i < n_upd; i++) {
        /* persistent state, or an arena buffer written earlier (an unsharded gradient being summed) */
        if (!upd[i] || dg_node_root(upd[i])->storage == DG_STORE_NONE) {
            g->err = DG_ERR(DG_ERR_USAGE, "graph: op %s '%s': in-place update %d has no storage", def->name,
                            name, i);
            return NULL;
        }
    }
    dg_node_t *n = node_new(name, kind, g->cur_phase);
    n->storage = DG_STORE_ARENA;
    n->n_src = n_src;
    for (int i = 0; i < n_src; i++)
        n->src[i] = src[i];
    n->n_upd = n_upd;
    for (int i = 0; i < n_upd; i++)
        n->upd[i] = upd[i];
    for (int i = 0; i < n_attr; i++)
        n->attr[i] = attr[i];
    dg_status_t st = def->shape(g, n);
    if (st != DG_OK) {
        for (int k = 0; k < n->n_side; k++)
            free(n->side[k]);
        free(n);
        g->err = st;
        return NULL;
    }
    if (n->storage != DG_STORE_NONE) {
        int64_t shape[DG_MAX_DIMS];
        for (int d = 0; d < n->ndim; d++)
            shape[d] = n->shape[d];
        node_set_shape(n, n->dtype, n->ndim, shape);
    } else {
        n->ndim = 0;
        n->nbytes = 0;
    }
    graph_append(g, n);
    for (int k = 0; k < n->n_side; k++)
        graph_append(g, n->side[k]);
    return n;
}

void dg_graph_phase_range(const dg_graph_t *g, dg_phase_t phase, int *first, int *end) {
    int f = -1, e = -1;
    for (int i = 0; i < g->n; i++) {
        if (g->nodes[i]->op == DG_OP_LEAF || g->nodes[i]->phase != phase) continue;
        if (f < 0) f = i;
        e = i + 1;
    }
    if (f < 0) f = e = 0;
    *first = f;
    *end = e;
}

#define VERIFY_FAIL(n, ...)                                                                                  \
    DG_ERR(DG_ERR_RUNTIME, "graph verify: node #%d '%s' (%s): %s", (n)->id, (n)->name, dg_op_name((n)->op),  \
           (dg_fmt(msg, sizeof msg, __VA_ARGS__), msg))

dg_status_t dg_graph_verify(const dg_graph_t *g) {
    char msg[256];
    int seen_phase_end[DG_PHASE_COUNT] = {0};
    int last_phase = -1;
    for (int i = 0; i < g->n; i++) {
        const dg_node_t *n = g->nodes[i];
        if (n->id != i) return VERIFY_FAIL(n, "id %d does not match position %d", n->id, i);
        if (n->op != DG_OP_LEAF && (int)n->phase != last_phase) { /* leaves belong to no phase */
            if (last_phase >= 0) seen_phase_end[last_phase] = 1;
            if (seen_phase_end[n->phase])
                return VERIFY_FAIL(n, "phase %s is not contiguous in the schedule", dg_phase_name(n->phase));
            last_phase = (int)n->phase;
        }
        for (int k = 0; k < n->n_src; k++) {
            const dg_node_t *s = n->src[k];
            if (!s || s->id >= i || g->nodes[s->id] != s)
                return VERIFY_FAIL(n, "input %d is not an earlier node (topological order broken)", k);
        }
        for (int k = 0; k < n->n_upd; k++) {
            const dg_node_t *r = dg_node_root_c(n->upd[k]);
            if (r->storage == DG_STORE_NONE || (r->storage == DG_STORE_ARENA && r->id >= i))
                return VERIFY_FAIL(n, "in-place update %d is neither persistent nor an earlier arena tensor",
                                   k);
        }
        for (int k = 0; k < n->n_side; k++) {
            const dg_node_t *s = n->side[k];
            if (s->id != i + 1 + k || s->op != DG_OP_SIDE || s->src[0] != n)
                return VERIFY_FAIL(n, "side output %d does not follow its producer", k);
        }
        if (n->op == DG_OP_SIDE) {
            const dg_node_t *p = n->src[0];
            if (p->id + 1 + n->attr[DG_A_SIDE_IDX] != i)
                return VERIFY_FAIL(n, "side output separated from producer");
        }
        /* a value produced on another stream may only be read after an explicit wait on it (or on a
         * later op of that stream) */
        for (int k = 0; k < n->n_src; k++) {
            const dg_node_t *s = n->src[k];
            if (s->op == DG_OP_SIDE) s = s->src[0];
            if (s->op == DG_OP_LEAF || s->stream == n->stream) continue;
            int ok = 0;
            for (int w = 0; w < n->n_wait; w++)
                if (n->wait[w]->stream == s->stream && n->wait[w]->id >= s->id) ok = 1;
            if (!ok)
                return VERIFY_FAIL(n, "reads '%s' from stream %d without a wait edge", s->name, s->stream);
        }
        for (int k = 0; k < n->n_wait; k++) {
            const dg_node_t *w = n->wait[k];
            if (!w || w->id >= i || g->nodes[w->id] != w)
                return VERIFY_FAIL(n, "wait edge %d does not point to an earlier node", k);
            if (w->stream == n->stream) return VERIFY_FAIL(n, "wait edge %d on the same stream", k);
        }
        if (n->view_src) {
            const dg_node_t *r = dg_node_root_c(n);
            if (r->storage == DG_STORE_ARENA && r->id >= i)
                return VERIFY_FAIL(n, "aliases a later node's storage");
            if (n->view_offs + n->nbytes > dg_node_root_c(n)->nbytes)
                return VERIFY_FAIL(n, "view (%zu bytes at %zu) exceeds its storage (%zu bytes)", n->nbytes,
                                   n->view_offs, r->nbytes);
        }
        /* an asynchronous collective must be waited for inside its own phase: its buffers live until
         * the wait, and the next phase must not start with it in flight */
        if (n->stream == DG_STREAM_COMM && n->op != DG_OP_LEAF && n->op != DG_OP_SIDE) {
            int waited = 0;
            for (int j = i + 1; j < g->n && !waited && g->nodes[j]->phase == n->phase; j++)
                for (int w = 0; w < g->nodes[j]->n_wait; w++)
                    if (g->nodes[j]->wait[w] == n) waited = 1;
            if (!waited)
                return VERIFY_FAIL(n, "comm-stream op is never waited for in phase %s",
                                   dg_phase_name(n->phase));
        }
        if (n->op == DG_OP_LEAF && n->storage != DG_STORE_PERSISTENT)
            return VERIFY_FAIL(n, "leaf without persistent storage");
        if (n->op != DG_OP_LEAF && n->op != DG_OP_SIDE && n->storage == DG_STORE_PERSISTENT)
            return VERIFY_FAIL(n, "op output marked persistent");
    }
    return DG_OK;
}

static void renumber(dg_graph_t *g) {
    for (int i = 0; i < g->n; i++)
        g->nodes[i]->id = i;
    g->generation++;
}

/* Takes n and its side outputs out of the node array (without freeing); returns how many. */
static int detach(dg_graph_t *g, dg_node_t *n) {
    int k = 1 + n->n_side, at = n->id;
    DG_ASSERT(g->nodes[at] == n);
    memmove(g->nodes + at, g->nodes + at + k, (size_t)(g->n - at - k) * sizeof *g->nodes);
    g->n -= k;
    return k;
}

void dg_graph_move(dg_graph_t *g, dg_node_t *n, int pos) {
    int k = detach(g, n);
    DG_ASSERT(pos >= 0 && pos <= g->n);
    memmove(g->nodes + pos + k, g->nodes + pos, (size_t)(g->n - pos) * sizeof *g->nodes);
    g->nodes[pos] = n;
    for (int s = 0; s < n->n_side; s++)
        g->nodes[pos + 1 + s] = n->side[s];
    g->n += k;
    renumber(g);
}

void dg_graph_replace_uses(dg_graph_t *g, dg_node_t *from, dg_node_t *to) {
    for (int i = 0; i < g->n; i++) {
        dg_node_t *x = g->nodes[i];
        if (x->op == DG_OP_SIDE) continue; /* a side output's src is its producer, not a use */
        for (int k = 0; k < x->n_src; k++)
            if (x->src[k] == from) x->src[k] = to;
        for (int k = 0; k < x->n_wait; k++)
            if (x->wait[k] == from) x->wait[k] = to;
        if (x->view_src == from) x->view_src = to;
    }
    g->generation++;
}

int dg_graph_n_consumers(const dg_graph_t *g, const dg_node_t *n) {
    int c = 0;
    for (int i = 0; i < g->n; i++) {
        const dg_node_t *x = g->nodes[i];
        if (x->op == DG_OP_SIDE) continue;
        for (int k = 0; k < x->n_src; k++)
            c += x->src[k] == n;
    }
    return c;
}

void dg_graph_remove(dg_graph_t *g, dg_node_t *n) {
    detach(g, n);
    for (int i = 0; i < g->n; i++) {
        const dg_node_t *x = g->nodes[i];
        for (int k = 0; k < x->n_src; k++)
            for (int s = -1; s < n->n_side; s++)
                DG_ASSERTF(x->src[k] != (s < 0 ? n : n->side[s]), "removing '%s' still read by '%s'", n->name,
                           x->name);
        DG_ASSERTF(x->view_src != n, "removing '%s' still aliased by '%s'", n->name, x->name);
    }
    for (int s = 0; s < n->n_side; s++)
        free(n->side[s]);
    free(n);
    renumber(g);
}

dg_status_t dg_graph_run_passes(dg_graph_t *g, const dg_pass_t *passes, int n) {
    for (int i = 0; i < n; i++) {
        dg_status_t st = passes[i].fn(g, passes[i].ctx);
        if (st == DG_OK && g->err) st = g->err;
        if (st != DG_OK) return st;
        g->generation++;
        st = dg_graph_verify(g);
        if (st != DG_OK) return dg_err_prefix(st, "after pass '%s'", passes[i].name);
    }
    return DG_OK;
}

dg_status_t dg_graph_alloc_persistent(dg_graph_t *g, dg_backend_t *be, dg_alloc_list_t *list) {
    for (int i = 0; i < g->n; i++) {
        dg_node_t *n = g->nodes[i];
        if (n->storage != DG_STORE_PERSISTENT || n->view_src || n->data) continue;
        void *p = NULL;
        DG_TRY(be->ops->alloc(be, n->nbytes ? n->nbytes : 1, &p));
        n->data = p;
        if (list->n == list->cap) {
            list->cap = list->cap ? 2 * list->cap : 32;
            void **np = realloc(list->ptrs, (size_t)list->cap * sizeof *np);
            DG_ASSERT(np != NULL);
            list->ptrs = np;
        }
        list->ptrs[list->n++] = p;
        DG_TRY(be->ops->memset0(be, p, n->nbytes ? n->nbytes : 1));
    }
    return DG_OK;
}

void dg_graph_free_persistent(dg_backend_t *be, dg_alloc_list_t *list) {
    for (int i = 0; i < list->n; i++)
        be->ops->free(be, list->ptrs[i]);
    free(list->ptrs);
    memset(list, 0, sizeof *list);
}

/* ---------------- printing ---------------- */

static const char *placement(const dg_node_t *n, const dg_memplan_t *plan, char *buf, size_t cap) {
    if (n->storage == DG_STORE_NONE) {
        dg_fmt(buf, cap, "-");
        return buf;
    }
    const dg_node_t *r = dg_node_root_c(n);
    if (r->storage == DG_STORE_PERSISTENT) {
        const char *what = (r->flags & DG_NF_PARAM)      ? "param"
                           : (r->flags & DG_NF_GRAD)     ? "grad"
                           : (r->flags & DG_NF_OPTSTATE) ? "optstate"
                           : (r->flags & DG_NF_MASTER)   ? "master"
                           : (r->flags & DG_NF_SCALAR)   ? "scalar"
                           : (r->flags & DG_NF_INPUT)    ? "input"
                           : (r->flags & DG_NF_FLAT)     ? "flat"
                                                         : "persistent";
        if (r != n)
            dg_fmt(buf, cap, "%s(#%d)", what, r->id);
        else
            dg_fmt(buf, cap, "%s", what);
        return buf;
    }
    if (plan && plan->offset[r->id] != SIZE_MAX) {
        size_t off = plan->offset[r->id];
        for (const dg_node_t *v = n; v->view_src; v = v->view_src)
            off += v->view_offs;
        if (r != n)
            dg_fmt(buf, cap, "arena@%zu(=#%d)", off, r->id);
        else
            dg_fmt(buf, cap, "arena@%zu", off);
    } else {
        if (r != n)
            dg_fmt(buf, cap, "arena(=#%d)", r->id);
        else
            dg_fmt(buf, cap, "arena");
    }
    return buf;
}

/* The tree's one JSON escaper (dg_json.h). */
static void json_str(FILE *out, const char *s) {
    dg_json_fputs(out, s);
}

void dg_graph_print(const dg_graph_t *g, const dg_memplan_t *plan, FILE *out, int json) {
    char shp[96], plc[96];
    if (json)
        fputs("[", out);
    else
        fprintf(out, "%5s %-4s %-4s %-18s %-36s %-16s %-5s %12s %-24s %s\n", "#", "ph", "strm", "op", "name",
                "shape", "dtype", "bytes", "place", "inputs");
    int first = 1;
    for (int i = 0; i < g->n; i++) {
        const dg_node_t *n = g->nodes[i];
        if (n->op == DG_OP_LEAF) continue; /* leaves are listed in the state summary, not the schedule */
        dg_node_shape_str(n, shp, sizeof shp);
        if (n->storage == DG_STORE_NONE) dg_fmt(shp, sizeof shp, "-");
        placement(n, plan, plc, sizeof plc);
        const char *dt = n->storage == DG_STORE_NONE ? "-" : dg_dtype_name(n->dtype);
        if (json) {
            fprintf(out, "%s\n {\"id\":%d,\"phase\":\"%s\",\"stream\":%d,\"op\":\"%s\",\"name\":",
                    first ? "" : ",", n->id, dg_phase_name(n->phase), n->stream, dg_op_name(n->op));
            json_str(out, n->name);
            fprintf(out, ",\"shape\":[");
            for (int d = 0; d < n->ndim && n->storage != DG_STORE_NONE; d++)
                fprintf(out, "%s%" PRId64, d ? "," : "", n->shape[d]);
            fprintf(out, "],\"dtype\":\"%s\",\"bytes\":%zu,\"place\":", dt, n->nbytes);
            json_str(out, plc);
            fprintf(out, ",\"inputs\":[");
            for (int k = 0; k < n->n_src; k++)
                fprintf(out, "%s%d", k ? "," : "", n->src[k]->id);
            fprintf(out, "],\"updates\":[");
            for (int k = 0; k < n->n_upd; k++)
                fprintf(out, "%s%d", k ? "," : "", n->upd[k]->id);
            fprintf(out, "],\"waits\":[");
            for (int k = 0; k < n->n_wait; k++)
                fprintf(out, "%s%d", k ? "," : "", n->wait[k]->id);
            fprintf(out, "]");
            if (dg_op_def(n->op)->is_collective)
                fprintf(out, ",\"mesh_dim\":\"%s\"", dg_mesh_dim_name((int)n->attr[DG_A_MESHDIM]));
            if (n->op == DG_OP_CAST)
                fprintf(out, ",\"to\":\"%s\",\"acc\":%d", dg_dtype_name((dg_dtype_t)n->attr[DG_A_DTYPE]),
                        (int)n->attr[DG_A_ACC]);
            if (n->op == DG_OP_ADAMW_ALL || n->op == DG_OP_SUMSQ_ALL) /* tensors covered by the one call */
                fprintf(out, ",\"segments\":%d", (int)n->attr[DG_A_NSEG]);
            fprintf(out, "}");
            first = 0;
            continue;
        }
        fprintf(out, "%5d %-4s %-4s %-18s %-36s %-16s %-5s %12zu %-24s", n->id, dg_phase_name(n->phase),
                n->stream == DG_STREAM_COMM ? "comm" : "comp", dg_op_name(n->op), n->name, shp, dt, n->nbytes,
                plc);
        for (int k = 0; k < n->n_src; k++)
            fprintf(out, "%s#%d", k ? "," : "", n->src[k]->id);
        for (int k = 0; k < n->n_upd; k++)
            fprintf(out, "%s+=#%d", (k || n->n_src) ? "," : "", n->upd[k]->id);
        if (dg_op_def(n->op)->is_collective)
            fprintf(out, " over %s", dg_mesh_dim_name((int)n->attr[DG_A_MESHDIM]));
        if (n->op == DG_OP_CAST) /* into a tensor of its own, over upd[0], or (acc) added to it */
            fprintf(out, " %s %s", n->attr[DG_A_ACC] ? "add as" : "to",
                    dg_dtype_name((dg_dtype_t)n->attr[DG_A_DTYPE]));
        if (n->op == DG_OP_ADAMW_ALL || n->op == DG_OP_SUMSQ_ALL)
            fprintf(out, " over %d tensors", (int)n->attr[DG_A_NSEG]);
        for (int k = 0; k < n->n_wait; k++)
            fprintf(out, " wait#%d", n->wait[k]->id);
        fputc('\n', out);
    }
    if (json) fputs("\n]", out);
}
