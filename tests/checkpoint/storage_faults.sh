#!/bin/bash
# storage_faults.sh — checkpoint storage faults of the real dgtrain (issue 19, item 1), on real file
# systems and real ranks under mpiexec:
#   full1 | full2     a size-limited tmpfs that the second checkpoint does not fit, at 1 | 2 ranks, with the
#                     space check off (checkpoint.space_check=false) so that the failure comes from below HDF5 (the direct chunk writer's
#                     pwrite at 1 rank; MPI-IO's collective writes, DG_CKPT_DIRECT_CHUNKS=0, at 2 ranks):
#                     training goes on, LATEST keeps naming the last valid checkpoint, no .partial is left,
#                     a health event and a warning name the space needed, and after checkpoint.max_failures
#                     failed saves in a row every rank exits 4 with one clear line; then, with space freed,
#                     the same command resumes from that checkpoint and finishes
#   fullcheck         the same full tmpfs with the space check on (2 ranks): refused before writing
#   fullasync         as full1 at 2 ranks with checkpoint.async = true (the background writer fails)
#   fullend           the final checkpoint does not fit: exit 4, not 0; and a SIGUSR1 stop whose checkpoint
#                     does not fit: exit 4, not 75
#   stall             one rank hangs inside a save while its heartbeats go on (DG_TEST_CKPT_STALL): every
#                     rank exits 3 within health.timeout_s + 10 s, naming the stuck rank; no .partial left
#   sigstop           SIGSTOP of one rank during a (throttled) save: exit 3 within health.timeout_s + 10 s
#   slow              a save that takes many times health.timeout_s but keeps writing (DG_TEST_CKPT_THROTTLE_MS)
#                     is not killed: exit 0
#   metricsfull       the run directory's file system fills during training (checkpoints elsewhere): one WARN
#                     line, training goes on, no half line in metrics.jsonl; once space is freed the lines
#                     continue after a metrics_gap event counting the lost ones; SIGUSR1 then stops it (75)
# Usage: storage_faults.sh CASE DGTRAIN DGCKPT MPIEXEC [MPIEXEC FLAGS...]
# Mounting needs root: without it the full* cases skip (77), or fail under CI=true.
set -u
CASE=$1
shift
SLURM_TEST_NAME=ckpt_storage_$CASE
source "$(dirname "$0")/../slurm/lib.sh" # also the skip policy (tests/lib/skip.sh)
source "$(dirname "$0")/../lib/mpijob.sh"
dgtrain_args "$@"
skip_or_fail() { dg_skip "$@"; } # docs/reliability.md, "The test suite itself"
[ -x "$DGTRAIN" ] && [ -x "$DGCKPT" ] || skip_or_fail "dgtrain or dgckpt is not built ('$DGTRAIN', '$DGCKPT')"

WORK=$(mktemp -d /tmp/dgt-storage-XXXXXX)
MNT=
cleanup() {
    kill_jobs
    sleep 0.3
    clean_shm
    if [ -n "$MNT" ] && mountpoint -q "$MNT"; then umount "$MNT" || umount -l "$MNT"; fi
    if [ "$FAILED" != 0 ] && [ "${KEEP_WORK:-0}" = 1 ]; then
        echo "work directory kept: $WORK"
    else
        rm -rf "$WORK"
    fi
}
trap cleanup EXIT

write_tiny_config "$WORK/cfg.ini" 20
HB=0.5
TO=3 # health.timeout_s of the stall cases
# CASE-specific settings on top of the tiny config: checkpoints every 2 steps, no validation
SETS=(--set checkpoint.every=2 --set health.heartbeat_s=1 --set health.timeout_s=60)

# A small tmpfs under WORK (the run directory and the data stay outside it): the first checkpoint of the
# tiny model (about 10.7 MB on disk) fits, a second one does not.
mount_small() {
    MNT=$WORK/mnt
    mkdir -p "$MNT"
    [ "$(id -u)" = 0 ] || skip_or_fail "mounting a tmpfs needs root"
    mount -t tmpfs -o size=16m tmpfs "$MNT" 2>"$WORK/mount.err" || skip_or_fail "mount -t tmpfs failed: $(cat "$WORK/mount.err")"
}

