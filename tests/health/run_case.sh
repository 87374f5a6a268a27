#!/bin/bash
# run_case.sh — one health scenario against health_driver under mpiexec: stop, kill, hang or signal a
# rank from outside and check how the whole job ends (exit code, time, message, every rank's log).
# Usage: run_case.sh CASE DRIVER MPIEXEC [MPIEXEC FLAGS...]
#   CASE: clean | sigstop | sigstop0 | hang | hanglate | probekill | sigkill | usr1 | term | sigint2 | badargs | probe | many
set -u
CASE=$1
DRIVER=$2
shift 2
MPI=("$@")
HB=0.2
TIMEOUT=3
SLACK=4 # "timeout_s plus a few seconds": launcher teardown on a loaded 2-core CI box

WORK=$(mktemp -d /tmp/dg-health-XXXXXX)
JOB=
# Open MPI's shared-memory segments outlive killed ranks: note them while the ranks run, and at the
# end remove those that no live process maps any more.
record_shm() {
    local f
    for f in "$WORK"/rank-*.pid; do
        [ -f "$f" ] && grep -o '/dev/shm/vader_segment[^ ]*' "/proc/$(cat "$f")/maps" 2>/dev/null
    done >>"$SHM_LIST"
}
SHM_LIST=$(mktemp /tmp/dg-health-shm-XXXXXX)
cleanup() {
    if [ -n "$JOB" ] && kill -0 "$JOB" 2>/dev/null; then kill -KILL "$JOB" 2>/dev/null; fi
    # A SIGSTOPped rank that outlived its launcher must not linger: continue and kill it by pid.
    for f in "$WORK"/rank-*.pid; do
        [ -f "$f" ] || continue
        p=$(cat "$f")
        if [ -n "$p" ] && kill -0 "$p" 2>/dev/null && grep -q health_driver "/proc/$p/cmdline" 2>/dev/null; then
            kill -KILL "$p" 2>/dev/null
            kill -CONT "$p" 2>/dev/null
        fi
    done
    rm -rf "$WORK"
    sleep 0.3
    sort -u "$SHM_LIST" | while read -r f; do
        [ -e "$f" ] && ! grep -qsF "$f" /proc/[0-9]*/maps && rm -f "$f"
    done
    rm -f "$SHM_LIST"
}
trap cleanup EXIT

fail() {
    echo "FAIL [$CASE]: $*"
    echo "----- job output -----"
    cat "$WORK/out" 2>/dev/null
    for f in "$WORK"/logs/rank-*.log; do [ -f "$f" ] && { echo "----- $f"; cat "$f"; }; done
    exit 1
}

source "$(dirname "$0")/../lib/clock.sh" # now, elapsed, le

# start NP ARGS... : launch the driver in the background
start() {
    local np=$1
    shift
    "${MPI[@]}" -n "$np" "$DRIVER" --dir "$WORK" --heartbeat "$HB" --timeout "$TIMEOUT" "$@" >"$WORK/out" 2>&1 &
    JOB=$!
}

# wait_step N: until rank 0 has finished step N (and every rank wrote its pid)
wait_step() {
    local n=$1 t0
    t0=$(now)
    while :; do
        if [ -f "$WORK/progress" ] && [ "$(cat "$WORK/progress" 2>/dev/null || echo -1)" -ge "$n" ] 2>/dev/null; then
            return 0
        fi
        kill -0 "$JOB" 2>/dev/null || fail "job ended before step $n"
        le "$(elapsed "$t0")" 60 || fail "no step $n after 60 s"
        sleep 0.05
    done
}

pid_of() { cat "$WORK/rank-$1.pid"; }

# finish MAXSECONDS: wait for the job; sets RC and DT (seconds since T0)
finish() {
    local max=$1
    while kill -0 "$JOB" 2>/dev/null; do
        if ! le "$(elapsed "$T0")" "$max"; then
            fail "job still running $(elapsed "$T0") s after the event (limit $max s)"
        fi
        sleep 0.05
    done
    wait "$JOB"
    RC=$?
    DT=$(elapsed "$T0")
    JOB=
}

