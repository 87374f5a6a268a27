/* validate.c — the suite driver: reads the SLA file (rank 0 reads, everyone parses the same bytes),
 * applies overrides, sets up the run directory, logging, topology and the per-rank node types, runs
 * the check groups in a fixed order, and has rank 0 print the table and write the reports. The
 * reports are rewritten after every group, so a job killed half-way still leaves what it measured.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "validate_impl.h"

static int utc_stamp(char *buf, size_t cap, const char *fmt) {
    time_t t = time(NULL);
    struct tm tm;
    gmtime_r(&t, &tm);
    return (int)strftime(buf, cap, fmt, &tm);
}

/* Rank 0 reads the file, every rank parses the broadcast text: one read of a shared file, identical
 * parse results everywhere. */
static dg_status_t load_sla(dg_boot_t *b, const char *path, dg_sla_t **out) {
    *out = NULL;
    char *text = NULL;
    size_t len = 0;
    dg_status_t s = DG_OK;
    if (b->world_rank == 0) s = dg_validate_read_file(path, &text, &len, 1 << 20);
    long long hdr[2] = {s, (long long)len};
    DG_MPI_CHECK(MPI_Bcast(hdr, 2, MPI_LONG_LONG, 0, b->world));
    if (hdr[0] != DG_OK) {
        /* the other ranks carry rank 0's message so that everybody returns the same thing */
        char msg[1024] = {0};
        if (b->world_rank == 0) snprintf(msg, sizeof msg, "%s", dg_last_error());
        DG_MPI_CHECK(MPI_Bcast(msg, sizeof msg, MPI_CHAR, 0, b->world));
        free(text);
        return DG_ERR((dg_status_t)hdr[0], "%s", msg);
    }
    if (b->world_rank != 0) text = dg_xmalloc((size_t)hdr[1] + 1);
    DG_MPI_CHECK(MPI_Bcast(text, (int)hdr[1], MPI_CHAR, 0, b->world));
    text[hdr[1]] = 0;
    s = dg_sla_parse(path, text, (size_t)hdr[1], out);
    free(text);
    return s;
}

static void print_error(dg_boot_t *b, dg_status_t code) {
    if (b->world_rank == 0 && code != DG_OK) {
        fprintf(stderr, "dgvalidate: error: %s\n", dg_last_error());
        fflush(stderr);
    }
}

/* Every rank agrees on `local`; rank 0 prints the first failing rank's message once. */
static dg_status_t agree_print(vctx_t *c, dg_status_t local) {
    char msg[2048];
    dg_status_t s = vc_agree(c, local, msg, sizeof msg);
    if (s != DG_OK && c->rank == 0) {
        fprintf(stderr, "dgvalidate: error: %s\n", msg);
        fflush(stderr);
    }
    return s;
}

static dg_status_t setup_ctx(vctx_t *c) {
    dg_boot_t *b = c->b;
    c->rank = b->world_rank;
    c->size = b->world_size;
    c->type_of_rank = dg_xcalloc((size_t)c->size, sizeof(int));
    for (int r = 0; r < c->size; r++)
        c->type_of_rank[r] = dg_sla_node_type(c->sla, b->hosts[r]);
    c->leader_of_node = dg_xcalloc((size_t)b->n_nodes, sizeof(int));
    for (int r = 0; r < c->size; r++)
        if (b->local_ranks[r] == 0) c->leader_of_node[b->node_ids[r]] = r;
    DG_MPI_CHECK(
        MPI_Comm_split(b->world, b->local_rank == 0 ? 0 : MPI_UNDEFINED, b->world_rank, &c->leaders));
    if (c->leaders != MPI_COMM_NULL) DG_MPI_CHECK(MPI_Comm_set_errhandler(c->leaders, MPI_ERRORS_RETURN));
    return DG_OK;
}

void vc_write_reports(vctx_t *c) {
    if (!c->rep) return;
    char p[1200];
    snprintf(p, sizeof p, "%s/validation.json", c->run_dir);
    if (dg_vreport_write_json(c->rep, p) != DG_OK) DG_LOG_ERROR("%s", dg_last_error());
    snprintf(p, sizeof p, "%s/validation-junit.xml", c->run_dir);
    if (dg_vreport_write_junit(c->rep, p) != DG_OK) DG_LOG_ERROR("%s", dg_last_error());
}

typedef dg_status_t (*group_fn)(vctx_t *);

