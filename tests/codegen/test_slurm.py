"""slurm.sbatch and launch.sh on several nodes, under a stand-in for Slurm (fake_slurm/: sbatch,
srun and scontrol as bash scripts that run every "node" on this machine): the #SBATCH
settings, the bundle found from any directory, the README's first command, --dry-run's
command line, and a three-node job with a spare that trains like the single-process
reference and resumes from its checkpoint on every node after a rank of the last node is
killed (its plan a zero_bubble schedule with a compressing projector: the zero_bubble and
the compressing bundles' launch too)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from dtdsl import cli
from dtdsl.codegen.slurm import slurm_time
from dtdsl.feed import wire
from tests.helpers.bundle import (
    RTOL,
    SPEC,
    read_jsonl,
    three_node_spec,
)

FAKE_SLURM = Path(__file__).resolve().parent / "fake_slurm"
# Slurm's order (SLURM_NODEID 0, 1, 2); sorted as strings, as torchrun's rendezvous orders
# host names, gpu10 comes first. (Here every "node" is this machine, so the rendezvous
# orders them by process id: the bundle must not care either way.)
NODELIST = "gpu2,gpu9,gpu10"
# Rank 4 dies as step 3 begins and the job resumes at step 2: 4 steps train steps 2
# and 3 again after the resume.
STEPS = 4




@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory) -> Path:
    """A bundle of the three-node spec (drawn samples: nothing here reads them)."""
    where = tmp_path_factory.mktemp("slurm")
    bundle = where / "bundle"
    assert cli.main(["compile", str(three_node_spec(where)), "-o", str(bundle),
                     "--synthetic", "--workers", "2"]) == 0
    job = json.loads((bundle / "job.json").read_text())
    assert (job["world_size"], job["nodes"], job["gpus_per_node"]) == (5, 3, 2)
    return bundle


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> Path:
    bundle = tmp_path_factory.mktemp("slurm") / "one"
    assert cli.main(["compile", str(SPEC), "-o", str(bundle), "--synthetic"]) == 0
    return bundle


def dtc(*argv: str) -> int:
    """``dtc`` and its exit status (argparse's own errors included)."""
    try:
        return cli.main(list(argv))
    except SystemExit as exit_:
        return int(exit_.code or 0)


@pytest.fixture
def node_tmp() -> Iterator[Path]:
    """The nodes' TMPDIR: short, as on a cluster (the feed's ipc socket paths under it
    must fit the 107 bytes of a socket address, which pytest's tmp paths under xdist do
    not leave room for)."""
    with tempfile.TemporaryDirectory(prefix="dts", dir="/tmp") as path:
        yield Path(path)


def slurm_env(tmp_path: Path, node_tmp: Path, **extra: str) -> dict[str, str]:
    """The environment sbatch runs in: the stand-ins first on PATH, the rendezvous on this
    machine (the fake node names resolve nowhere: DTDSL_RDZV_HOST), node-local TMPDIR."""
    spool = tmp_path / "spool"
    spool.mkdir(exist_ok=True)
    return {**os.environ, "PATH": f"{FAKE_SLURM}{os.pathsep}{os.environ['PATH']}",
            "FAKE_SLURM_NODELIST": NODELIST, "FAKE_SLURM_SPOOL": str(spool),
            "FAKE_SLURM_CPUS": "2(x3)", "PYTHON": sys.executable,
            "DTDSL_RDZV_HOST": "127.0.0.1", "DTDSL_RDZV_PORT": str(wire.free_port_base(1)),
            "TMPDIR": str(node_tmp), **extra}


def sbatch(cwd: Path, script: str | Path, *args: str, env: dict[str, str],
           timeout: float = 600) -> tuple[int, str, str]:
    """Submit ``script`` from ``cwd`` (the stand-in runs the job at once): its exit
    status, the job's output (slurm-ID.out) and the job id."""
    proc = subprocess.run(["sbatch", "--time=10", str(script), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)
    found = re.search(r"Submitted batch job (\d+)", proc.stdout)
    assert found, proc.stdout + proc.stderr
    job_id = found.group(1)
    return proc.returncode, (cwd / f"slurm-{job_id}.out").read_text() + proc.stderr, job_id


def fake_python(where: Path, dryrun_status: int = 0) -> tuple[Path, Path]:
    """A PYTHON that records its command lines (one a line) and starts nothing: exit 0,
    ``dryrun_status`` for ``-m dtdsl.train.dryrun``. The script and its log."""
    log = where / "python.log"
    script = where / "python"
    script.write_text("#!/usr/bin/env bash\n"
                      f"printf '%s\\n' \"$*\" >> {shlex.quote(str(log))}\n"
                      f'case "$*" in *dtdsl.train.dryrun*) exit {dryrun_status} ;; esac\n')
    script.chmod(0o755)
    return script, log


# ---- rendering ------------------------------------------------------------------------------

def _directives(text: str) -> tuple[list[str], list[str]]:
    """slurm.sbatch's #SBATCH lines sbatch reads (those before the first command) and its
    commented ones."""
    read, commented = [], []
    for line in text.splitlines()[1:]:
        if not line.startswith("#"):
            break
        if line.startswith("#SBATCH "):
            read.append(line[len("#SBATCH "):])
        elif line.startswith("##SBATCH "):
            commented.append(line[len("##SBATCH "):])
    assert not [line for line in text.splitlines() if line.startswith("#SBATCH") and
                line[len("#SBATCH "):] not in read], "an #SBATCH line after a command"
    return read, commented


def test_sbatch_settings_given_and_to_fill_in(tmp_path, three_nodes):
    text = (three_nodes / "slurm.sbatch").read_text()
    read, commented = _directives(text)
    assert read == ["--job-name=dtdsl-tiny_cpu", "--nodes=3", "--ntasks-per-node=1",
                    "--gpus-per-node=2", "--exclusive", "--mem=0", "--output=slurm-%j.out"]
    assert commented == ["--time=D-HH:MM:SS", "--partition=PARTITION", "--account=ACCOUNT"]
    for what in ("time limit", "partition", "account"):
        assert f"# FILL IN the {what} (remove one '#')" in text, what
    assert "node 2, the last in torchrun's rendezvous\n# order (by host name), runs 1 of its " \
        "2 GPUs' ranks (rank 4); its other process is a spare\n# that exits at once." in text

    given = tmp_path / "given"
    assert cli.main(["compile", str(three_node_spec(tmp_path)), "-o", str(given), "--synthetic",
                     "--time", "1-12:00:00", "--partition", "gpu,gpu-long",
                     "--account", "proj_1"]) == 0
    text = (given / "slurm.sbatch").read_text()
    read, commented = _directives(text)
    assert read[-3:] == ["--time=1-12:00:00", "--partition=gpu,gpu-long", "--account=proj_1"]
    assert commented == [] and "FILL IN" not in text
    for bundle in (three_nodes, given):
        for script in ("slurm.sbatch", "launch.sh"):
            assert subprocess.run(["bash", "-n", str(bundle / script)]).returncode == 0
        everything = "".join(p.read_text() for p in bundle.iterdir() if p.suffix in
                             (".sh", ".sbatch", ".md", ".py"))
        for gone in ("DTDSL_NODE_RANK", "DTDSL_FEED_HOSTS", "port-base"):
            assert gone not in everything, gone
    # torchrun is never told a node rank: its rendezvous orders the nodes
    launch = (three_nodes / "launch.sh").read_text()
    torchrun = launch[launch.index('"$PYTHON" -m dtdsl.train.torchrun'):]
    assert "--node-rank" not in torchrun and '--nproc-per-node "$GPUS_PER_NODE"' in torchrun


@pytest.mark.parametrize("value, said", [
    ("x", "is not a Slurm time limit"), ("1:75:00", "75 is out of range"),
    ("1-24:00", "24 is out of range"), ("0", "no time at all"), ("0-0:00", "no time at all"),
    ("-5", "is not a Slurm time limit"), ("1:2:3:4", "is not a Slurm time limit"),
    ("", "is not a Slurm time limit")])
def test_bad_time_limits_are_usage_errors(tmp_path, capsys, value, said):
    out = tmp_path / "b"
    assert dtc("compile", str(SPEC), "-o", str(out), "--synthetic", "--time", value) == 2
    err = capsys.readouterr().err
    assert "argument --time" in err and said in err, err
    assert not out.exists()


def test_good_time_limits_and_bad_names(tmp_path, capsys):
    for value in ("30", "90", "45:30", "1:30:00", "100:00:00", "2-0", "2-12:30",
                  "7-00:00:00"):
        assert slurm_time(value) == value
    assert slurm_time("unlimited") == "UNLIMITED"
    for option, value in (("--partition", "a b"), ("--partition", "gpu,"),
                          ("--account", "x;touch PWNED"), ("--account", "a,b")):
        assert dtc("compile", str(SPEC), "-o", str(tmp_path / "b"), "--synthetic", option,
                   value) == 2
        assert "is not a Slurm" in capsys.readouterr().err, (option, value)
    assert not (tmp_path / "b").exists()


def _first_command(readme: str) -> str:
    launch = readme[readme.index("## Launch"):]
    block = launch[launch.index("```sh\n") + len("```sh\n"):]
    return block.splitlines()[0].split("#")[0].strip()


def test_the_readme_starts_with_the_command_for_its_bundle(one_node, three_nodes,
                                                          shipped_bundle):
    single = (one_node / "README.md").read_text()
    assert _first_command(single) == "./launch.sh"
    assert "sbatch slurm.sbatch" in single and "spare" not in single
    several = (three_nodes / "README.md").read_text()
    assert _first_command(several) == "sbatch slurm.sbatch"
    assert "./launch.sh --nnodes 3 --rdzv HOST:29500" in several      # without Slurm
    assert "node 2, the last in torchrun's rendezvous order" in " ".join(several.split())
    for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_DEBUG",
                 "DTDSL_RDZV_HOST", "DTDSL_BUNDLE"):
        assert name in several, name
    assert "DTDSL_FAULT=rank1@5 sbatch slurm.sbatch" in several
    # the paper-scale bundle: its last node and spares, spelled out
    big = shipped_bundle("mllm_72b")      # dtc compile specs/mllm_72b.dt --synthetic
    job = json.loads((big / "job.json").read_text())
    nodes, per_node, world = job["nodes"], job["gpus_per_node"], job["world_size"]
    last = world - (nodes - 1) * per_node
    assert 0 < last < per_node, "the plan fills its last node: no spares to describe"
    said = (f"node {nodes - 1}, the last in torchrun's rendezvous order (by host name), runs "
            f"{last} of its {per_node} GPUs' ranks (ranks {world - last}..{world - 1}); its "
            f"other {per_node - last} processes are spares that exit at once.")
    for name in ("README.md", "slurm.sbatch", "launch.sh"):
        text = " ".join((big / name).read_text().replace("\n#", "\n").split())
        assert said in text, name
    assert _first_command((big / "README.md").read_text()) == "sbatch slurm.sbatch"


# ---- --dry-run and finding the bundle (a PYTHON that starts nothing) ------------------------

def test_dry_run_runs_preflight_then_the_dry_run_module(tmp_path, one_node, three_nodes):
    python, log = fake_python(tmp_path, dryrun_status=7)
    env = {**os.environ, "PYTHON": str(python)}
    run_dir = tmp_path / "run"

    def dry(bundle: Path, *args: str) -> list[str]:
        log.unlink(missing_ok=True)
        proc = subprocess.run(["bash", str(bundle / "launch.sh"), "--dry-run", "--run-dir",
                               str(run_dir), *args], env=env, capture_output=True,
                              text=True, timeout=60, check=False)
        assert proc.returncode == 7, proc.stderr      # the dry run's own status
        assert not run_dir.exists()                   # no workers, no torchrun, no logs
        return log.read_text().splitlines()

    assert dry(one_node) == [f"-m dtdsl.train.preflight {one_node} --run-dir={run_dir}",
                             f"-m dtdsl.train.dryrun {one_node}"]
    b = three_nodes
    assert dry(b) == [f"-m dtdsl.train.preflight {b} --run-dir={run_dir}",
                      f"-m dtdsl.train.dryrun {b}"]            # every node's ranks
    assert dry(b, "--node-rank", "1", "--data", "d")[1:] == [f"-m dtdsl.train.dryrun {b} --node 1"]
    assert "--data=d" in log.read_text().splitlines()[0]
    # A path that starts with "-" stays a value ("--run-dir=-x"); launch.sh started
    # through a link finds its bundle.
    assert dry(b, "--data", "-d")[0].endswith(" --data=-d")
    link = tmp_path / "mylaunch"
    link.symlink_to(b / "launch.sh")
    log.unlink(missing_ok=True)
    proc = subprocess.run(["bash", str(link), "--dry-run", "--run-dir", str(run_dir)],
                          env=env, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 7, proc.stderr
    assert log.read_text().splitlines()[1] == f"-m dtdsl.train.dryrun {b}"


@pytest.mark.parametrize("args", [["--run-dir"], ["--run-dir", ""], ["--data", "--dry-run"],
                                  ["--steps"]])
def test_an_option_without_its_value_is_one_line(tmp_path, one_node, args):
    # Not bash's "$2: unbound variable", not the next option taken as a folder, not ""
    # as the current directory.
    python, log = fake_python(tmp_path)
    proc = subprocess.run(["bash", str(one_node / "launch.sh"), *args, "--dry-run"],
                          env={**os.environ, "PYTHON": str(python)}, capture_output=True,
                          text=True, timeout=60, check=False, cwd=tmp_path)
    assert proc.returncode == 2 and \
        proc.stderr == f"launch.sh: {args[0]} wants a value (see --help)\n", proc.stderr
    assert not log.exists()


@pytest.mark.slow
def test_dry_run_of_a_node_with_the_real_module(tmp_path, three_nodes):
    proc = subprocess.run(["bash", str(three_nodes / "launch.sh"), "--dry-run", "--node-rank",
                           "2", "--run-dir", str(tmp_path / "run")],
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The last node holds the plan's last rank (and a spare): its groups, feed and data.
    assert "1 of 5 ranks on 1 of 3 node(s)" in proc.stdout, proc.stdout
    assert proc.stdout.rstrip().endswith("ok")
    assert not (tmp_path / "run").exists()


def test_sbatch_from_anywhere_finds_its_bundle(tmp_path, node_tmp, three_nodes):
    """Submitted by a relative path from another directory: the job's record (Command=)
    names the bundle; each node dry-runs its own ranks (SLURM_NODEID)."""
    python, log = fake_python(tmp_path)
    env = slurm_env(tmp_path, node_tmp, PYTHON=str(python))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    status, out, job_id = sbatch(elsewhere, os.path.relpath(three_nodes / "slurm.sbatch",
                                                            elsewhere), "--dry-run", env=env)
    assert status == 0, out
    assert f"bundle {three_nodes.resolve()}, 3 nodes, rendezvous at 127.0.0.1:" in out
    lines = log.read_text().splitlines()
    assert sorted(line for line in lines if "dryrun" in line) == \
        [f"-m dtdsl.train.dryrun {three_nodes.resolve()} --node {k}" for k in range(3)]
    srun = (tmp_path / "spool" / "srun.args").read_text()
    assert srun.startswith("--ntasks-per-node=1 --cpus-per-task=2 --cpu-bind=none ")
    # the smallest node's CPUs; a requeued job resumes
    log.unlink()
    requeued = {**env, "FAKE_SLURM_CPUS": "16(x2),12", "SLURM_RESTART_COUNT": "1"}
    status, out, _ = sbatch(elsewhere, three_nodes / "slurm.sbatch", "--dry-run", env=requeued)
    assert status == 0, out
    srun = (tmp_path / "spool" / "srun.args").read_text().splitlines()[-1]
    assert srun.startswith("--ntasks-per-node=1 --cpus-per-task=12 ") and \
        srun.endswith(" --resume --dry-run"), srun

    # Without the job's record, the directory it was submitted from: the bundle itself.
    log.unlink()
    env["FAKE_SLURM_NO_RECORD"] = "1"
    status, out, _ = sbatch(three_nodes, "slurm.sbatch", "--dry-run", env=env)
    assert status == 0, out
    assert len(log.read_text().splitlines()) == 6
    # ... and from elsewhere it cannot know: a clear refusal, nothing started
    log.unlink()
    status, out, _ = sbatch(elsewhere, three_nodes / "slurm.sbatch", "--dry-run", env=env)
    assert status == 2 and "cannot find its bundle" in out and "DTDSL_BUNDLE" in out
    assert not log.exists()
    # A copy of the script outside the bundle is not the bundle; DTDSL_BUNDLE names it.
    del env["FAKE_SLURM_NO_RECORD"]
    copy = elsewhere / "mine.sbatch"
    shutil.copy(three_nodes / "slurm.sbatch", copy)
    status, out, _ = sbatch(elsewhere, copy, "--dry-run", env=env)
    assert status == 2 and "cannot find its bundle" in out
    status, out, _ = sbatch(elsewhere, copy, "--dry-run",
                            env={**env, "DTDSL_BUNDLE": str(three_nodes)})
    assert status == 0, out
    assert len(log.read_text().splitlines()) == 6


# ---- a three-node job --------------------------------------------------------------------

def zero_bubble_three_node_spec(where: Path) -> Path:
    """``three_node_spec`` with a zero_bubble schedule, a backbone of two pipeline stages
    (no TP) and a compressing vision projector (``avg_pool(2)``)."""
    text = three_node_spec(where).read_text()
    for old, new in (("schedule         = 1f1b", "schedule         = zero_bubble"),
                     # No TP (its DTensor passes cost CPU no claim here needs): the
                     # backbone dp 2 x pp 2, the generator the fifth rank.
                     ("  tp(*) in {1, 2}\n", "  tp(*) == 1\n  pp(llm) == 2\n"),
                     ("projector vit -> llm : mlp(depth=2)",
                      "projector vit -> llm { arch = mlp(depth=2)  compress = avg_pool(2) }")):
        assert old in text, old
        text = text.replace(old, new)
    spec = where / "three_nodes_zero_bubble.dt"
    spec.write_text(text)
    return spec


# The job is also the suite's zero_bubble bundle and its compressing projector's: a
# zero_bubble schedule (the backbone's backwards split into B and W, ``train.zerobubble``)
# of two backbone stages, launched with the P2P ordering check on, and an avg_pool(2)
# projector; it trains as ``dtc reference`` does.
@pytest.mark.slow
def test_three_slurm_nodes_train_like_the_reference_and_resume_after_a_killed_rank(
        tmp_path, node_tmp, dataset):  # noqa: F811
    from dtdsl.ir.schedule import ActionKind, parse_schedule
    from dtdsl.schedule.validate import validate_nccl

    spec = zero_bubble_three_node_spec(tmp_path)
    bundle = tmp_path / "bundle"
    assert cli.main(["compile", str(spec), "-o", str(bundle), "--data", str(dataset),
                     "--workers", "2"]) == 0
    job = json.loads((bundle / "job.json").read_text())
    assert (job["world_size"], job["nodes"], job["gpus_per_node"]) == (5, 3, 2)
    assert job["feed"]["workers_per_node"] == 1
    schedule = parse_schedule("\n".join(
        line for line in (bundle / "schedule.txt").read_text().splitlines()
        if not line.startswith("#")))
    assert schedule.name == "zero_bubble" and schedule.unit("llm").pp == 2
    assert any(a.kind is ActionKind.W for a in schedule.stage("llm", 1).actions)
    validate_nccl(schedule)
    assert json.loads((bundle / "plan.json").read_text())["gpus_used"] >= 2
    run_dir = tmp_path / "run"
    submit = tmp_path / "submit"
    submit.mkdir()
    # Rank 4 is the one rank of the last node in rendezvous order (its other process, rank
    # 5, is the spare). It dies as step 3 begins; with synchronous saves ckpt-2 was
    # committed before any rank began step 2 (every step starts with a barrier), and
    # ckpt-4 cannot have begun: the job must resume from ckpt-2 at step 2.
    env = slurm_env(tmp_path, node_tmp, DTDSL_FAULT="rank4@3", DTDSL_P2P_CHECK="1")
    status, out, job_id = sbatch(
        submit, os.path.relpath(bundle / "slurm.sbatch", submit), "--run-dir", str(run_dir),
        "--steps", str(STEPS), "--checkpoint-mode", "sync", env=env)
    assert status == 0, out[-8000:]
    assert f"bundle {bundle.resolve()}, 3 nodes" in out
    assert "DTDSL_FAULT: killing rank4 at step 3" in out
    resumed = re.findall(r"checkpoint: resumed from (\S+) at step (\d+)", out)
    assert resumed == [(str(run_dir / "checkpoints" / "ckpt-2"), "2")], out[-8000:]
    # Every node's trainers came back at step 2: each node's workers heard them (a new
    # session), the first time at step 0.
    logs = sorted((run_dir / "logs").glob("workers-*.log"))
    assert len(logs) == 3, logs
    nodes: list[str] = []
    for path in logs:
        heard = re.findall(r"the trainers \(session (\w+), ranks ([^)]*)\) start at step "
                           r"(\d+)", path.read_text())
        assert [at for _, _, at in heard] == ["0", "2"], (path, path.read_text()[-3000:])
        nodes.append(heard[0][1])
    # the ranks of each node as the rendezvous placed them; rank 5 a spare
    assert sorted(nodes) == ["[0, 1]", "[2, 3]", "[4]"]
    assert re.search(r"^\d: rank 5: a spare \(the plan's ranks are 0\.\.4\); exiting$", out,
                     re.M), out[-8000:]
    # One line per step, the re-run's, equal to the single-process reference (``dtc
    # reference`` on the same data).
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(STEPS))
    ref = tmp_path / "reference.jsonl"
    assert cli.main(["reference", str(spec), "--steps", str(STEPS), "--data", str(dataset),
                     "--threads", "1", "--out", str(ref)]) == 0
    want = [r["loss"] for r in read_jsonl(ref)]
    assert len(want) == STEPS
    assert [m["loss"] for m in metrics] == pytest.approx(want, rel=RTOL)
    # One launch, resumed in it; every node's feed directory removed.
    assert [p.name for p in (run_dir / "launches").iterdir()] == [f"slurm-{job_id}"]
    assert not list((tmp_path / "tmp").glob("dtdsl-feed.*"))