launch() { # launch NP OUT ARGS...: dgtrain in the background
    local np=$1 out=$2
    shift 2
    "${MPI[@]}" -n "$np" "$DGTRAIN" "$WORK/cfg.ini" "${SETS[@]}" "$@" >"$out" 2>&1 &
    JOB=$!
}
show() { # show FILE...: on failure, what the job said
    for f in "$@"; do
        echo "----- $f"
        tail -n 40 "$f" 2>/dev/null
    done
}
no_partial() { # no_partial DIR WHAT
    if ls "$1" 2>/dev/null | grep -q '\.partial$'; then fail "$2: a .partial file is left in $1: $(ls "$1")"; fi
}
every_rank_log() { # every_rank_log RUN NP ERE WHAT: each rank's log has a line matching ERE
    local r
    for ((r = 0; r < $2; r++)); do
        grep -qE -- "$3" "$1/logs/rank-$r.log" 2>/dev/null || fail "$4: rank $r's log has no /$3/"
    done
}

# full disk: max_failures=2 -> the first save fits, the next two fail, exit 4
full_case() { # full_case NP TAG [env...]
    local np=$1 tag=$2
    shift 2
    local run=$WORK/run_$tag ck=$MNT/ck_$tag
    T0=$(now)
    env "$@" "${MPI[@]}" -n "$np" -x DG_CKPT_DIRECT_CHUNKS "$DGTRAIN" "$WORK/cfg.ini" \
        "${SETS[@]}" "${EXTRA[@]}" "${SPACE[@]}" --set run.dir="$run" --set checkpoint.dir="$ck" --set checkpoint.max_failures=2 \
        >"$WORK/$tag.out" 2>&1 &
    JOB=$!
    expect_job 4 240 "$WORK/$tag.out" "$tag" || return 1
    [ "$(cat "$ck/LATEST" 2>/dev/null)" = step_00000002.h5 ] || fail "$tag: LATEST is '$(cat "$ck/LATEST" 2>/dev/null)', expected step_00000002.h5"
    [ "$(ls "$ck" | grep -c '^step_.*\.h5$')" = 1 ] || fail "$tag: expected one checkpoint in $ck: $(ls "$ck")"
    no_partial "$ck" "$tag"
    local sc=true
    [ "${#SPACE[@]}" -gt 0 ] && sc=false
    grep -qE "^checkpoint\.space_check = $sc( |$)" "$run/config.ini" ||
        fail "$tag: RUN_DIR/config.ini does not record checkpoint.space_check = $sc: $(grep space_check "$run/config.ini")"
    "$DGCKPT" verify -q "$ck/step_00000002.h5" >/dev/null || fail "$tag: step_00000002.h5 does not verify"
    # training went on after the first failed save (step 4) up to the second one (step 6; with async
    # saves its failure is known when the next save, at step 8, waits for it)
    local last=6
    [ "${#EXTRA[@]}" -gt 0 ] && last=8
    [ "$(metrics_last_step "$run/metrics.jsonl")" = $last ] || fail "$tag: last step $(metrics_last_step "$run/metrics.jsonl"), expected $last (training on after the failed save of step 4, stopped at the second failure)"
    local ev
    ev=$(grep '"kind":"checkpoint_failed"' "$run/metrics.jsonl")
    [ "$(printf '%s\n' "$ev" | grep -c .)" = 2 ] || fail "$tag: expected 2 checkpoint_failed health events, got: $ev"
    printf '%s\n' "$ev" | head -n 1 | grep -qE '"step":4,"reason":"no_space".*"needed_bytes":[1-9][0-9]{6,},"free_bytes":[0-9]+,"latest":"step_00000002.h5","consecutive":1,"max_failures":2' ||
        fail "$tag: the first checkpoint_failed event does not name the space needed: $(printf '%s\n' "$ev" | head -n 1)"
    grep -qE "WARN: checkpoint of step 4 not saved: .* needs about [0-9.]+ MB free, it has [0-9.]+ MB; free at least [0-9.]+ MB" "$WORK/$tag.out" ||
        fail "$tag: no warning naming the free space needed"
    # one clear line on stderr, and the same agreed error in every rank's log
    local line
    line=$(grep '^dgtrain: error on rank' "$WORK/$tag.out")
    [ "$(printf '%s\n' "$line" | grep -c .)" = 1 ] || fail "$tag: expected one 'dgtrain: error' line, got: $line"
    printf '%s\n' "$line" | grep -q "checkpoints could not be saved 2 times in a row (checkpoint.max_failures=2).*not enough space.*stopping with exit code 4" ||
        fail "$tag: the error line does not say what happened: $line"
    every_rank_log "$run" "$np" "checkpoints could not be saved 2 times in a row" "$tag"
    grep -qE "Segmentation|signal 11|ABORT|deadlock" "$WORK/$tag.out" && fail "$tag: a crash or abort in the output"
    [ "$FAILED" = 0 ] || {
        show "$WORK/$tag.out"
        return 1
    }
    echo "PASS $tag: $np rank(s): the saves of steps 4 and 6 failed for lack of space, training went on, exit 4 after ${DT}s: $line" | cut -c1-400
    return 0
}

