#!/bin/bash
# test_dgprep_gpt2.sh — dgprep --tokenizer gpt2 on the command line: each option's errors (exact
# one-line message, exit 1), the ranks-file search order, a vocabulary too large for uint16 shards,
# the progress line, and the build without PCRE2 (it refuses gpt2 clearly, bytes still work). The ids
# themselves are test_tiktoken.py's job.
# Usage: test_dgprep_gpt2.sh PATH/TO/dgprep PATH/TO/dgprep_nopcre2
set -u
DGPREP=$1
NOPCRE=$2
T=$(mktemp -d /tmp/dg_test_dgprep_gpt2_XXXXXX)
trap 'rm -rf "$T"' EXIT
source "$(dirname "$0")/../lib/expect.sh"
PY=/usr/bin/python3

RANKS=${DG_GPT2_TIKTOKEN:-}
for p in /usr/local/share/dgtrain/gpt2.tiktoken /usr/share/dgtrain/gpt2.tiktoken; do
    [ -z "$RANKS" ] && [ -f "$p" ] && RANKS=$p
done
if [ -z "$RANKS" ] || [ ! -f "$RANKS" ]; then
    echo "no gpt2.tiktoken (run scripts/setup.sh)"
    [ "${CI:-}" = true ] && { echo "FAIL (CI=true)"; exit 1; }
    echo SKIP
    exit 77
fi
unset DG_GPT2_TIKTOKEN

printf 'Hello world\n' >"$T/ok.txt"
printf 'ab\0cd\n' >"$T/bin.dat"

G=(--tokenizer gpt2 --out "$T/o")
expect_fail "dgprep: --tokenizer expects 'bytes' or 'gpt2', got 'gpt3'" "$DGPREP" --tokenizer gpt3 --out "$T/o" "$T/ok.txt"
expect_fail "dgprep: --docs expects 'file' or 'blank-line', got 'line'" "$DGPREP" "${G[@]}" --docs line "$T/ok.txt"
expect_fail "dgprep: --docs needs --tokenizer gpt2" "$DGPREP" --out "$T/o" --docs file "$T/ok.txt"
expect_fail "dgprep: --vocab needs --tokenizer gpt2" "$DGPREP" --out "$T/o" --vocab "$RANKS" "$T/ok.txt"
expect_fail "dgprep: --hf-tokenizer needs --tokenizer gpt2" "$DGPREP" --out "$T/o" --hf-tokenizer "$T" "$T/ok.txt"
expect_fail "dgprep: --chunk-bytes needs --tokenizer gpt2" "$DGPREP" --out "$T/o" --chunk-bytes 10 "$T/ok.txt"
expect_fail "dgprep: give --vocab FILE or --hf-tokenizer DIR, not both" "$DGPREP" "${G[@]}" --vocab "$RANKS" --hf-tokenizer "$T" "$T/ok.txt"
expect_fail "dgprep: --threads expects an integer in [1, 4096], got '0'" "$DGPREP" "${G[@]}" --threads 0 "$T/ok.txt"
expect_fail "dgprep: --chunk-bytes expects an integer in [1, 2^40], got '-5'" "$DGPREP" "${G[@]}" --chunk-bytes -5 "$T/ok.txt"
expect_fail "dgprep: tokenizer: cannot read ranks file $T/none.tiktoken: No such file or directory" \
    "$DGPREP" "${G[@]}" --vocab "$T/none.tiktoken" "$T/ok.txt"
expect_fail "dgprep: tokenizer: cannot read $T/vocab.json: No such file or directory" \
    "$DGPREP" "${G[@]}" --hf-tokenizer "$T" "$T/ok.txt"
DG_GPT2_TIKTOKEN=$T/none expect_fail \
    "dgprep: tokenizer: cannot read ranks file $T/none (from \$DG_GPT2_TIKTOKEN): No such file or directory" \
    "$DGPREP" "${G[@]}" "$T/ok.txt"
printf 'IQ== 0\nnot a line\n' >"$T/bad.tiktoken"
expect_fail "dgprep: tokenizer $T/bad.tiktoken:2: expected 'BASE64 RANK' (a token in base64, one space, a decimal rank)" \
    "$DGPREP" "${G[@]}" --vocab "$T/bad.tiktoken" "$T/ok.txt"
