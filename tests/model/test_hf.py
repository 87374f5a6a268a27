#!/usr/bin/env python3
"""test_hf.py — Hugging Face / llm.c weights in and out of the real dgtrain (issue 22 items 2 and 3),
against the real transformers (the test venv: scripts/requirements-test.txt).

Usage: test_hf.py CASE DGTRAIN DGCKPT HF_LOGITS MPIEXEC [MPIEXEC FLAGS...]
Cases:
  export     dgtrain trains a few steps (from a random transformers model); dgckpt export --format hf; GPT2LMHeadModel.from_pretrained loads it
             with no warning and no missing/unexpected key, its logits are within 1e-4 of dgtrain's own
             (tests/model/hf_logits) on the same tokens, and both pick the same 32 greedy tokens
  roundtrip  a transformers-made model (save_pretrained) -> model.init=hf: (every parameter frozen, so the
             run changes nothing) -> export -> every tensor bitwise equal (BF16 / F16 files: equal to
             their exactly widened values); a resume then wins over model.init (log line)
  llmc       an llm.c file written from the same model -> model.init=llmc: -> export -> bitwise equal
  mesh       model.init at 2 ranks with dp_shard=2 and with tp=2: the first-step loss of the 1-rank run
             (1e-5 relative), and not the loss of the random init
  tokenizer  a 50257-token run exported with --tokenizer DIR: vocab.json + merges.txt copied, loadable;
             a run on `dgprep --tokenizer gpt2` data exported without --tokenizer: GPT-2's vocab.json and
             merges.txt written from the ranks, and transformers' tokenizer from them encodes as tiktoken;
             data that records no tokenizer: no tokenizer files, and the export says why
  errors     shape mismatch (names the field), missing file, bad safetensors header, wrong llm.c magic,
             bad prefix: dgtrain exits 1 with a one-line message; dgckpt export into a non-empty dir: exit 2
Under CI=true a missing torch / transformers fails (tests/lib/dgskip.py)."""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import dgskip  # noqa: E402
import dgrun  # noqa: E402
from dgrun import Fail, check  # noqa: E402

L, H, C, T, V = 2, 2, 64, 64, 250  # vocab 250: dgtrain pads wte to 256 rows, Hugging Face keeps 250
LOGIT_ATOL = 1e-4

CONFIG = dgrun.small_gpt(
    "written by tests/model/test_hf.py",
    run={"name": "hf", "seed": 7},
    model={"n_layer": L, "n_head": H, "d_model": C, "seq_len": T, "vocab_size": V},
    train={"steps": 3, "global_batch": 4, "micro_batch": 2, "warmup_steps": 1, "lr": "3e-3", "log_every": 1000},
)


class Env:
    def __init__(self, argv):
        self.dgtrain, self.dgckpt, self.logits_bin = argv[0], argv[1], argv[2]
        self.mpi = argv[3:]
        self.work = tempfile.mkdtemp(prefix="dgt-hf-")
        self.cfg = self.d("cfg.ini")
        self.shard = self.d("train.bin")
        with open(self.cfg, "w") as f:
            f.write(CONFIG.replace("[data]\n", "[data]\ntrain = %s\n" % self.shard))
        write_shard(self.shard, 64 * (T + 1))

    def d(self, name):
        return os.path.join(self.work, name)

    def train(self, name, sets=(), ranks=1, expect_rc=0):
        """dgtrain under mpiexec -n ranks; ranks=0: started directly, as one process (MPI singleton)."""
        run_dir = self.d(name)
        cmd = list(self.mpi) + ["-n", str(ranks)] if ranks else []
        cmd += [self.dgtrain, self.cfg, "--set", "run.dir=" + run_dir]
        for s in sets:
            cmd += ["--set", s]
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240)
        check(p.returncode == expect_rc, "%s: dgtrain exited %d (expected %d): %s" %
              (name, p.returncode, expect_rc, p.stdout[-1500:]))
        return run_dir, p.stdout

    def ckpt(self, run_dir):
        d = os.path.join(run_dir, "checkpoints")
        files = sorted(f for f in os.listdir(d) if f.startswith("step_") and f.endswith(".h5"))
        check(files, "no checkpoint in %s" % d)
        return os.path.join(d, files[-1])

    def export(self, ckpt, out, expect_rc=0):
        p = subprocess.run([self.dgckpt, "export", "--format", "hf", ckpt, out], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=120)
        check(p.returncode == expect_rc, "dgckpt export --format hf exited %d (expected %d): %s" %
              (p.returncode, expect_rc, p.stdout))
        return p.stdout


