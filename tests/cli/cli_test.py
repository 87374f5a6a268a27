#!/usr/bin/env python3
"""cli_test.py — end-to-end tests of the `dgtrain` executable: --help, --version, --print-config,
--dry-run / --topology (text and --json, parsed here) at 1, 2 and 4 ranks, exit codes, every bad-input
class with its one-line message, the failure agreement (bad input on one rank only: every rank exits
1 promptly and rank 0 names the failing rank and host), and --export-topology.

    cli_test.py --dgtrain PATH --mpiexec PATH --mpiflags "FLAGS" --source-dir DIR --work-dir DIR CASE

Each CASE is one ctest test (see CMakeLists.txt).
"""
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time

from clitest import check  # noqa: E402  (tests/cli/clitest.py)
import clitest  # noqa: E402

A = None


def run(args, ranks=None, timeout=60, env=None):
    """Run dgtrain (under mpiexec when ranks is set, or an MPMD list of (n, extra args)). Returns
    (rc, stdout, stderr, seconds)."""
    if ranks is None:
        cmd = [A.dgtrain] + args
    elif isinstance(ranks, int):
        cmd = [A.mpiexec] + shlex.split(A.mpiflags) + ["-n", str(ranks), A.dgtrain] + args
    else:
        cmd = [A.mpiexec] + shlex.split(A.mpiflags)
        for i, (n, extra) in enumerate(ranks):
            if i:
                cmd.append(":")
            cmd += ["-n", str(n), A.dgtrain] + args + extra
    e = dict(os.environ)
    e.update(env or {})
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e, cwd=A.source_dir)
    dt = time.time() - t0
    return p.returncode, p.stdout, p.stderr, dt


def our_error_lines(err):
    return [l for l in err.splitlines() if l.startswith("dgtrain: error")]


def rundir(name):
    d = os.path.join(A.work_dir, name)
    shutil.rmtree(d, ignore_errors=True)
    return d


def print_config_keys():
    rc, out, err, _ = run(["--print-config"])
    check(rc == 0, "--print-config exits 0 (got %d: %s)" % (rc, err))
    return [l.split(" = ")[0] for l in out.splitlines() if not l.startswith("#")]


# ---------------------------------------------------------------- cases

def case_help():
    rc, out, err, _ = run(["--help"])
    check(rc == 0, "--help exits 0")
    check(out.startswith("usage: dgtrain"), "--help starts with the usage line")
    for opt in ("--set", "--print-config", "--print-env", "--dry-run", "--topology", "--json", "--plan-only", "--export-topology",
                "--version"):
        check(opt in out, "--help documents " + opt)
    check("exit codes: 0 finished; 1 usage or config error; 2 runtime failure; 3 aborted" in out,
          "--help documents the exit codes")
    keys = print_config_keys()
    check(len(keys) >= 56, "--print-config lists every key (%d)" % len(keys))
    for k in keys:
        check(re.search(r"^  %s +\S" % re.escape(k), out, re.M), "--help documents key " + k)
    # under mpiexec only rank 0 prints it
    rc, out2, err, _ = run(["--help"], ranks=2)
    check(rc == 0 and out2 == out, "--help at 2 ranks prints once")


def case_version():
    rc, out, err, _ = run(["--version"])
    check(rc == 0 and out == "dgtrain 0.1.0\n", "--version prints 'dgtrain 0.1.0' (got %r)" % out)


