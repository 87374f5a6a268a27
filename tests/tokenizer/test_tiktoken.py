#!/usr/bin/env python3
"""test_tiktoken.py — dgtrain's GPT-2 tokenizer against tiktoken, id for id.

The oracle is tiktoken.Encoding built from the local ranks file (get_encoding("gpt2") would use the
network), with GPT-2's pattern as written in GPT-2's encoder.py and, as a check of the oracle itself,
with the equivalent pattern tiktoken ships for r50k_base. On a mixed-script corpus generated here
(English, code, CJK, Arabic, Hebrew, Devanagari, emoji with ZWJ sequences and skin tones, combining
marks, numbers of many lengths, whitespace runs with tabs / CRLF / trailing spaces / Unicode spaces,
contractions in both cases, very long words, random assigned code points, invalid UTF-8) it compares:

  - the C API (test_tokenizer encode-docs) with the .tiktoken reader and with the vocab.json +
    merges.txt reader (files generated here from the ranks, via GPT-2's byte-to-unicode mapping);
  - decode(encode(x)) == x (the repaired text for invalid UTF-8), and the invalid-UTF-8 counts;
  - every id of dgprep --tokenizer gpt2's shards: per-file documents, blank-line documents, a val
    split, several thread counts and chunk sizes (the output must not depend on them), the HF reader.

Usage: test_tiktoken.py DGPREP TEST_TOKENIZER. Without tiktoken or the ranks file: exit 77 (skip), or 1
under CI=true.
"""
import json
import os
import random
import struct
import subprocess
import sys
import tempfile
import unicodedata

CLASSIC_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOT = 50256


def skip(why):
    if os.environ.get("CI") == "true":
        print("FAIL (CI=true): " + why)
        sys.exit(1)
    print("SKIP: " + why)
    sys.exit(77)


def ranks_path():
    env = os.environ.get("DG_GPT2_TIKTOKEN")
    if env:
        return env
    for p in ("/usr/local/share/dgtrain/gpt2.tiktoken", "/usr/share/dgtrain/gpt2.tiktoken"):
        if os.path.exists(p):
            return p
    skip("no gpt2.tiktoken (run scripts/setup.sh)")


# ---------------- the corpus ----------------

ASSIGNED = None


def assigned_code_points():
    """Code points assigned in this Python's Unicode (14.0 for Debian 12's 3.11, as PCRE2 10.42): later
    additions may be letters to tiktoken's newer regex tables but unassigned to PCRE2 (docs/data.md)."""
    global ASSIGNED
    if ASSIGNED is None:
        ASSIGNED = [c for c in range(0x20, 0x30000)
                    if not (0xD800 <= c < 0xE000) and c != 0x7F
                    and unicodedata.category(chr(c)) not in ("Cn", "Cs", "Cc")]
    return ASSIGNED


WORDS = ("the quick brown fox jumps over a lazy dog and then it rests under trees while "
         "people talk about tokenizers transformers gradients shards HDF5 MPI ranks").split()
SNIPPETS = [
    "你好，世界！这是一个测试。", "日本語のテキストとカタカナ、ひらがな。", "한국어 문장입니다.",
    "مرحبا بالعالم، هذا نص عربي.", "שלום עולם, זה טקסט בעברית.", "नमस्ते दुनिया। यह हिन्दी है।",
    "สวัสดีชาวโลก", "Ελληνικά γράμματα", "Привет, мир!", "𝐀𝐁𝐂 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "👍🏽👍🏿🙋‍♀️", "👩‍💻 and 👨‍👩‍👧‍👦 family", "🇯🇵🇫🇷 flags", "1️⃣ keycap", "❤️‍🔥",
    "e\u0301 a\u0300\u0316 Z\u0351\u0364\u0347a\u0337\u0358l\u036ag\u0327o", "ﬁ ligature", "Ａｂｃ１２３",
    "He's", "they're", "I've", "I'm", "we'll", "she'd", "don't", "HE'S", "THEY'RE", "I'M", "WE'LL",
    "It’s curly", "'s", "'t", "'S'T'RE", "''''", "rock'n'roll",
    "def f(x):\n    return x ** 2  # square\n", "int main(void) {\n\treturn 0;\n}\n",
    "if (a && b) { c->d[i] = e; }", "<|endoftext|>", "<|endoftext|> in the middle",
    "   trailing   \n", "\r\n\r\n", "\t\t\tindent", "\u00a0nbsp\u00a0", "\u3000ideographic\u3000space",
    "\u2028line sep\u2029para", "\u0085next line", "\u180emongolian vowel separator", "\x0bvt\x0cff",
    "x\n \ny", "a \n\n b", "  \n  \n", "tab\t \tmix",
]