expect_fail "dgprep: $T/bin.dat is not text: NUL byte at offset 2" "$DGPREP" "${G[@]}" "$T/bin.dat"
# A vocabulary that uint16 shards cannot hold: the 256 bytes and 70000 four-letter tokens.
$PY - "$T/big.tiktoken" <<'EOF'
import base64, sys
with open(sys.argv[1], "w") as f:
    r = 0
    for b in range(256):
        f.write("%s %d\n" % (base64.b64encode(bytes([b])).decode(), r)); r += 1
    for i in range(70000):
        f.write("%s %d\n" % (base64.b64encode(bytes([65 + i // 26 ** k % 26 for k in range(4)])).decode(), r)); r += 1
EOF
expect_fail "dgprep: tokenizer $T/big.tiktoken has 70257 tokens; llm.c shards (uint16) hold at most 65536" \
    "$DGPREP" "${G[@]}" --vocab "$T/big.tiktoken" "$T/ok.txt"
[ -e "$T/o" ] && fail_check "a failed run created $T/o"

# Search order: $DG_GPT2_TIKTOKEN, then <dir of the executable>/../share/dgtrain, then the system paths.
check_source() { # want-path env-value prog
    local want=$1 envv=$2 prog=$3 out
    out=$(DG_GPT2_TIKTOKEN=$envv "$prog" "${G[@]}" --quiet --val-fraction 0 "$T/ok.txt" 2>&1)
    if ! grep -qF "  GPT-2 BPE ($want): 1 document, each preceded by <|endoftext|> (50256)" <<<"$out"; then
        fail_check "ranks should come from $want (env '$envv'); output: $out"
    fi
}
mkdir -p "$T/inst/bin" "$T/inst/share/dgtrain"
cp "$DGPREP" "$T/inst/bin/dgprep"
cp "$RANKS" "$T/inst/share/dgtrain/gpt2.tiktoken"
cp "$RANKS" "$T/env.tiktoken"
check_source "$T/env.tiktoken" "$T/env.tiktoken" "$T/inst/bin/dgprep"
check_source "$T/inst/bin/../share/dgtrain/gpt2.tiktoken" "" "$T/inst/bin/dgprep"
rm "$T/inst/share/dgtrain/gpt2.tiktoken"
check_source "$RANKS" "" "$T/inst/bin/dgprep"
out=$("$DGPREP" "${G[@]}" --vocab "$T/env.tiktoken" "$T/ok.txt" 2>&1)
if ! grep -qF "  model.vocab_size = 50257" <<<"$out" || ! grep -qF "GPT-2 BPE ($T/env.tiktoken)" <<<"$out"; then
    fail_check "--vocab FILE run: $out"
fi

# Progress: inputs of 4 MB or more get percentage lines with the rate when stderr is not a terminal
# (one per 10% passed, counted as pieces of about --chunk-bytes finish).
$PY -c "
import sys
line = 'Tokenizers split text into pieces; 12345 numbers, \u4f60\u597d, and emoji \U0001F44D too.\n'
open(sys.argv[1], 'w').write(line * (5 * 1024 * 1024 // len(line.encode()) + 1))
" "$T/big.txt"
err=$("$DGPREP" "${G[@]}" --threads 2 "$T/big.txt" 2>&1 >/dev/null)
if ! grep -qE "^dgprep: [1-9]0% of 5\.2 MB, [0-9]+\.[0-9] MB/s$" <<<"$err" ||
    ! grep -qE "^dgprep: 100% of 5\.2 MB, [0-9]+\.[0-9] MB/s$" <<<"$err"; then
    fail_check "no progress lines for a 5 MB input; stderr was: $err"
fi
err=$("$DGPREP" "${G[@]}" --quiet "$T/big.txt" 2>&1 >/dev/null)
[ -z "$err" ] || fail_check "--quiet printed: $err"

# Built without PCRE2: gpt2 is refused with a clear message, byte-level shards still work.
expect_fail "dgprep: --tokenizer gpt2 is not available: this dgprep was built without PCRE2 (install libpcre2-dev, e.g. with scripts/setup.sh, and rebuild)" \
    "$NOPCRE" "${G[@]}" "$T/ok.txt"
if ! "$NOPCRE" --out "$T/nb" --quiet "$T/ok.txt" | grep -qF "model.vocab_size = 256"; then
    fail_check "the no-PCRE2 dgprep cannot make byte-level shards"
fi

expect_done
