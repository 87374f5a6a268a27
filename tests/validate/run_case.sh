#!/bin/bash
# run_case.sh — one dgvalidate test case under mpiexec (tests/validate/CMakeLists.txt lists them):
#   np1 np2 np4   every check at 1, 2 and 4 ranks (4 ranks as 2 simulated nodes of 2), reports parsed
#   slow          DG_TEST_VALIDATE_SLOW_RANK=2 (its figure divided by 10^6): rank 2 named as the straggler, exit 4
#   impossible    impossible references from a named node type: FAIL lines naming hosts, exit 4
#   readonly      a checkpoint directory root cannot write to: the storage checks FAIL, exit 4
#   badinput      bad SLA files and options: one "dgvalidate: error: FILE:LINE: ..." line, exit 1
# Usage: run_case.sh CASE DGVALIDATE HAVE_TRAIN MPIEXEC [MPIEXEC FLAGS...]
set -u
CASE=$1
DGV=$2
HAVE_TRAIN=$3
shift 3
MPI=("$@")
HERE=$(cd "$(dirname "$0")" && pwd)
SLA=$HERE/test_sla.ini
CHECK=(python3 "$HERE/check_reports.py")
WORK=$(mktemp -d /tmp/dgv-test-XXXXXX)
RO=
cleanup() {
    [ -n "$RO" ] && chattr -i "$RO" 2>/dev/null
    rm -rf "$WORK"
}
trap cleanup EXIT
FAILED=0
fail() {
    echo "FAIL [$CASE]: $*"
    FAILED=1
}

# run NP "ENV=V ..." ARGS... : dgvalidate under mpiexec (NP 0: started directly, an MPI singleton);
# sets OUT (stdout), ERR (stderr), RC
run() {
    local np=$1 envs=$2 xs=() e launch
    shift 2
    for e in $envs; do xs+=(-x "$e"); done
    launch=("${MPI[@]}" -n "$np" "${xs[@]}")
    [ "$np" = 0 ] && launch=()
    echo "+ ${envs:+$envs }${launch[*]} dgvalidate $*"
    (cd "$WORK" && env $envs "${launch[@]}" "$DGV" "$@" >"$WORK/out" 2>"$WORK/err")
    RC=$?
    OUT=$(cat "$WORK/out")
    ERR=$(cat "$WORK/err")
}
show() {
    echo "----- stdout"
    echo "$OUT"
    echo "----- stderr (last 20 lines)"
    echo "$ERR" | tail -n 20
}
expect_rc() {
    [ "$RC" = "$1" ] || fail "exit code $RC, expected $1"
}
has_line() { # has_line ERE DESCRIPTION
    printf '%s\n' "$OUT" | grep -qE -- "$1" || fail "$2: no line matching /$1/ on stdout"
}

# What may be skipped on a CPU machine; GPU/NCCL checks may also PASS where a GPU is present.
GPU_EXP=(--expect 'compute.gpu_*=SKIP|PASS' --expect 'comm.nccl.*=SKIP|PASS' --expect 'topology.gpu_sharing=SKIP|PASS')
if [ "$HAVE_TRAIN" = 1 ]; then TRAIN_EXP=(--require 'train.match' --require 'train.resume' --require 'train.recovery'); else TRAIN_EXP=(--expect 'train.*=SKIP'); fi
ALL_REQ=(--require 'topology.devices' --require 'topology.binding' --require 'topology.versions' --require 'health.monitor'
    --require 'comm.mpi.allreduce.intra' --require 'comm.mpi.allgather.intra' --require 'comm.mpi.reduce_scatter.intra'
    --require 'comm.mpi.broadcast.intra' --require 'comm.mpi.sendrecv.intra' --require 'compute.cpu_gemm'
    --require 'compute.cpu_gemm.stragglers' --require 'compute.cpu_stream' --require 'compute.cpu_stream.stragglers'
    --require 'storage.write' --require 'storage.read' --require 'storage.create' --require 'storage.rename'
    --require 'health.rtt')