case "$CASE" in
full1 | full2 | fullcheck | fullasync)
    mount_small
    EXTRA=()
    # the space check off (checkpoint.space_check=false): the save proceeds and fails from below; on (the
    # default, fullcheck): the same save is refused before anything is written
    SPACE=(--set checkpoint.space_check=false)
    case "$CASE" in
    fullasync) NP=2 ENVV=(DG_CKPT_DIRECT_CHUNKS=1) EXTRA=(--set checkpoint.async=true) ;;
    full1) NP=1 ENVV=(DG_CKPT_DIRECT_CHUNKS=1) ;; # ENOSPC in dgtrain's own chunk pwrite
    full2) NP=2 ENVV=(DG_CKPT_DIRECT_CHUNKS=0) ;; # a short write inside MPI-IO, under HDF5
    fullcheck) NP=2 ENVV=(DG_CKPT_DIRECT_CHUNKS=1) SPACE=() ;;
    esac
    full_case "$NP" "$CASE" "${ENVV[@]}" || exit 1
    # the failure is caught where it happens, not later by luck (the commit's LATEST write): a short
    # write that MPI-IO reports as a success would otherwise leave a checkpoint with missing data
    case "$CASE" in
    full1 | fullasync) where="writing a chunk at offset [0-9]+: No space left on device" ;;
    full2) where="MPI_File_write_at_all \(offset [0-9]+ in its file view\) wrote [0-9]+ of [0-9]+ bytes and reported no error" ;;
    fullcheck) where="less than the [0-9.]+ MB this checkpoint needs; nothing was written" ;;
    esac
    grep -qE "^dgtrain: error on rank .*$where" "$WORK/$CASE.out" ||
        fail "$CASE: the error does not say where the write failed (/$where/): $(grep -m1 'dgtrain: error' "$WORK/$CASE.out")"
    # free the space (a bigger tmpfs over the same directory's content) and run the same command again
    ck=$MNT/ck_$CASE
    cp -a "$ck" "$WORK/saved_ck"
    umount "$MNT"
    mount -t tmpfs -o size=64m tmpfs "$MNT" || {
        fail "remount"
        exit 1
    }
    cp -a "$WORK/saved_ck" "$ck"
    T0=$(now)
    env "${ENVV[@]}" "${MPI[@]}" -n "$NP" -x DG_CKPT_DIRECT_CHUNKS "$DGTRAIN" "$WORK/cfg.ini" \
        "${SETS[@]}" "${EXTRA[@]}" "${SPACE[@]}" --set run.dir="$WORK/run_$CASE" --set checkpoint.dir="$ck" --set checkpoint.max_failures=2 \
        >"$WORK/$CASE.resume.out" 2>&1 &
    JOB=$!
    wait_job 240 || exit 1
    [ "$RC" = 0 ] || fail "$CASE: the rerun with space exited $RC, expected 0"
    grep -q '"event":"resume","step":2,' "$WORK/run_$CASE/metrics.jsonl" || fail "$CASE: the rerun did not resume from step 2"
    [ "$(cat "$ck/LATEST")" = step_00000020.h5 ] || fail "$CASE: LATEST after the rerun is $(cat "$ck/LATEST")"
    [ "$FAILED" = 0 ] || {
        show "$WORK/$CASE.resume.out"
        exit 1
    }
    echo "PASS $CASE: with space freed, the same command resumed from step_00000002.h5 and finished (exit 0)"
    ;;
