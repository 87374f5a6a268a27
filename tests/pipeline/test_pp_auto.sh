#!/bin/bash
# test_pp_auto.sh — parallel.mesh = auto scores pipeline candidates on the live cluster too
# (docs/parallelism.md "The planner's rule"): on this one CPU node, 2 and 4 ranks of the default job, the
# planner's --plan-only report carries a "pipeline rejected: ..." line naming the best pp plan, its bubble
# and the plan without a pipeline it lost to, and the chosen mesh has no pp.
# Usage: test_pp_auto.sh DGTRAIN CONFIG MPIEXEC [MPIEXEC FLAGS...]
set -u
dgtrain=$1 config=$2
shift 2
work=$(mktemp -d /tmp/dgt-pp-auto-XXXXXX)
trap 'rm -rf "$work"' EXIT
errors=()
# need TEXT PATTERN WHAT: TEXT must match the shell PATTERN
need() { [[ $1 == $2 ]] || errors+=("$3: ${1:-<none>}"); }

for n in 2 4; do
    "$@" -n $n "$dgtrain" "$config" --plan-only --set run.dir="$work/run$n" >"$work/out$n" 2>&1
    rc=$?
    pp=$(grep -m1 '^  pipeline' "$work/out$n")
    chosen=$(grep -m1 '^  chosen:' "$work/out$n")
    echo "$n ranks: exit $rc"
    echo "$chosen" | cut -c1-160
    echo "$pp" | cut -c1-240
    need "$rc" 0 "$n ranks: --plan-only exit code"
    need "$pp" "  pipeline rejected: the best pp plan *pp=* estimates * ms per step against * ms for *: its bubble of *% over * micro-batches*" "$n ranks: the pipeline verdict"
    need "$chosen" "  chosen: dp_replicate=*" "$n ranks: the chosen plan"
    [[ $chosen == *pp=* ]] && errors+=("$n ranks: a pipeline was chosen on one node: $chosen")
done
if ((${#errors[@]})); then
    printf 'FAIL: %s\n' "${errors[@]}"
    exit 1
fi
echo "PASS: mesh = auto scores pipelines on the live cluster and says why it rejected them"
