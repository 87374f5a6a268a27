#!/usr/bin/env python3
"""Runs the dgtrain commands that docs/planning.md marks as runnable and checks that each succeeds.

A fenced block directly after a line `<!-- doc-test: run ... -->` is runnable: each of its lines that
starts with `dgtrain ` is run from the repository root with the real dgtrain binary in place of the word
`dgtrain`. It must carry --plan-only or --dry-run (nothing trains), exit 0 and print the `chosen:` line
of the planner. A doc with no runnable command fails (the markers went missing).
Usage: doc_examples.py SOURCE_DIR DGTRAIN [DOC.md]
"""
import os
import shlex
import subprocess
import sys


def runnable_commands(text):
    cmds, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("<!-- doc-test: run"):
            j = i + 1
            if j >= len(lines) or not lines[j].startswith("```"):
                raise ValueError("line %d: a doc-test marker not followed by a fenced block" % (i + 1))
            j += 1
            while j < len(lines) and not lines[j].startswith("```"):
                if lines[j].startswith("dgtrain "):
                    cmds.append((j + 1, lines[j]))
                j += 1
            i = j
        i += 1
    return cmds


def main():
    src, dgtrain = sys.argv[1], sys.argv[2]
    doc = sys.argv[3] if len(sys.argv) > 3 else os.path.join(src, "docs", "planning.md")
    with open(doc) as f:
        cmds = runnable_commands(f.read())
    if not cmds:
        print("FAIL: %s has no runnable dgtrain command (no <!-- doc-test: run --> block)" % doc)
        return 1
    failed = 0
    for line, cmd in cmds:
        argv = shlex.split(cmd)
        if "--plan-only" not in argv and "--dry-run" not in argv:
            print("FAIL: %s:%d: a runnable example must use --plan-only or --dry-run: %s" % (doc, line, cmd))
            failed += 1
            continue
        p = subprocess.run([dgtrain] + argv[1:], cwd=src, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
        chosen = [l for l in p.stdout.splitlines() if l.strip().startswith("chosen:")]
        if p.returncode != 0 or not chosen:
            tail = " | ".join(l for l in p.stdout.splitlines()[-4:] if l.strip())
            print("FAIL: %s:%d: exit %d%s: %s\n  %s" % (doc, line, p.returncode,
                  "" if chosen else " and no 'chosen:' line", cmd, tail))
            failed += 1
        else:
            print("ok  %s:%d: %s" % (os.path.basename(doc), line, chosen[0].strip()[:120]))
    if failed:
        return 1
    print("PASS: %d runnable example(s) in %s succeed" % (len(cmds), doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