# every_check NP NODES "ENV=V ..." CHECK-ARGS...: every check at NP ranks (on NODES nodes), exit 0, and the
# reports parsed with the expectations of a CPU machine plus CHECK-ARGS
every_check() {
    local np=$1 nodes=$2 envs=$3
    shift 3
    run "$np" "$envs" "$SLA" --run-dir "$WORK/run"
    expect_rc 0
    "${CHECK[@]}" "$WORK/run" --ranks "$np" --nodes "$nodes" --exit 0 "${GPU_EXP[@]}" "${TRAIN_EXP[@]}" "${ALL_REQ[@]}" \
        "$@" || FAILED=1
}

case "$CASE" in
np1)
    every_check 1 1 "" --expect 'health.rtt=SKIP' --expect 'comm.mpi.sendrecv.intra=SKIP' \
        --expect 'comm.mpi.*.inter=SKIP' --expect 'comm.mpi.*.world=SKIP'
    has_line '^dgvalidate: [0-9]+ checks: .* -> PASS \(exit 0\)$' "summary"
    ;;
np2)
    every_check 2 1 "" --expect 'comm.mpi.*.inter=SKIP' --expect 'comm.mpi.*.world=SKIP'
    has_line '^comm\.mpi\.allreduce\.intra +busbw [0-9.]+ [KMGT]?B/s .*PASS$' "allreduce row"
    ;;
np4)
    # 2 simulated nodes of 2 ranks: the intra, inter and world groups all exist
    every_check 4 2 "DG_BOOT_RANKS_PER_NODE=2" --require 'comm.mpi.allreduce.inter' --require 'comm.mpi.sendrecv.world'
    ;;
slow)
    run 4 "DG_BOOT_RANKS_PER_NODE=2 DG_TEST_VALIDATE_SLOW_RANK=2 DG_TEST_VALIDATE_SLOW_FACTOR=1e6" "$SLA" --run-dir "$WORK/run" \
        --checks compute.cpu_gemm,compute.cpu_stream
    expect_rc 4
    for k in cpu_gemm cpu_stream; do
        has_line "^FAIL compute\.$k\.stragglers: straggler: rank 2 \([^)]*\) at .* of the median" "$k straggler"
        line=$(printf '%s\n' "$OUT" | grep "^FAIL compute\.$k\.stragglers:")
        printf '%s\n' "$line" | grep -qE 'rank [013] \(' && fail "$k: a healthy rank is named: $line"
    done
    "${CHECK[@]}" "$WORK/run" --ranks 4 --nodes 2 --exit 4 --expect 'compute.*.stragglers=FAIL' \
        --expect 'compute.gpu_*=SKIP|PASS' --message 'compute.cpu_*.stragglers=rank 2 (' || FAILED=1
    ;;
impossible)
    run 2 "" "$HERE/sla_impossible.ini" --run-dir "$WORK/run" --checks compute.cpu_gemm,comm.mpi.allreduce.intra,storage.create,train.recovery
    expect_rc 4
    if [ "$HAVE_TRAIN" = 1 ]; then
        has_line '^FAIL train\.recovery: the resumed run took .* to its first step \(boot .*, checkpoint read .*, plan build .*\), want <= 1 us' "recovery"
        REC_EXP=(--expect 'train.recovery=FAIL')
    else
        REC_EXP=(--expect 'train.recovery=SKIP')
    fi
    has_line "^  node 0: [^,]+, 2 ranks, node type 'ci'$" "node type"
    has_line '^FAIL compute\.cpu_gemm: node 0 \([^,]+, ranks from 0\): .* want >= 0\.9 PFLOP/s' "gemm"
    has_line '^FAIL comm\.mpi\.allreduce\.intra: busbw .* on the intra group of 2 ranks from rank 0 \([^)]+\), want >= 900 TB/s' "allreduce"
    has_line '^FAIL storage\.create: create latency too high on rank 0 \([^)]+\), rank 1 \([^)]+\)' "create"
    "${CHECK[@]}" "$WORK/run" --ranks 2 --nodes 1 --exit 4 --expect 'compute.cpu_gemm=FAIL' \
        --expect 'comm.mpi.allreduce.intra=FAIL' --expect 'storage.create=FAIL' --expect 'compute.cpu_gemm.stragglers=PASS' \
        "${REC_EXP[@]}" --require 'train.recovery' --require 'compute.cpu_gemm' --require 'comm.mpi.allreduce.intra' --require 'storage.create' || FAILED=1
    ;;
