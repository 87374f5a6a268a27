#!/bin/bash
# test_harness.sh — slurm/train.sh on a real one-node Slurm cluster (tests/slurm/cluster.sh) with a
# stand-in for dgtrain (fake_dgtrain.sh running the health test driver: real MPI ranks, real health.h).
# Checks, against real sbatch/srun/scontrol:
#   badargs   train.sh refuses bad use with one line and launches nothing (also as a batch job)
#   requeue   USR1 to the batch step -> ranks checkpoint, exit 75 -> requeue -> resume -> finish;
#             a run.dir full of shell metacharacters is used literally
#   watchdog  a rank hangs -> watchdog exit 3 on every rank -> requeue -> resume -> finish
#   maxrest   DGT_MAX_RESTARTS=0: exit 75 is not requeued
#   resize    the requeued job is resized to 1 task while pending -> resumes with 1 rank
#   cancel    a plain scancel: dgtrain still checkpoints within KillWait, the job is NOT requeued, and
#             train.sh logged that decision when the SIGTERM came (before Slurm could SIGKILL it)
#   killrank  SIGKILL of one rank: srun ends the step (137) -> requeue -> finish
#   mpirun    the mpirun fallback launcher (DGT_LAUNCHER=mpirun): USR1 -> exit 75 -> requeue -> finish
# The job scenarios run side by side on the test node (it claims 16 CPUs).
# Usage: test_harness.sh HEALTH_DRIVER
set -u
SLURM_TEST_NAME=slurm_harness
source "$(dirname "$0")/lib.sh"
DRIVER=$(readlink -f "${1:?usage: test_harness.sh HEALTH_DRIVER}")
[ -x "$DRIVER" ] || {
    echo "FAIL: $DRIVER is not executable"
    exit 1
}
export FAKE_DRIVER=$DRIVER
export DGTRAIN_BIN=$HERE/fake_dgtrain.sh
export DGT_SLURM_CPUS=16
WORK=$(mktemp -d /tmp/dgt-slurm-test-XXXXXX)
trap 'rm -rf "$WORK"' EXIT # start_cluster replaces this with a trap that also stops the cluster

# ------------------------------------------------------------ bad use, outside Slurm (--check)
expect_usage_error() { # expect_usage_error PATTERN ARGS...
    local pat=$1 out rc was=$FAILED
    FAILED=0
    shift
    out=$(cd "$WORK" && env -u SLURM_JOB_ID bash "$TRAIN_SH" "$@" 2>&1)
    rc=$?
    [ "$rc" = 1 ] || fail "train.sh $* exited $rc, expected 1 (output: $out)"
    [ "$(printf '%s\n' "$out" | wc -l)" = 1 ] || fail "train.sh $* printed more than one line: $out"
    printf '%s\n' "$out" | grep -q -- "$pat" || fail "train.sh $*: expected '$pat', got: $out"
    [ "$FAILED" = 0 ] && echo "ok: train.sh $* -> $out"
    [ "$was" = 0 ] || FAILED=$was
}
printf '[run]\ndir = %s/ok-run\n' "$WORK" >"$WORK/ok.ini"
printf '[run]\ndir = %s/afile/sub\n' "$WORK" >"$WORK/nodir.ini"
: >"$WORK/afile"
printf '[fake]\nsteps = many\n' >"$WORK/badval.ini"
expect_usage_error "config file 'missing.ini' does not exist" --check missing.ini
expect_usage_error "unknown option '--bogus'" --check ok.ini --bogus
expect_usage_error "cannot create run.dir '$WORK/afile/sub'" --check nodir.ini
expect_usage_error "bad --set 'nonsense': expected section.key=value" --check ok.ini --set nonsense
expect_usage_error "dgtrain rejected the configuration: dgtrain: badval.ini: fake.steps and fake.step_ms must be integers" --check badval.ini
expect_usage_error "no config file" --check
expect_usage_error "not inside a Slurm job" ok.ini
out=$(cd "$WORK" && env -u SLURM_JOB_ID bash "$TRAIN_SH" --check ok.ini 2>&1) || fail "--check on a good config failed: $out"
[ "$FAILED" = 0 ] || exit 1

start_cluster
tlog "cluster up: $SLURM_CONF"