fullend)
    mount_small
    # a 10 MB file leaves too little for even the first checkpoint: the only save is the final one
    head -c 10M /dev/zero >"$MNT/filler"
    run=$WORK/run_end
    T0=$(now)
    launch 2 "$WORK/end.out" --set checkpoint.every=0 --set train.steps=3 --set run.dir="$run" --set checkpoint.dir="$MNT/ck"
    wait_job 240 || exit 1
    [ "$RC" = 4 ] || fail "fullend: a run whose final checkpoint failed exited $RC, expected 4"
    grep -q "^dgtrain: error on rank .*the checkpoint of step 3 could not be saved: not enough space" "$WORK/end.out" ||
        fail "fullend: no clear line about the final checkpoint: $(grep -m1 'dgtrain: error' "$WORK/end.out")"
    grep -q '"reason":"finished"' "$run/metrics.jsonl" && fail "fullend: the run claims to have finished"
    no_partial "$MNT/ck" fullend
    [ "$FAILED" = 0 ] || {
        show "$WORK/end.out"
        exit 1
    }
    echo "PASS fullend: final checkpoint does not fit -> exit 4: $(grep -m1 'dgtrain: error' "$WORK/end.out" | cut -c1-250)"
    # a signal stop: its checkpoint does not fit either -> 4, never 75 (75 promises a complete checkpoint)
    run=$WORK/run_sig
    launch 2 "$WORK/sig.out" --set checkpoint.every=0 --set train.steps=100000 --set run.dir="$run" --set checkpoint.dir="$MNT/ck"
    t0=$(now)
    until step_reached "$run/metrics.jsonl" 3; do
        kill -0 "$JOB" 2>/dev/null && le "$(elapsed "$t0")" 120 || {
            fail "sig: dgtrain did not reach step 3"
            show "$WORK/sig.out"
            exit 1
        }
        sleep 0.1
    done
    kill -USR1 "$JOB"
    T0=$(now)
    wait_job 120 || exit 1
    [ "$RC" = 4 ] || fail "sig: a stop whose checkpoint failed exited $RC, expected 4 (never 75)"
    grep -q "^dgtrain: error on rank .*stopped on SIGUSR1 at step [0-9]* without a complete checkpoint (so not exit 75)" "$WORK/sig.out" ||
        fail "sig: no clear line: $(grep -m1 'dgtrain: error' "$WORK/sig.out")"
    [ ! -e "$MNT/ck/LATEST" ] || fail "sig: LATEST appeared"
    no_partial "$MNT/ck" sig
    [ "$FAILED" = 0 ] || {
        show "$WORK/sig.out"
        exit 1
    }
    echo "PASS fullend: SIGUSR1 stop whose checkpoint does not fit -> exit 4 in ${DT}s: $(grep -m1 'dgtrain: error' "$WORK/sig.out" | cut -c1-250)"
    ;;