def case_print_config():
    cfgfile = os.path.join(A.work_dir, "pc.ini")
    with open(cfgfile, "w") as fh:
        fh.write("# print-config test\n[run]\nname = pc-test\n\n[train]\nsteps = 5\nmicro_batch = 4\n")
    rc, out, err, _ = run([cfgfile, "--set", "train.steps=7", "--set=train.lr=0.01",
                           "--set", "train.steps=9", "--print-config"], ranks=2)
    check(rc == 0, "--print-config at 2 ranks exits 0 (%s)" % err)
    lines = out.splitlines()
    check(lines and re.match(r"# dgtrain 0\.1\.0 effective configuration \(hash [0-9a-f]{16}\)$", lines[0]),
          "header line with the config hash")
    vals = {}
    for l in lines[1:]:
        m = re.match(r"^(\S+) = (.*?) +# (.*)$", l)
        check(m is not None, "line format 'key = value  # source': %r" % l)
        if m:
            vals[m.group(1)] = (m.group(2), m.group(3))
    check(len(vals) == len(lines) - 1, "printed once (rank 0 only)")
    check(vals.get("train.steps") == ("9", "--set"), "a later --set wins: %r" % (vals.get("train.steps"),))
    check(vals.get("train.lr") == ("0.01", "--set"), "--set=... form: %r" % (vals.get("train.lr"),))
    check(vals.get("run.name") == ('"pc-test"', cfgfile + ":3"), "file value and FILE:LINE source: %r"
          % (vals.get("run.name"),))
    check(vals.get("train.micro_batch") == ("4", cfgfile + ":7"), "file source line: %r"
          % (vals.get("train.micro_batch"),))
    check(vals.get("run.log_level") == ("info", "default"), "default source: %r" % (vals.get("run.log_level"),))
    # same config => same hash; a changed value => another hash
    first = lines[0] if lines else None
    rc, out2, _, _ = run([cfgfile, "--set", "train.steps=9", "--set", "train.lr=0.01", "--print-config"])
    check(first and out2.startswith(first + "\n"), "the hash depends on values, not on how they were given")
    rc, out3, _, _ = run([cfgfile, "--set", "train.steps=10", "--set", "train.lr=0.01", "--print-config"])
    check(first and out3.startswith("# dgtrain") and not out3.startswith(first + "\n"), "another value gives another hash")
    d = rundir("pcdry")
    rc, dry, err, _ = run([cfgfile, "--set", "train.steps=9", "--set", "train.lr=0.01", "--set", "run.dir=" + d,
                           "--topology"])
    _, pc, _, _ = run([cfgfile, "--set", "train.steps=9", "--set", "train.lr=0.01", "--set", "run.dir=" + d,
                       "--print-config"])
    h = re.search(r"hash ([0-9a-f]{16})", pc)
    check(h and ("config %s (hash %s)" % (cfgfile, h.group(1))) in err, "the log's start line shows the same hash")


def parse_json(out, what):
    try:
        return json.loads(out)
    except ValueError as e:
        check(False, "%s: stdout is one JSON document (%s): %r" % (what, e, out[:300]))
        return None


