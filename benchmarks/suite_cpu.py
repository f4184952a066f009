"""Where the test suite's CPU goes: per test file and per kind of process.

    python benchmarks/suite_cpu.py [--workers 2] [--out DIR] [PYTEST PATH ...]

Runs pytest as ``.ci/run`` does on a fresh machine (``-n 2 --dist worksteal``, bytecode
caches written, inductor's compile caches in a new empty folder unless ``--inductor-cache``
names one; the whole suite unless paths are given) with two recorders on ``PYTHONPATH``: a
pytest plugin that writes each test's CPU (its worker's and the children it reaped) and
wall time, and a ``sitecustomize`` that makes every Python process the suite starts (a
bundle's trainer ranks, preprocessing workers, torchrun's agent, preflight, ``dtc``) write
its own CPU when it exits. Forked children (``tests.dist``'s ranks, memcheck's replays)
leave with ``os._exit`` and write nothing: theirs is the rest of the process tree's CPU.

On a 2-core machine the suite fits in 20 minutes only if it needs at most about 38
CPU-minutes (2026-11-29, inductor's caches empty as on CI: 48.2 in 25.6 minutes, of which
65% in forked ranks, 17% in bundle launches' processes, 18% in the pytest workers
themselves; with the caches of earlier runs the compiled tests take some 200 CPU-s less).
The two workers keep both cores busy (their tests' wall times sum to twice the run's, less
2%); a third worker only adds contention: 29.8 minutes and 52.1 CPU-minutes with
``--workers 3``, against 26.4 and 47.8 with 2 (2026-11-30).
Prints the breakdown; writes ``tests.tsv`` (test, CPU s, wall s, and of the CPU the pytest
process's own), ``processes.tsv`` (kind, CPU s, wall s, argv) and ``summary.json`` to
``--out`` (default: a new temporary folder).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Written into the recorders' folder; both append one line per record to the file their
# environment variable names (several processes append at once: one write each).
_SITECUSTOMIZE = '''
import atexit, os, resource, sys, time
_t0 = time.monotonic()
def _dtdsl_suite_cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    kind = ""
    if "_pytest.main" in sys.modules:
        # xdist's workers run from execnet's "python -c"
        kind = "pytest worker" if sys.argv[:1] == ["-c"] else "pytest (main)"
    elif "multiprocessing" in sys.modules:
        import multiprocessing
        if multiprocessing.parent_process() is not None:
            kind = "multiprocessing spawn child"  # its argv is its parent's
    argv = " ".join(sys.argv).replace("\\t", " ").replace("\\n", " ")[:300]
    line = f"{kind}\\t{r.ru_utime + r.ru_stime:.3f}\\t{time.monotonic() - _t0:.3f}\\t{argv}\\n"
    with open(os.environ["DTDSL_SUITE_CPU_PROCS"], "a") as f:
        f.write(line)
atexit.register(_dtdsl_suite_cpu)
'''

_PLUGIN = '''
import os, resource, time
import pytest
def _cpu():
    a = resource.getrusage(resource.RUSAGE_SELF)
    b = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = a.ru_utime + a.ru_stime
    return own + b.ru_utime + b.ru_stime, own
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    (cpu, own), wall = _cpu(), time.perf_counter()
    yield
    (cpu2, own2), wall2 = _cpu(), time.perf_counter()
    with open(os.environ["DTDSL_SUITE_CPU_TESTS"], "a") as f:
        f.write(f"{item.nodeid}\\t{cpu2 - cpu:.3f}\\t{wall2 - wall:.3f}\\t{own2 - own:.3f}\\n")
'''

# (what the argv holds, kind): the first that matches names a process.
_KINDS = (("torch/distributed/run.py", "torchrun agent"),
          ("/train.py", "trainer rank (bundle)"),
          ("worker.py --all", "worker supervisor"),
          ("workers/worker.py", "preprocessing worker"),
          ("dtdsl/train/preflight", "preflight"),
          ("dtdsl/train/supervise", "launch supervisor"),
          ("dtdsl/train/dryrun", "dry run"),
          ("dtdsl/cli", "dtc"),
          ("benchmarks/", "benchmark"))


def kind_of(recorded: str, argv: str) -> str:
    """The kind of process a record names (``recorded``: the recorder's own guess)."""
    if recorded:
        return recorded
    for part, kind in _KINDS:
        if part in argv:
            return kind
    return "other"


def _read_tsv(path: Path, columns: int) -> list[list[str]]:
    if not path.exists():
        return []
    return [row for row in (line.rstrip("\n").split("\t", columns - 1)
                            for line in path.read_text().splitlines()) if len(row) == columns]


def summarise(tests: list[list[str]], procs: list[list[str]], tree_cpu: float,
              wall: float) -> dict:
    """The breakdown: by kind of process (forked children as the rest of ``tree_cpu``),
    by test file."""
    kinds: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for recorded, cpu, _, argv in procs:
        entry = kinds[kind_of(recorded, argv)]
        entry[0] += float(cpu)
        entry[1] += 1
    recorded_cpu = sum(v[0] for v in kinds.values())
    by_kind = {k: {"cpu_s": round(v[0], 1), "processes": int(v[1])} for k, v in kinds.items()}
    by_kind["forked children (not recorded: the rest)"] = {
        "cpu_s": round(max(0.0, tree_cpu - recorded_cpu), 1), "processes": None}
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for nodeid, cpu, test_wall, _ in tests:
        entry = files[nodeid.partition("::")[0]]
        entry[0] += float(cpu)
        entry[1] += float(test_wall)
        entry[2] += 1
    return {"wall_s": round(wall, 1), "tree_cpu_s": round(tree_cpu, 1),
            "tests": len(tests), "by_kind": dict(sorted(by_kind.items(),
                                                        key=lambda kv: -kv[1]["cpu_s"])),
            "by_file": {f: {"cpu_s": round(v[0], 1), "wall_s": round(v[1], 1),
                            "tests": int(v[2])}
                        for f, v in sorted(files.items(), key=lambda kv: -kv[1][0])}}


def _print(summary: dict, top: int) -> None:
    tree = summary["tree_cpu_s"] or 1.0
    print(f"wall {summary['wall_s'] / 60:.1f} min, CPU {tree / 60:.1f} min "
          f"({summary['tests']} tests)")
    print("\nby kind of process:")
    for kind, v in summary["by_kind"].items():
        count = "" if v["processes"] is None else f" ({v['processes']} processes)"
        print(f"  {v['cpu_s']:8.1f} s {100 * v['cpu_s'] / tree:5.1f}%  {kind}{count}")
    print(f"\nthe {top} test files with the most CPU:")
    for name, v in list(summary["by_file"].items())[:top]:
        print(f"  {v['cpu_s']:8.1f} s {100 * v['cpu_s'] / tree:5.1f}%  {name} ({v['tests']} tests)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="test paths (default: the whole suite)")
    parser.add_argument("--workers", default="2", help="pytest-xdist workers (-n), 0 for none")
    parser.add_argument("--out", type=Path, help="folder for the TSVs and summary.json")
    parser.add_argument("--top", type=int, default=25, help="test files to print")
    parser.add_argument("--inductor-cache", type=Path,
                        help="inductor's cache folder to use (default: a new empty one, as "
                             "on CI's fresh machine)")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="suite-cpu-"))
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="suite-cpu-recorders-") as recorders:
        Path(recorders, "sitecustomize.py").write_text(_SITECUSTOMIZE)
        Path(recorders, "dtdsl_suite_cpu.py").write_text(_PLUGIN)
        tests_tsv, procs_tsv = out / "tests.raw.tsv", out / "processes.raw.tsv"
        for path in (tests_tsv, procs_tsv):
            path.unlink(missing_ok=True)
        env = dict(os.environ)
        env.pop("PYTHONDONTWRITEBYTECODE", None)       # as .ci/run
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [recorders,
                                                          env.get("PYTHONPATH")]))
        env["DTDSL_SUITE_CPU_TESTS"] = str(tests_tsv)
        env["DTDSL_SUITE_CPU_PROCS"] = str(procs_tsv)
        env["TORCHINDUCTOR_CACHE_DIR"] = str(args.inductor_cache or
                                             Path(recorders, "inductor-cache"))
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   "-p", "dtdsl_suite_cpu", *args.paths]
        if args.workers != "0":
            command += ["-n", args.workers, "--dist", "worksteal"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        code = subprocess.run(command, cwd=ROOT, env=env, check=False).returncode
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    tree_cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    tests = _read_tsv(tests_tsv, 4)
    procs = _read_tsv(procs_tsv, 4)
    (out / "tests.tsv").write_text("".join("\t".join(r) + "\n" for r in tests))
    (out / "processes.tsv").write_text("".join(
        f"{kind_of(r[0], r[3])}\t{r[1]}\t{r[2]}\t{r[3]}\n" for r in procs))
    for path in (tests_tsv, procs_tsv):
        path.unlink(missing_ok=True)
    summary = summarise(tests, procs, tree_cpu, wall)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    _print(summary, args.top)
    print(f"\npytest exited {code}; tests.tsv, processes.tsv, summary.json in {out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
