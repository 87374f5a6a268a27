# tests/lib/expect.sh — the bad-input check of the shell tests that drive a command line (sourced).
# shellcheck shell=bash
#
# expect_fail WANT PROG ARGS...: PROG ARGS must exit 1 with exactly WANT on stderr (stdout is ignored);
# otherwise it prints what differs and counts one in $fails (the test's exit status comes from it).
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
