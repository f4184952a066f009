"""Launching compiled bundles in tests: the tiny spec, ``launch.sh`` run and checked,
its run directory read, and the single-process reference's losses to compare with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from dtdsl import cli
from dtdsl.driver import run_frontend
from dtdsl.train.reference import train_reference
from tests.helpers import shared

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "specs" / "tiny_cpu.dt"
STEPS = 3
RTOL = 1e-4


def launch(bundle: Path, run_dir: Path, *extra: str, timeout: float = 300,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(["bash", str(bundle / "launch.sh"), "--run-dir", str(run_dir),
                           *extra],
                          capture_output=True, text=True, timeout=timeout, env=full,
                          check=False)


def launch_in_background(bundle: Path, run_dir: Path, out: Path, *extra: str
                         ) -> subprocess.Popen:
    """``launch.sh`` started in a session of its own (a group to signal), its output
    (both streams) going to ``out``."""
    with open(out, "w") as sink:
        return subprocess.Popen(["bash", str(bundle / "launch.sh"), "--run-dir", str(run_dir),
                                 *extra], stdout=sink, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHON": sys.executable},
                                start_new_session=True)


def wait_for_output(proc: subprocess.Popen, out: Path, text: str, timeout: float) -> None:
    """Wait until ``text`` is in ``out`` (the launch still running), for ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while text not in out.read_text() and time.monotonic() < deadline:
        assert proc.poll() is None, out.read_text()[-3000:]
        time.sleep(0.05)
    assert text in out.read_text(), out.read_text()[-3000:]


def worker_log(run_dir: Path) -> str:
    """What the preprocessing workers of every node logged (``logs/workers-*.log``)."""
    return "".join(p.read_text() for p in sorted((run_dir / "logs").glob("workers*.log")))


