#!/usr/bin/env python3
"""json_check.py — the JSON escaper (src/common/dg_json.h) as an independent reader sees it: random byte
strings quoted by dg_json_fputs must each parse with Python's strict json module, be valid UTF-8, hold
no raw control character, and decode to the documented rule (valid UTF-8 kept, every other byte as the
code point of the same value, i.e. Latin-1).

    json_check.py TEST_COMMON
"""
import json
import subprocess
import sys


def expected(raw):
    """The documented rule, implemented independently: longest valid UTF-8 prefix sequence at each
    position (Python's strict decoder refuses overlongs, surrogates and > U+10FFFF as RFC 3629 does)."""
    out, i = [], 0
    while i < len(raw):
        for n in (1, 2, 3, 4):
            chunk = raw[i:i + n]
            try:
                ch = chunk.decode("utf-8")
            except UnicodeDecodeError:
                continue
            if len(ch) == 1 and (raw[i] >= 0x80 or n == 1):
                out.append(ch)
                i += n
                break
        else:
            out.append(chr(raw[i]))
            i += 1
    return "".join(out)


def main():
    exe = sys.argv[1]
    fails = 0
    total = 0
    for seed in (1, 2, 3):
        p = subprocess.run([exe, "json-dump", "3000", str(seed)], stdout=subprocess.PIPE, check=True, timeout=60)
        for line in p.stdout.split(b"\n"):
            if not line:
                continue
            total += 1
            hexpart, quoted = line.split(b" ", 1)
            raw = bytes.fromhex(hexpart.decode())
            try:
                text = quoted.decode("utf-8")  # strict: the output itself is valid UTF-8
                val = json.loads(text)  # strict: control characters inside strings are refused
            except (UnicodeDecodeError, ValueError) as e:
                fails += 1
                print("FAIL: %r -> %r: %s" % (raw, quoted, e))
                continue
            if any(ord(c) < 0x20 for c in text):
                fails += 1
                print("FAIL: raw control character in %r" % quoted)
            if val != expected(raw):
                fails += 1
                print("FAIL: %r decodes to %r, expected %r" % (raw, val, expected(raw)))
    print("json_check: %d strings, %d failures" % (total, fails))
    return 1 if fails or total < 9000 else 0


if __name__ == "__main__":
    sys.exit(main())
