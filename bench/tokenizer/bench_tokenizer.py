#!/usr/bin/env python3
"""bench_tokenizer.py — dgprep --tokenizer gpt2 vs tiktoken, MB/s per core; run through run.sh.

Input: BENCH_MB of text as 1 MB documents (one file each), a mix of English prose (the license texts
in /usr/share/common-licenses) and the mixed-script documents of tests/tokenizer/test_tiktoken.py.
Per core: dgprep --threads 1, CPU seconds from the child's rusage (it includes loading the ranks,
reading the files and writing the shards), against tiktoken's encode_ordinary over the documents on one
thread (CPU seconds of this process). Then for each thread count in BENCH_THREADS (default "1 <CPUs>"):
dgprep --threads N against encode_ordinary_batch(num_threads=N), wall time. All ids are compared.
"""
import glob
import os
import resource
import struct
import subprocess
import sys
import time

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "tests", "tokenizer"))
import test_tiktoken as tt  # noqa: E402  (the corpus generator and the oracle's pattern)


def cpus():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def child_cpu(cmd):
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode:
        sys.exit("dgprep failed: " + out.stderr)
    return (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime), wall


def main():
    dgprep, work = sys.argv[1], sys.argv[2]
    mb = int(os.environ.get("BENCH_MB", "64"))
    nthr = [int(x) for x in os.environ.get("BENCH_THREADS", "1 %d" % cpus()).split()]
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    rpath = tt.ranks_path()
    enc = tiktoken.Encoding(name="gpt2_local", pat_str=tt.CLASSIC_PAT, mergeable_ranks=load_tiktoken_bpe(rpath),
                            special_tokens={"<|endoftext|>": tt.EOT})

    english = b"".join(open(f, "rb").read() for f in sorted(glob.glob("/usr/share/common-licenses/*"))
                       if os.path.isfile(f) and not os.path.islink(f))
    mixed = b"".join(tt.corpus()[:200])
    blob = b""
    while len(blob) < mb * 10**6:
        blob += english * 3 + mixed  # about 2/3 English, 1/3 mixed-script
    blob = blob[:mb * 10**6]
    docs, ddir = [], os.path.join(work, "docs")
    os.makedirs(ddir, exist_ok=True)
    for f in glob.glob(os.path.join(ddir, "*")):
        os.unlink(f)
    step = 10**6
    for i in range(0, len(blob), step):
        d = blob[i:i + step]
        while d and (d[-1] & 0xC0) == 0x80:  # whole characters per document
            d = d[:-1]
        docs.append(d)
    paths = []
    for i, d in enumerate(docs):
        p = os.path.join(ddir, "d%05d.txt" % i)
        open(p, "wb").write(d)
        paths.append(p)
    nbytes = sum(map(len, docs)) / 1e6
    texts = [d.decode("utf-8", "replace") for d in docs]

    out1 = os.path.join(work, "o1")
    c1, w1 = child_cpu([dgprep, "--tokenizer", "gpt2", "--quiet", "--val-fraction", "0", "--threads", "1",
                        "--out", out1, *paths])
    t0 = time.process_time()
    ids = [enc.encode_ordinary(t) for t in texts]
    tk1 = time.process_time() - t0
    want = []
    for x in ids:
        want += [tt.EOT] + x
    got, _ = tt.read_shards(out1, "default", "train")
    same = list(got) == want

    print("input: %.1f MB in %d documents (2/3 English prose, 1/3 mixed-script); %d tokens; %d CPUs"
          % (nbytes, len(docs), len(want), cpus()))
    print("MB/s per core (input MB / CPU seconds, one thread): dgprep --tokenizer gpt2 (whole run: load, "
          "read, encode, write) %.1f, tiktoken %s encode_ordinary %.1f; ratio %.2f; aim >= 5: %s"
          % (nbytes / c1, tiktoken.__version__, nbytes / tk1, tk1 / c1, "yes" if nbytes / c1 >= 5 else "NO"))
    print("| threads | dgprep wall s | dgprep MB/s | tiktoken encode_ordinary_batch wall s | tiktoken MB/s | dgprep / tiktoken |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in nthr:
        if n == 1:
            wn = w1
        else:
            _, wn = child_cpu([dgprep, "--tokenizer", "gpt2", "--quiet", "--val-fraction", "0", "--threads", str(n),
                               "--out", os.path.join(work, "on"), *paths])
            same = same and tt.read_shards(os.path.join(work, "on"), "default", "train")[0] == got
        t0 = time.perf_counter()
        ids_b = enc.encode_ordinary_batch(texts, num_threads=n)
        tkn = time.perf_counter() - t0
        same = same and ids_b == ids
        print("| %d | %.2f | %.1f | %.2f | %.1f | %.2f |" % (n, wn, nbytes / wn, tkn, nbytes / tkn, tkn / wn))
    print("ids identical (dgprep at every thread count, tiktoken): %s" % ("yes" if same else "NO"))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