# every live rank (all but $1) must say in its log that it took the job down or was told to exit 3
check_all_exit3() {
    local skip=$1 np=$2 r
    for ((r = 0; r < np; r++)); do
        [ "$r" = "$skip" ] && continue
        grep -qE "aborting the job with exit code 3|exiting with code 3" "$WORK/logs/rank-$r.log" 2>/dev/null ||
            fail "rank $r's log does not show it leaving with exit code 3"
    done
}

case "$CASE" in
clean)
    # Short heartbeat and timeout, a slow step (1.5 s, below the timeout) on one rank while the others
    # wait in the all-reduce, and a 4.5 s phase on every rank announced with dg_health_expect(8 s): no
    # false positive, clean collective shutdown.
    T0=$(now)
    start 3 --steps 40 --step-ms 50 --slow-rank 1 --slow-step 10 --slow-ms 1500 --long-step 20 --long-ms 4500 --expect 8
    finish 60
    [ "$RC" = 0 ] || fail "exit code $RC, expected 0"
    grep -qi watchdog "$WORK/out" && fail "watchdog fired on a healthy job"
    for r in 0 1 2; do grep -q "finished 40 steps" "$WORK/logs/rank-$r.log" || fail "rank $r did not finish"; done
    echo "PASS clean: 3 ranks, 40 steps incl. a 1.5 s slow step and a 4.5 s expected phase, heartbeat ${HB}s timeout ${TIMEOUT}s, exit 0 in ${DT}s"
    ;;
sigstop | sigstop0)
    if [ "$CASE" = sigstop ]; then NP=4; VICTIM=2; else NP=3; VICTIM=0; fi
    start "$NP" --steps 100000 --step-ms 40
    wait_step 5
    record_shm
    kill -STOP "$(pid_of $VICTIM)"
    T0=$(now)
    finish $((TIMEOUT + SLACK))
    [ "$RC" = 3 ] || fail "exit code $RC, expected 3"
    grep -qE "watchdog: (no heartbeat from|rank [0-9]+ has had no heartbeat from) rank $VICTIM \(host [^)]*\)|watchdog: rank $VICTIM \(host [^)]*\) has made no progress" "$WORK/out" ||
        fail "no watchdog line naming rank $VICTIM"
    grep -E "watchdog: " "$WORK/out" | grep -vq "rank $VICTIM" && fail "a watchdog line blames another rank"
    check_all_exit3 "$VICTIM" "$NP"
    if [ "$VICTIM" != 0 ]; then
        grep -q "\"kind\":\"watchdog\",\"culprit_rank\":$VICTIM" "$WORK/events.jsonl" 2>/dev/null ||
            fail "rank 0's event sink got no watchdog event naming rank $VICTIM"
    fi
    echo "PASS $CASE: SIGSTOP of rank $VICTIM of $NP -> exit 3 after ${DT}s (timeout ${TIMEOUT}s):"
    grep -m1 "watchdog: " "$WORK/out"
    ;;
hang)
    # The main thread of rank 1 hangs (test hook) while its health thread still heartbeats: the rank
    # itself, or a peer waiting for it, must name rank 1.
    export DG_TEST_STALL_RANK=1 DG_TEST_STALL_STEP=8
    T0=$(now)
    # 500 ms steps: rank 1 stalls in compute half a second before its peers wait in the all-reduce, more
    # than the watchdog's check interval (one heartbeat), so rank 1 is the first to see its own stall
    start 3 --steps 100000 --step-ms 500
    wait_step 2
    record_shm
    finish $((TIMEOUT + SLACK + 7)) # ~4 s to reach step 8, then the timeout
    unset DG_TEST_STALL_RANK DG_TEST_STALL_STEP
    [ "$RC" = 3 ] || fail "exit code $RC, expected 3"
    grep -qE "watchdog: rank 1 \(host [^)]*\) has made no progress for [0-9.]+ s in step 8 doing 'compute'" "$WORK/out" ||
        fail "no watchdog line naming rank 1 stalled in step 8 'compute'"
    check_all_exit3 -1 3
    echo "PASS hang: rank 1 hung at step 8 -> exit 3 after ${DT}s (incl. ~4 s to reach step 8):"
    grep -m1 "watchdog: " "$WORK/out"
    ;;