def case_dry_run(n):
    d = rundir("dry%d" % n)
    host = socket.gethostname()
    rc, out, err, _ = run(["configs/default.ini", "--dry-run", "--set", "run.dir=" + d], ranks=n)
    check(rc == 0, "--dry-run at %d ranks exits 0 (%s)" % (n, err))
    text_hash = re.search(r"^dgtrain 0\.1\.0 dry run: config configs/default\.ini \(hash ([0-9a-f]{16})\)", out, re.M)
    check(text_hash is not None, "dry-run header with the config hash")
    check(re.search(r"^world: %d ranks? on 1 node; MPI: .+; thread level MPI_THREAD_MULTIPLE$" % n, out, re.M),
          "world line")
    table = re.search(r"^ rank  host .*?\n(.*?)^node ", out, re.M | re.S)
    check(table is not None, "rank table present")
    rows = re.findall(r"^ +(\d+) +(\S+) +(\d+) +(\d+) +(\S+) +(\S+) +(\S+) +(\S+) +(.+)$",
                      table.group(1) if table else "", re.M)
    check(len(rows) == n, "one table row per rank (%d)" % len(rows))
    check(sorted(int(r[0]) for r in rows) == list(range(n)), "every rank listed once")
    for r in rows:
        check(r[1] == host and r[2] == "0" and r[3] == r[0], "row of rank %s: host, node 0, local rank" % r[0])
        check(r[8] == "applied", "binding applied on the live machine (%s)" % r[8])
    check(re.search(r"^node 0 \(%s\): \d+ sockets?, \d+ cores, \d+ PUs, \d+ NUMA nodes?, \d+ GPUs?, \d+ NICs?; "
                    r"topology live$" % re.escape(host), out, re.M), "node line")
    for r in range(n):
        log = os.path.join(d, "logs", "rank-%d.log" % r)
        check(os.path.isfile(log) and os.path.getsize(log) > 0, "log file " + log)
        if os.path.isfile(log):
            text = open(log).read()
            check("[rank %d %s]" % (r, host) in text, "log lines carry rank and host")

    # the same as one JSON document
    rc, out, err, _ = run(["configs/default.ini", "--dry-run", "--json", "--set", "run.dir=" + d], ranks=n)
    check(rc == 0, "--dry-run --json exits 0")
    doc = parse_json(out, "--dry-run --json")
    if doc is None:
        return
    check(text_hash and doc["run"]["config_hash"] == text_hash.group(1), "JSON and text show the same config hash")
    check(doc["run"]["world_size"] == n and doc["run"]["config"] == "configs/default.ini", "JSON run section")
    t = doc["topology"]
    check(t["world_size"] == n and t["n_nodes"] == 1, "JSON world")
    check(t["thread_level"] == "MPI_THREAD_MULTIPLE" and t["mpi_version"], "JSON MPI fields")
    check([r["rank"] for r in t["ranks"]] == list(range(n)), "JSON ranks in order")
    check(sorted(r["local_rank"] for r in t["ranks"]) == list(range(n)), "JSON local ranks")
    cpus = [r["cpuset"] for r in t["ranks"]]
    check(all(c and c != "-" for c in cpus), "every rank has a cpuset")
    node = t["nodes"][0]
    check(node["cores"] >= 1 and node["pus"] >= node["cores"] and node["topology"] == "live", "JSON node")
    if n <= node["cores"]:
        check(len(set(cpus)) == n, "ranks get different cores when there are enough")


def case_topology_xml():
    xml = os.path.join("tests", "mpi_boot", "data", "node-2s-8gpu-4ib.xml")
    d = rundir("topo8")
    rc, out, err, _ = run(["--topology", "--json", "--set", "run.dir=" + d, "--set", "topology.xml=" + xml], ranks=4)
    check(rc == 0, "--topology --json with an XML at 4 ranks exits 0 (%s)" % err)
    t = parse_json(out, "--topology --json")
    if t is None:
        return
    # GPUs 0-3 are on socket 0: its four ranks get a quarter of its 16 cores (and their hyperthreads) each
    want = ["0-3,32-35", "4-7,36-39", "8-11,40-43", "12-15,44-47"]
    check(len(t["ranks"]) == 4, "4 ranks")
    for r in t["ranks"]:
        i = r["rank"]
        check(r["gpu"] is not None and r["gpu"]["index"] == i and r["gpu"]["cuda_index"] == i, "rank %d gets GPU %d" % (i, i))
        check(r["numa"] == 0, "rank %d on NUMA 0" % i)
        check(r["cpuset"] == want[i], "rank %d cpuset %s (got %s)" % (i, want[i], r["cpuset"]))
        check(r["binding"] == "computed, not applied (XML)", "an XML machine is not bound to")
    node = t["nodes"][0]
    check(node["topology_host"] == "gpunode-a" and node["sockets"] == 2 and node["cores"] == 32 and node["pus"] == 64,
          "node summary")
    check(len(node["gpus"]) == 8 and len(node["nics"]) == 5, "8 GPUs and 5 NICs")
    check([x["kind"] for x in node["nics"]] == ["eth", "ib", "ib", "ib", "ib"], "NIC kinds")
    check(node["nvlink_gbps"][0][1] == 100 and node["nvlink_gbps"][0][2] == 50 and node["nvlink_gbps"][0][4] == 0,
          "NVLink matrix")
    # text form of the same
    rc, out, err, _ = run(["--topology", "--set", "run.dir=" + d, "--set", "topology.xml=" + xml])
    check(rc == 0 and "topology from %s (host gpunode-a)" % xml in out, "text node line names the XML")
    check(re.search(r"^  gpu 7  0000:db:00\.0  cuda 7  numa 1 +cpus 16-31,48-63 +NVIDIA H100 80GB HBM3$", out, re.M),
          "text GPU line")
    check(re.search(r"^  nic 4  0000:bb:00\.0  ib   numa 1 +mlx5_3$", out, re.M), "text NIC line")