stall | sigstop)
    run=$WORK/run_$CASE
    mesh=(--set parallel.mesh=dp_replicate=1,dp_shard=2,tp=1) # both ranks write pieces
    HSETS=(--set health.heartbeat_s=$HB --set health.timeout_s=$TO --set run.dir="$run")
    if [ "$CASE" = stall ]; then
        # rank 1 hangs in the second save (step 4), after its first tensor; its health thread lives on
        DG_TEST_CKPT_STALL=write@1:2 launch 2 "$WORK/$CASE.out" "${mesh[@]}" "${HSETS[@]}"
        what="rank 1 hangs inside the save of step 4"
        t0=$(now)
        until grep -q "DG_TEST_CKPT_STALL=write@1:2: rank 1 hangs" "$run/logs/rank-1.log" 2>/dev/null; do
            kill -0 "$JOB" 2>/dev/null && le "$(elapsed "$t0")" 120 || {
                fail "stall: the hook never fired"
                show "$WORK/$CASE.out"
                exit 1
            }
            sleep 0.05
        done
        T0=$(now)
    else
        # every write is slowed down so that the save of step 4 lasts; rank 1 is stopped in it
        DG_TEST_CKPT_THROTTLE_MS=40 launch 2 "$WORK/$CASE.out" "${mesh[@]}" "${HSETS[@]}"
        what="SIGSTOP of rank 1 while it writes the checkpoint of step 4"
        t0=$(now)
        until [ -e "$run/checkpoints/step_00000004.h5.partial" ]; do
            kill -0 "$JOB" 2>/dev/null && le "$(elapsed "$t0")" 120 || {
                fail "sigstop: the save of step 4 never started"
                show "$WORK/$CASE.out"
                exit 1
            }
            sleep 0.02
        done
        stop_rank1 || exit 1
    fi
    wait_job $((TO + 10)) || {
        show "$WORK/$CASE.out"
        exit 1
    }
    [ "$RC" = 3 ] || fail "$CASE: exit $RC, expected 3"
    grep -qE "watchdog: (rank 1 \(host [^)]*\) has made no progress|no heartbeat from rank 1|rank 0 has had no heartbeat from rank 1)" "$WORK/$CASE.out" ||
        fail "$CASE: no watchdog line naming rank 1: $(grep -m2 watchdog "$WORK/$CASE.out")"
    grep -E "watchdog: " "$WORK/$CASE.out" | grep -vq "rank 1" && fail "$CASE: a watchdog line blames another rank"
    if [ "$CASE" = stall ]; then
        every_rank_log "$run" 2 "aborting the job with exit code 3|exiting with code 3" "$CASE"
    fi
    [ "$(cat "$run/checkpoints/LATEST" 2>/dev/null)" = step_00000002.h5 ] || fail "$CASE: LATEST is '$(cat "$run/checkpoints/LATEST" 2>/dev/null)'"
    [ "$CASE" = stall ] && no_partial "$run/checkpoints" "$CASE" # (a stopped rank removes nothing; the next save does)
    [ "$FAILED" = 0 ] || {
        show "$WORK/$CASE.out"
        exit 1
    }
    echo "PASS $CASE: $what -> exit 3 on every rank ${DT}s later (health.timeout_s=$TO): $(grep -m1 'watchdog: ' "$WORK/$CASE.out" | cut -c1-300)"
    ;;
slow)
    # every write sleeps first: the final save takes far longer than health.timeout_s. The tiny model's
    # tensors are one chunk each, which parallel HDF5 has rank 0 write (the other rank sends it its data
    # and then waits in the save's collectives): rank 0 keeps writing, rank 1 waits, nobody is stuck.
    run=$WORK/run_slow
    T0=$(now)
    DG_TEST_CKPT_THROTTLE_MS=40 launch 2 "$WORK/slow.out" --set parallel.mesh=dp_replicate=1,dp_shard=2,tp=1 \
        --set checkpoint.every=0 --set train.steps=2 --set health.heartbeat_s=$HB --set health.timeout_s=$TO \
        --set run.dir="$run"
    wait_job 300 || exit 1
    [ "$RC" = 0 ] || fail "slow: exit $RC, expected 0"
    grep -qi watchdog "$WORK/slow.out" && fail "slow: the watchdog fired on a save that kept writing"
    secs=$(grep '"event":"checkpoint"' "$run/metrics.jsonl" | tail -n 1 | sed -E 's/.*"seconds":([0-9.]+).*/\1/')
    # not a timing verdict: the throttle makes the save last at least this long; this checks that the
    # scenario really is a save much longer than the stall limit
    le $((3 * TO)) "${secs:-0}" || fail "slow: the save took ${secs:-?} s, not the > $((3 * TO)) s this case needs (throttle not effective?)"
    "$DGCKPT" verify -q "$(latest_ckpt "$run")" >/dev/null || fail "slow: the slow checkpoint does not verify"
    [ "$FAILED" = 0 ] || {
        show "$WORK/slow.out"
        exit 1
    }
    echo "PASS slow: a ${secs} s save (health.timeout_s=$TO) that kept writing was not killed; exit 0"
    ;;