static int run_suite(vctx_t *c, double t0) {
    static const struct {
        const char *name;
        group_fn fn;
    } groups[] = {{"topology", vc_check_topology}, {"health", vc_check_health},   {"comm", vc_check_comm},
                  {"compute", vc_check_compute},   {"storage", vc_check_storage}, {"train", vc_check_train}};
    for (size_t g = 0; g < sizeof groups / sizeof *groups; g++) {
        if (!vc_selected(c, groups[g].name)) continue;
        if (c->rank == 0) DG_LOG_INFO("running the %s checks", groups[g].name);
        dg_status_t s = groups[g].fn(c);
        if (c->rep) c->rep->seconds = dg_now_s() - t0;
        if (s != DG_OK) {
            /* a harness failure that leaves the ranks unable to continue together (an MPI error) */
            if (c->rep) {
                c->rep->aborted_exit = s == DG_ERR_PEER ? DG_ERR_PEER : DG_ERR_RUNTIME;
                snprintf(c->rep->aborted_msg, sizeof c->rep->aborted_msg, "the %s checks could not run: %s",
                         groups[g].name, dg_last_error());
            }
            vc_write_reports(c);
            return s == DG_ERR_PEER ? DG_ERR_PEER : DG_ERR_RUNTIME;
        }
        vc_write_reports(c);
    }
    return 0;
}

