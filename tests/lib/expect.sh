# tests/lib/expect.sh — the bad-input check of the shell tests that drive a command line (sourced).
# shellcheck shell=bash
#
# expect_fail WANT PROG ARGS...: PROG ARGS must exit 1 with exactly WANT on stderr (stdout is ignored);
# otherwise it prints what differs and counts one in $fails; expect_done turns $fails into the exit status.
fails=${fails:-0}
expect_fail() {
    local want=$1 prog=$2
    shift 2
    local err rc
    err=$("$prog" "$@" 2>&1 >/dev/null)
    rc=$?
    if [ "$rc" -ne 1 ] || [ "$err" != "$want" ]; then
        echo "FAIL: $prog $*"
        echo "  rc:   $rc (want 1)"
        echo "  got:  $err"
        echo "  want: $want"
        fails=$((fails + 1))
    fi
}

# fail_check WHAT: one failed check of the test's own: prints "FAIL: WHAT" and counts it in $fails
fail_check() {
    echo "FAIL: $*"
    fails=$((fails + 1))
}

# expect_done: the test's end: "N check(s) failed" and exit 1, or "ok" and exit 0
expect_done() {
    if [ "$fails" -ne 0 ]; then
        echo "$fails check(s) failed"
        exit 1
    fi
    echo "ok"
}