def write_shard(path, n_tok):
    """An llm.c token shard of word-like byte text (ids < 128 < V) from a fixed LCG."""
    words = [b"the", b"of", b"data", b"rank", b"model", b"step", b"and", b"loss", b"a", b"check"]
    out, x = bytearray(), 4242
    while len(out) < n_tok:
        x = (1103515245 * x + 12345) % 2**31
        out += words[(x >> 16) % len(words)] + b" "
    toks = out[:n_tok]
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, n_tok, *([0] * 253)) + struct.pack("<%dH" % n_tok, *toks))


def steps(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [j for j in map(json.loads, f) if j.get("event") == "step"]


def hf_model(env, torch, transformers, init_range=0.02):
    """A random GPT-2 made and saved by transformers itself."""
    torch.manual_seed(1234)
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=T, n_embd=C, n_layer=L, n_head=H,
                                  activation_function="gelu_new", bos_token_id=None, eos_token_id=None,
                                  initializer_range=init_range)
    m = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():  # non-trivial layer norms and biases, so that a swapped tensor shows
        for n, p in m.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    out = env.d("hf0")
    m.save_pretrained(out, safe_serialization=True)
    return out, m


def st_tensors(path):
    from safetensors.numpy import load_file
    return load_file(path)


def same_tensors(a_dir, b_dir, what):
    a, b = st_tensors(os.path.join(a_dir, "model.safetensors")), st_tensors(os.path.join(b_dir, "model.safetensors"))
    a.pop("lm_head.weight", None)
    check(sorted(a) == sorted(b), "%s: tensor names differ: %s vs %s" % (what, sorted(set(a) ^ set(b))[:6], ""))
    bad = [k for k in a if a[k].shape != b[k].shape or a[k].tobytes() != b[k].tobytes()]
    check(not bad, "%s: tensors not bitwise equal: %s" % (what, bad[:6]))
    print("  %s: %d tensors bitwise equal" % (what, len(a)))


def load_quiet(transformers, path):
    """from_pretrained with every warning captured: (model, list of warnings)."""
    import logging
    import warnings
    records = []

    class Grab(logging.Handler):
        def emit(self, r):
            if r.levelno >= logging.WARNING:
                records.append(r.getMessage())

    transformers.logging.set_verbosity_warning()
    lg = transformers.logging.get_logger("transformers")
    h = Grab()
    lg.addHandler(h)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        m, info = transformers.GPT2LMHeadModel.from_pretrained(path, output_loading_info=True)
    lg.removeHandler(h)
    records += [str(x.message) for x in w]
    for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        if info.get(k):
            records.append("%s: %s" % (k, info[k]))
    return m, records


