"""Shared test fixtures and the --update-golden flag."""

from __future__ import annotations

import contextlib
import gc
import os
from pathlib import Path

import pytest

from tests.helpers import shared

# Every process the tests start (launched bundles, torchrun, gloo children) checks that its
# point-to-point transfers are matched as NCCL would match them (dtdsl.parallel.p2p).
os.environ.setdefault("DTDSL_P2P_CHECK", "1")
# One OpenMP / BLAS thread in the pytest process and every process it starts (the
# preprocessing workers, dtc, benchmarks; torchrun gives its ranks one already): the
# tensors here are tiny, and on CI's 2 cores beside the suite's other processes a thread
# per core spins for its share (a 3-step tiny_cpu reference took 31 s of CPU at 2
# threads, 1.5 s at one). Set before torch or numpy is imported; a test that wants more
# threads sets them itself.
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "specs").glob("*.dt"))


def pytest_collection_modifyitems(config, items):
    """The slowest files first (``tests/slowest.txt``, by their tests' summed time; a line
    naming a test ranks its file), each file's tests together and in their order (a
    module-scoped fixture is built once), the rest in collection order: under pytest-xdist
    a long test that starts last holds the run up while the other workers wait. The order
    is the same on every worker (xdist requires it). It pairs with ``--dist worksteal``
    (``.ci/run``): the default ``load`` scheduler hands the first worker the slow head of
    this order as one chunk, and the others finish long before it does."""
    rank: dict[str, int] = {}
    for line in (ROOT / "tests" / "slowest.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            rank.setdefault(line.strip().partition("::")[0], len(rank))
    items.sort(key=lambda item: rank.get(item.nodeid.partition("::")[0], len(rank)))


def pytest_collection_finish(session):
    """The collected suite (its modules, test items and their parameters: hundreds of
    thousands of objects, alive to the end) out of the garbage collector's view: its
    full collections would pass over them all again and again (some 5% of a pytest
    process's CPU), and so would those of every process a test forks."""
    gc.freeze()


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite golden files from the current output instead of comparing")


@pytest.fixture
def update_golden(request) -> bool:
    return request.config.getoption("--update-golden")


@pytest.fixture
def deterministic():
    """Deterministic kernels where torch has them (``warn_only``: an op without one warns
    instead of failing), for the tests that compare bitwise; the gloo children of
    ``tests.dist.run`` fork with the setting. On a GPU this is what makes such a
    comparison meaningful; the CPU kernels the tests run are deterministic already."""
    import torch

    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(before)


@pytest.fixture
def one_thread():
    """Tiny tensors: one torch thread is faster, and immune to other processes on the
    cores. The model, parallel and train tests use it for every test (their conftest)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def _shared_folder(tmp_path_factory) -> None:
    """``tests.helpers.shared``'s folder: in this run's temporary directory, shared by every
    pytest-xdist worker of the run (this process's own without xdist), so a paper-scale
    plan, a bundle run or a reference is made once a run, not once a worker."""
    base = tmp_path_factory.getbasetemp()
    shared.ROOT = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"


@pytest.fixture(scope="session")
def shipped_plan():
    """``shipped_plan(name)``: the Plan JSON of ``specs/<name>.dt`` that ``dtc compile`` and
    ``dtc memcheck`` plan by default (``dtc plan --no-baseline -o``, the same call),
    planned once per test run and spec text (shared by the xdist workers): the
    paper-scale specs take seconds of CPU each, and many tests need one of their plans
    without testing the planner. A test of planning plans itself."""
    import hashlib
    import io

    from dtdsl import cli

    def get(name: str) -> Path:
        spec = ROOT / "specs" / f"{name}.dt"
        digest = hashlib.sha256(spec.read_bytes()).hexdigest()[:16]
        with shared.locked(f"plan_{name}_{digest}") as folder:
            out = folder / "plan.json"
            if not out.exists():
                folder.mkdir(parents=True, exist_ok=True)
                said = io.StringIO()        # not into the capsys of the test that asked
                with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
                    code = cli.main(["plan", str(spec), "--no-baseline", "-o",
                                     str(folder / "plan.tmp")])
                assert code == 0, said.getvalue()
                (folder / "plan.tmp").replace(out)
        return out

    return get


@pytest.fixture(scope="session")
def shipped_bundle(shipped_plan):
    """``shipped_bundle(name)``: ``dtc compile specs/<name>.dt --synthetic`` of
    ``shipped_plan(name)``, compiled once per test run (shared by the xdist workers): the
    same files as a compile that plans (but for ``job.key``). Shared: read it, never
    write into it."""
    import io
    import shutil

    from dtdsl import cli

    def get(name: str) -> Path:
        plan = shipped_plan(name)
        with shared.locked(f"bundle_{plan.parent.name}") as folder:
            out = folder / "bundle"
            if not (folder / "done").exists():
                shutil.rmtree(folder, ignore_errors=True)   # a compile cut short
                said = io.StringIO()
                with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
                    code = cli.main(["compile", str(ROOT / "specs" / f"{name}.dt"), "-o",
                                     str(out), "--synthetic", "--plan", str(plan)])
                assert code == 0, said.getvalue()
                (folder / "done").touch()
        return out

    return get


@pytest.fixture(scope="session")
def planned_compile():
    """``planned_compile(name)``: the bundle of ``dtc compile specs/<name>.dt --synthetic``
    with no ``--plan`` (the compile plans for itself), run once per test run and spec text
    (shared by the xdist workers). Several tests check that such a compile of a paper-scale
    spec succeeds, and planning it takes most of a minute of CPU: they check the one real
    run. A compile that fails fails every test that asks, with its output. Shared: read it,
    never write into it."""
    import hashlib
    import io
    import shutil

    from dtdsl import cli

    def get(name: str) -> Path:
        spec = ROOT / "specs" / f"{name}.dt"
        digest = hashlib.sha256(spec.read_bytes()).hexdigest()[:16]
        with shared.locked(f"planned_compile_{name}_{digest}") as folder:
            out = folder / "bundle"
            if not (folder / "done").exists():
                shutil.rmtree(folder, ignore_errors=True)   # a compile cut short
                folder.mkdir(parents=True)
                said = io.StringIO()
                with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
                    code = cli.main(["compile", str(spec), "-o", str(out), "--synthetic"])
                (folder / "said.txt").write_text(said.getvalue())
                (folder / "code").write_text(str(code))
                (folder / "done").touch()
            code = int((folder / "code").read_text())
            assert code == 0, (folder / "said.txt").read_text()
        return out

    return get


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """The tiny spec's synthetic dataset, indexed (``tests.helpers.bundle.tiny_dataset``):
    made once per test module that asks for it."""
    from tests.helpers.bundle import tiny_dataset

    return tiny_dataset(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_run():
    """``tests.helpers.bundle.TinyRun``: the tiny bundle (a checkpoint every 2 steps, 2
    workers, its dataset) launched for 8 steps, once per test run (shared by the xdist
    workers): the fault, launch-lock, launch-fault and fed-bundle tests all check this one
    run (a launch is some 25 s of CPU, nearly all of it starting processes). Shared: read
    it, never write into it; a test that launches against it copies it first."""
    from tests.helpers.bundle import tiny_run_in

    with shared.locked("tiny_run") as folder:
        return tiny_run_in(folder)