def number(rng):
    k = rng.choice([1, 1, 2, 3, 4, 5, 7, 10, 16, 25, 40])
    s = "".join(rng.choice("0123456789") for _ in range(k))
    return rng.choice([s, s + "." + str(rng.randint(0, 999)), "-" + s, "{:,}".format(int(s))])


def whitespace(rng):
    return rng.choice([" " * rng.randint(1, 40), "\t" * rng.randint(1, 5), "\n" * rng.randint(1, 4),
                       "\r\n", " \n", "  \t\n", "\n\n\n   ", "\u00a0" * 3, " \u3000 "])


def long_word(rng):
    return rng.choice([
        "a" * rng.randint(200, 5000),
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(100, 3000))),
        "9" * rng.randint(100, 2000), "!" * rng.randint(50, 1000), " " * rng.randint(100, 10000),
        "Supercalifragilisticexpialidocious" * rng.randint(2, 60),
        "".join(chr(rng.choice(assigned_code_points())) for _ in range(rng.randint(50, 500))),
    ])


def document(rng):
    parts = []
    for _ in range(rng.randint(1, 120)):
        r = rng.random()
        if r < 0.45:
            w = rng.choice(WORDS)
            parts.append(rng.choice([w, w.capitalize(), w.upper()]) + rng.choice(["", " ", " ", ", ", ". "]))
        elif r < 0.6:
            parts.append(rng.choice(SNIPPETS))
        elif r < 0.7:
            parts.append(number(rng))
        elif r < 0.82:
            parts.append(whitespace(rng))
        elif r < 0.95:
            parts.append("".join(chr(rng.choice(assigned_code_points())) for _ in range(rng.randint(1, 12))))
        elif r < 0.98:
            parts.append(rng.choice(["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Ll"]))
        else:
            parts.append(long_word(rng))
    return "".join(parts)


def corrupt(rng, b):
    """Insert invalid UTF-8: stray continuation bytes, truncated sequences, overlongs, surrogates."""
    bad = [b"\x80", b"\xbf\xbf", b"\xc3", b"\xe2\x82", b"\xf0\x9f\x98", b"\xc0\xaf", b"\xed\xa0\x80",
           b"\xf4\x90\x80\x80", b"\xff", b"\xfe\xfe", b"\xf8\x88\x80\x80\x80"]
    out = bytearray(b)
    for _ in range(rng.randint(1, 6)):
        i = rng.randint(0, len(out))
        out[i:i] = rng.choice(bad)
    return bytes(out)


def corpus(seed=20261202):
    rng = random.Random(seed)
    docs = [s.encode() for s in SNIPPETS]
    docs += [document(rng).encode() for _ in range(220)]
    docs += [long_word(rng).encode() for _ in range(12)]
    docs += [corrupt(rng, document(rng).encode()) for _ in range(40)]
    docs += [b"\xff", b"abc\xe2\x82", b"\xc3" + b"x" * 2000 + b"\xe2\x82\xac\xe2\x82"]
    return docs


# ---------------- helpers ----------------

def frame_texts(path, texts):
    with open(path, "wb") as f:
        for t in texts:
            f.write(struct.pack("<I", len(t)) + t)


def read_framed_ids(path):
    b = open(path, "rb").read()
    out, i = [], 0
    while i < len(b):
        (n,) = struct.unpack_from("<I", b, i)
        out.append(list(struct.unpack_from("<%dI" % n, b, i + 4)))
        i += 4 + 4 * n
    return out