# ------------------------------------------------------------ scenarios (each in its own dir)
# submit DIR ARGS... -> prints the job id
submit() {
    local d=$1
    shift
    (cd "$d" && sbatch --parsable -o "$d/job.out" "$@")
}
progress() { cat "$1/fake/progress" 2>/dev/null || echo -1; }
wait_progress() { # wait_progress RUN_DIR N SECONDS (and note the ranks' shared-memory segments)
    local t0
    t0=$(now)
    while le "$(elapsed "$t0")" "$3"; do
        if [ "$(progress "$1")" -ge "$2" ] 2>/dev/null; then
            record_shm $(cat "$1"/fake/rank-*.pid 2>/dev/null)
            return 0
        fi
        sleep 0.1
    done
    fail "run in $1 did not reach step $2 in $3 s"
}

# fake_cfg NAME STEPS: sets the calling scenario's d ($WORK/NAME) and run ($d/run), writes $d/cfg.ini
fake_cfg() {
    d=$WORK/$1
    run=$d/run
    mkdir -p "$d"
    printf '[run]\ndir = %s\n[fake]\nsteps = %s\nstep_ms = 50\n' "$run" "$2" >"$d/cfg.ini"
}
# usr1_requeue JID: USR1 to the batch step, then wait for the job's requeue (Restarts=1) and its end
usr1_requeue() {
    scancel --signal=USR1 --batch "$1"
    wait_until 30 "requeue of job $1" bash -c "[ \"\$(scontrol show job -o $1 | grep -o 'Restarts=[0-9]*')\" = Restarts=1 ]" || return 1
    wait_job_state "$1" 60 COMPLETED FAILED
}

scenario_badargs() {
    local d=$WORK/badargs jid
    mkdir -p "$d"
    jid=$(submit "$d" "$TRAIN_SH" missing.ini) || return 1
    wait_job_state "$jid" 30 FAILED COMPLETED || return 1
    [ "$(job_field "$jid" ExitCode)" = 1:0 ] || fail "badargs job exit code $(job_field "$jid" ExitCode), expected 1:0"
    [ "$(job_field "$jid" Restarts)" = 0 ] || fail "badargs job was requeued"
    need "$d/job.out" "train.sh: error: config file 'missing.ini' does not exist" "no clear error in the job output"
    grep -q "command:" "$d/job.out" && fail "badargs job launched something"
    [ "$FAILED" = 0 ] && echo "PASS badargs job $jid: $(grep -m1 error: "$d/job.out")"
}

scenario_requeue() {
    local d=$WORK/requeue jid run
    mkdir -p "$d"
    # shell metacharacters, spaces and quotes in run.dir: must be used literally, never evaluated
    run="$d/run \$(touch $d/PWNED) \`touch $d/PWNED2\`;'x'"
    printf '[run]\ndir = %s\n[fake]\nsteps = 80\nstep_ms = 50\n' "$run" >"$d/cfg.ini"
    jid=$(submit "$d" "$TRAIN_SH" cfg.ini) || return 1
    wait_progress "$run" 8 40 || return 1
    usr1_requeue "$jid" || return 1
    [ "$(job_field "$jid" JobState)" = COMPLETED ] || fail "requeue job ended $(job_field "$jid" JobState) $(job_field "$jid" ExitCode)"
    need "$d/job.out" "got SIGUSR1: asking dgtrain to checkpoint" "USR1 not forwarded"
    need "$d/job.out" "dgtrain exit 75 \(stopped on a signal after a checkpoint\): requeueing job $jid" "no requeue after exit 75"
    need "$d/job.out" "start: restart 0 of max 10, nodes [^ ]+ \(1 node\(s\), 2 task\(s\)\)" "no restart-0 line"
    need "$d/job.out" "start: restart 1 of max 10, nodes [^ ]+ \(1 node\(s\), 2 task\(s\)\)" "no restart-1 line"
    need "$d/job.out" "health_driver: resuming at step [1-9][0-9]* of 80 with 2 rank" "did not resume"
    need "$d/job.out" "dgtrain finished \(exit 0\)" "did not finish"
    [ "$(cat "$run/fake/checkpoint" 2>/dev/null)" = 80 ] || fail "final checkpoint is not step 80"
    need "$run/logs/slurm.log" "job $jid: start: restart 1" "run.dir/logs/slurm.log lacks the restart history"
    [ -e "$d/PWNED" ] || [ -e "$d/PWNED2" ] && fail "a config value was evaluated by a shell"
    [ "$FAILED" = 0 ] && echo "PASS requeue job $jid: USR1 -> exit 75 -> requeued -> $(grep -o 'resuming at step [0-9]* of 80' "$d/job.out") -> finished"
}

