#!/bin/bash
# run_test_python.sh — run a Python test with the test virtual environment's interpreter (made by
# scripts/setup.sh from scripts/requirements-test.txt; $DG_TEST_VENV, default /opt/dgtrain/test-venv).
# Without it the test is skipped (exit 77), or fails under CI=true.
#   run_test_python.sh SCRIPT.py ARGS...
venv=${DG_TEST_VENV:-/opt/dgtrain/test-venv}
if [ ! -x "$venv/bin/python" ]; then
    echo "no test venv at $venv (run scripts/setup.sh)"
    [ "${CI:-}" = true ] && { echo "FAIL (CI=true)"; exit 1; }
    echo "SKIP"
    exit 77
fi
exec "$venv/bin/python" "$@"