def bad(args, want, ranks=None, env=None):
    # bad input every rank sees and reports before MPI_Finalize (whose fence no rank leaves early): no
    # need for mpiexec's 1-s grace before it kills the others, which it waits twice even when every rank
    # has already exited
    env = dict(env or {}, OMPI_MCA_odls_base_sigkill_timeout="0")
    rc, out, err, dt = run(args, ranks=ranks, env=env)
    lines = our_error_lines(err)
    host = socket.gethostname()
    check(rc == 1, "%s: exit code 1 (got %d)" % (args, rc))
    check(len(lines) == 1, "%s: exactly one error line (got %r)" % (args, lines))
    if lines:
        n = ranks if isinstance(ranks, int) else 1
        others = "" if n == 1 else " and %d other rank%s" % (n - 1, "s" if n > 2 else "")
        expect = "dgtrain: error on rank 0 (%s)%s: %s" % (host, others, want)
        check(lines[0] == expect, "%s:\n  got  %s\n  want %s" % (args, lines[0], expect))
    check(out == "", "%s: nothing on stdout" % (args,))


def case_bad_input():
    w = A.work_dir
    os.makedirs(w, exist_ok=True)

    def f(name, text):
        p = os.path.join(w, name)
        with open(p, "w") as fh:
            fh.write(text)
        return p

    # every bad-input class is checked message by message in config_unit; here the end-to-end path of
    # each kind of source (file line, --set, file system, command line, cross-key rule)
    p = f("key.ini", "[train]\nsteps = 10\nstpes = 3\n")
    bad([p, "--print-config"], "%s:3: unknown key 'train.stpes'; did you mean 'train.steps'?" % p)
    p = f("mal.ini", "[train]\nsteps 10\n")
    bad([p, "--print-config"], "%s:2: malformed line 'steps 10': expected '[section]' or 'key = value'" % p)
    missing = os.path.join(w, "nope.ini")
    bad([missing, "--print-config"], "cannot open config file '%s': No such file or directory" % missing)
    bad(["--set", "train.steps=x", "--print-config"], "--set 'train.steps=x': train.steps: expected an integer, got 'x'")
    bad(["--dry-runn"], "unknown option '--dry-runn'; did you mean '--dry-run'? (dgtrain --help lists the options)")
    bad(["--json"], "--json goes with --print-env, --dry-run, --topology or --plan-only")
    bad(["--set", "train.global_batch=10", "--set", "train.micro_batch=4", "--print-config"],
        "train.global_batch = 10 (--set) is not a multiple of train.micro_batch = 4 (--set): expected global_batch "
        "= micro_batch x data-parallel ranks x accumulation steps")
    # every rank sees the same bad input: one line from rank 0, counting the others
    p = f("key2.ini", "[model]\nn_heads = 3\n")
    bad([p, "--dry-run"], "%s:2: unknown key 'model.n_heads'; did you mean 'model.n_head'?" % p, ranks=2)
    bad(["--dry-run", "--set", "topology.xml=/nonexistent.xml", "--set", "run.dir=" + rundir("badxml")],
        "cannot open hwloc topology XML '/nonexistent.xml' (topology.xml): No such file or directory", ranks=4)


