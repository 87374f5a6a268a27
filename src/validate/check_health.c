/* check_health.c — the heartbeat path: round-trip latency between rank 0 and every other rank (the kind
 * of path health.h's tree heartbeats take between neighbours), measured one rank at a
 * time so the numbers are not polluted by each other, and a short run of the real heartbeat monitor
 * (dg_health_create ... dg_health_free) over the whole job, which proves that its thread starts and every
 * rank's heartbeats get through.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "health.h"
#include "validate_impl.h"

#define RTT_TAG 7301

/* Rank 0 pings rank r `reps` times (after a few warm-up rounds); returns the median RTT in seconds. */
static dg_status_t ping(vctx_t *c, int peer, int reps, double *median, double *worst) {
    MPI_Comm w = c->b->world;
    double *t = dg_xmalloc((size_t)reps * sizeof(double));
    char buf[16] = {0};
    dg_status_t s = DG_OK;
    for (int i = -5; i < reps && s == DG_OK; i++) {
        double a = dg_now_s();
        if (MPI_Send(buf, 16, MPI_CHAR, peer, RTT_TAG, w) != MPI_SUCCESS ||
            MPI_Recv(buf, 16, MPI_CHAR, peer, RTT_TAG, w, MPI_STATUS_IGNORE) != MPI_SUCCESS)
            s = DG_ERR(DG_ERR_RUNTIME, "MPI ping-pong with rank %d failed", peer);
        if (i >= 0) t[i] = dg_now_s() - a;
    }
    if (s == DG_OK) {
        *worst = 0;
        for (int i = 0; i < reps; i++)
            if (t[i] > *worst) *worst = t[i];
        *median = vc_median(t, reps);
    }
    free(t);
    return s;
}

static dg_status_t pong(vctx_t *c, int reps) {
    MPI_Comm w = c->b->world;
    char buf[16];
    /* the first ping may come much later (rank 0 serves the ranks in order): wait for it quietly */
    MPI_Request req;
    DG_MPI_CHECK(MPI_Irecv(buf, 16, MPI_CHAR, 0, RTT_TAG, w, &req));
    DG_TRY(vc_quiet_wait(c, &req, "health.rtt ping"));
    DG_MPI_CHECK(MPI_Send(buf, 16, MPI_CHAR, 0, RTT_TAG, w));
    for (int i = 1; i < reps + 5; i++) {
        DG_MPI_CHECK(MPI_Recv(buf, 16, MPI_CHAR, 0, RTT_TAG, w, MPI_STATUS_IGNORE));
        DG_MPI_CHECK(MPI_Send(buf, 16, MPI_CHAR, 0, RTT_TAG, w));
    }
    return DG_OK;
}