def launch_ok(bundle: Path, run_dir: Path, *extra: str,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``launch``, asserting it exited 0 (the tail of its output otherwise)."""
    proc = launch(bundle, run_dir, *extra, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def reference_losses(steps: int, data: Path | None = None, spec: Path = SPEC) -> list[float]:
    """The single-process reference's losses of ``spec`` over ``steps``, on ``data``, at
    one torch thread whoever calls it (tests/data's too: the default of one per core
    spins beside a launched bundle's ranks; a 3-step tiny_cpu reference took 31 s of CPU
    at 2 threads, 1.5 s at one). On synthetic data (None) trained once per spec text and
    steps (the co-located and the phased bundle's tests share theirs); a dataset is read
    anew each time (a test may change its files)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if data is None:
            return list(_synthetic_reference(steps, spec.name, spec.read_bytes()))
        from dtdsl.feed.source import DatasetSource

        program = run_frontend(str(spec), spec.read_bytes()).program
        return [r["loss"] for r in train_reference(program, steps,
                                                   source=DatasetSource(program, data))]
    finally:
        torch.set_num_threads(threads)


@cache
def _synthetic_reference(steps: int, name: str, text: bytes) -> tuple[float, ...]:
    def make() -> list[float]:
        program = run_frontend(name, text).program
        return [r["loss"] for r in train_reference(program, steps)]

    return tuple(shared.json_value(f"synthetic-{shared.digest(steps, name, text)}", make))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def consumed(run_dir: Path, unit: str) -> dict[int, list[str]]:
    """Per step, the keys ``unit``'s replicas consumed (all replicas together)."""
    out: dict[int, list[str]] = {}
    for r in read_jsonl(run_dir / "samples.jsonl"):
        if r["unit"] == unit:
            out.setdefault(r["step"], []).extend(r["keys"])
    return out


DATASET_SAMPLES = 48        # 3 global batches of 16: one epoch in 3 steps
FEED_STEPS = 4



def tiny_dataset(tmp_path_factory) -> Path:
    """The tiny spec's synthetic dataset of ``DATASET_SAMPLES`` samples, indexed."""
    return tiny_dataset_in(tmp_path_factory.mktemp("data") / "tiny")


def tiny_dataset_in(out: Path) -> Path:
    """``tiny_dataset``, written to ``out``."""
    assert cli.main(["data", "synth", str(SPEC), "-o", str(out), "--samples",
                     str(DATASET_SAMPLES), "-q"]) == 0
    # Indexed once here, as a launch's preflight indexes it (its tokens counted): so no
    # test's launch depends on being the first to read it (its stderr says "indexing").
    from dtdsl.train.preflight import check_data

    assert check_data(run_frontend(str(SPEC), SPEC.read_bytes()).program, str(out)) == []
    return out


CKPT_EVERY = 2          # the shared run's checkpoints: every 2 steps
SHARED_STEPS = 8        # the shared run: an epoch is 3 steps, epochs 0 and 1 whole, 2 begun


@dataclass
class TinyRun:
    """One launch shared by the tests of several modules (``tests/conftest.py``'s
    ``tiny_run``): tiny_cpu with a checkpoint every ``CKPT_EVERY`` steps and 2 workers
    (``bundle``, of ``spec``) on its dataset, launched for ``SHARED_STEPS`` steps into ``run_dir``
    (its output in ``out``); at its step 1 a fresh start and a resume on its run directory
    (``refused``), its files as they were then (``before``). Shared: read it, never write
    into it (launch against a copy)."""
    dataset: Path
    spec: Path
    bundle: Path
    run_dir: Path
    out: Path
    pid: int
    returncode: int
    before: dict[str, bytes]
    refused: list[subprocess.CompletedProcess[str]]

    def bundle_copy(self, where: Path) -> Path:
        """A copy of ``bundle`` in ``where`` (``where/bundle``) to change or launch, its
        dataset reached as from the original: a bundle names it by a path relative to
        itself (``../data/tiny``), so ``where/data`` links to the shared one's folder."""
        import shutil

        where.mkdir(parents=True, exist_ok=True)
        (where / "data").symlink_to(self.dataset.parent, target_is_directory=True)
        shutil.copytree(self.bundle, where / "bundle")
        return where / "bundle"


def run_files(run_dir: Path) -> dict[str, bytes]:
    """A run directory's files (but its logs and its launches' node files) by name."""
    from dtdsl.train.rundir import NODES_DIR

    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and "logs" not in p.parts and NODES_DIR not in p.parts}


def tiny_run_in(folder: Path) -> TinyRun:
    """``TinyRun`` made in ``folder`` (or read back from it, made there before)."""
    import shutil
    import signal

    record = folder / "run.json"
    if record.exists():
        return _read_record(record)
    shutil.rmtree(folder, ignore_errors=True)       # one cut short
    folder.mkdir(parents=True)
    dataset = tiny_dataset_in(folder / "data" / "tiny")
    spec = folder / "tiny_ckpt.dt"
    text = SPEC.read_text()
    assert "checkpoint_every = 10" in text
    spec.write_text(text.replace("checkpoint_every = 10", f"checkpoint_every = {CKPT_EVERY}"))
    bundle = folder / "bundle"
    assert cli.main(["compile", str(spec), "-o", str(bundle), "--data", str(dataset),
                     "--workers", "2"]) == 0
    run_dir, out = folder / "run", folder / "run.out"
    steps = str(SHARED_STEPS)
    first = launch_in_background(bundle, run_dir, out, "--steps", steps)
    try:
        wait_for_output(first, out, f"step 1/{steps}", 120)
        before = run_files(run_dir)
        refused = [launch(bundle, run_dir, "--steps", steps, *extra, timeout=60)
                   for extra in ((), ("--resume",))]
        returncode = first.wait(timeout=300)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    made = TinyRun(dataset, spec, bundle, run_dir, out, first.pid, returncode, before, refused)
    _write_record(record, made)
    return made


def _write_record(path: Path, run: TinyRun) -> None:
    """``run`` as JSON (the other xdist workers read it back: ``_read_record``)."""
    import base64
    import json

    doc = {"paths": {k: str(getattr(run, k)) for k in _PATHS},
           "pid": run.pid, "returncode": run.returncode,
           "before": {k: base64.b64encode(v).decode() for k, v in run.before.items()},
           "refused": [{"args": p.args, "returncode": p.returncode, "stdout": p.stdout,
                        "stderr": p.stderr} for p in run.refused]}
    path.with_suffix(".tmp").write_text(json.dumps(doc))
    path.with_suffix(".tmp").replace(path)


def _read_record(path: Path) -> TinyRun:
    import base64
    import json

    doc = json.loads(path.read_text())
    return TinyRun(**{k: Path(v) for k, v in doc["paths"].items()}, pid=doc["pid"],
                   returncode=doc["returncode"],
                   before={k: base64.b64decode(v) for k, v in doc["before"].items()},
                   refused=[subprocess.CompletedProcess(**p) for p in doc["refused"]])


_PATHS = ("dataset", "spec", "bundle", "run_dir", "out")


def on_two_ranks(text: str) -> str:
    """tiny_cpu's text (``text``, edited or not) on 2 GPUs instead of 4: the same layout
    (the backbone data-parallel, the encoder and the generator co-located on its ranks) at
    DP 2 instead of 4, for a launch whose claim needs replicas but not four (two ranks
    fewer to start: some 10 s of CPU a launch)."""
    for old in ("gpus          = 4", "gpus_per_node = 4"):
        assert old in text, old
    return text.replace("gpus          = 4", "gpus          = 2") \
        .replace("gpus_per_node = 4", "gpus_per_node = 2")


def three_node_spec(where: Path) -> Path:
    """tiny_cpu on 5 GPUs, 2 a node: 3 nodes, the last with one rank and one spare;
    a checkpoint every 2 steps."""
    text = SPEC.read_text()
    for old in ("gpus          = 4", "gpus_per_node = 4", "checkpoint_every = 10"):
        assert old in text, old
    spec = where / "three_nodes.dt"
    spec.write_text(text.replace("gpus          = 4", "gpus          = 5")
                    .replace("gpus_per_node = 4", "gpus_per_node = 2")
                    .replace("checkpoint_every = 10", "checkpoint_every = 2"))
    return spec


def two_stage_spec(where: Path, schedule: str) -> Path:
    """tiny_cpu with ``schedule = SCHEDULE`` and a backbone of two pipeline stages."""
    text = SPEC.read_text()
    for old in ("schedule         = 1f1b", "  tp(*) in {1, 2}\n"):
        assert old in text, old
    spec = where / "tiny_two_stages.dt"
    spec.write_text(text.replace("schedule         = 1f1b", f"schedule         = {schedule}")
                    .replace("  tp(*) in {1, 2}\n", "  tp(*) in {1, 2}\n  pp(llm) == 2\n"))
    return spec


def compiled_schedule(spec: Path, bundle: Path):
    """``dtc compile`` of ``spec`` into ``bundle`` (synthetic data, no workers), and the
    bundle's schedule parsed back from its ``schedule.txt``."""
    from dtdsl.ir.schedule import parse_schedule

    assert cli.main(["compile", str(spec), "-o", str(bundle), "--synthetic",
                     "--workers", "0"]) == 0
    text = "\n".join(line for line in (bundle / "schedule.txt").read_text().splitlines()
                     if not line.startswith("#"))
    return parse_schedule(text)