def case_fail_agree():
    """Bad input on one rank only: all ranks exit 1 promptly; rank 0 names the failing rank and host."""
    host = socket.gethostname()
    d = rundir("agree")
    base = ["--dry-run", "--set", "run.dir=" + d]
    # a config error on rank 1 (its own --set)
    rc, out, err, dt = run(base, ranks=[(1, []), (1, ["--set", "train.stpes=3"]), (2, [])], timeout=60)
    lines = our_error_lines(err)
    check(rc == 1, "one bad rank: exit code 1 (got %d)" % rc)
    check(lines == ["dgtrain: error on rank 1 (%s): --set 'train.stpes=3': unknown key 'train.stpes'; did you mean "
                    "'train.steps'?" % host], "one line naming rank 1: %r" % lines)
    check(out == "", "no report printed after a failed agreement")
    check(dt < 20, "prompt (%.1f s)" % dt)
    # a topology error on ranks 2 and 3 only, after the config stage agreed
    rc, out, err, dt = run(base, ranks=[(2, []), (2, ["--set", "topology.xml=/nonexistent.xml"])], timeout=60)
    lines = our_error_lines(err)
    check(rc == 1, "bad topology on two ranks: exit code 1 (got %d)" % rc)
    check(lines == ["dgtrain: error on rank 2 (%s) and 1 other rank: cannot open hwloc topology XML "
                    "'/nonexistent.xml' (topology.xml): No such file or directory" % host], "names rank 2: %r" % lines)
    check(dt < 20, "prompt (%.1f s)" % dt)


def case_export_topology():
    d = rundir("export")
    os.makedirs(d, exist_ok=True)
    out_xml = os.path.join(d, "a.xml")
    src = os.path.join("tests", "mpi_boot", "data", "node-2s-snc-4gpu.xml")
    rc, out, err, _ = run(["--export-topology", out_xml, "--set", "run.dir=" + d, "--set", "topology.xml=" + src])
    check(rc == 0 and os.path.isfile(out_xml), "--export-topology writes the file (%s)" % err)
    rc, out, err, _ = run(["--topology", "--json", "--set", "run.dir=" + d, "--set", "topology.xml=" + out_xml], ranks=4)
    t = parse_json(out, "--topology --json of the exported XML")
    if t:
        node = t["nodes"][0]
        check(node["topology_host"] == "gpunode-b" and node["numa_nodes"] == 4 and len(node["gpus"]) == 4,
              "the export describes the same machine")
        check([r["cpuset"] for r in t["ranks"]] == ["6-8", "9-11", "12-17", "18-23"], "same binding plan: %r"
              % [r["cpuset"] for r in t["ranks"]])
    # the live machine: report and export in one run, then report the exported file
    live = os.path.join(d, "live.xml")
    rc, out, err, _ = run(["--topology", "--json", "--export-topology=" + live, "--set", "run.dir=" + d])
    check(rc == 0 and os.path.isfile(live) and os.path.getsize(live) > 100, "live export (%s)" % err)
    t1 = parse_json(out, "live --topology --json")
    rc, out, err, _ = run(["--topology", "--json", "--set", "run.dir=" + d, "--set", "topology.xml=" + live])
    t2 = parse_json(out, "exported --topology --json")
    if t1 and t2:
        a, b = t1["nodes"][0], t2["nodes"][0]
        for k in ("sockets", "cores", "pus", "numa_nodes", "gpus", "nics"):
            check(a[k] == b[k], "live and exported topology agree on %s" % k)
        check(b["topology_host"] == socket.gethostname(), "exported XML names this host")


