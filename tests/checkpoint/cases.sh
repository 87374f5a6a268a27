#!/usr/bin/env bash
# cases.sh — checkpoint test scenarios (ctest label ckpt), played with ckpt_driver and dgckpt.
# usage: cases.sh CASE DRIVER DGCKPT MPIEXEC [MPIFLAGS...]
# Each case works in a fresh directory under $CKPT_WORK_DIR (or $TMPDIR; kept on failure, path printed), exits 0 on
# success, 1 on failure, 77 when a prerequisite is missing (with the reason; under CI=true that fails: tests/lib/skip.sh).
set -u
CASE=$1 DRV=$2 CK=$3
shift 3
MPI=("$@")
# ckpt_driver installs no signal handler: when one of its ranks exits non-zero, the SIGTERM mpiexec sends
# the others ends them as its SIGKILL would. The grace between the two (odls_base_sigkill_timeout, 1 s)
# is waited even when every rank has already exited: ~2 s of idle wall time per expected failure.
export OMPI_MCA_odls_base_sigkill_timeout=0
HERE=$(cd "$(dirname "$0")" && pwd)
W=$(mktemp -d "${CKPT_WORK_DIR:-${TMPDIR:-/tmp}}/dgckpt_${CASE}_XXXXXX")
cd "$W" || exit 1
FAILED=0