hanglate)
    # Rank 1 hangs in host code 600 ms after its peers began to wait for it in the all-reduce: its last
    # activity change is younger than theirs, so by the clock alone the waiters look stuck longer. The
    # waiters' "waiting in a collective" travels with the heartbeats: they must name rank 1, not
    # themselves (the race a loaded Slurm node showed in CI).
    T0=$(now)
    start 3 --steps 100000 --step-ms 40 --slow-rank 1 --slow-step 6 --slow-ms 600 --hang-after-slow 1
    finish $((TIMEOUT + SLACK + 3))
    [ "$RC" = 3 ] || fail "exit code $RC, expected 3"
    grep -qE "watchdog: rank 1 \(host [^)]*\) has made no progress for [0-9.]+ s in step 6 doing 'host code'" "$WORK/out" ||
        fail "no watchdog line naming rank 1 stuck in step 6 'host code'"
    grep -E "watchdog: rank [02] \(host [^)]*\) has made no progress" "$WORK/out" && fail "a waiting rank blamed itself"
    check_all_exit3 -1 3
    echo "PASS hanglate: rank 1 hung in host code after its peers waited -> exit 3 after ${DT}s naming rank 1:"
    grep -m1 "watchdog: " "$WORK/out"
    ;;
probekill)
    # Rank 1's health thread dies at step 4 (test hook DG_TEST_PROBE_KILL_*: no bye, no more heartbeats)
    # while its training thread runs on: its tree neighbours see the silence past the liveness timeout
    # and take the job down naming rank 1, exit 3, instead of training on without a watchdog for it.
    export DG_TEST_PROBE_KILL_RANK=1 DG_TEST_PROBE_KILL_STEP=4
    start 3 --steps 100000 --step-ms 40
    wait_step 4
    record_shm
    T0=$(now)
    finish $((TIMEOUT + SLACK))
    unset DG_TEST_PROBE_KILL_RANK DG_TEST_PROBE_KILL_STEP
    [ "$RC" = 3 ] || fail "exit code $RC, expected 3"
    grep -q "health thread exits at step" "$WORK/logs/rank-1.log" || fail "rank 1's probe was not killed"
    grep -qE "watchdog: no heartbeat from rank 1 \(host [^)]*\) for [0-9.]+ s" "$WORK/out" ||
        fail "no watchdog line naming rank 1's silence"
    check_all_exit3 1 3
    echo "PASS probekill: rank 1's probe thread died at step 4 -> exit 3 after ${DT}s:"
    grep -m1 "watchdog: no heartbeat" "$WORK/out"
    ;;
