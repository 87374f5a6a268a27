#!/bin/bash
# test_dgprep.sh — the dgprep command line: every error case (exact one-line message, exit 1), a
# round trip checked by an independent reader (python3 parses the llm.c shards), multi-shard output,
# and progress lines for a big input. Usage: test_dgprep.sh PATH/TO/dgprep
set -u
DGPREP=$1
T=$(mktemp -d /tmp/dg_test_dgprep_XXXXXX)
trap 'rm -rf "$T"' EXIT
source "$(dirname "$0")/../lib/expect.sh"

printf 'some text\n' >"$T/ok.txt"
: >"$T/empty.txt"
printf 'ab\0cd\n' >"$T/bin.dat"
mkdir "$T/emptydir"
printf 'x' >"$T/afile"

expect_fail "dgprep: cannot read $T/nope.txt: No such file or directory" "$DGPREP" --out "$T/o" "$T/nope.txt"
expect_fail "dgprep: $T/empty.txt is empty" "$DGPREP" --out "$T/o" "$T/ok.txt" "$T/empty.txt"
expect_fail "dgprep: $T/bin.dat is not text: NUL byte at offset 2" "$DGPREP" --out "$T/o" "$T/bin.dat"
expect_fail "dgprep: empty input: no text file to read" "$DGPREP" --out "$T/o" "$T/emptydir"
expect_fail "dgprep: output directory $T/afile/sub is not usable: cannot create directory $T/afile/sub: Not a directory" "$DGPREP" \
    --out "$T/afile/sub" "$T/ok.txt"
expect_fail "dgprep: --out DIR is required (see dgprep --help)" "$DGPREP" "$T/ok.txt"
expect_fail "dgprep: no input files given (see dgprep --help)" "$DGPREP" --out "$T/o"
expect_fail "dgprep: --val-fraction expects a number with 0 <= F < 1, got '1.5'" "$DGPREP" --out "$T/o" --val-fraction 1.5 "$T/ok.txt"
expect_fail "dgprep: --val-fraction expects a number with 0 <= F < 1, got 'abc'" "$DGPREP" --out "$T/o" --val-fraction=abc "$T/ok.txt"
expect_fail "dgprep: --shard-tokens expects an integer in [1, 2147483647], got '0'" "$DGPREP" --out "$T/o" --shard-tokens 0 "$T/ok.txt"
expect_fail "dgprep: unknown option '--frobnicate' (see dgprep --help)" "$DGPREP" --frobnicate
expect_fail "dgprep: --out needs a value (see dgprep --help)" "$DGPREP" "$T/ok.txt" --out
expect_fail "dgprep: bad name 'a/b' (expected letters, digits, '_', '-', '.'; not starting with '.')" "$DGPREP" \
    --out "$T/o" --name a/b "$T/ok.txt"
[ -e "$T/o" ] && fail_check "a failed run created $T/o"

"$DGPREP" --help | grep -q "usage: dgprep --out DIR" || fail_check "--help"

# Round trip: a directory (sorted: a.txt then b.txt) plus an explicit file, small shards.
mkdir "$T/in"
python3 - "$T" <<'EOF'
import sys
t = sys.argv[1]
open(t + "/in/b.txt", "w").write("".join("second file, line %d\n" % i for i in range(30)))
open(t + "/in/a.txt", "w", encoding="utf-8").write("".join("première ligne %d — ok\n" % i for i in range(40)))
open(t + "/c.txt", "w").write("no newline at the end")
EOF
out=$("$DGPREP" --out "$T/shards" --name rt --val-fraction 0.25 --shard-tokens 300 --quiet "$T/in" "$T/c.txt")
rc=$?
if [ $rc -ne 0 ]; then
    fail_check "round trip run exited $rc"
fi
echo "$out"
python3 - "$T" "$out" <<'EOF' || fails=$((fails + 1))
import glob, struct, sys
t, out = sys.argv[1], sys.argv[2]

def split(data, frac):
    # the documented rule: cut0 = n - round(n*frac); move to the next line start before the last byte
    n = len(data)
    cut0 = n - int(n * frac + 0.5)
    cut = 0 if cut0 == 0 else None
    if cut is None:
        for i in range(max(cut0 - 1, 0), n - 1):
            if data[i] == 10:
                cut = i + 1
                break
    if cut is None:
        cut = cut0
    tr, va = data[:cut], data[cut:]
    if not data.endswith(b"\n"):
        if va: va += b"\n"
        else: tr += b"\n"
    return tr, va

want_tr, want_va = b"", b""
for f in [t + "/in/a.txt", t + "/in/b.txt", t + "/c.txt"]:
    a, b = split(open(f, "rb").read(), 0.25)
    want_tr += a
    want_va += b

def read(pattern):
    files = sorted(glob.glob(pattern))
    toks = []
    for f in files:
        raw = open(f, "rb").read()
        magic, version, n = struct.unpack("<3i", raw[:12])
        assert magic == 20240520 and version == 1, (f, magic, version)
        assert len(raw) == 1024 + 2 * n, (f, len(raw), n)
        assert n <= 300, (f, n)
        toks += struct.unpack("<%dH" % n, raw[1024:])
    return files, bytes(toks)

ftr, tr = read(t + "/shards/rt_train_*.bin")
fva, va = read(t + "/shards/rt_val_*.bin")
ok = True
if tr != want_tr: print("FAIL: train tokens differ"); ok = False
if va != want_va: print("FAIL: val tokens differ"); ok = False
if len(ftr) != (len(want_tr) + 299) // 300: print("FAIL: %d train shards" % len(ftr)); ok = False
want_line = "dgprep: 3 files (%d bytes) -> %d train tokens in %d shards, %d val tokens in %d shard%s" % (
    len(open(t + "/in/a.txt", "rb").read()) + len(open(t + "/in/b.txt", "rb").read()) + 21,
    len(want_tr), len(ftr), len(want_va), len(fva), "" if len(fva) == 1 else "s")
if out.splitlines()[0] != want_line: print("FAIL: summary\n  got  %s\n  want %s" % (out.splitlines()[0], want_line)); ok = False
if ("data.train = %s/shards/rt_train_*.bin" % t) not in out: print("FAIL: train glob not printed"); ok = False
print("round trip: %d train + %d val tokens in %d + %d shards" % (len(tr), len(va), len(ftr), len(fva)))
sys.exit(0 if ok else 1)
EOF

# Progress for big inputs (>= 32 MB): plain percentage lines when stderr is not a terminal.
python3 -c "
import sys
line = b'The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs.\n'
open(sys.argv[1], 'wb').write(line * (34 * 1024 * 1024 // len(line) + 1))
" "$T/big.txt"
err=$("$DGPREP" --out "$T/bigout" --shard-tokens 10000000 "$T/big.txt" 2>&1 >/dev/null)
if ! grep -q "^dgprep: 50% of 35.7 MB$" <<<"$err" || ! grep -q "^dgprep: 100% of 35.7 MB$" <<<"$err"; then
    fail_check "no progress lines for a big input; stderr was: $err"
fi
n=$(ls "$T/bigout" | grep -c '^default_train_.*\.bin$')
if [ "$n" -ne 4 ]; then
    fail_check "expected 4 train shards of <= 10M tokens for ~32M train bytes, got $n"
fi

expect_done
