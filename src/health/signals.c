/* signals.c — SIGUSR1/SIGTERM/SIGINT become a "stop at the next step boundary" flag.
 *
 * Slurm (--signal=B:USR1@lead, preemption, scancel) and humans (Ctrl-C) ask a run to stop; a rank must
 * not die mid-step because its peers would hang and the work since the last checkpoint would be lost.
 * The handlers therefore only record the signal; the loop polls it through dg_health_agree_stop. Only
 * async-signal-safe calls (write, _exit) are made inside the handler.
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "health.h"

static volatile sig_atomic_t g_pending = 0;
static volatile sig_atomic_t g_sigints = 0;

static void say(const char *s) {
    ssize_t r = write(STDERR_FILENO, s, strlen(s));
    (void)r;
}

static void on_signal(int sig) {
    /* All three signals are blocked while any handler runs (sa_mask), so these updates cannot race. */
    if (sig == SIGINT) {
        if (g_sigints >= 1) {
            say("dgtrain: second interrupt (SIGINT): exiting now without a checkpoint (exit 130)\n");
            _exit(130);
        }
        g_sigints = 1;
        say("dgtrain: interrupt (SIGINT): will checkpoint and stop at the next step boundary; "
            "interrupt again to exit at once without a checkpoint\n");
    }
    if (g_pending == 0) g_pending = sig;
}

void dg_signals_install(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    sigaddset(&sa.sa_mask, SIGUSR1);
    sigaddset(&sa.sa_mask, SIGTERM);
    sigaddset(&sa.sa_mask, SIGINT);
    sigaction(SIGUSR1, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
}

int dg_signals_pending(void) {
    return (int)g_pending;
}

void dg_signals_clear(void) {
    g_pending = 0;
    g_sigints = 0;
}

const char *dg_signal_name(int sig) {
    static _Thread_local char buf[32];
    switch (sig) {
    case 0:
        return "none";
    case SIGUSR1:
        return "SIGUSR1";
    case SIGUSR2:
        return "SIGUSR2";
    case SIGTERM:
        return "SIGTERM";
    case SIGINT:
        return "SIGINT";
    case SIGHUP:
        return "SIGHUP";
    default:
        snprintf(buf, sizeof buf, "signal %d", sig);
        return buf;
    }
}