scenario_watchdog() {
    local d jid run
    fake_cfg watchdog 40
    jid=$(FAKE_STALL_FIRST=1 submit "$d" "$TRAIN_SH" cfg.ini) || return 1
    wait_job_state "$jid" 90 COMPLETED FAILED || return 1
    [ "$(job_field "$jid" JobState)" = COMPLETED ] || fail "watchdog job ended $(job_field "$jid" JobState)"
    [ "$(job_field "$jid" Restarts)" = 1 ] || fail "watchdog job restarts $(job_field "$jid" Restarts), expected 1"
    need "$d/job.out" "watchdog: rank 1 \(host [^)]*\) has made no progress" "watchdog did not name rank 1"
    need "$d/job.out" "dgtrain exit 3 \(a peer failed or the watchdog fired\): requeueing" "exit 3 not requeued"
    need "$d/job.out" "dgtrain finished \(exit 0\)" "did not finish after the requeue"
    [ "$FAILED" = 0 ] && echo "PASS watchdog job $jid: hang -> exit 3 -> requeued -> finished"
}

scenario_maxrest() {
    local d jid run
    fake_cfg maxrest 400
    jid=$(DGT_MAX_RESTARTS=0 submit "$d" "$TRAIN_SH" cfg.ini) || return 1
    wait_progress "$run" 5 40 || return 1
    scancel --signal=USR1 --batch "$jid"
    wait_job_state "$jid" 30 FAILED COMPLETED || return 1
    [ "$(job_field "$jid" ExitCode)" = 75:0 ] || fail "maxrest exit code $(job_field "$jid" ExitCode), expected 75:0"
    [ "$(job_field "$jid" Restarts)" = 0 ] || fail "maxrest job was requeued"
    need "$d/job.out" "restart count 0 reached DGT_MAX_RESTARTS=0: not requeueing" "no max-restarts message"
    [ "$FAILED" = 0 ] && echo "PASS maxrest job $jid: exit 75 at the restart limit -> not requeued (ExitCode 75:0)"
}

scenario_resize() {
    local d jid run t0 st
    fake_cfg resize 60
    jid=$(submit "$d" "$TRAIN_SH" cfg.ini) || return 1
    wait_progress "$run" 8 40 || return 1
    scancel --signal=USR1 --batch "$jid"
    # catch it pending after the requeue, hold it, shrink it to one task, let it go
    t0=$(now)
    while :; do
        st=$(scontrol show job -o "$jid" | grep -o 'JobState=[A-Z]* .*Restarts=[0-9]*' | sed -E 's/JobState=([A-Z]*).*Restarts=([0-9]*)/\1 \2/')
        [ "$st" = "PENDING 1" ] && break
        le "$(elapsed "$t0")" 30 || {
            fail "resize job never pending after its requeue (state $st)"
            return 1
        }
        sleep 0.1
    done
    scontrol hold "$jid" || fail "cannot hold $jid"
    scontrol update JobId="$jid" NumTasks=1 TasksPerNode=1 || fail "cannot resize $jid"
    scontrol release "$jid" || fail "cannot release $jid"
    wait_job_state "$jid" 60 COMPLETED FAILED || return 1
    [ "$(job_field "$jid" JobState)" = COMPLETED ] || fail "resize job ended $(job_field "$jid" JobState)"
    need "$d/job.out" "start: restart 1 of max 10, nodes [^ ]+ \(1 node\(s\), 1 task\(s\)\)" "restart did not see 1 task"
    need "$d/job.out" "health_driver: resuming at step [1-9][0-9]* of 60 with 1 rank" "did not resume with 1 rank"
    need "$d/job.out" "dgtrain finished \(exit 0\)" "did not finish"
    [ "$FAILED" = 0 ] && echo "PASS resize job $jid: 2 tasks -> USR1 -> requeued, resized -> $(grep -o 'resuming at step [0-9]* of 60 with 1 rank' "$d/job.out") -> finished"
}

