#!/bin/bash
# sample_cli.sh — `dgtrain sample` as a user runs it (issue 22.4), on a tiny model really trained 6 steps:
#   determinism: the same seed twice gives the same text, another seed another text (temperature 1);
#   --top-k 1 gives the greedy tokens; a run directory, its checkpoint directory and the file agree;
#   streaming text on stdout and the figures on stderr; --json is one valid object with the figures;
#   --bench 5 reports p50/p99 first-token latency; a full context stops with "context full";
#   bad input (flag values, unknown flags, no checkpoint, a prompt longer than seq_len) exits 2 with one line;
#   the tokenizer: auto = byte for a run on the default data, --tokenizer gpt2 on a 50257-token model.
# Usage: sample_cli.sh DGTRAIN MPIEXEC [MPIEXEC FLAGS...]
set -u
DGTRAIN=$1
shift
MPI=("$@")
DG_TEST_NAME=sample_cli
source "$(dirname "$0")/lib.sh"
[ -x "$DGTRAIN" ] || dg_skip "dgtrain is not built ('$DGTRAIN')"
command -v python3 >/dev/null || dg_skip "no python3 (for the JSON checks)"
WORK=$(mktemp -d /tmp/dgt-sample-cli-XXXXXX)
trap 'rm -rf "$WORK"' EXIT
FAILED=0
bad() {
    echo "FAIL: $*"
    FAILED=1
}
train_tiny 6
RUN=$WORK/run
S=(timeout 120 "$DGTRAIN" sample)

# streaming text on stdout, figures on stderr
"${S[@]}" "$RUN" --prompt "The cat " --tokens 24 --seed 5 >"$WORK/a.out" 2>"$WORK/a.err" || bad "plain run exit $?: $(cat "$WORK/a.err")"
[ "$(wc -c <"$WORK/a.out")" -gt 0 ] || bad "no text on stdout"
for f in "warm-up [0-9.]+ ms" "first-token latency [0-9.]+ ms" "[0-9.]+ tokens/s" "tokenizer byte" "stopped: tokens"; do
    grep -Eq "$f" "$WORK/a.err" || bad "stderr lacks /$f/: $(cat "$WORK/a.err")"
done

json() { "${S[@]}" "$@" --json 2>"$WORK/j.err"; }
ids() { python3 -c 'import json,sys; print(json.load(sys.stdin)["token_ids"])'; }
# determinism
a=$(json "$RUN" --prompt "The cat " --tokens 32 --seed 11 --temperature 1 | ids)
b=$(json "$RUN" --prompt "The cat " --tokens 32 --seed 11 --temperature 1 | ids)
c=$(json "$RUN" --prompt "The cat " --tokens 32 --seed 12 --temperature 1 | ids)
[ -n "$a" ] && [ "$a" = "$b" ] || bad "seed 11 twice gave different tokens: $a / $b"
[ "$a" != "$c" ] || bad "seeds 11 and 12 gave the same 32 tokens: $a"
# top-k 1 = greedy, whatever the seed and temperature
g=$(json "$RUN" --prompt "The cat " --tokens 32 --temperature 0 | ids)
k=$(json "$RUN" --prompt "The cat " --tokens 32 --temperature 1.5 --top-k 1 --seed 99 | ids)
[ -n "$g" ] && [ "$g" = "$k" ] || bad "--top-k 1 ($k) differs from greedy ($g)"
# the run directory, the checkpoint directory and the file name the same checkpoint; each run below checks
# one more thing against the greedy tokens of the run directory (g), so that a difference in either fails:
# top-p tiny = greedy too (the nucleus is the most likely token), and --prompt-file = --prompt
printf 'The cat ' >"$WORK/prompt.txt"
f=$(json "$(ls "$RUN"/checkpoints/step_*.h5 | tail -n 1)" --prompt "The cat " --tokens 32 --temperature 1 --top-p 1e-9 --seed 3 | ids)
[ "$g" = "$f" ] || bad "the checkpoint file with --top-p 1e-9 ($f) differs from the run dir's greedy tokens ($g)"
d=$(json "$RUN/checkpoints" --prompt-file "$WORK/prompt.txt" --tokens 32 --temperature 0 | ids)
[ "$g" = "$d" ] || bad "the checkpoint dir with --prompt-file ($d) differs from the run dir with --prompt ($g)"
# a damaged newest checkpoint: the run directory falls back to the previous one, as resume=auto does
cp -a "$RUN" "$WORK/run2"
truncate -s 4096 "$WORK/run2/checkpoints/step_00000006.h5"
fb=$(json "$WORK/run2" --prompt "The cat " --tokens 4 --temperature 0 | python3 -c 'import json,sys; o=json.load(sys.stdin); print(o["step"], o["checkpoint"].endswith("step_00000003.h5"))')
[ "$fb" = "3 True" ] || bad "a truncated step 6 did not fall back to step 3: '$fb' ($(cat "$WORK/j.err"))"