log() { printf '%s\n' "$*"; }
fail() {
    printf 'FAIL: %s\n' "$*" >&2
    FAILED=1
}
finish() {
    if [ "$FAILED" = 0 ]; then
        cd / && rm -rf "$W"
        log "PASS $CASE"
        exit 0
    fi
    log "FAILED $CASE (work directory kept: $W)"
    exit 1
}
mpi() { # mpi N args...: run the driver on N ranks
    local n=$1
    shift
    "${MPI[@]}" -n "$n" "$DRV" "$@"
}
# expect_ok "what" cmd...: the command must succeed
expect_ok() {
    local what=$1
    shift
    local out
    if ! out=$("$@" 2>&1); then
        fail "$what: command failed: $*"
        printf '%s\n' "$out" | tail -20 >&2
        return 1
    fi
    printf '%s\n' "$out" | grep -v -e '^ok ' -e '^ *$' | tail -5
    return 0
}
# expect_err "what" "needle" cmd...: the command must fail and its output contain needle (grep -E)
expect_err() {
    local what=$1 needle=$2
    shift 2
    local out rc
    out=$("$@" 2>&1)
    rc=$?
    if [ $rc = 0 ]; then
        fail "$what: expected a failure, got success: $*"
        return 1
    fi
    if ! printf '%s\n' "$out" | grep -Eq -- "$needle"; then
        fail "$what: the output does not mention /$needle/:"
        printf '%s\n' "$out" | tail -10 >&2
        return 1
    fi
    log "ok: $what -> $(printf '%s\n' "$out" | grep -E -m1 -- "$needle" | cut -c1-220)"
}
step_of() { # step_00000012.h5 -> 12
    local b
    b=$(basename "$1")
    b=${b#step_}
    echo $((10#${b%.h5}))
}

# ---------------------------------------------------------------- cases

case_roundtrip() {
    # bitwise save/load at 1 and at 4 ranks, several layouts
    expect_ok "save 1 rank" mpi 1 save --dir c1 --step 3 --seed 11 --layout fsdp
    expect_ok "load 1 rank" mpi 1 load c1/step_00000003.h5 --seed 11 --layout fsdp
    expect_ok "save 4 ranks mixed" mpi 4 save --dir c4 --step 4 --seed 12 --layout mixed
    expect_ok "load 4 ranks mixed" mpi 4 load c4/step_00000004.h5 --seed 12 --layout mixed
    expect_ok "load 4 ranks grid" mpi 4 load c4/step_00000004.h5 --seed 12 --layout grid
    expect_ok "save 4 ranks grid" mpi 4 save --dir c4g --step 5 --seed 13 --layout grid
    expect_ok "load 4 ranks cols" mpi 4 load c4g/step_00000005.h5 --seed 13 --layout cols
    # the check itself can fail: the wrong seed must be reported as mismatches
    expect_err "wrong values are detected" "mismatched=[1-9]" mpi 1 load c1/step_00000003.h5 --seed 99 --layout fsdp
    [ "$(cat c4/LATEST)" = step_00000004.h5 ] || fail "LATEST of c4 is '$(cat c4/LATEST)'"
}

case_reshard() {
    # write with 4 ranks, read at 2, 3 and 1 with other decompositions (uneven splits, column splits,
    # replicas with one owner, two pieces per rank, a 2-D grid); and 3 -> 4
    expect_ok "save 4 mixed" mpi 4 save --dir r --step 7 --seed 21 --layout mixed
    for spec in "2 cols" "2 grid" "3 mixed" "3 rep" "3 grid" "1 fsdp" "1 mixed"; do
        set -- $spec
        expect_ok "4 -> $1 ($2)" mpi "$1" load r/step_00000007.h5 --seed 21 --layout "$2"
    done
    expect_ok "save 3 grid" mpi 3 save --dir r3 --step 8 --seed 22 --layout grid
    expect_ok "3 -> 4 (mixed)" mpi 4 load r3/step_00000008.h5 --seed 22 --layout mixed
    expect_ok "3 -> 2 (cols)" mpi 2 load r3/step_00000008.h5 --seed 22 --layout cols
}

# sim runs: uninterrupted vs interrupted at step 6 and resumed (bitwise when same mesh)
resume_pair() { # resume_pair NAME N1 LAYOUT1 N2 LAYOUT2 TOL
    local name=$1 n1=$2 l1=$3 n2=$4 l2=$5 tol=$6
    expect_ok "$name: uninterrupted" mpi "$n1" sim --dir "$name.ref" --steps 12 --every 3 --layout "$l1" --out "$name.ref.txt"
    expect_ok "$name: first part" mpi "$n1" sim --dir "$name.run" --steps 12 --every 3 --layout "$l1" --out "$name.run.txt" --stop-after 6
    expect_ok "$name: resumed" mpi "$n2" sim --dir "$name.run" --steps 12 --every 3 --layout "$l2" --out "$name.run.txt" --resume auto
    grep -q "^resume step 6 from_world $n1 to_world $n2 " "$name.run.txt" || fail "$name: no resume line for $n1 -> $n2"
    if [ "$tol" = 0 ]; then
        expect_ok "$name: losses, tokens and samples bitwise" "$DRV" compare "$name.ref.txt" "$name.run.txt"
    else
        expect_ok "$name: tokens and samples exact, losses within $tol" "$DRV" compare "$name.ref.txt" "$name.run.txt" --tol "$tol"
    fi
    # the element-wise update makes final weights independent of the decomposition: bitwise either way
    expect_ok "$name: final weights identical" "$CK" diff "$name.ref/step_00000012.h5" "$name.run/step_00000012.h5"
}

case_resume_same() {
    resume_pair same1 1 fsdp 1 fsdp 0
    resume_pair same4 4 mixed 4 mixed 0
    # negative control: stopping at 7 but resuming from 6 repeats step 7, which compare must notice
    expect_ok "control: run to 7" mpi 2 sim --dir ctl --steps 12 --every 3 --layout fsdp --out ctl.txt --stop-after 7
    expect_ok "control: resume" mpi 2 sim --dir ctl --steps 12 --every 3 --layout fsdp --out ctl.txt --resume auto
    expect_ok "control: reference" mpi 2 sim --dir ctlref --steps 12 --every 3 --layout fsdp --out ctlref.txt
    expect_err "a repeated step is detected" "samples differ|more steps" "$DRV" compare ctlref.txt ctl.txt
}

case_resume_worldsize() {
    resume_pair w42 4 mixed 2 cols 1e-5
    resume_pair w23 2 fsdp 3 mixed 1e-5
    resume_pair w31 3 grid 1 fsdp 1e-5
}

case_damage() {
    expect_ok "save step 1" mpi 2 save --dir d --step 1 --seed 1 --layout fsdp
    expect_ok "save step 2" mpi 2 save --dir d --step 2 --seed 2 --layout fsdp
    cp d/step_00000002.h5 good.h5
    # a flipped bit inside a chunk of /model/big
    cp good.h5 flip.h5
    expect_ok "flip a bit" "$DRV" corrupt flip.h5 model/big
    expect_err "flipped bit: load" "flip.h5:/model/big: checksum mismatch \(Fletcher32\)" mpi 4 load flip.h5 --seed 2 --layout cols
    expect_err "flipped bit: verify" "flip.h5:/model/big: checksum mismatch" "$CK" verify flip.h5
    # the manifest is checksummed too
    cp good.h5 flipm.h5
    expect_ok "flip a manifest bit" "$DRV" corrupt flipm.h5 manifest
    expect_err "flipped manifest" "flipm.h5:/manifest.*(Fletcher32|checksum)" mpi 2 load flipm.h5 --seed 2
    # truncated
    cp good.h5 trunc.h5
    truncate -s $(($(stat -c %s good.h5) / 2)) trunc.h5
    expect_err "truncated: load" "trunc.h5 cannot be opened as HDF5.*truncated" mpi 2 load trunc.h5 --seed 2
    expect_err "truncated: verify" "trunc.h5 cannot be opened as HDF5" "$CK" verify trunc.h5
    # not HDF5 at all
    printf 'this is not a checkpoint\n' >text.h5
    expect_err "not HDF5" "text.h5 cannot be opened as HDF5.*(signature|Not an HDF5)" mpi 2 load text.h5 --seed 2
    expect_err "missing file" "nofile.h5: no such file" mpi 2 load nofile.h5 --seed 2
    # a dataset missing
    cp good.h5 miss.h5
    expect_ok "delete /model/wpe" "$DRV" delete miss.h5 model/wpe
    expect_err "missing dataset: load" "miss.h5: dataset /model/wpe is missing" mpi 2 load miss.h5 --seed 2
    expect_err "missing dataset: verify" "miss.h5: dataset /model/wpe is missing" "$CK" verify miss.h5
    # a dataset with the wrong shape (file tampered), and a model whose shape changed (config)
    cp good.h5 shape.h5
    expect_ok "reshape /model/wpe" "$DRV" reshape shape.h5 model/wpe
    expect_err "wrong shape in file" "shape.h5:/model/wpe has shape \[3, 3\], expected \[16, 24\]" mpi 2 load shape.h5 --seed 2
    expect_err "model changed shape" "good.h5: dataset /model/wte has shape \[97, 24\], expected \[97, 25\]" mpi 3 load good.h5 --seed 2 --bump-shape wte
    # and the untouched copy still loads
    expect_ok "good copy" mpi 3 load good.h5 --seed 2 --layout mixed
}

case_fallback() {
    expect_ok "steps 1-3" mpi 2 sim --dir f --steps 3 --every 1 --layout fsdp
    # LATEST damaged (garbage) -> newest complete checkpoint
    printf 'garbage\n' >f/LATEST
    [ "$("$CK" resolve f 2>/dev/null)" = f/step_00000003.h5 ] || fail "garbage LATEST: resolve gave '$("$CK" resolve f 2>&1)'"
    # LATEST naming a missing file
    printf 'step_00000009.h5\n' >f/LATEST
    [ "$("$CK" resolve f 2>/dev/null)" = f/step_00000003.h5 ] || fail "LATEST -> missing: resolve gave '$("$CK" resolve f 2>&1)'"
    # LATEST names step 2 (older): it is taken as is
    printf 'step_00000002.h5\n' >f/LATEST
    [ "$("$CK" resolve f 2>/dev/null)" = f/step_00000002.h5 ] || fail "LATEST -> step 2: resolve gave '$("$CK" resolve f 2>&1)'"
    # LATEST's target damaged by a flipped bit: the structure is intact, so only a full check (or the
    # load itself) finds it; resume=auto then falls back to the next older checkpoint
    printf 'step_00000003.h5\n' >f/LATEST
    expect_ok "flip a bit in step 3" "$DRV" corrupt f/step_00000003.h5 optim/big/m
    [ "$("$CK" resolve f 2>/dev/null)" = f/step_00000003.h5 ] || fail "structural resolve should still pick step 3"
    [ "$("$CK" resolve f --full 2>/dev/null)" = f/step_00000002.h5 ] || fail "flipped LATEST target: full resolve gave '$("$CK" resolve f --full 2>&1)'"
    local out
    out=$(mpi 3 sim --dir f --steps 3 --resume auto --layout mixed 2>&1) || fail "sim resume with fallback failed: $out"
    printf '%s\n' "$out" | grep -q "resumed from f/step_00000002.h5 at step 2" || fail "sim did not fall back to step 2: $out"
    printf '%s\n' "$out" | grep -q "step_00000003.h5:/optim/big/m: checksum mismatch" ||
        fail "the fallback warning does not name the damaged dataset: $out"
    log "ok: resume=auto fell back past the damaged step 3 to step 2 and redid step 3"
    [ "$(cat f/LATEST)" = step_00000003.h5 ] || fail "LATEST after the re-save is $(cat f/LATEST)"
    expect_ok "the re-saved step 3 verifies" "$CK" verify f/step_00000003.h5
    # truncated newest files are skipped by the structural check
    truncate -s 1000 f/step_00000003.h5
    truncate -s 5000 f/step_00000002.h5
    [ "$("$CK" resolve f 2>/dev/null)" = f/step_00000001.h5 ] || fail "truncated: resolve gave '$("$CK" resolve f 2>&1)'"
    # nothing usable: a clear error, not a silent fresh start
    printf 'x' >f/step_00000001.h5
    expect_err "all damaged" "no usable checkpoint in f: all 3 rejected" "$CK" resolve f
    expect_err "all damaged: sim" "no usable checkpoint in f" mpi 2 sim --dir f --steps 4 --resume auto
    # an explicit path is taken or refused, never replaced by another file
    expect_err "resume=PATH damaged" "step_00000001.h5 cannot be opened" mpi 2 sim --dir f --steps 2 --resume f/step_00000001.h5
    # an empty or missing directory means a fresh start
    [ -z "$("$CK" resolve nothing_here)" ] || fail "a missing directory should resolve to ''"
    mkdir empty
    [ -z "$("$CK" resolve empty)" ] || fail "an empty directory should resolve to ''"
}

case_sigkill() {
    # kill one rank with SIGKILL at random moments while it saves every step; the previous complete
    # checkpoint must survive, nothing half-written may carry a final name, and the restart finishes
    local seed=${CKPT_KILL_SEED:-$$}
    RANDOM=$seed
    log "random seed $seed"
    local trials=${CKPT_KILL_TRIALS:-4}
    for t in $(seq 1 "$trials"); do
        rm -rf k pids
        mpi 3 sim --dir k --steps 100000 --every 1 --layout mixed --keep 3 --pids pids >/dev/null 2>&1 &
        local job=$!
        local waited=0
        while [ ! -f k/LATEST ] && [ $waited -lt 600 ]; do
            sleep 0.1
            waited=$((waited + 1))
        done
        [ -f k/LATEST ] || {
            fail "trial $t: no checkpoint appeared"
            kill $job 2>/dev/null
            wait $job 2>/dev/null
            continue
        }
        sleep "0.$((RANDOM % 10))$((RANDOM % 10))"
        local r=$((RANDOM % 3))
        local pid
        pid=$(cat pids/rank-$r.pid)
        kill -9 "$pid" 2>/dev/null
        wait $job 2>/dev/null
        local rc=$?
        [ $rc != 0 ] || fail "trial $t: the job exited 0 after rank $r was killed"
        local finals partials
        finals=$(ls k | grep -c '^step_.*\.h5$')
        partials=$(ls k | grep -c '\.partial$')
        # every file under a final name is complete
        for f in k/step_*.h5; do
            "$CK" verify "$f" >/dev/null 2>&1 || fail "trial $t: $f has a final name but does not verify: $("$CK" verify "$f" 2>&1 | tail -1)"
        done
        local p
        p=$("$CK" resolve k --full 2>&1) || fail "trial $t: resolve failed: $p"
        [ -n "$p" ] || fail "trial $t: nothing to resume from"
        local s
        s=$(step_of "$p")
        log "trial $t: killed rank $r (pid $pid) after ~$(((waited + 1) * 100)) ms + random delay; $finals complete, $partials partial; resume from $p"
        local out
        out=$(mpi 3 sim --dir k --steps $((s + 3)) --every 1 --layout fsdp --keep 3 --resume auto 2>&1) ||
            fail "trial $t: the restart failed: $out"
        printf '%s\n' "$out" | grep -q "resumed from $p at step $s" || fail "trial $t: restart did not resume from $p: $out"
        [ "$(cat k/LATEST)" = "$(printf 'step_%08d.h5' $((s + 3)))" ] || fail "trial $t: LATEST after the restart is $(cat k/LATEST)"
        ls k | grep -q '\.partial$' && fail "trial $t: a .partial survived the restart's retention"
    done
}

case_async() {
    expect_ok "async writes beside all-reduces, injected failure" mpi 4 async-stress --dir a --rounds 4
    # async checkpoints resume bitwise like synchronous ones
    expect_ok "sync reference" mpi 2 sim --dir as.ref --steps 9 --every 3 --layout fsdp --out as.ref.txt
    expect_ok "async, first part" mpi 2 sim --dir as.run --steps 9 --every 3 --layout fsdp --out as.run.txt --async --stop-after 6
    expect_ok "async, resumed" mpi 2 sim --dir as.run --steps 9 --every 3 --layout fsdp --out as.run.txt --async --resume auto
    expect_ok "async resume bitwise" "$DRV" compare as.ref.txt as.run.txt
    expect_ok "async final weights" "$CK" diff as.ref/step_00000009.h5 as.run/step_00000009.h5
    # the snapshot is taken at submit: the driver scribbles on its state right after, the file must not care
    expect_ok "async save" mpi 3 save --dir snap --step 1 --seed 5 --layout mixed --async
    expect_ok "snapshot isolation" mpi 2 load snap/step_00000001.h5 --seed 5 --layout fsdp
    # a failure on one rank only (test hook) is reported on every rank and LATEST is untouched
    local before
    before=$(cat snap/LATEST)
    expect_err "one rank fails mid-write" "injected failure at phase 'write'" env DG_TEST_CKPT_FAIL=write@2 "${MPI[@]}" -x DG_TEST_CKPT_FAIL -n 3 "$DRV" save --dir snap --step 2 --seed 6 --layout mixed --async
    [ "$(cat snap/LATEST)" = "$before" ] || fail "LATEST changed after a failed async write"
    [ ! -e snap/step_00000002.h5 ] || fail "a failed write left a final-named file"
    expect_err "commit failure" "injected failure at phase 'commit'" env DG_TEST_CKPT_FAIL=commit "${MPI[@]}" -x DG_TEST_CKPT_FAIL -n 2 "$DRV" save --dir snap --step 3 --seed 6 --layout fsdp
    [ "$(cat snap/LATEST)" = "$before" ] || fail "LATEST changed after a failed commit"
    [ ! -e snap/step_00000003.h5 ] || fail "a failed commit left a final-named file"
}

case_incremental() {
    # frozen tensors (wte, big, vec, layer 0) never change: an incremental chain links them
    local frz='wte,big,vec,h.0.*'
    expect_ok "full run" mpi 3 sim --dir full --steps 8 --every 2 --layout mixed --freeze "$frz" --out full.txt
    expect_ok "incremental run" mpi 3 sim --dir inc --steps 8 --every 2 --layout mixed --freeze "$frz" --incremental --out inc.txt
    local fs is
    fs=$(stat -c %s full/step_00000008.h5)
    is=$(stat -c %s inc/step_00000008.h5)
    log "full checkpoint $fs bytes, incremental $is bytes"
    [ "$is" -lt $((fs / 2)) ] || fail "incremental checkpoint ($is bytes) is not much smaller than a full one ($fs bytes)"
    [ "$(stat -c %s inc/step_00000002.h5)" -ge "$((fs * 9 / 10))" ] || fail "the first checkpoint of the chain should be full"
    "$CK" show inc/step_00000008.h5 >show.txt
    grep -q "^base       step_00000006.h5" show.txt || fail "show: no base: $(head -12 show.txt)"
    grep -q "^chain      .* -> step_00000002.h5 (present" show.txt || fail "show: no chain: $(head -12 show.txt)"
    grep -q "/model/big .* -> step_00000002.h5" show.txt || fail "show: /model/big is not linked"
    grep -q "/model/h.1.mlp.w .* stored" show.txt || fail "show: trained /model/h.1.mlp.w should be stored"
    expect_ok "same weights as the full run" "$CK" diff full/step_00000008.h5 inc/step_00000008.h5
    expect_ok "verify follows links" "$CK" verify inc/step_00000008.h5
    rm -rf inc2 && mkdir inc2 && cp inc/step_00000002.h5 inc/step_00000004.h5 inc2/ && echo step_00000004.h5 >inc2/LATEST
    expect_ok "resume from an incremental checkpoint" mpi 2 sim --dir inc2 --steps 8 --every 2 --layout fsdp --freeze "$frz" --incremental --resume auto --out inc2.txt
    expect_ok "final weights" "$CK" diff full/step_00000008.h5 inc2/step_00000008.h5
    # tampering: a link leading outside the directory, through a symlink, in a loop, or to a missing base
    mkdir -p t && cp inc/*.h5 t/ && cp full/step_00000008.h5 outside.h5
    cp t/step_00000008.h5 t/out.h5
    expect_ok "link out" "$DRV" link t/out.h5 /model/wpe ../outside.h5
    expect_err "link outside the directory" "t/out.h5:/model/wpe is an external link to '../outside.h5', outside the checkpoint directory" mpi 2 sim --dir t --steps 9 --resume t/out.h5 --freeze "$frz"
    ln -s "$W/outside.h5" t/sneaky.h5
    cp t/step_00000008.h5 t/sym.h5
    expect_ok "link via symlink" "$DRV" link t/sym.h5 /model/wpe sneaky.h5
    expect_err "symlink leading outside" "resolves to .*outside.h5 outside the checkpoint directory" "$CK" verify t/sym.h5
    cp t/step_00000008.h5 t/A.h5 && cp t/step_00000008.h5 t/B.h5
    expect_ok "loop A" "$DRV" link t/A.h5 /model/wpe B.h5
    expect_ok "loop B" "$DRV" link t/B.h5 /model/wpe A.h5
    expect_err "link loop" "external links loop: t/A.h5:/model/wpe -> B.h5:/model/wpe -> A.h5:/model/wpe" mpi 2 sim --dir t --steps 9 --resume t/A.h5 --freeze "$frz"
    rm t/step_00000002.h5
    expect_err "missing base" "links to t/step_00000002.h5, which cannot be opened" "$CK" verify t/step_00000008.h5
    # a replaced base (different data under the same name) is caught by the hash
    mkdir -p r && cp inc/step_00000006.h5 inc/step_00000008.h5 r/
    expect_ok "rewrite the base with other values" mpi 1 save --dir rr --step 2 --seed 99 --layout fsdp
    cp rr/step_00000002.h5 r/step_00000002.h5
    expect_err "replaced base" "content hash .* differs|hash attribute" "$CK" verify r/step_00000008.h5
}

case_retention() {
    # keep=2 with an incremental chain: the newest two stay, so does the full base they link to
    expect_ok "run" mpi 2 sim --dir k --steps 12 --every 2 --layout fsdp --freeze 'wte,big' --incremental --keep 2
    local files
    files=$(ls k | tr '\n' ' ')
    [ "$files" = "LATEST step_00000002.h5 step_00000010.h5 step_00000012.h5 " ] || fail "incremental keep=2 left: $files"
    # without incremental, exactly keep files remain
    expect_ok "run" mpi 2 sim --dir p --steps 10 --every 2 --layout fsdp --keep 3
    files=$(ls p | tr '\n' ' ')
    [ "$files" = "LATEST step_00000006.h5 step_00000008.h5 step_00000010.h5 " ] || fail "keep=3 left: $files"
    # keep=0 keeps everything
    expect_ok "run" mpi 1 sim --dir a --steps 6 --every 2 --layout fsdp --keep 0
    [ "$(ls a | grep -c h5)" = 3 ] || fail "keep=0 deleted files: $(ls a)"
    # LATEST's target is never deleted, even when older than the newest files (re-save of an older step)
    cp -r p q
    printf 'step_00000006.h5\n' >q/LATEST
    : >q/step_00000007.h5.partial
    expect_ok "resume from 6 and save 7" mpi 2 sim --dir q --steps 7 --every 1 --layout fsdp --keep 1 --resume auto
    files=$(ls q | tr '\n' ' ')
    [ "$files" = "LATEST step_00000007.h5 step_00000010.h5 " ] || fail "keep=1 after re-save left: $files"
    [ "$(cat q/LATEST)" = step_00000007.h5 ] || fail "LATEST is $(cat q/LATEST)"
}

case_partial() {
    # whatever is at the partial name cannot redirect the write: a symlink planted there is removed (not
    # followed) and the file is created exclusively
    mkdir -p p && printf 'do not touch\n' >victim.txt
    ln -s "$W/victim.txt" p/step_00000003.h5.partial
    expect_ok "save over a planted symlink" mpi 2 save --dir p --step 3 --seed 4 --layout fsdp
    [ "$(cat victim.txt)" = "do not touch" ] || fail "the symlink's target was written"
    [ -L p/step_00000003.h5.partial ] && fail "the planted symlink is still there"
    expect_ok "the checkpoint verifies" "$CK" verify -q p/step_00000003.h5
    # a directory of that name is a clear error, and LATEST stays
    mkdir p/step_00000004.h5.partial
    expect_err "a directory at the partial name" "step_00000004.h5.partial exists and is a directory" mpi 2 save --dir p --step 4 --seed 4 --layout fsdp
    [ "$(cat p/LATEST)" = step_00000003.h5 ] || fail "LATEST is $(cat p/LATEST)"
}

case_umask() {
    (umask 027 && mpi 2 save --dir u1 --step 1 --seed 1 --layout fsdp >/dev/null) || fail "save with umask 027"
    local m
    m=$(stat -c %a u1/step_00000001.h5)
    [ "$m" = 640 ] || fail "umask 027 gave mode $m"
    m=$(stat -c %a u1/LATEST)
    [ "$m" = 640 ] || fail "umask 027 gave LATEST mode $m"
    (umask 000 && mpi 2 save --dir u2 --step 1 --seed 1 --layout fsdp >/dev/null) || fail "save with umask 000"
    m=$(stat -c %a u2/step_00000001.h5)
    [ "$m" = 664 ] || fail "umask 000 gave mode $m (must never be world-writable)"
    m=$(stat -c %a u2/LATEST)
    [ "$m" = 664 ] || fail "umask 000 gave LATEST mode $m"
    log "ok: modes 640 under umask 027, 664 under umask 000"
}

find_h5py() {
    for p in "${PYTHON_H5PY:-}" python3 /usr/bin/python3; do
        [ -n "$p" ] && command -v "$p" >/dev/null 2>&1 && "$p" -c 'import h5py, numpy' 2>/dev/null && {
            echo "$p"
            return 0
        }
    done
    return 1
}

case_direct() {
    # Chunks that lie wholly in one rank's piece are checksummed and written by that rank itself (save.c,
    # "direct chunk writes"); the others go through HDF5's collective filtered write. With 1 KiB chunks
    # the small test tensors have many chunks: whole ones, shared ones, edge chunks with padding, 1-D,
    # and tensors that do not qualify (3-D chunking, column or replicated pieces).
    local n l out
    for spec in "1 fsdp" "3 fsdp" "4 mixed" "2 cols"; do
        set -- $spec
        n=$1 l=$2
        out=$(mpi "$n" save --dir "d$n$l" --step 1 --seed 5 --layout "$l" --chunk-bytes 1024 2>&1) || fail "save $n $l: $out"
        case "$l" in
        fsdp | mixed)
            printf '%s\n' "$out" | grep -q 'direct_bytes=[1-9]' || fail "save $n $l wrote no direct chunks: $out"
            # tensors whose every chunk is written directly skip HDF5's creation fill (save.c)
            printf '%s\n' "$out" | grep -q 'fill_skipped_bytes=[1-9]' || fail "save $n $l skipped no fill: $out"
            ;;
        esac
        expect_ok "load $n $l at 3 ranks (grid)" mpi 3 load "d$n$l/step_00000001.h5" --seed 5 --layout grid
        expect_ok "load $n $l at 1 rank" mpi 1 load "d$n$l/step_00000001.h5" --seed 5 --layout fsdp
        expect_ok "verify $n $l" "$CK" verify "d$n$l/step_00000001.h5"
    done
    # the switch: everything through HDF5, same values
    out=$(DG_CKPT_DIRECT_CHUNKS=0 mpi 3 save --dir off --step 1 --seed 5 --layout fsdp --chunk-bytes 1024 2>&1) || fail "save direct off: $out"
    printf '%s\n' "$out" | grep -q 'direct_bytes=0 fill_skipped_bytes=0' || fail "DG_CKPT_DIRECT_CHUNKS=0 still wrote direct chunks or skipped fills: $out"
    # direct chunks with HDF5's fill: the same values as the file written with skipped fills
    out=$(DG_CKPT_SKIP_FILL=0 mpi 3 save --dir fill --step 1 --seed 5 --layout fsdp --chunk-bytes 1024 2>&1) || fail "save fill on: $out"
    printf '%s\n' "$out" | grep -q 'direct_bytes=[1-9][0-9]* fill_skipped_bytes=0' || fail "DG_CKPT_SKIP_FILL=0: $out"
    expect_ok "diff skipped fill vs HDF5's fill" "$CK" diff d3fsdp/step_00000001.h5 fill/step_00000001.h5
    # a chunk index that does not look as the direct writer expects, after a skipped fill (the test hook
    # pretends so on rank 1): the save is redone with HDF5's fill, and says so
    out=$(DG_TEST_CKPT_FAIL=chunkindex@1 mpi 3 save --dir redo --step 1 --seed 5 --layout fsdp --chunk-bytes 1024 2>&1) || fail "save with an unexpected chunk index: $out"
    printf '%s\n' "$out" | grep -q 'writing it again with HDF5.s fill' || fail "no warning about the redone save: $out"
    printf '%s\n' "$out" | grep -q 'fill_skipped_bytes=0' || fail "the redone save still skipped fills: $out"
    expect_ok "verify the redone save" "$CK" verify redo/step_00000001.h5
    expect_ok "diff redone save vs skipped fill" "$CK" diff d3fsdp/step_00000001.h5 redo/step_00000001.h5
    expect_ok "load direct off" mpi 2 load off/step_00000001.h5 --seed 5 --layout cols
    # HDF5 itself (h5dump) reads the directly written chunks and verifies their checksums: same values
    # as the file HDF5 wrote alone
    if command -v h5dump >/dev/null; then
        for ds in model/wte model/vec optim/big/m; do
            h5dump -d "/$ds" d3fsdp/step_00000001.h5 >a.txt 2>&1 || fail "h5dump /$ds of the direct file: $(tail -3 a.txt)"
            h5dump -d "/$ds" off/step_00000001.h5 >b.txt 2>&1 || fail "h5dump /$ds of the HDF5 file"
            diff <(sed 1d a.txt) <(sed 1d b.txt) >/dev/null || fail "h5dump /$ds: direct and HDF5-written values differ"
        done
    fi
    # a flipped bit in a directly written chunk (whole chunk of rank 1; the edge chunk; a 1-D chunk) is
    # caught by HDF5's checksum on read
    for dc in "model/wte 4" "model/wte 9" "model/vec 3"; do
        set -- $dc
        cp d3fsdp/step_00000001.h5 flip.h5
        expect_ok "flip a bit in $1 chunk $2" "$DRV" corrupt flip.h5 "$1" --chunk "$2"
        expect_err "flipped $1 chunk $2: load" "flip.h5:/$1: checksum mismatch \(Fletcher32\)" mpi 2 load flip.h5 --seed 5 --layout fsdp
        expect_err "flipped $1 chunk $2: verify" "flip.h5:/$1: checksum mismatch" "$CK" verify flip.h5
    done
    # async saves take the same path (from the snapshot)
    out=$(mpi 3 save --dir as --step 2 --seed 6 --layout fsdp --chunk-bytes 1024 --async 2>&1) || fail "async save: $out"
    printf '%s\n' "$out" | grep -q 'direct_bytes=[1-9]' || fail "async save wrote no direct chunks: $out"
    expect_ok "load async direct" mpi 2 load as/step_00000002.h5 --seed 6 --layout cols
}

case_h5py() {
    local py
    if ! py=$(find_h5py); then
        source "$HERE/../lib/skip.sh" # SKIP (77) outside CI, FAIL under CI=true
        dg_skip "no python3 with h5py and numpy (Debian: apt-get install python3-h5py; scripts/setup.sh does it)"
    fi
    command -v h5dump >/dev/null || {
        source "$HERE/../lib/skip.sh"
        dg_skip "h5dump not found (Debian: hdf5-tools; scripts/setup.sh installs it)"
    }
    expect_ok "full" mpi 3 sim --dir h --steps 4 --every 2 --layout mixed --freeze 'big,wte' --incremental
    expect_ok "synthetic" mpi 2 save --dir hs --step 5 --seed 8 --layout cols
    # h5py, from another directory, follows the incremental links and reads values and attributes
    mkdir -p elsewhere
    (cd elsewhere && "$py" "$HERE/test_h5py.py" "$W/hs/step_00000005.h5" 8 "$W/h/step_00000004.h5") || fail "h5py checks"
    # h5dump reads the header, a dataset and an attribute without dgtrain
    h5dump -H -p hs/step_00000005.h5 >dump.txt 2>&1 || fail "h5dump -H failed"
    grep -q 'DATASET "wte"' dump.txt && grep -q 'CHECKSUM FLETCHER32' dump.txt || fail "h5dump -H output lacks wte or FLETCHER32"
    h5dump -d /model/h.0.ln.w hs/step_00000005.h5 >dump2.txt 2>&1 || fail "h5dump -d failed"
    grep -q '(0):' dump2.txt || fail "h5dump -d printed no data"
    h5dump -a /format hs/step_00000005.h5 | grep -q dgtrain-checkpoint || fail "h5dump -a /format"
    h5dump -d /model/big h/step_00000004.h5 >dump3.txt 2>&1 || fail "h5dump does not follow the external link: $(tail -3 dump3.txt)"
    log "ok: h5dump reads header, data, attributes and linked datasets"
}

case_dgckpt() {
    expect_ok "chain" mpi 2 sim --dir c --steps 6 --every 2 --layout fsdp --freeze 'wte' --incremental --keep 5
    expect_ok "other" mpi 2 sim --dir o --steps 6 --every 2 --layout fsdp --freeze 'wte' --keep 5
    : >c/step_00000007.h5.partial
    "$CK" list c >list.txt || fail "list failed"
    cat list.txt
    grep -q "step_00000006.h5 .* ok  <- LATEST" list.txt || fail "list: LATEST not marked"
    grep -q "step_00000002.h5 .* full .* ok" list.txt || fail "list: full base"
    grep -q "step_00000004.h5 .* incr (3 linked)" list.txt || fail "list: incremental kind"
    grep -q "step_00000007.h5.partial .* interrupted save" list.txt || fail "list: partial"
    "$CK" show c/step_00000004.h5 --config >show.txt || fail "show failed"
    for k in "^step       4" "^tokens     512" "^world      2 ranks, mesh dp_replicate=1,dp_shard=2,tp=1" "^loader     epoch 0, cursor 32, samples seen 32" "^rng        1 words" "^config     2 lines:" "^name = sim" "/model/wte .* -> step_00000002.h5" "/optim/big/v .* stored"; do
        grep -Eq -- "$k" show.txt || fail "show: no line /$k/"
    done
    expect_ok "verify" "$CK" verify c/step_00000006.h5
    "$CK" verify -q c/step_00000006.h5 | grep -q ": ok" || fail "verify -q"
    # diff: identical -> 0, different -> 1 with per-dataset max |a-b|, missing dataset reported
    "$CK" diff c/step_00000006.h5 o/step_00000006.h5 >diff.txt || fail "diff of identical weights returned $?"
    grep -q "/model/wte .* max|a-b| = 0 (identical)" diff.txt || fail "diff output: $(head -3 diff.txt)"
    "$CK" diff c/step_00000004.h5 o/step_00000006.h5 >diff2.txt
    [ $? = 1 ] || fail "diff of different steps should exit 1"
    grep -Eq "/model/h.0.attn.w +max\|a-b\| = [0-9.e-]+ +\([0-9]+ of 1728 elements differ" diff2.txt || fail "diff2: $(grep attn.w diff2.txt | head -2)"
    grep -q "note: step 4 vs 6" diff2.txt || fail "diff2: no step note"
    cp o/step_00000006.h5 o6.h5 && "$DRV" delete o6.h5 model/wpe
    # the manifest of o6.h5 still lists /model/wpe: reading it fails, which is trouble (exit 2), not a difference
    expect_err "diff on a damaged file" "dataset /model/wpe is missing" "$CK" diff o/step_00000006.h5 o6.h5
    "$CK" diff o/step_00000006.h5 o6.h5 >/dev/null 2>&1
    [ $? = 2 ] || fail "diff on an unreadable dataset should exit 2"
    # export: a safetensors file parsed with the Python standard library only, values checked
    # against the formula the synthetic state was made from
    expect_ok "synthetic" mpi 3 save --dir s --step 3 --seed 31 --layout mixed
    expect_ok "export" "$CK" export s/step_00000003.h5 w.safetensors
    expect_ok "export --all" "$CK" export s/step_00000003.h5 all.safetensors --all
    expect_ok "export of an incremental checkpoint" "$CK" export c/step_00000006.h5 inc.safetensors
    local py
    if py=$(command -v python3); then
        expect_ok "safetensors (model)" "$py" "$HERE/check_safetensors.py" w.safetensors 31 model
        expect_ok "safetensors (all)" "$py" "$HERE/check_safetensors.py" all.safetensors 31 all
        expect_err "the checker catches a wrong seed" "mismatch" "$py" "$HERE/check_safetensors.py" w.safetensors 32 model
    else
        fail "python3 is needed to parse the safetensors file"
    fi
    # usage errors: exit 2 with a message
    expect_err "no command" "usage" "$CK"
    expect_err "bad command" "unknown command 'frobnicate'" "$CK" frobnicate
    expect_err "missing arg" "expected 2 arguments" "$CK" diff a
    expect_err "bad option" "unknown option --bogus" "$CK" show c/step_00000006.h5 --bogus
    "$CK" verify nonexistent.h5 >/dev/null 2>&1
    [ $? = 1 ] || fail "verify of a missing file should exit 1"
    "$CK" frobnicate >/dev/null 2>&1
    [ $? = 2 ] || fail "usage error should exit 2"
}

case "$CASE" in
roundtrip | reshard | resume_same | resume_worldsize | damage | fallback | sigkill | async | incremental | retention | umask | partial | h5py | dgckpt | direct)
    "case_$CASE"
    ;;
*)
    echo "unknown case $CASE" >&2
    exit 2
    ;;
esac
finish