scenario_cancel() {
    local d jid run
    fake_cfg cancel 400
    jid=$(submit "$d" "$TRAIN_SH" cfg.ini) || return 1
    wait_progress "$run" 5 40 || return 1
    scancel "$jid"
    # CANCELLED (not COMPLETING): every process of the job has ended, train.sh included, on its own or
    # SIGKILLed by Slurm KillWait seconds after the SIGTERM. Only now is "not requeued" a verdict.
    wait_job_state "$jid" 90 CANCELLED || return 1
    sleep 2 # a requeue train.sh asked for just before it ended would show up as PENDING by now
    [ "$(job_field "$jid" JobState)" = CANCELLED ] || fail "cancel: job is $(job_field "$jid" JobState) after scancel"
    [ "$(job_field "$jid" Restarts)" = 0 ] || fail "cancel: job was requeued after scancel"
    test -s "$run/fake/checkpoint" || fail "cancel: no checkpoint written after the SIGTERM"
    # written by the signal trap itself, so it is there whenever the SIGTERM reached train.sh
    need "$run/logs/slurm.log" "got SIGTERM: asking dgtrain to checkpoint and stop .*; after SIGTERM .* this job will not requeue itself" \
        "cancel: SIGTERM not forwarded, or no 'will not requeue itself' note"
    grep -q "requeueing job $jid" "$run/logs/slurm.log" && fail "cancel: train.sh asked for a requeue"
    # the exit-code line exists only when dgtrain ended before KillWait; when it does, it says the same
    if grep -q "job $jid: dgtrain exit" "$run/logs/slurm.log"; then
        need "$run/logs/slurm.log" "after SIGTERM: the job is being cancelled or preempted; not requeueing" "cancel: an exit-code line that is not 'not requeueing'"
    fi
    [ "$FAILED" = 0 ] && echo "PASS cancel job $jid: scancel -> checkpoint at step $(cat "$run/fake/checkpoint") -> CANCELLED, not requeued"
}

scenario_killrank() {
    local d jid run pid
    fake_cfg killrank 60
    jid=$(submit "$d" "$TRAIN_SH" cfg.ini) || return 1
    wait_progress "$run" 5 40 || return 1
    pid=$(cat "$run/fake/rank-1.pid")
    grep -q health_driver "/proc/$pid/cmdline" 2>/dev/null || {
        fail "killrank: $pid is not rank 1 of the job"
        return 1
    }
    kill -KILL "$pid"
    wait_job_state "$jid" 60 COMPLETED FAILED || return 1
    [ "$(job_field "$jid" JobState)" = COMPLETED ] || fail "killrank: job ended $(job_field "$jid" JobState)"
    [ "$(job_field "$jid" Restarts)" = 1 ] || fail "killrank: restarts $(job_field "$jid" Restarts), expected 1"
    need "$d/job.out" "dgtrain exit 137 \(a rank was killed" "killrank: exit 137 not explained"
    need "$d/job.out" "dgtrain finished \(exit 0\)" "killrank: did not finish after the requeue"
    [ "$FAILED" = 0 ] && echo "PASS killrank job $jid: SIGKILL of rank 1 -> srun exit 137 -> requeued -> finished"
}

scenario_mpirun() {
    local d jid run
    fake_cfg mpirun 60
    jid=$(DGT_LAUNCHER=mpirun DGT_MPIRUN_ARGS="--oversubscribe --bind-to none" submit "$d" "$TRAIN_SH" cfg.ini) || return 1
    wait_progress "$run" 8 40 || return 1
    usr1_requeue "$jid" || return 1
    [ "$(job_field "$jid" JobState)" = COMPLETED ] || fail "mpirun: job ended $(job_field "$jid" JobState)"
    need "$d/job.out" "launcher mpirun" "mpirun: not launched with mpirun"
    need "$d/job.out" "dgtrain exit 75 \(stopped on a signal after a checkpoint\): requeueing" "mpirun: no requeue on 75"
    need "$d/job.out" "resuming at step [1-9][0-9]* of 60 with 2 rank" "mpirun: did not resume"
    need "$d/job.out" "dgtrain finished \(exit 0\)" "mpirun: did not finish"
    [ "$FAILED" = 0 ] && echo "PASS mpirun job $jid: mpirun launcher: USR1 -> exit 75 -> requeued -> resumed -> finished"
}

T0=$(now)
declare -A PIDS
for s in badargs requeue watchdog maxrest resize cancel killrank mpirun; do
    (
        FAILED=0
        scenario_$s
        rc=$?
        [ "$FAILED" = 0 ] && [ $rc = 0 ] && exit 0
        show_output "$WORK/$s/job.out"
        exit 1
    ) >"$WORK/$s.log" 2>&1 &
    PIDS[$s]=$!
done
for s in badargs requeue watchdog maxrest resize cancel killrank mpirun; do
    wait "${PIDS[$s]}" || FAILED=1
    cat "$WORK/$s.log"
done
tlog "all scenarios done in $(elapsed "$T0") s"
[ "$FAILED" = 0 ] || exit 1
echo "slurm harness: all scenarios passed"
exit 0