sigkill)
    # Several trials at random steps: the job must end everywhere within timeout + slack.
    for trial in 1 2 3; do
        rm -rf "${WORK:?}"/* 2>/dev/null
        VICTIM=$((RANDOM % 3))
        AT=$((2 + RANDOM % 8))
        start 3 --steps 100000 --step-ms 40
        wait_step "$AT"
        record_shm
        kill -KILL "$(pid_of $VICTIM)"
        T0=$(now)
        finish $((TIMEOUT + SLACK))
        [ "$RC" = 0 ] && fail "trial $trial: exit code 0 after a rank was killed"
        echo "PASS sigkill trial $trial: SIGKILL of rank $VICTIM after step $AT -> job ended (exit $RC) in ${DT}s"
    done
    ;;
usr1 | term)
    if [ "$CASE" = usr1 ]; then NP=3; VICTIM=2; SIG=USR1; else NP=2; VICTIM=0; SIG=TERM; fi
    start "$NP" --steps 100000 --step-ms 40 --ckpt-ms 300
    wait_step 4
    kill -"$SIG" "$(pid_of $VICTIM)"
    T0=$(now)
    finish 10
    [ "$RC" = 75 ] || fail "exit code $RC, expected 75"
    step=
    for ((r = 0; r < NP; r++)); do
        line=$(grep -E "stopping on SIG$SIG after step [0-9]+" "$WORK/logs/rank-$r.log") || fail "rank $r did not stop on SIG$SIG"
        s=$(echo "$line" | sed -E 's/.*after step ([0-9]+).*/\1/')
        [ -z "$step" ] && step=$s
        [ "$s" = "$step" ] || fail "ranks stopped at different steps ($step vs $s)"
    done
    grep -q "\"kind\":\"signal_stop\",\"signal\":\"SIG$SIG\"" "$WORK/events.jsonl" || fail "no signal_stop event"
    grep -qi watchdog "$WORK/out" && fail "watchdog fired during a signal stop"
    echo "PASS $CASE: SIG$SIG to rank $VICTIM of $NP -> all ranks stopped after step $step, exit 75 in ${DT}s"
    ;;
sigint2)
    # First SIGINT: stop at the boundary, then a 3 s checkpoint; the second SIGINT must not wait for it.
    start 2 --steps 100000 --step-ms 40 --ckpt-ms 3000
    wait_step 3
    kill -INT "$(pid_of 1)"
    # wait until the ranks are in the (simulated) checkpoint: the stop was agreed
    t1=$(now)
    until grep -q signal_stop "$WORK/events.jsonl" 2>/dev/null; do
        le "$(elapsed "$t1")" 5 || fail "no stop agreed 5 s after SIGINT"
        sleep 0.05
    done
    sleep 0.3
    P1=$(pid_of 1)
    kill -INT "$P1"
    T0=$(now)
    while kill -0 "$P1" 2>/dev/null && grep -q health_driver "/proc/$P1/cmdline" 2>/dev/null; do
        le "$(elapsed "$T0")" 1 || fail "rank 1 still alive 1 s after the second SIGINT"
        sleep 0.02
    done
    GONE=$(elapsed "$T0")
    # the launcher then tears the other rank down (SIGTERM is caught, so it takes its SIGKILL delay)
    finish 6
    [ "$RC" = 130 ] || fail "exit code $RC, expected 130"
    grep -q "dgtrain: second interrupt (SIGINT): exiting now without a checkpoint" "$WORK/out" || fail "no second-interrupt message"
    grep -q "stopping on SIGINT" "$WORK/logs/rank-1.log" && fail "rank 1 finished its checkpoint instead of exiting at once"
    echo "PASS sigint2: second SIGINT during the checkpoint -> rank 1 gone in ${GONE}s, job exit 130 in ${DT}s with:"
    grep -m1 "second interrupt" "$WORK/out"
    ;;