int dg_validate_run(dg_boot_t *b, const dg_validate_opts_t *o) {
    double t0 = dg_now_s();
    vctx_t ctx;
    memset(&ctx, 0, sizeof ctx);
    vctx_t *c = &ctx;
    c->b = b;
    c->rank = b->world_rank;
    c->size = b->world_size;
    c->leaders = MPI_COMM_NULL;
    dg_config_t *cfg = dg_xcalloc(1, sizeof *cfg);
    dg_vreport_t rep;
    dg_vreport_init(&rep);
    int code = 0;

    /* ---- the SLA file and overrides (bad input: exit 1) ---- */
    dg_status_t s = DG_OK;
    if (!o->sla_path || !*o->sla_path)
        s = DG_ERR(DG_ERR_USAGE, "no SLA file given (usage: dgvalidate SLA.ini)");
    if (s == DG_OK) s = load_sla(b, o->sla_path, &c->sla);
    const char **cfg_sets = dg_xcalloc((size_t)o->nsets + 2, sizeof *cfg_sets);
    int n_cfg_sets = 0;
    for (int i = 0; s == DG_OK && i < o->nsets; i++) {
        if (strncmp(o->sets[i], "validate.", 9) == 0)
            s = dg_sla_set(c->sla, o->sets[i]);
        else
            cfg_sets[n_cfg_sets++] = o->sets[i];
    }
    char xml_set[DG_CFG_STR + 32];
    if (s == DG_OK && o->topology_xml && *o->topology_xml) {
        snprintf(xml_set, sizeof xml_set, "topology.xml=%s", o->topology_xml);
        cfg_sets[n_cfg_sets++] = xml_set;
    }
    if (s == DG_OK) s = dg_config_load(cfg, NULL, n_cfg_sets, cfg_sets);
    if (s == DG_OK) {
        c->set = dg_sla_settings(c->sla);
        const char *sel = o->checks && *o->checks ? o->checks : c->set->checks;
        if (o->checks && *o->checks) {
            /* the command line's list is checked like the file's */
            char kv[600];
            snprintf(kv, sizeof kv, "validate.checks=%s", o->checks);
            s = dg_sla_set(c->sla, kv);
        }
        snprintf(c->checks, sizeof c->checks, "%s", sel);
    }
    free(cfg_sets);
    /* every rank parsed the same bytes, so the outcome is the same everywhere: no agreement needed */
    if (s != DG_OK) {
        print_error(b, s);
        code = s == DG_ERR_USAGE ? DG_ERR_USAGE : DG_ERR_RUNTIME;
        goto out;
    }
    /* a relative train_config is relative to the SLA file, which usually sits beside it */
    if (c->set->train_config[0] && c->set->train_config[0] != '/' && strchr(o->sla_path, '/')) {
        char kv[2300];
        snprintf(kv, sizeof kv, "validate.train_config=%.*s/%.1000s",
                 (int)(strrchr(o->sla_path, '/') - o->sla_path), o->sla_path, c->set->train_config);
        if (dg_sla_set(c->sla, kv) != DG_OK) {
            print_error(b, DG_ERR_USAGE);
            code = DG_ERR_USAGE;
            goto out;
        }
    }
    if (vc_selected(c, "train") && c->set->train_config[0]) {
        /* a broken base config is bad input: say so now, not after the other checks ran */
        dg_config_t *tc = dg_xcalloc(1, sizeof *tc);
        s = dg_config_load(tc, c->set->train_config, 0, NULL);
        free(tc);
        if (s != DG_OK) {
            char m[1500];
            snprintf(m, sizeof m, "%s", dg_last_error());
            s = DG_ERR(DG_ERR_USAGE, "validate.train_config: %s", m);
            print_error(b, s);
            code = DG_ERR_USAGE;
            goto out;
        }
    }
    c->timeout_s = c->set->comm_timeout_s;
    b->agree_timeout_s = c->set->comm_timeout_s;

    /* ---- run directory and logs ---- */
    char stamp[32] = {0};
    if (c->rank == 0) {
        if (o->run_dir && *o->run_dir)
            snprintf(c->run_dir, sizeof c->run_dir, "%s", o->run_dir);
        else {
            utc_stamp(stamp, sizeof stamp, "%Y%m%d-%H%M%S");
            snprintf(c->run_dir, sizeof c->run_dir, "runs/validate-%s", stamp);
        }
    }
    if (MPI_Bcast(c->run_dir, sizeof c->run_dir, MPI_CHAR, 0, b->world) != MPI_SUCCESS) {
        code = DG_ERR_RUNTIME;
        goto out;
    }
    char logdir[1100];
    snprintf(logdir, sizeof logdir, "%.1000s/logs", c->run_dir);
    s = c->rank == 0 ? dg_mkdir_p(logdir) : DG_OK;
    s = agree_print(c, s);
    if (s == DG_OK) s = agree_print(c, dg_log_init(c->rank, b->host, DG_LOG_INFO, logdir));
    if (s != DG_OK) {
        code = s == DG_ERR_USAGE ? DG_ERR_USAGE : DG_ERR_RUNTIME;
        goto out;
    }

    /* ---- topology and binding, as dgtrain does it ---- */
    s = dg_boot_agree(b, dg_boot_topology(b, cfg));
    if (s != DG_OK) {
        code = s; /* dg_boot_agree printed it */
        goto out;
    }
    c->cfg = cfg;
    if (setup_ctx(c) != DG_OK) {
        print_error(b, DG_ERR_RUNTIME);
        code = DG_ERR_RUNTIME;
        goto out;
    }

    if (c->rank == 0) {
        c->rep = &rep;
        snprintf(rep.sla, sizeof rep.sla, "%.1000s", o->sla_path);
        snprintf(rep.run_dir, sizeof rep.run_dir, "%.1000s", c->run_dir);
        utc_stamp(rep.started, sizeof rep.started, "%Y-%m-%dT%H:%M:%SZ");
        rep.world_size = c->size;
        rep.n_nodes = b->n_nodes;
        size_t off = 0;
        for (int n = 0; n < b->n_nodes && off + 1 < sizeof rep.hosts; n++) {
            int w = snprintf(rep.hosts + off, sizeof rep.hosts - off, "%s%s", n ? " " : "",
                             b->hosts[c->leader_of_node[n]]);
            if (w < 0) break;
            off += (size_t)w;
        }
        printf("dgvalidate %s: %d rank%s on %d node%s; SLA %s; run dir %s\n", DG_VERSION_STRING, c->size,
               c->size == 1 ? "" : "s", b->n_nodes, b->n_nodes == 1 ? "" : "s", o->sla_path, c->run_dir);
        for (int n = 0; n < b->n_nodes; n++) {
            int lead = c->leader_of_node[n];
            int ranks = 0;
            for (int r = 0; r < c->size; r++)
                ranks += b->node_ids[r] == n;
            printf("  node %d: %s, %d rank%s, node type '%s'\n", n, b->hosts[lead], ranks,
                   ranks == 1 ? "" : "s", dg_sla_type_name(c->sla, c->type_of_rank[lead]));
        }
        printf("  checks: %s\n\n", c->checks);
        fflush(stdout);
    }

    code = run_suite(c, t0);
    if (c->rep) {
        rep.complete = code == 0;
        rep.seconds = dg_now_s() - t0;
        dg_vreport_print_table(&rep, stdout);
        vc_write_reports(c);
        printf("reports: %s/validation.json, %s/validation-junit.xml\n", c->run_dir, c->run_dir);
        fflush(stdout);
        if (code == 0) code = dg_vreport_exit_code(&rep);
    }
    /* rank 0 decides from the report; everybody leaves with its code */
    if (MPI_Bcast(&code, 1, MPI_INT, 0, b->world) != MPI_SUCCESS) code = DG_ERR_RUNTIME;

out:
    if (c->leaders != MPI_COMM_NULL) MPI_Comm_free(&c->leaders);
    free(c->type_of_rank);
    free(c->leader_of_node);
    dg_sla_free(c->sla);
    dg_vreport_destroy(&rep);
    free(cfg);
    return code;
}