def case_print_env():
    """--print-env lists the registry (text and --json); a malformed value is refused at start (exit 1, one
    line naming variable, value and type); a DG_TEST_* hook set in a build without hooks is warned about."""
    rc, out, err, _ = run(["--print-env", "--json"], env={"DG_COMM_RING_SEG_KB": "3", "DG_TEST_STALL_RANK": "1"})
    check(rc == 0, "--print-env --json exits 0 (%d: %s)" % (rc, err))
    doc = parse_json(out, "--print-env --json")
    if not doc:
        return
    hooks = doc.get("test_hooks_compiled")
    check(hooks in (True, False), "test_hooks_compiled is a bool")
    by = {v["name"]: v for v in doc.get("vars", [])}
    check(len(by) >= 30, "--print-env lists the registry (%d)" % len(by))
    check(by.get("DG_COMM_RING_SEG_KB", {}).get("value") == "3", "the current value of a set switch")
    check(by.get("DG_SYNC_HOST_READS", {}).get("value", 1) is None, "an unset switch is null")
    h = by.get("DG_TEST_STALL_RANK", {})
    check(h.get("kind") == "test-hook" and h.get("compiled_in") == hooks and h.get("value") == ("1" if hooks else None),
          "hook row follows the build (hooks %s): %r" % (hooks, h))
    for n, v in by.items():
        check(n.startswith("DG_TEST_") == (v["kind"] == "test-hook"), "%s: DG_TEST_ prefix iff hook" % n)
    rc, txt, err, _ = run(["--print-env"], ranks=2, env={"DG_COMM_RING_SEG_KB": "3"})
    lines = txt.splitlines()
    check(rc == 0 and len(lines) == len(by), "text: one line per switch, rank 0 only (%d lines, %d vars)"
          % (len(lines), len(by)))
    row = [l for l in lines if l.startswith("DG_COMM_RING_SEG_KB ")]
    check(row and re.match(r"DG_COMM_RING_SEG_KB +int +default=512 +3 +\S", row[0]), "text row: %r" % row)
    row = [l for l in lines if l.startswith("DG_TEST_CKPT_FAIL ")]
    check(row and (" unset " in row[0] if hooks else " not compiled in " in row[0]), "hook text row: %r" % row)
    # a malformed value: refused before any work, one line per rank, exit 1
    rc, out, err, _ = run(["--print-config"], ranks=2, env={"DG_COMM_RING_SEG_KB": "four"})
    lines = our_error_lines(err)
    want = "environment: DG_COMM_RING_SEG_KB='four' is not a whole decimal number"
    check(rc == 1 and lines and all(l.endswith(want) for l in lines), "malformed value refused (rc %d): %r" % (rc, err))
    check(out == "", "nothing on stdout after a malformed value")
    rc, out, err, _ = run(["--print-config"], env={"DG_SYNC_HOST_READS": "maybe"})
    check(rc == 1 and "DG_SYNC_HOST_READS='maybe' is not a bool" in err, "malformed bool refused: %r" % err)
    # a former switch that is a config key now: not read (the key keeps its value), one warning naming the key
    rc, out, err, _ = run(["--print-config"], env={"DG_CKPT_THREADS": "4", "DG_CKPT_SPACE_CHECK": "0",
                                             "DG_NCCL_NONBLOCKING": "1"})
    check(rc == 0 and "warning: DG_CKPT_THREADS is no longer read: it is the config key checkpoint.threads now "
          "(--set checkpoint.threads=VALUE)" in err and "config key checkpoint.space_check now" in err
          and "config key parallel.nccl_nonblocking now" in err,
          "moved switches: one warning each naming the key (rc %d): %r" % (rc, err))
    check(re.search(r"^checkpoint\.threads = 0 ", out, re.M) and re.search(r"^checkpoint\.space_check = true ", out, re.M)
          and re.search(r"^parallel\.nccl_nonblocking = false ", out, re.M),
          "moved switches are not read: %r" % [l for l in out.splitlines() if "threads" in l or "space" in l])
    check(not {"DG_CKPT_THREADS", "DG_CKPT_SPACE_CHECK", "DG_NCCL_NONBLOCKING"} & set(by), "moved switches are not in --print-env")
    rc, out, err, _ = run(["--print-config"], env={"DG_TEST_STALL_STEP": "4"})
    warn = "warning: DG_TEST_STALL_STEP is set but ignored: test hooks are not compiled into this build"
    check(rc == 0 and ((warn in err) != hooks), "hook warning only without hooks (hooks %s): %r" % (hooks, err))


CASES = {
    "print_env": case_print_env,
    "help": case_help,
    "version": case_version,
    "print_config": case_print_config,
    "dry_run_n1": lambda: case_dry_run(1),
    "dry_run_n2": lambda: case_dry_run(2),
    "dry_run_n4": lambda: case_dry_run(4),
    "topology_xml": case_topology_xml,
    "bad_input": case_bad_input,
    "fail_agree": case_fail_agree,
    "export_topology": case_export_topology,
}


def main():
    global A
    A = clitest.parse_args(CASES, "--source-dir")
    return clitest.run_case(A, CASES)

if __name__ == "__main__":
    sys.exit(main())