def case_export(env, torch, transformers):
    # weights 15x GPT-2's init scale: a start whose greedy decoding is not one token repeated
    src, _ = hf_model(env, torch, transformers, init_range=0.3)
    run, _ = env.train("run_a", ("model.init=hf:" + src, "train.lr=3e-4"))
    out = env.d("hf_a")
    env.export(env.ckpt(run), out)
    m, warns = load_quiet(transformers, out)
    check(not warns, "transformers warned on loading the export: %s" % warns)
    m.eval()
    check(m.config.vocab_size == V and m.transformer.wte.weight.shape[0] == V, "vocab is not the true %d" % V)
    check(m.lm_head.weight.data_ptr() == m.transformer.wte.weight.data_ptr(), "lm_head is not tied")
    prompt = [int(b) for b in b"the model of data and "][:16]
    p = subprocess.run([env.logits_bin, env.ckpt(run), ",".join(map(str, prompt)), "32"], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=120)
    check(p.returncode == 0, "hf_logits failed: %s" % p.stderr)
    ref = json.loads(p.stdout)
    with torch.no_grad():
        got = m(torch.tensor([prompt])).logits[0].double()
        diff = (got - torch.tensor(ref["logits"], dtype=torch.float64)).abs().max().item()
        ids = list(prompt)
        for _ in range(32):
            ids.append(int(m(torch.tensor([ids])).logits[0, -1].argmax()))
    print("  logits: max |transformers - dgtrain| = %.3g over %d x %d" % (diff, len(prompt), V))
    check(diff <= LOGIT_ATOL, "logits differ by %.3g > %g" % (diff, LOGIT_ATOL))
    check(ids[len(prompt):] == ref["greedy"], "greedy tokens differ: %s vs %s" % (ids[len(prompt):], ref["greedy"]))
    check(len(set(ref["greedy"])) >= 4, "greedy decoding is too uniform to compare: %s" % ref["greedy"])
    print("  32 greedy tokens equal: %s" % ref["greedy"])


FROZEN = ("train.freeze=*", "train.steps=1")