readonly)
    # Root ignores permission bits, so a chmod'ed directory would not do. An immutable directory
    # (chattr +i) refuses even root; where the file system has no such flag, fall back to a path
    # whose parent is a regular file, which no one can create.
    RO=$WORK/ro
    mkdir -p "$RO"
    if chattr +i "$RO" 2>/dev/null && ! touch "$RO/probe" 2>/dev/null; then
        how="immutable directory (chattr +i)"
        DIR=$RO/ckpt
    else
        chattr -i "$RO" 2>/dev/null
        RO=
        : >"$WORK/afile"
        how="parent is a regular file"
        DIR=$WORK/afile/ckpt
    fi
    echo "read-only checkpoint directory: $DIR ($how)"
    run 2 "" "$SLA" --run-dir "$WORK/run" --checks storage --set "validate.storage_dir=$DIR"
    expect_rc 4
    for k in write read create rename; do
        has_line "^FAIL storage\.$k: storage directory not writable: rank 0 \([^)]+\): .*$DIR" "storage.$k"
    done
    "${CHECK[@]}" "$WORK/run" --ranks 2 --nodes 1 --exit 4 --expect 'storage.*=FAIL' --message "storage.*=$DIR" || FAILED=1
    ;;
setrundir)
    # --set run.dir=DIR is --run-dir DIR: the reports go to DIR, nothing to runs/validate-<time> (docs/validation.md)
    run 2 "" "$SLA" --checks topology --set run.dir="$WORK/sr"
    expect_rc 0
    [ -f "$WORK/sr/validation.json" ] && [ -f "$WORK/sr/validation-junit.xml" ] ||
        fail "--set run.dir=$WORK/sr: no validation.json / validation-junit.xml there"
    [ -e "$WORK/runs" ] && fail "--set run.dir was ignored: reports under $WORK/runs: $(ls "$WORK/runs")"
    has_line "^reports: $WORK/sr/validation.json" "reports line naming the --set run.dir"
    [ "$FAILED" = 0 ] || show
    run 0 "" "$SLA" --checks topology --run-dir "$WORK/a" --set run.dir="$WORK/b"
    expect_rc 1
    printf '%s\n' "$ERR" | grep -q "dgvalidate: error: --run-dir '$WORK/a' and --set run.dir='$WORK/b' name different run directories" ||
        { fail "conflicting --run-dir and --set run.dir: no one-line error"; show; }
    [ -e "$WORK/a" ] || [ -e "$WORK/b" ] && fail "conflicting run dirs: something was written"
    run 0 "" "$SLA" --checks topology --run-dir "$WORK/same" --set run.dir="$WORK/same"
    expect_rc 0
    [ -f "$WORK/same/validation.json" ] || fail "--run-dir D --set run.dir=D: no report in D"
    ;;