def read_framed_texts(path):
    b = open(path, "rb").read()
    out, i = [], 0
    while i < len(b):
        (n,) = struct.unpack_from("<I", b, i)
        out.append(b[i + 4:i + 4 + n])
        i += 4 + n
    return out


def write_framed_ids(path, seqs):
    with open(path, "wb") as f:
        for s in seqs:
            f.write(struct.pack("<I%dI" % len(s), len(s), *s))


def read_shards(pattern_dir, name, split):
    files = sorted(f for f in os.listdir(pattern_dir) if f.startswith(name + "_" + split + "_"))
    toks = []
    for f in files:
        raw = open(os.path.join(pattern_dir, f), "rb").read()
        magic, version, n = struct.unpack("<3i", raw[:12])
        assert magic == 20240520 and version == 1 and len(raw) == 1024 + 2 * n, f
        toks += struct.unpack("<%dH" % n, raw[1024:])
    return toks, len(files)


def bytes_to_unicode():
    """GPT-2's encoder.py mapping: printable Latin-1 bytes stand for themselves, the rest are shifted
    to U+0100 upwards in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    m, extra = {}, 0
    for b in range(256):
        if b in keep:
            m[b] = chr(b)
        else:
            m[b] = chr(256 + extra)
            extra += 1
    return m


def hf_files(ranks):
    """vocab.json's dict and merges.txt's lines from the ranks: each token r >= 256 is the merge of the
    two parts that the byte-pair merge of its bytes, using only ranks below r, ends with."""
    b2u = bytes_to_unicode()
    enc = lambda bs: "".join(b2u[c] for c in bs)
    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    merges = []
    for tok, r in by_rank:
        if r < 256:
            assert len(tok) == 1
            continue
        parts = [bytes([c]) for c in tok]
        while len(parts) > 2:
            best, bi = None, -1
            for i in range(len(parts) - 1):
                q = ranks.get(parts[i] + parts[i + 1])
                if q is not None and q < r and (best is None or q < best):
                    best, bi = q, i
            assert bi >= 0, tok
            parts[bi:bi + 2] = [parts[bi] + parts[bi + 1]]
        merges.append(enc(parts[0]) + " " + enc(parts[1]))
    vocab = {enc(tok): r for tok, r in by_rank}
    vocab["<|endoftext|>"] = EOT
    return vocab, merges


def write_hf(dirname, vocab, merges, ensure_ascii):
    os.makedirs(dirname, exist_ok=True)
    with open(os.path.join(dirname, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=ensure_ascii)
    with open(os.path.join(dirname, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(merges) + "\n")


def val_cut(data, frac):
    """dgprep's documented val split (docs/data.md): cut0 = n - round(n*frac), then the next line start
    before the last byte, else cut0."""
    n = len(data)
    cut0 = n - int(n * frac + 0.5)
    if cut0 == 0:
        return 0
    for i in range(max(cut0 - 1, 0), n - 1):
        if data[i] == 10:
            return i + 1
    return cut0


def blank_line_docs(text):
    """llm.c's tinyshakespeare.py rule: a document ends after each "\\n\\n"; empty ones are dropped."""
    out, start = [], 0
    while True:
        k = text.find("\n\n", start)
        if k < 0:
            break
        out.append(text[start:k + 2])
        start = k + 2
    out.append(text[start:])
    return [d for d in out if d]


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    dgprep, helper = sys.argv[1], sys.argv[2]
    try:
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe
    except ImportError as e:
        skip("tiktoken is not importable (%s): run scripts/setup.sh, use its test venv" % e)
    rpath = ranks_path()
    ranks = load_tiktoken_bpe(rpath)
    specials = {"<|endoftext|>": EOT}
    enc = tiktoken.Encoding(name="gpt2_local", pat_str=CLASSIC_PAT, mergeable_ranks=ranks, special_tokens=specials)
    try:
        from tiktoken_ext.openai_public import r50k_pat_str
    except ImportError:
        r50k_pat_str = CLASSIC_PAT
    enc2 = tiktoken.Encoding(name="gpt2_local2", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens=specials)
    fails = []

    def check(cond, msg):
        if not cond:
            fails.append(msg)
            print("FAIL: " + msg)

    docs = corpus()
    texts = [d.decode("utf-8", "replace") for d in docs]
    want = [enc.encode_ordinary(t) for t in texts]
    for i, t in enumerate(texts):
        check(enc2.encode_ordinary(t) == want[i], "oracle: the two patterns disagree on doc %d" % i)
    n_bytes = sum(len(d) for d in docs)
    print("corpus: %d documents, %d bytes, %d tokens" % (len(docs), n_bytes, sum(map(len, want))))

    with tempfile.TemporaryDirectory(prefix="dg_test_tiktoken_") as tmp:
        hf = os.path.join(tmp, "hf")
        hf_ascii = os.path.join(tmp, "hf_ascii")
        vocab, merges = hf_files(ranks)
        write_hf(hf, vocab, merges, ensure_ascii=False)
        write_hf(hf_ascii, vocab, merges, ensure_ascii=True)

        # ---- the C API, both readers ----
        extra = [b"nul\x00inside", b"\x01\x02control\x7f", b""]
        api_docs = docs + extra
        api_want = want + [enc.encode_ordinary(d.decode("utf-8", "replace")) for d in extra]
        frame_texts(os.path.join(tmp, "in.bin"), api_docs)
        for kind, src in (("--tiktoken", rpath), ("--hf", hf), ("--hf", hf_ascii)):
            out = subprocess.run([helper, "encode-docs", kind, src, os.path.join(tmp, "in.bin"),
                                  os.path.join(tmp, "ids.bin")], capture_output=True, text=True)
            check(out.returncode == 0, "encode-docs %s %s: exit %d: %s" % (kind, src, out.returncode, out.stderr))
            if out.returncode:
                continue
            got = read_framed_ids(os.path.join(tmp, "ids.bin"))
            check(len(got) == len(api_docs), "encode-docs %s: %d records" % (kind, len(got)))
            bad = [i for i in range(len(api_docs)) if got[i] != api_want[i]]
            for i in bad[:5]:
                w, g = api_want[i], got[i]
                j = next((k for k in range(min(len(w), len(g))) if w[k] != g[k]), min(len(w), len(g)))
                print("  doc %d (%s): first difference at id %d: got %s want %s (text %r)" % (
                    i, kind, j, g[j:j + 5], w[j:j + 5], api_docs[i][:80]))
            check(not bad, "C API (%s %s) differs from tiktoken on %d of %d documents" % (
                kind, os.path.basename(src), len(bad), len(api_docs)))
            # invalid UTF-8 counts: replacements = U+FFFD after decoding minus the real ones before
            counts = {int(l.split()[1]): int(l.split()[2]) for l in out.stdout.splitlines() if l.startswith("invalid")}
            for i, d in enumerate(api_docs):
                n_bad = d.decode("utf-8", "replace").count("\ufffd") - d.count("\ufffd".encode())
                check(counts.get(i, 0) == n_bad, "doc %d: %d invalid UTF-8 sequences reported, %d expected" % (
                    i, counts.get(i, 0), n_bad))
        # decode(encode(x)) == x (x repaired)
        write_framed_ids(os.path.join(tmp, "ids_want.bin"), api_want)
        r = subprocess.run([helper, "decode-docs", "--tiktoken", rpath, os.path.join(tmp, "ids_want.bin"),
                            os.path.join(tmp, "back.bin")], capture_output=True, text=True)
        check(r.returncode == 0, "decode-docs: " + r.stderr)
        back = read_framed_texts(os.path.join(tmp, "back.bin"))
        rt_bad = [i for i, d in enumerate(api_docs) if back[i] != d.decode("utf-8", "replace").encode()]
        check(not rt_bad, "decode(encode(x)) != x for %d documents (first %s)" % (len(rt_bad), rt_bad[:5]))
        check(all(back[i] == d for i, d in enumerate(api_docs) if d.decode("utf-8", "replace").encode() == d),
              "decode(encode(x)) != x for valid UTF-8")

        # ---- dgprep: each document a file ----
        ddir = os.path.join(tmp, "docs")
        os.makedirs(ddir)
        files = []
        for i, d in enumerate(docs):
            if not d:
                continue
            p = os.path.join(ddir, "d%04d.txt" % i)
            open(p, "wb").write(d)
            files.append((p, d))

        def run_prep(out, *args):
            r = subprocess.run([dgprep, "--tokenizer", "gpt2", "--out", out, "--name", "t", *args,
                                *[p for p, _ in files]], capture_output=True, text=True)
            check(r.returncode == 0, "dgprep %s: exit %d: %s" % (" ".join(args), r.returncode, r.stderr))
            return r

        expect = []
        for _, d in files:
            expect += [EOT] + enc.encode_ordinary(d.decode("utf-8", "replace"))
        n_invalid = sum(d.decode("utf-8", "replace").count("\ufffd") - d.count("\ufffd".encode()) for _, d in files)
        first_bad = None
        for p, d in files:
            try:
                d.decode("utf-8")
            except UnicodeDecodeError as e:  # e.start: where the first invalid sequence begins
                first_bad = (p, e.start)
                break

        outputs = {}
        for label, args in (("threads 3, chunk 300", ["--threads", "3", "--chunk-bytes", "300", "--shard-tokens", "7777"]),
                            ("threads 1, default chunk", ["--threads", "1", "--shard-tokens", "7777"]),
                            ("threads 2, chunk 1", ["--threads", "2", "--chunk-bytes", "1", "--shard-tokens", "7777"]),
                            ("hf reader", ["--hf-tokenizer", hf, "--threads", "2", "--shard-tokens", "7777"])):
            out = os.path.join(tmp, "o_" + label.replace(" ", "_").replace(",", ""))
            r = run_prep(out, "--val-fraction", "0", *args)
            got, n_shards = read_shards(out, "t", "train")
            outputs[label] = b"".join(open(os.path.join(out, f), "rb").read() for f in sorted(os.listdir(out)))
            check(got == expect, "dgprep (%s): %d ids, want %d; first difference at %s" % (
                label, len(got), len(expect), next((k for k in range(min(len(got), len(expect)))
                                                    if got[k] != expect[k]), "the end")))
            check(n_shards == (len(expect) + 7776) // 7777, "dgprep (%s): %d shards" % (label, n_shards))
            check("%d documents, each preceded by <|endoftext|> (50256)" % len(files) in r.stdout,
                  "dgprep (%s): document count not reported: %s" % (label, r.stdout))
            want_inv = "invalid UTF-8: %d sequences replaced by U+FFFD (the first in %s at byte %d)" % (
                n_invalid, first_bad[0], first_bad[1])
            check(want_inv in r.stdout, "dgprep (%s): invalid UTF-8 report\n  got:  %s\n  want: %s" % (
                label, r.stdout, want_inv))
            check("model.vocab_size = 50257" in r.stdout, "dgprep (%s): vocab size line" % label)
        check(len(set(outputs.values())) == 1, "dgprep output depends on threads / chunk size / reader")

        # ---- dgprep: blank-line documents, and a val split ----
        out = os.path.join(tmp, "o_blank")
        run_prep(out, "--docs", "blank-line", "--val-fraction", "0.3", "--threads", "3", "--chunk-bytes", "200")
        exp_tr, exp_va = [], []
        for _, d in files:
            c = val_cut(d, 0.3)
            for part, dst in ((d[:c], exp_tr), (d[c:], exp_va)):
                for doc in blank_line_docs(part.decode("utf-8", "replace")):
                    dst += [EOT] + enc.encode_ordinary(doc)
        got_tr, _ = read_shards(out, "t", "train")
        got_va, _ = read_shards(out, "t", "val")
        check(got_tr == exp_tr, "dgprep --docs blank-line: train ids differ (%d vs %d)" % (len(got_tr), len(exp_tr)))
        check(got_va == exp_va, "dgprep --docs blank-line: val ids differ (%d vs %d)" % (len(got_va), len(exp_va)))
        check(sum(1 for t in exp_tr if t == EOT) > len(files), "the blank-line corpus has too few blank lines")

    if fails:
        print("%d check(s) failed" % len(fails))
        return 1
    print("ok: C API (both readers), round trips and dgprep shards identical to tiktoken")
    return 0


if __name__ == "__main__":
    sys.exit(main())