static dg_status_t check_rtt(vctx_t *c) {
    if (c->size == 1) {
        vc_skip(c, "health.rtt", "1 rank: there is no peer to exchange heartbeats with");
        return DG_OK;
    }
    double t0 = dg_now_s();
    int reps = c->set->rtt_reps;
    double *med = NULL, *mx = NULL;
    dg_status_t s = DG_OK;
    if (c->rank == 0) {
        med = dg_xcalloc((size_t)c->size, sizeof(double));
        mx = dg_xcalloc((size_t)c->size, sizeof(double));
        for (int r = 1; r < c->size && s == DG_OK; r++)
            s = ping(c, r, reps, &med[r], &mx[r]);
    } else {
        s = pong(c, reps);
    }
    if (s != DG_OK) return s; /* a broken point-to-point path: the suite cannot go on */
    DG_TRY(vc_quiet_barrier(c, c->b->world, "health.rtt"));
    if (c->rank == 0) {
        dg_vcheck_t *k = vc_add(c, "health.rtt");
        int worst = 1;
        for (int r = 2; r < c->size; r++)
            if (med[r] > med[worst]) worst = r;
        int *bad = dg_xmalloc((size_t)c->size * sizeof(int)), nbad = 0, nref = 0;
        const dg_sla_ref_t *shown = NULL;
        vbuf_t det = {0};
        vbuf_printf(&det, "{\"reps\": %d, \"ranks\": [", reps);
        for (int r = 1; r < c->size; r++) {
            const dg_sla_ref_t *ref = dg_sla_ref(c->sla, c->type_of_rank[r], "health.rtt");
            if (ref) {
                nref++;
                if (!shown) shown = ref;
                if (!dg_sla_ref_ok(ref, med[r])) bad[nbad++] = r;
            }
            vbuf_printf(&det, "%s{\"rank\": %d, \"host\": ", r > 1 ? ", " : "", r);
            vbuf_json_str(&det, c->b->hosts[r]);
            vbuf_printf(&det, ", \"median_s\": %.9g, \"max_s\": %.9g}", med[r], mx[r]);
        }
        vbuf_printf(&det, "]}");
        char v[32];
        vc_fmt_value(v, sizeof v, med[worst], DG_DIM_TIME);
        snprintf(k->measured, sizeof k->measured, "worst median %s (rank %d, %s) over %d rank%s", v, worst,
                 c->b->hosts[worst], c->size - 1, c->size == 2 ? "" : "s");
        k->has_value = 1;
        k->value = med[worst];
        snprintf(k->unit, sizeof k->unit, "s");
        if (shown) dg_sla_ref_format(shown, k->reference, sizeof k->reference);
        if (nbad) {
            char who[1024], lim[200];
            vc_fmt_ranks(c, bad, nbad, who, sizeof who);
            dg_sla_ref_format(dg_sla_ref(c->sla, c->type_of_rank[bad[0]], "health.rtt"), lim, sizeof lim);
            vc_fmt_value(v, sizeof v, med[bad[0]], DG_DIM_TIME);
            k->verdict = DG_VERDICT_FAIL;
            snprintf(k->message, sizeof k->message,
                     "heartbeat round trip to rank 0 too slow on %s (e.g. %s, want %s)", who, v, lim);
        } else if (!nref) {
            snprintf(k->message, sizeof k->message, "no reference ref.health.rtt in the SLA: measured only");
        }
        k->seconds = dg_now_s() - t0;
        dg_vcheck_set_details(k, det.s);
        vbuf_free(&det);
        free(bad);
    }
    free(med);
    free(mx);
    return DG_OK;
}

/* The real monitor for a few heartbeat periods. A rank whose heartbeats do not arrive makes the monitor
 * abort the job (exit 3) naming it, which is the verdict this check exists to surface. */
static dg_status_t check_monitor(vctx_t *c) {
    double t0 = dg_now_s();
    double hb = c->set->heartbeat_s, timeout = 10 * hb > 3 ? 10 * hb : 3;
    dg_health_t *h = NULL;
    dg_status_t s = dg_health_create(c->b->world, c->rank, c->b->host, hb, timeout, &h);
    char msg[2048];
    dg_status_t agreed = vc_agree(c, s, msg, sizeof msg);
    if (agreed != DG_OK) {
        /* some ranks may have a monitor: free it (collective) only where every rank has one */
        if (s == DG_OK) {
            DG_LOG_WARN("health.monitor: another rank could not start its monitor; leaking this one");
        }
        dg_vcheck_t *k = vc_add(c, "health.monitor");
        if (k) {
            k->verdict = DG_VERDICT_ERROR;
            snprintf(k->message, sizeof k->message, "the heartbeat monitor did not start: %.1900s", msg);
            k->seconds = dg_now_s() - t0;
        }
        return DG_OK;
    }
    /* four heartbeat periods of ordinary activity */
    double end = dg_now_s() + 4 * hb;
    while (dg_now_s() < end) {
        dg_health_set_activity(h, 0, "validate health.monitor");
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    dg_health_free(h);
    DG_TRY(vc_quiet_barrier(c, c->b->world, "health.monitor"));
    dg_vcheck_t *k = vc_add(c, "health.monitor");
    if (k) {
        snprintf(k->measured, sizeof k->measured, "%d rank%s, heartbeat %.2g s for %.2g s, no fault", c->size,
                 c->size == 1 ? "" : "s", hb, 4 * hb);
        snprintf(k->reference, sizeof k->reference, "no silent rank within %.3g s", timeout);
        k->seconds = dg_now_s() - t0;
    }
    return DG_OK;
}

dg_status_t vc_check_health(vctx_t *c) {
    if (vc_selected(c, "health.rtt")) DG_TRY(check_rtt(c));
    if (vc_selected(c, "health.monitor")) DG_TRY(check_monitor(c));
    return DG_OK;
}