def case_roundtrip(env, torch, transformers):
    src, m = hf_model(env, torch, transformers)
    run, log = env.train("run_b", FROZEN + ("model.init=hf:" + src,))
    check("init: weights from hf:" + src in log, "no 'init: weights from' line: %s" % log[-800:])
    out = env.d("hf_b")
    env.export(env.ckpt(run), out)
    same_tensors(src, out, "hf -> dgtrain -> hf")
    for dt in (torch.bfloat16, torch.float16):  # half-precision files are widened exactly
        from safetensors.torch import load_file
        half = env.d("hf_%s" % str(dt).split(".")[1])
        m.to(dt).save_pretrained(half, safe_serialization=True)
        run, _ = env.train("run_" + os.path.basename(half), FROZEN + ("model.init=hf:" + half,))
        out = half + "_out"
        env.export(env.ckpt(run), out)
        a, b = load_file(os.path.join(half, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
        a.pop("lm_head.weight", None)
        bad = [k for k in a if k not in b or not torch.equal(a[k].float(), b[k])]
        check(sorted(a) == sorted(b) and not bad, "%s -> dgtrain -> hf: not the widened values: %s" % (dt, bad[:6]))
        print("  %s -> dgtrain -> hf: %d tensors equal to the exactly widened values" % (dt, len(a)))
    _, log = env.train("run_b", ("train.steps=2", "model.init=hf:" + src))
    check("model.init ignored" in log and "init: resuming from" in log and "init: weights from" not in log,
          "a resume did not win over model.init: %s" % log[-800:])


def write_llmc(path, model, magic=20240326, version=3):
    """llm.c's checkpoint layout (train_gpt2.py write_model): header, then 16 tensors, [out, in]."""
    import numpy as np
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    Vp = (V + 127) // 128 * 128
    wte = np.zeros((Vp, C), np.float32)
    wte[:V] = sd["transformer.wte.weight"]
    per = lambda n, t=False: np.stack([sd["transformer.h.%d.%s" % (i, n)].T if t else
                                       sd["transformer.h.%d.%s" % (i, n)] for i in range(L)])
    parts = [wte, sd["transformer.wpe.weight"], per("ln_1.weight"), per("ln_1.bias"),
             per("attn.c_attn.weight", True), per("attn.c_attn.bias"), per("attn.c_proj.weight", True),
             per("attn.c_proj.bias"), per("ln_2.weight"), per("ln_2.bias"), per("mlp.c_fc.weight", True),
             per("mlp.c_fc.bias"), per("mlp.c_proj.weight", True), per("mlp.c_proj.bias"),
             sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"]]
    hdr = [magic, version, T, V, L, H, C, Vp] + [0] * 248
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *hdr))
        for p in parts:
            f.write(np.ascontiguousarray(p, dtype="<f4").tobytes())


def case_llmc(env, torch, transformers):
    src, m = hf_model(env, torch, transformers)
    bin_ = env.d("model.bin")
    write_llmc(bin_, m)
    run, log = env.train("run_c", FROZEN + ("model.init=llmc:" + bin_,))
    check("init: weights from llmc:" in log, "no 'init: weights from llmc:' line")
    out = env.d("hf_c")
    env.export(env.ckpt(run), out)
    same_tensors(src, out, "llm.c -> dgtrain -> hf")


def case_mesh(env, torch, transformers):
    src, _ = hf_model(env, torch, transformers)
    init = "model.init=hf:" + src
    base = steps(env.train("m1", ("train.steps=1", init))[0])[0]["loss"]
    rand = steps(env.train("m0", ("train.steps=1",))[0])[0]["loss"]
    check(abs(rand - base) > 1e-3, "the init loss %.6f equals the random-init loss %.6f" % (base, rand))
    for mesh in ("dp_replicate=1,dp_shard=2,tp=1", "dp_replicate=1,dp_shard=1,tp=2"):
        got = steps(env.train("m_" + mesh.replace(",", "_").replace("=", ""), ("train.steps=1", init,
                                                                            "parallel.mesh=" + mesh), ranks=2)[0])
        rel = abs(got[0]["loss"] - base) / abs(base)
        print("  %s: first loss %.7f vs 1 rank %.7f (rel %.2g; random init %.5f)" % (mesh, got[0]["loss"], base,
                                                                                    rel, rand))
        check(rel <= 1e-5, "%s: first-step loss %.7f vs %.7f at 1 rank" % (mesh, got[0]["loss"], base))


def expect_error(env, name, sets, needle):
    # started without mpiexec (a singleton, as a user may run it): the same start-up checks at less cost
    _, log = env.train(name, ("train.steps=1",) + tuple(sets), ranks=0, expect_rc=1)
    lines = [l for l in log.splitlines() if needle in l]
    check(lines, "%s: no line with %r in: %s" % (name, needle, log[-800:]))
    print("  %s: %s" % (name, lines[0].strip()[:200]))


def case_errors(env, torch, transformers):
    src, m = hf_model(env, torch, transformers)
    expect_error(env, "e_shape", ("model.init=hf:" + src, "model.n_layer=3"),
                 "n_layer differs: the weights have 2, the run's model has 3")
    expect_error(env, "e_pos", ("model.init=hf:" + src, "model.seq_len=128"), "n_positions (seq_len) differs")
    expect_error(env, "e_missing", ("model.init=hf:" + env.d("nope"),), "cannot open " + env.d("nope"))
    bad = env.d("hf_bad")
    shutil.copytree(src, bad)
    with open(os.path.join(bad, "model.safetensors"), "r+b") as f:
        f.write(struct.pack("<Q", 1 << 40))
    expect_error(env, "e_header", ("model.init=hf:" + bad,), "bad safetensors header")
    with open(os.path.join(bad, "model.safetensors"), "r+b") as f:
        hl = struct.unpack("<Q", open(os.path.join(src, "model.safetensors"), "rb").read(8))[0]
        f.write(struct.pack("<Q", hl) + b"{\"x\": [")
    expect_error(env, "e_json", ("model.init=hf:" + bad,), "bad safetensors header")
    bin_ = env.d("bad.bin")
    write_llmc(bin_, m, magic=12345)
    expect_error(env, "e_magic", ("model.init=llmc:" + bin_,), "bad magic 12345")
    write_llmc(bin_, m, version=5)
    expect_error(env, "e_bf16", ("model.init=llmc:" + bin_,), "version 5 (bf16 weights) is not supported")
    expect_error(env, "e_prefix", ("model.init=gguf:x",), "hf:DIR")
    relu = env.d("hf_relu")
    shutil.copytree(src, relu)
    cj = os.path.join(relu, "config.json")
    cfg = json.load(open(cj))
    cfg["activation_function"] = "relu"
    json.dump(cfg, open(cj, "w"))
    expect_error(env, "e_act", ("model.init=hf:" + relu,), "activation_function \"relu\" is not dgtrain's tanh GELU")
    run, _ = env.train("e_ok", ("train.steps=1",))
    os.makedirs(env.d("full"))
    open(os.path.join(env.d("full"), "x"), "w").close()
    out = env.export(env.ckpt(run), env.d("full"), expect_rc=2)
    check("already exists" in out, "dgckpt export into a non-empty dir: %s" % out)
    print("  dgckpt export into a non-empty dir: exit 2: %s" % out.strip())
    p = subprocess.run([env.dgckpt, "export", "--format", "hf", env.ckpt(run), env.d("tok_out"), "--tokenizer",
                        env.d("tok")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    check(p.returncode == 2 and "not GPT-2's 50257" in p.stdout and not os.path.exists(env.d("tok_out")),
          "--tokenizer with a %d-token model: exit %d: %s" % (V, p.returncode, p.stdout))
    print("  --tokenizer with a %d-token model: exit 2: %s" % (V, p.stdout.strip()))


def case_tokenizer(env, torch, transformers):
    """A 50257-token run exported with --tokenizer: the files are copied, transformers' GPT-2 tokenizer
    loads them from the export, and the config names GPT-2's <|endoftext|> (50256)."""
    tok = env.d("tok")
    os.makedirs(tok)
    vocab = {"a": 0, "b": 1, "ab": 2, "<|endoftext|>": 3}
    with open(os.path.join(tok, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(tok, "merges.txt"), "w") as f:
        f.write("#version: 0.2\na b\n")
    run, _ = env.train("run_t", ("train.steps=1", "model.vocab_size=50257", "model.n_layer=1", "model.d_model=32",
                                 "model.seq_len=32"))
    out = env.d("hf_t")
    p = subprocess.run([env.dgckpt, "export", "--format", "hf", env.ckpt(run), out, "--tokenizer", tok],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    check(p.returncode == 0, "export --tokenizer exited %d: %s" % (p.returncode, p.stdout))
    for n in ("vocab.json", "merges.txt"):
        check(open(os.path.join(out, n), "rb").read() == open(os.path.join(tok, n), "rb").read(), "%s not copied" % n)
    t = transformers.GPT2TokenizerFast.from_pretrained(out)
    check(t("ab")["input_ids"] == [2], "the exported tokenizer does not merge 'a b': %s" % t("ab"))
    cfg = json.load(open(os.path.join(out, "config.json")))
    check(cfg["vocab_size"] == 50257 and cfg["eos_token_id"] == 50256 and cfg["bos_token_id"] == 50256,
          "config.json: %s" % cfg)
    m, warns = load_quiet(transformers, out)
    check(not warns and m.transformer.wte.weight.shape[0] == 50257, "loading the 50257-token export: %s" % warns)
    print("  tokenizer files copied and loaded; vocab 50257, eos 50256")
    auto_tokenizer(env, transformers, run)


TEXTS = ["Hello world, it's 2026 and the ranks  agree.\n", "  indented\tcode = x**2 # comment\n\n\n",
         "Grüße aus Köln: naïve café, 東京, Привет, 👍🏽 🇯🇵.", "He'll say they're done; I'M NOT.  1234567 3.14159"]


def auto_tokenizer(env, transformers, untagged_run):
    """dgprep --tokenizer gpt2 records its tokenizer in the shard headers; the checkpoint keeps it; export
    without --tokenizer writes GPT-2's files, and transformers' tokenizer from them matches tiktoken."""
    import tiktoken
    import tiktoken.load
    ranks_file = os.environ.get("DG_GPT2_TIKTOKEN") or "/usr/local/share/dgtrain/gpt2.tiktoken"
    if not os.path.exists(ranks_file):
        dgskip.skip("no gpt2.tiktoken (run scripts/setup.sh)")
    enc = tiktoken.Encoding("gpt2-local", pat_str=r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
                            mergeable_ranks=tiktoken.load.load_tiktoken_bpe(ranks_file),
                            special_tokens={"<|endoftext|>": 50256})
    text = env.d("corpus.txt")
    with open(text, "w") as f:
        for i in range(160):
            f.write(TEXTS[i % len(TEXTS)] + " line %d of the corpus.\n" % i)
    data = env.d("gpt2data")
    p = subprocess.run([os.environ["DGPREP"], "--tokenizer", "gpt2", "--out", data, "--name", "t", text],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    check(p.returncode == 0, "dgprep --tokenizer gpt2 exited %d: %s" % (p.returncode, p.stdout))
    run, _ = env.train("run_auto", ("train.steps=1", "model.vocab_size=50257", "model.n_layer=1",
                                    "model.d_model=32", "model.seq_len=32", "data.train=%s/t_train_*.bin" % data,
                                    "data.val=%s/t_val_*.bin" % data, "data.val_batches=1"))
    out = env.d("hf_auto")
    p = subprocess.run([env.dgckpt, "export", "--format", "hf", env.ckpt(run), out], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=120)
    check(p.returncode == 0 and "tokenizer files from" in p.stdout, "auto export: exit %d: %s" % (p.returncode, p.stdout))
    merges = open(os.path.join(out, "merges.txt"), encoding="utf-8").read().splitlines()
    vocab = json.load(open(os.path.join(out, "vocab.json"), encoding="utf-8"))
    check(merges[0].startswith("#version") and len(merges) == 50001 and len(vocab) == 50257
          and vocab["<|endoftext|>"] == 50256, "merges %d lines, vocab %d" % (len(merges), len(vocab)))
    for cls in (transformers.GPT2TokenizerFast, transformers.GPT2Tokenizer):
        t = cls.from_pretrained(out)
        for s in TEXTS + [open(text, encoding="utf-8").read()]:
            want = enc.encode_ordinary(s)
            got = t(s)["input_ids"]
            check(got == want, "%s on %r: %s != tiktoken %s" % (cls.__name__, s[:40], got[:20], want[:20]))
            check(t.decode(got) == s, "%s decode of %r" % (cls.__name__, s[:40]))
    p = subprocess.run([env.dgckpt, "export", "--format", "hf", env.ckpt(untagged_run), env.d("hf_untagged")],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    check(p.returncode == 0 and "records no tokenizer" in p.stdout
          and not os.path.exists(os.path.join(env.d("hf_untagged"), "vocab.json")),
          "untagged export: exit %d: %s" % (p.returncode, p.stdout))
    print("  dgprep gpt2 data -> export writes GPT-2's tokenizer files (50000 merges): transformers' fast and slow "
          "tokenizers encode %d texts as tiktoken; untagged data: no files, said so" % (len(TEXTS) + 1))


def main():
    if len(sys.argv) < 6:
        print(__doc__)
        return 2
    case = sys.argv[1]
    try:
        import torch
        import transformers
    except ImportError as e:
        return dgskip.skip("torch / transformers not importable (%s): run scripts/setup.sh" % e)
    torch.set_num_threads(1)
    env = Env(sys.argv[2:])
    try:
        globals()["case_" + case](env, torch, transformers)
    except Fail as e:
        print("FAIL: %s (work dir %s kept)" % (e, env.work))
        return 1
    shutil.rmtree(env.work, ignore_errors=True)
    print("PASS: %s" % case)
    return 0


if __name__ == "__main__":
    sys.exit(main())
