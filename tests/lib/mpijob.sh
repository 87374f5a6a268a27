# tests/lib/mpijob.sh — the shell tests that run dgtrain's ranks under mpiexec in the background and
# provoke faults in them (sourced after tests/slurm/lib.sh, whose fail, le and elapsed it uses).
# shellcheck shell=bash
#
# JOB is the launcher's pid while a job runs; STOPPED lists the pids a test has sent SIGSTOP.
#   rank_pid RANK      the pid of that rank among the launcher's children (OMPI_COMM_WORLD_RANK)
#   wait_job LIMIT     waits for JOB: sets RC and DT (seconds since T0); fails past LIMIT seconds
#   kill_jobs          kills JOB and every STOPPED pid (SIGKILL, then SIGCONT so that it can die)
#   stop_rank1         SIGSTOPs rank 1 of a 2-rank JOB (noting both ranks' shared memory, record_shm, and
#                      adding it to STOPPED) and starts the clock T0; fails when rank 1 is not found
#   expect_job WANT LIMIT OUT WHAT
#                      wait_job LIMIT, then RC must be WANT; otherwise fails "WHAT: exit RC, expected WANT"
#                      and prints the job's output OUT (its last 40 lines); returns 1 on either failure
#   job_workdir NAME   WORK=$(mktemp -d /tmp/dgt-NAME-XXXXXX), and on exit: kill_jobs, clean_shm (the
#                      MPI shared memory, tests/slurm/lib.sh), WORK removed
JOB=
rank_pid() {
    local p
    for p in $(pgrep -P "$JOB"); do
        if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$1"; then
            echo "$p"
            return 0
        fi
    done
    return 1
}
wait_job() {
    while kill -0 "$JOB" 2>/dev/null; do
        le "$(elapsed "$T0")" "$1" || {
            fail "job still running $(elapsed "$T0") s after the fault (limit $1 s)"
            return 1
        }
        sleep 0.1
    done
    wait "$JOB"
    RC=$?
    DT=$(elapsed "$T0")
    JOB=
}
kill_jobs() {
    [ -n "$JOB" ] && kill -KILL "$JOB" 2>/dev/null
    local p
    for p in ${STOPPED:-}; do
        kill -KILL "$p" 2>/dev/null
        kill -CONT "$p" 2>/dev/null
    done
}
expect_job() {
    wait_job "$2" || return 1
    [ "$RC" = "$1" ] || {
        fail "$4: exit $RC, expected $1; its output:"
        tail -n 40 "$3"
        return 1
    }
}
job_workdir() {
    WORK=$(mktemp -d "/tmp/dgt-$1-XXXXXX")
    trap 'kill_jobs; sleep 0.5; clean_shm; rm -rf "$WORK"' EXIT
}
stop_rank1() {
    local pid
    pid=$(rank_pid 1) || {
        fail "cannot find rank 1's pid"
        return 1
    }
    record_shm "$(rank_pid 0)" "$pid"
    kill -STOP "$pid"
    STOPPED="${STOPPED:-} $pid"
    T0=$(now)
}