badinput)
    bad() { # bad NP EXPECTED-SUBSTRING ARGS...
        local np=$1 want=$2
        shift 2
        run "$np" "" "$@" --run-dir "$WORK/run-bad"
        local lines
        lines=$(printf '%s\n' "$ERR" | grep -c '^dgvalidate: error')
        if [ "$RC" != 1 ] || [ "$lines" != 1 ] || ! printf '%s\n' "$ERR" | grep -qF -- "$want"; then
            fail "exit $RC, $lines error line(s), expected exit 1 and one line with '$want'"
            show
        else
            echo "ok: $(printf '%s\n' "$ERR" | grep '^dgvalidate: error')"
        fi
        [ -e "$WORK/run-bad/validation.json" ] && fail "a report was written for bad input"
    }
    w() { printf '%b' "$2" >"$WORK/$1"; }
    w unknown_key.ini '[validate]\ncomm_iters = 3\ncomm_iter = 5\n'
    bad 0 "unknown_key.ini:3: unknown key validate.comm_iter; did you mean 'validate.comm_iters'?" "$WORK/unknown_key.ini"
    w metric.ini '[node:*]\nref.compute.cpu_gem = 10, -0.2, none, GFLOP/s\n'
    bad 2 "metric.ini:2: unknown metric 'ref.compute.cpu_gem'; did you mean 'ref.compute.cpu_gemm'?" "$WORK/metric.ini"
    w unit.ini '; comment\n[node:*]\nref.storage.write = 10, -0.2, none, GFLOP/s\n'
    bad 0 "unit.ini:3: ref.storage.write: unit 'GFLOP/s' measures something else: expected one of B/s" "$WORK/unit.ini"
    w lower.ini '[node:*]\nref.health.rtt = 10, 0.2, none, us\n'
    bad 0 "lower.ini:2: ref.health.rtt: lower threshold 0.2 must be in [-1, 0]" "$WORK/lower.ini"
    w fields.ini '[node:*]\nref.health.rtt = 10, none, us\n'
    bad 0 "fields.ini:2: ref.health.rtt = '10, none, us': expected 'target, lower, upper, unit'" "$WORK/fields.ini"
    w malformed.ini '[validate]\nthis line is not ini\n'
    bad 0 "malformed.ini:2: malformed line" "$WORK/malformed.ini"
    w section.ini '[validate]\n[nodes:gpu]\n'
    bad 0 "section.ini:2: unknown section [nodes:gpu]" "$WORK/section.ini"
    w nomatch.ini '[node:h200]\ngpus = 8\n'
    bad 0 "nomatch.ini:1: [node:h200] has no 'match'" "$WORK/nomatch.ini"
    w count.ini '[node:*]\ngpus = eight\n'
    bad 0 "count.ini:2: gpus = 'eight': expected 'any', a count N or '>=N'" "$WORK/count.ini"
    w dup.ini '[validate]\ncomm_iters = 3\ncomm_iters = 4\n'
    bad 0 "dup.ini:3: duplicate key validate.comm_iters (first set at line 2)" "$WORK/dup.ini"
    bad 2 "/nonexistent/sla.ini: cannot read: No such file or directory" /nonexistent/sla.ini
    bad 0 "validate.checks: unknown check 'comms'" "$SLA" --checks topology,comms
    bad 0 "validate.comm_sizes: sizes must increase" "$SLA" --set validate.comm_sizes=1K,8
    bad 0 "unknown option '--frobnicate'" "$SLA" --frobnicate
    bad 2 "topology.bind" "$SLA" --set topology.bind=sideways
    # --check: the same parser, no MPI (slurm/validate.sh runs it before launching)
    out=$("$DGV" --check "$WORK/unit.ini" 2>&1)
    [ $? = 1 ] && printf '%s\n' "$out" | grep -q "unit.ini:3: ref.storage.write: unit 'GFLOP/s'" ||
        fail "--check on a bad SLA: $out"
    out=$("$DGV" --check "$SLA" --checks comm 2>&1) || fail "--check on the test SLA: $out"
    printf '%s\n' "$out" | grep -q "is valid: 1 node type, checks 'comm'" || fail "--check output: $out"
    ;;
*)
    echo "unknown case '$CASE'"
    exit 2
    ;;
esac

if [ "$FAILED" != 0 ]; then
    show
    echo "FAIL [$CASE]"
    exit 1
fi
echo "PASS [$CASE]"