metricsfull)
    MNT=$WORK/mnt
    mkdir -p "$MNT"
    [ "$(id -u)" = 0 ] || skip_or_fail "mounting a tmpfs needs root"
    mount -t tmpfs -o size=2m tmpfs "$MNT" 2>"$WORK/mount.err" || skip_or_fail "mount -t tmpfs failed: $(cat "$WORK/mount.err")"
    run=$MNT/run
    m=$run/metrics.jsonl
    T0=$(now)
    "${MPI[@]}" -n 1 "$DGTRAIN" "$WORK/cfg.ini" --set train.steps=1000000 --set run.dir="$run" \
        --set checkpoint.dir="$WORK/ck" >"$WORK/mf.out" 2>&1 &
    JOB=$!
    until step_reached "$m" 3; do
        le "$(elapsed "$T0")" 120 || { fail "metricsfull: no step 3 within 120 s"; show "$WORK/mf.out"; exit 1; }
        sleep 0.1
    done
    dd if=/dev/zero of="$MNT/filler" bs=4k 2>/dev/null # fills the tmpfs (dd stops at ENOSPC)
    T1=$(now)
    until grep -q "WARN: metrics: cannot write .*No space left on device; training goes on" "$WORK/mf.out"; do
        le "$(elapsed "$T1")" 60 || { fail "metricsfull: no warning within 60 s of the full disk"; show "$WORK/mf.out"; exit 1; }
        sleep 0.1
    done
    full_step=$(metrics_last_step "$m")
    sleep 2 # steps go on, their lines dropped
    rm -f "$MNT/filler"
    T1=$(now)
    until grep -q "WARN: metrics: .* is written again; [0-9]* line(s) were lost" "$WORK/mf.out" && step_reached "$m" $((full_step + 10)); do
        le "$(elapsed "$T1")" 60 || { fail "metricsfull: no lines again within 60 s of freeing space"; show "$WORK/mf.out"; exit 1; }
        sleep 0.1
    done
    kill -USR1 "$JOB" # mpiexec forwards it to the rank
    T0=$(now)
    expect_job 75 120 "$WORK/mf.out" metricsfull || exit 1
    [ "$(grep -c "WARN: metrics: cannot write" "$WORK/mf.out")" = 1 ] || fail "metricsfull: expected one 'cannot write' warning: $(grep -c "WARN: metrics: cannot write" "$WORK/mf.out")"
    # every line is whole JSON; one gap, after the last step written before it, before the next one
    python3 - "$m" "$full_step" <<'PY' || fail "metricsfull: metrics.jsonl check failed"
import json, sys
lines = open(sys.argv[1]).read().split("\n")
assert lines[-1] == "", "the file does not end with a newline"
ev = [json.loads(ln) for ln in lines[:-1]]  # raises on a half line
gaps = [i for i, e in enumerate(ev) if e.get("event") == "metrics_gap"]
assert len(gaps) == 1 and ev[gaps[0]]["lines_lost"] > 0, "metrics_gap events: %s" % [ev[i] for i in gaps]
assert all("run_id" in e and "attempt" in e for e in ev), "a line without the run identity"
steps = [e["step"] for e in ev if e.get("event") == "step"]
before = [e["step"] for e in ev[:gaps[0]] if e.get("event") == "step"]
after = [e["step"] for e in ev[gaps[0]:] if e.get("event") == "step"]
assert steps == sorted(steps) and before and after, "step lines out of order or missing around the gap"
skipped = after[0] - before[-1] - 1
assert skipped >= 1, "no step line is missing at the gap (%d then %d)" % (before[-1], after[0])
assert ev[gaps[0]]["lines_lost"] >= skipped, "lines_lost %d < %d step lines missing" % (ev[gaps[0]]["lines_lost"], skipped)
print("metrics.jsonl: %d whole lines, step lines %d..%d, gap after step %d: %d step lines missing, lines_lost %d"
      % (len(ev), steps[0], steps[-1], before[-1], skipped, ev[gaps[0]]["lines_lost"]))
PY
    [ "$FAILED" = 0 ] || { show "$WORK/mf.out"; exit 1; }
    echo "PASS metricsfull: the run directory filled at step $full_step; training went on, lines dropped whole, a metrics_gap event where they are missing, exit 75 on SIGUSR1"
    ;;
*)
    echo "storage_faults.sh: unknown case '$CASE'"
    exit 2
    ;;
esac
[ "$FAILED" = 0 ] || exit 1
exit 0
