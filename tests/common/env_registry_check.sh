#!/bin/bash
# env_registry_check.sh SRC_DIR — the registry is the only reader of DG_* variables, and documented:
# 1. no getenv("DG_ in src/ outside src/common/env.c;
# 2. every name registered in src/common/env.c is a row of README.md's "Environment variables" table,
#    and every row there is registered (README and registry stay in sync).
set -u
root=${1:?usage: env_registry_check.sh SRC_DIR}
fail=0
hits=$(grep -rn 'getenv("DG_' "$root/src" | grep -v "^$root/src/common/env.c:")
if [ -n "$hits" ]; then
    echo "FAIL: getenv(\"DG_ outside src/common/env.c (use dg_env_* from dg_env.h):"; echo "$hits"; fail=1
fi
reg=$(grep -oE '^ *\{"DG_[A-Z0-9_]+", DG_ENV_' "$root/src/common/env.c" | grep -oE '"DG_[A-Z0-9_]+"' | tr -d '"' | sort)
[ "$(echo "$reg" | wc -l)" -ge 30 ] || { echo "FAIL: could not read the registry ($(echo "$reg" | wc -l) names)"; fail=1; }
doc=$(sed -n '/^## Environment variables/,/^## /p' "$root/README.md" | grep -oE '^\| `DG_[A-Z0-9_]+`' |
      grep -oE 'DG_[A-Z0-9_]+' | sort)
missing=$(comm -23 <(echo "$reg") <(echo "$doc"))
extra=$(comm -13 <(echo "$reg") <(echo "$doc"))
[ -z "$missing" ] || { echo "FAIL: registered but not in README.md 'Environment variables': $missing"; fail=1; }
[ -z "$extra" ] || { echo "FAIL: in README.md 'Environment variables' but not registered: $extra"; fail=1; }
[ $fail = 0 ] && echo "env_registry_check: $(echo "$reg" | wc -l) switches, all read through env.c and documented"
exit $fail