# --json: one valid object with the figures
json "$RUN" --prompt "Hello" --tokens 8 >"$WORK/j.json" || bad "--json exit $?: $(cat "$WORK/j.err")"
python3 - "$WORK/j.json" <<'PY' || bad "--json output: $(cat "$WORK/j.json")"
import json, sys
o = json.load(open(sys.argv[1]))
for k in ("text", "token_ids", "warmup_ms", "first_token_ms", "tokens_per_s", "prompt_tokens", "device", "tokenizer", "stop"):
    assert k in o, k
assert len(o["token_ids"]) == 8 and o["prompt_tokens"] == 5 and o["stop"] == "tokens", o
assert o["warmup_ms"] > 0 and o["first_token_ms"] > 0 and o["tokens_per_s"] > 0, o
assert o["device"] == "cpu" and o["tokenizer"] == "byte", o
PY

# --bench 5: p50/p99 (text and JSON)
"${S[@]}" "$RUN" --bench 5 --tokens 8 >"$WORK/b.out" 2>"$WORK/b.err" || bad "--bench exit $?: $(cat "$WORK/b.err")"
grep -Eq "p50 [0-9.]+ ms, p99 [0-9.]+ ms" "$WORK/b.out" || bad "--bench output lacks p50/p99: $(cat "$WORK/b.out")"
"${S[@]}" "$RUN" --bench 5 --tokens 8 --json 2>/dev/null | python3 -c '
import json, sys
o = json.load(sys.stdin)
assert o["bench"] == 5 and len(o["first_token_ms"]) == 5, o
assert 0 < o["first_token_ms_p50"] <= o["first_token_ms_p99"], o
assert len(set(o["prompt_tokens"])) > 1, o  # built-in prompts of varied lengths
' || bad "--bench --json"

# a full context: the tiny model's seq_len is 128; a 120-byte prompt leaves room for 8 more positions
long=$(printf 'a%.0s' $(seq 120))
n=$(json "$RUN" --prompt "$long" --tokens 50 | python3 -c 'import json,sys; o=json.load(sys.stdin); print(len(o["token_ids"]), o["stop"])')
[ "$n" = "9 context full (seq_len 128)" ] || bad "a full context gave '$n', expected '9 context full (seq_len 128)'"

