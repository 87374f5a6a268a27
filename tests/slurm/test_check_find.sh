#!/bin/bash
# docs/reliability.md: `slurm/train.sh --check` must find build/src/cli/dgtrain when run from the repository root
# (outside Slurm there is no SLURM_SUBMIT_DIR) and from any other directory (through the script's own
# checkout, slurm/..), and DGTRAIN_BIN must override. No Slurm daemons are needed for --check: it runs the
# real dgtrain --print-config. Usage: test_check_find.sh SOURCE_DIR DGTRAIN
set -u
SRC=$1
DGTRAIN=$2
[ -x "$DGTRAIN" ] || { echo "FAIL: dgtrain '$DGTRAIN' is not executable"; exit 1; }
W=$(mktemp -d /tmp/dgt-check-find.XXXXXX)
trap 'rm -rf "$W"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }
# a repository layout: REPO/slurm/train.sh and REPO/build/src/cli/dgtrain (the real binary)
mkdir -p "$W/repo/slurm" "$W/repo/build/src/cli" "$W/elsewhere"
cp "$SRC/slurm/train.sh" "$SRC/slurm/lib.sh" "$W/repo/slurm/" # train.sh sources lib.sh beside it
cp "$DGTRAIN" "$W/repo/build/src/cli/dgtrain"
printf '[run]\ndir = %s/run\n' "$W" >"$W/cfg.ini"
# no dgtrain on PATH and none of the Slurm/build variables: only the new lookups can find it
clean=(env -u DGTRAIN_BIN -u DGT_BUILD_DIR -u SLURM_SUBMIT_DIR -u SLURM_JOB_ID PATH=/usr/bin:/bin)

out=$(cd "$W/repo" && "${clean[@]}" bash slurm/train.sh --check "$W/cfg.ini" 2>&1)
rc=$?
[ $rc = 0 ] && grep -q "checks passed.*dgtrain $W/repo/build/src/cli/dgtrain" <<<"$out" ||
    fail "from the repository root: rc $rc: $out"

out=$(cd "$W/elsewhere" && "${clean[@]}" bash "$W/repo/slurm/train.sh" --check "$W/cfg.ini" 2>&1)
rc=$?
[ $rc = 0 ] && grep -q "checks passed.*dgtrain $W/repo/build/src/cli/dgtrain" <<<"$out" ||
    fail "from another directory: rc $rc: $out"

cp "$DGTRAIN" "$W/elsewhere/dgt-other"
out=$(cd "$W/repo" && "${clean[@]}" DGTRAIN_BIN="$W/elsewhere/dgt-other" bash slurm/train.sh --check "$W/cfg.ini" 2>&1)
rc=$?
[ $rc = 0 ] && grep -q "checks passed.*dgtrain $W/elsewhere/dgt-other" <<<"$out" ||
    fail "DGTRAIN_BIN override: rc $rc: $out"

# nothing to find: one clear line naming what was tried, exit 1
rm "$W/repo/build/src/cli/dgtrain"
out=$(cd "$W/elsewhere" && "${clean[@]}" bash "$W/repo/slurm/train.sh" --check "$W/cfg.ini" 2>&1)
rc=$?
[ $rc = 1 ] && grep -q "cannot find dgtrain: tried .*DGTRAIN_BIN" <<<"$out" ||
    fail "no dgtrain anywhere: expected exit 1 and 'cannot find dgtrain', got rc $rc: $out"

[ $fails = 0 ] && echo "PASS: train.sh --check finds dgtrain from the repo root, elsewhere, and via DGTRAIN_BIN"
exit $((fails > 0))