probe)
    # Adaptive probe period: 7 ranks (a 3-level tree) probing at 50/200/10 ms. Rank 1 (parent 0,
    # children 3 and 4) is SIGSTOPped for 2 s, below the liveness floor (4 s): its neighbours see a late
    # heartbeat -> one SLA Level-1 event (heartbeat_rtt) and 10 ms probes, then back to 200 ms after
    # three good probes; the job finishes (exit 0). Every rank sent at most (neighbours x probes + byes)
    # heartbeats: O(1) per period.
    NP=7
    start "$NP" --steps 80 --step-ms 40 --probe-ms 50,200,10 --floor 4 --timeout 8
    wait_step 10
    kill -STOP "$(pid_of 1)"
    sleep 2
    kill -CONT "$(pid_of 1)"
    T0=$(now)
    finish 60
    [ "$RC" = 0 ] || fail "exit code $RC, expected 0"
    grep -qi "watchdog" "$WORK/out" && fail "watchdog fired on a rank that was stopped below the floor"
    grep -q '"event":"sla","objective":"heartbeat_rtt","level":1,.*"action":"warn".*"peer_rank":1,"reason":"late heartbeat"' "$WORK/events.jsonl" ||
        fail "rank 0 raised no heartbeat_rtt SLA event for rank 1's late heartbeat"
    grep -q '"kind":"heartbeat_alert".*"period_ms":10.0' "$WORK/events.jsonl" || fail "no heartbeat_alert event at the 10 ms period"
    grep -q "heartbeat: late heartbeat from rank 1 .*probing every 10 ms" "$WORK/logs/rank-0.log" || fail "rank 0 did not log the late heartbeat"
    for ((r = 0; r < NP; r++)); do
        line=$(grep "health stats:" "$WORK/logs/rank-$r.log") || fail "rank $r logged no stats"
        read -r probes sent period nb < <(echo "$line" | sed -E 's/.*probes ([0-9]+) sent ([0-9]+) .*period_ms ([0-9.]+) neighbours ([0-9]+).*/\1 \2 \3 \4/')
        [ "$period" = 200.0 ] || fail "rank $r ends at a ${period} ms period, expected the steady 200 ms: $line"
        [ "$sent" -le $((nb * probes + nb)) ] || fail "rank $r sent $sent heartbeats in $probes periods to $nb neighbours: $line"
        [ "$probes" -gt 3 ] || fail "rank $r made only $probes probes: $line"
    done
    echo "PASS probe: 2 s SIGSTOP of rank 1 of $NP -> SLA heartbeat_rtt event, 10 ms probes, back to 200 ms, exit 0; rank 0: $(grep -o 'probes.*' "$WORK/logs/rank-0.log" | tail -1)"
    ;;
many)
    # Many ranks oversubscribed on few cores (tree of depth 6 at 40 ranks): SIGSTOP rank 13 (parent 6,
    # children 27 and 28) -> its tree neighbours name it, every live rank exits 3, the job exits 3.
    NP=${DG_HEALTH_MANY_NP:-40}
    VICTIM=13
    start "$NP" --steps 100000 --step-ms 100 --probe-ms 50,200,10 --floor 2 --timeout 20
    wait_step 3
    record_shm
    kill -STOP "$(pid_of $VICTIM)"
    T0=$(now)
    finish 15
    [ "$RC" = 3 ] || fail "exit code $RC, expected 3"
    grep -qE "watchdog: (no heartbeat from|rank [0-9]+ has had no heartbeat from) rank $VICTIM \(host [^)]*\)" "$WORK/out" ||
        fail "no watchdog line naming rank $VICTIM"
    grep -E "watchdog: " "$WORK/out" | grep -vq "rank $VICTIM" && fail "a watchdog line blames another rank"
    check_all_exit3 "$VICTIM" "$NP"
    grep -q "\"kind\":\"watchdog\",\"culprit_rank\":$VICTIM" "$WORK/events.jsonl" 2>/dev/null ||
        fail "rank 0's event sink got no watchdog event naming rank $VICTIM"
    echo "PASS many: SIGSTOP of rank $VICTIM of $NP -> exit 3 after ${DT}s:"
    grep -m1 "watchdog: " "$WORK/out"
    ;;
badargs)
    T0=$(now)
    start 2 --steps 3 --heartbeat 1 --timeout 2
    finish 20
    [ "$RC" = 1 ] || fail "exit code $RC, expected 1"
    grep -q "health.timeout_s (2) must be at least 3 x health.heartbeat_s (1)" "$WORK/out" || fail "no clear message"
    echo "PASS badargs: $(grep -m1 'health.timeout_s' "$WORK/out")"
    ;;
*)
    echo "run_case.sh: unknown case '$CASE'"
    exit 2
    ;;
esac
exit 0
