#!/usr/bin/env python3
"""check_reports.py — parse and check the two reports dgvalidate writes in its run directory:
validation.json (json) and validation-junit.xml (xml.etree), against each other and against what the test
expects.

usage: check_reports.py RUN_DIR --ranks N --nodes M --exit CODE [--expect GLOB=VERDICT[|VERDICT]...]
                        [--checks-exactly GLOB,...] [--message GLOB=SUBSTRING ...]

--expect       checks whose name matches GLOB must have one of the verdicts; every check matched by no
               --expect must PASS (so a new SKIP or FAIL is never silently accepted)
--require      GLOB that must match at least one check (repeatable)
--message      a check matching GLOB must have SUBSTRING in its message (JSON and the JUnit element)
Exits 0 when everything holds, 1 with one line per problem otherwise.
"""
import argparse
import fnmatch
import json
import math
import os
import sys
import xml.etree.ElementTree as ET

VERDICTS = {"PASS", "FAIL", "SKIP", "ERROR"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--exit", type=int, required=True, dest="exit_code")
    ap.add_argument("--expect", action="append", default=[])
    ap.add_argument("--require", action="append", default=[])
    ap.add_argument("--message", action="append", default=[])
    a = ap.parse_args()
    problems = []

    def bad(msg):
        problems.append(msg)

    jpath = os.path.join(a.run_dir, "validation.json")
    xpath = os.path.join(a.run_dir, "validation-junit.xml")
    try:
        with open(jpath) as f:
            rep = json.load(f)
    except Exception as e:  # noqa: BLE001 - any parse failure is the finding
        print(f"FAIL: {jpath} does not parse as JSON: {e}")
        return 1
    try:
        root = ET.parse(xpath).getroot()
    except Exception as e:  # noqa: BLE001
        print(f"FAIL: {xpath} does not parse as XML: {e}")
        return 1

    # ---- JSON structure
    for key, typ in [("suite", str), ("version", str), ("started", str), ("seconds", (int, float)),
                     ("sla", str), ("run_dir", str), ("world_size", int), ("n_nodes", int), ("hosts", list),
                     ("complete", bool), ("result", str), ("exit_code", int), ("counts", dict), ("checks", list)]:
        if not isinstance(rep.get(key), typ):
            bad(f"JSON: '{key}' missing or not {typ}")
    if problems:
        print("\n".join("FAIL: " + p for p in problems))
        return 1
    if rep["suite"] != "dgvalidate":
        bad(f"JSON: suite is {rep['suite']!r}")
    if rep["world_size"] != a.ranks:
        bad(f"JSON: world_size {rep['world_size']}, expected {a.ranks}")
    if rep["n_nodes"] != a.nodes or len(rep["hosts"]) != a.nodes:
        bad(f"JSON: n_nodes {rep['n_nodes']} / hosts {rep['hosts']}, expected {a.nodes} nodes")
    if not rep["complete"]:
        bad("JSON: complete is false")
    if rep["exit_code"] != a.exit_code:
        bad(f"JSON: exit_code {rep['exit_code']}, expected {a.exit_code}")
    if rep["result"] != ("PASS" if a.exit_code == 0 else "FAIL"):
        bad(f"JSON: result {rep['result']} does not match exit code {a.exit_code}")
    if os.path.realpath(rep["run_dir"]) != os.path.realpath(a.run_dir):
        bad(f"JSON: run_dir {rep['run_dir']!r} is not {a.run_dir!r}")

    checks = rep["checks"]
    names = [c.get("name") for c in checks]
    if len(set(names)) != len(names):
        bad("JSON: duplicate check names")
    counts = {"pass": 0, "fail": 0, "error": 0, "skip": 0}
    for c in checks:
        n = c.get("name", "?")
        for key in ("name", "group", "verdict", "unit", "measured", "reference", "message"):
            if not isinstance(c.get(key), str):
                bad(f"JSON: check {n}: '{key}' missing or not a string")
        if not isinstance(c.get("details"), dict):
            bad(f"JSON: check {n}: details is not an object")
        if c.get("verdict") not in VERDICTS:
            bad(f"JSON: check {n}: verdict {c.get('verdict')!r}")
            continue
        counts[c["verdict"].lower()] += 1
        if c["group"] != n.split(".")[0]:
            bad(f"JSON: check {n}: group {c['group']!r}")
        if c["verdict"] in ("FAIL", "ERROR", "SKIP") and not c["message"]:
            bad(f"JSON: check {n}: {c['verdict']} without a message")
        v = c.get("value")
        if v is not None and (not isinstance(v, (int, float)) or not math.isfinite(v)):
            bad(f"JSON: check {n}: value {v!r}")
        if c["verdict"] == "PASS" and c["unit"] and (v is None or v < 0):
            bad(f"JSON: check {n}: PASS with unit {c['unit']} but value {v!r}")
        # a comm check's data check: every sweep point measured, 0 wrong elements when it passed
        if n.startswith("comm.") and c["verdict"] == "PASS":
            for g in c["details"].get("groups", []):
                if g.get("wrong") != 0:
                    bad(f"JSON: check {n}: group {g.get('group_id')} has {g.get('wrong')} wrong elements")
                for p in g.get("sweep", []):
                    if p["bytes"] > 0 and g["ranks"] > 1 and not (p["busbw_GBps"] is not None and p["busbw_GBps"] >= 0
                                                               and p["algbw_GBps"] > 0 and p["time_us"] > 0):
                        bad(f"JSON: check {n}: bad sweep point {p}")
        # the resumed run's recovery time: its parts and the training SLA's verdict (docs/sla.md)
        if n == "train.recovery" and c["verdict"] in ("PASS", "FAIL"):
            d = c["details"]
            parts = [d.get(k) for k in ("boot_s", "checkpoint_read_s", "plan_build_s")]
            if not (isinstance(v, (int, float)) and v > 0 and all(isinstance(x, (int, float)) and x >= 0 for x in parts)
                    and sum(parts) <= v * 1.001 + 1e-3 and d.get("sla_verdict") in ("met", "violated")
                    and "SLA " + d.get("sla_verdict", "?") in c["measured"]):
                bad(f"JSON: check {n}: recovery {v!r} parts {parts} details {d} measured {c['measured']!r}")
    if counts != rep["counts"]:
        bad(f"JSON: counts {rep['counts']} do not match the checks {counts}")
    if (counts["fail"] or counts["error"]) and a.exit_code == 0:
        bad("JSON: FAIL/ERROR checks but exit code 0")

    # ---- expectations
    exp = []
    for e in a.expect:
        glob, _, vs = e.partition("=")
        exp.append((glob, set(vs.split("|"))))
    for c in checks:
        allowed = None
        for glob, vs in exp:
            if fnmatch.fnmatchcase(c["name"], glob):
                allowed = vs
                break
        if allowed is None:
            allowed = {"PASS"}
        if c["verdict"] not in allowed:
            bad(f"{c['name']}: {c['verdict']} (expected {'|'.join(sorted(allowed))}): {c['message']}")
    for glob in a.require:
        if not any(fnmatch.fnmatchcase(n, glob) for n in names):
            bad(f"no check matches {glob!r} (checks: {', '.join(names)})")

    # ---- JUnit: the same checks, counts and messages
    if root.tag != "testsuites":
        bad(f"JUnit: root element is <{root.tag}>")
    suites = root.findall("testsuite")
    if len(suites) != 1:
        bad(f"JUnit: {len(suites)} <testsuite> elements")
    else:
        s = suites[0]
        cases = s.findall("testcase")
        if [tc.get("name") for tc in cases] != names:
            bad("JUnit: testcase names/order differ from the JSON checks")
        for elem in (root, s):
            for attr, want in (("tests", len(checks)), ("failures", counts["fail"]), ("errors", counts["error"]),
                               ("skipped", counts["skip"])):
                if elem.get(attr) != str(want):
                    bad(f"JUnit: <{elem.tag}> {attr}={elem.get(attr)!r}, expected {want}")
        props = {p.get("name"): p.get("value") for p in s.findall("properties/property")}
        if props.get("world_size") != str(a.ranks):
            bad(f"JUnit: property world_size {props.get('world_size')!r}")
        byname = {c["name"]: c for c in checks}
        for tc in cases:
            c = byname.get(tc.get("name"))
            if c is None:
                continue
            if tc.get("classname") != "dgvalidate." + c["group"]:
                bad(f"JUnit: {c['name']}: classname {tc.get('classname')!r}")
            try:
                float(tc.get("time"))
            except (TypeError, ValueError):
                bad(f"JUnit: {c['name']}: time {tc.get('time')!r}")
            f, e, sk = tc.find("failure"), tc.find("error"), tc.find("skipped")
            want = {"PASS": (None, None, None), "FAIL": ("f", None, None), "ERROR": (None, "e", None),
                    "SKIP": (None, None, "s")}[c["verdict"]]
            got = ("f" if f is not None else None, "e" if e is not None else None, "s" if sk is not None else None)
            if got != want:
                bad(f"JUnit: {c['name']}: elements {got} for verdict {c['verdict']}")
            el = f if f is not None else e if e is not None else sk
            if el is not None and el.get("message") != c["message"]:
                bad(f"JUnit: {c['name']}: message differs from the JSON one")
            if tc.find("system-out") is None or c["measured"] not in (tc.find("system-out").text or ""):
                bad(f"JUnit: {c['name']}: system-out does not carry the measurement")

    for m in a.message:
        glob, _, sub = m.partition("=")
        hits = [c for c in checks if fnmatch.fnmatchcase(c["name"], glob)]
        if not hits:
            bad(f"--message: no check matches {glob!r}")
        for c in hits:
            if sub not in c["message"]:
                bad(f"{c['name']}: message {c['message']!r} lacks {sub!r}")

    if problems:
        for p in problems:
            print("FAIL: " + p)
        return 1
    print(f"reports OK: {len(checks)} checks ({counts['pass']} pass, {counts['fail']} fail, {counts['error']} error, "
          f"{counts['skip']} skip), exit {rep['exit_code']}, JSON and JUnit agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