# bad input: exit 2 and one line naming the value
expect2() {
    local what=$1 pat=$2
    shift 2
    "${S[@]}" "$@" >"$WORK/e.out" 2>"$WORK/e.err"
    local rc=$?
    [ $rc = 2 ] || bad "$what: exit $rc, expected 2 ($(cat "$WORK/e.err"))"
    [ "$(wc -l <"$WORK/e.err")" = 1 ] || bad "$what: expected one line on stderr, got: $(cat "$WORK/e.err")"
    grep -q -- "$pat" "$WORK/e.err" || bad "$what: stderr lacks '$pat': $(cat "$WORK/e.err")"
}
expect2 "no checkpoint" "no checkpoint in" "$WORK" --prompt x
expect2 "missing path" "does not exist" "$WORK/nope" --prompt x
expect2 "prompt too long" "seq_len = 128" "$RUN" --prompt "$(printf 'b%.0s' $(seq 129))"
expect2 "empty prompt" "0 tokens" "$RUN" --prompt ""
expect2 "bad temperature" "--temperature -1" "$RUN" --prompt x --temperature -1
expect2 "bad top-p" "--top-p 0" "$RUN" --prompt x --top-p 0
expect2 "bad top-k" "--top-k '-3'" "$RUN" --prompt x --top-k -3
expect2 "bad tokens" "--tokens '0'" "$RUN" --prompt x --tokens 0
expect2 "bad seed" "--seed 'abc'" "$RUN" --prompt x --seed abc
expect2 "bad device" "--device 'tpu'" "$RUN" --prompt x --device tpu
expect2 "bad tokenizer" "--tokenizer 'bpe'" "$RUN" --prompt x --tokenizer bpe
expect2 "unknown flag" "unknown option '--temp'" "$RUN" --prompt x --temp 1
expect2 "no prompt" "no prompt" "$RUN"
expect2 "bad bench" "--bench '0'" "$RUN" --bench 0
expect2 "two checkpoints" "more than one checkpoint" "$RUN" "$RUN" --prompt x
# --device cuda: generates on a GPU machine with a CUDA build; anywhere else exit 2 with one line
"${S[@]}" "$RUN" --prompt x --tokens 2 --device cuda >/dev/null 2>"$WORK/e.err"
rc=$?
[ $rc = 0 ] || { [ $rc = 2 ] && [ "$(wc -l <"$WORK/e.err")" = 1 ]; } || bad "--device cuda: exit $rc: $(cat "$WORK/e.err")"
expect2 "missing prompt file" "cannot open" "$RUN" --prompt-file "$WORK/none.txt"
expect2 "gpt2 on a byte model" "vocab_size >= 50257" "$RUN" --prompt x --tokenizer gpt2

# GPT-2 BPE: a model with GPT-2's vocabulary (trained 2 steps on the byte data), --tokenizer gpt2
G=$WORK/run50k
OMP_NUM_THREADS=1 timeout 300 "${MPI[@]}" -n 1 "$DGTRAIN" "$WORK/cfg.ini" --set run.dir="$G" --set model.vocab_size=50257 \
    --set train.steps=2 >"$WORK/t50.out" 2>&1 || bad "training the 50257-token model failed: $(tail -n 3 "$WORK/t50.out")"
auto=$(json "$G" --prompt "Hello world, this is" --tokens 4 | python3 -c 'import json,sys; print(json.load(sys.stdin)["tokenizer"])')
[ "$auto" = byte ] || bad "auto tokenizer for a run on the default (byte) data: '$auto', expected byte"
if [ $FAILED = 0 ]; then
    [ -n "${DG_GPT2_TIKTOKEN:-}" ] || [ -e /usr/local/share/dgtrain/gpt2.tiktoken ] || [ -e /usr/share/dgtrain/gpt2.tiktoken ] ||
        dg_skip "no GPT-2 ranks file (scripts/setup.sh installs /usr/local/share/dgtrain/gpt2.tiktoken)"
fi
gp=$(json "$G" --prompt "Hello world, this is" --tokens 6 --tokenizer gpt2 --ignore-eos --seed 2 |
    python3 -c 'import json,sys; o=json.load(sys.stdin); print(o["tokenizer"], o["prompt_tokens"], len(o["token_ids"]), max(o["token_ids"]) < 50257)')
[ "$gp" = "gpt2 5 6 True" ] || bad "--tokenizer gpt2: '$gp', expected 'gpt2 5 6 True' ($(cat "$WORK/j.err"))"
[ $FAILED = 0 ] && echo PASS
exit $FAILED
