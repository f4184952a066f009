"""Run a function on N gloo ranks in child processes (a test helper).

``run(fn, world_size, *args)`` starts ``world_size`` processes with
``torch.multiprocessing``, initialises a gloo default group through a file store in a
fresh temporary directory (no TCP port to race for), calls ``fn(rank, world_size, *args)``
on each and tears the group down. ``fn`` must be importable by name (a module-level
function). A child that raises makes ``run`` raise ``ChildFailed`` with the traceback of
every child that failed, the earliest (usually the cause) first, and the other children
are killed; a run that outlives ``timeout`` is killed and raises ``TimeoutError``.
Children return nothing: check inside ``fn`` with ``assert``.

The start method defaults to ``fork`` where available (no re-import of torch: a 5-rank
run takes well under a second instead of several). Set ``DTDSL_TEST_START=spawn`` to use
``spawn`` instead.
"""

from __future__ import annotations

import datetime
import gc
import importlib
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dtdsl.ir.plan import Plan, UnitPlan, split_layers

__all__ = ["ChildFailed", "make_plan", "run"]

# Modules the runtime imports on first use (lazily): imported once here, before the forks,
# not again in every rank of every run.
for _name in ("dtdsl.cost.model", "dtdsl.reorder.workload", "dtdsl.train.checkpoint",
              "numpy.ma", "torch.distributed.checkpoint", "torch._functorch.aot_autograd"):
    importlib.import_module(_name)


class ChildFailed(AssertionError):
    """A child rank raised; the message holds its rank and traceback."""


def _child(rank: int, fn: Callable[..., Any], world: int, tmp: str, pg_timeout: float,
           args: tuple[Any, ...]) -> None:
    # A forked child's garbage collections then pass over its own objects only, not over
    # the pytest process's it inherited (hundreds of thousands: the suite's modules and
    # fixtures), each pass copying every page it touches. (A spawned child has none.)
    gc.freeze()
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # Every multi-rank test runs under the ordering check (parallel.p2p): a transfer that
    # NCCL's in-order matching would pair wrongly fails the test.
    os.environ.setdefault("DTDSL_P2P_CHECK", "1")
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}",
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=pg_timeout))
    try:
        fn(rank, world, *args)
        # No rank leaves before all are up: gloo's connect on a slow rank fails ("closed
        # by peer") when a fast one with no collective to wait on has exited already.
        dist.barrier()
    except BaseException:
        # Leave the traceback for the parent, stamped with the time: when one rank fails,
        # its peers fail next ("connection closed"), and the earliest is the cause.
        with open(os.path.join(tmp, f"error.{rank}"), "w") as f:
            f.write(f"{time.time()!r}\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


def _errors(tmp: str) -> str:
    found = []
    for name in os.listdir(tmp):
        if name.startswith("error."):
            with open(os.path.join(tmp, name)) as f:
                stamp, _, text = f.read().partition("\n")
            try:
                when = float(stamp)
            except ValueError:      # still being written by a rank that is failing now
                when = float("inf")
            found.append((when, int(name.split(".")[1]), text))
    return "\n".join(f"--- rank {rank} failed{' first' if i == 0 else ''}:\n{text}"
                     for i, (_, rank, text) in enumerate(sorted(found)))


def run(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 30.0,
        start_method: str | None = None) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; see the module
    docstring."""
    if not 1 <= world_size <= 8:
        raise ValueError(f"world_size {world_size} is outside 1..8")
    method = start_method or os.environ.get("DTDSL_TEST_START") or (
        "fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with tempfile.TemporaryDirectory(prefix="dtdsl-dist-") as tmp:
        ctx = mp.start_processes(_child, args=(fn, world_size, tmp, timeout, args),
                                 nprocs=world_size, join=False, start_method=method)
        deadline = time.monotonic() + timeout
        name = getattr(fn, "__name__", repr(fn))
        try:
            while not ctx.join(timeout=max(0.0, min(0.5, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{name} on {world_size} ranks did not finish in "
                                       f"{timeout:g} s\n{_errors(tmp)}")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            detail = _errors(tmp) or str(exc)
            raise ChildFailed(f"{name} on {world_size} ranks:\n{detail}") from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join(timeout=5)


def make_plan(*units: tuple[str, str, int, int, int]) -> Plan:
    """A hand-made plan from (name, role, tp, dp, pp) per unit, laid out in that order."""
    out, first = [], 0
    for name, role, tp, dp, pp in units:
        gpus = tp * dp * pp
        out.append(UnitPlan(
            name=name, role=role, projectors=(), gpus=gpus, tp=tp, dp=dp, pp=pp,
            first_rank=first, layers_per_stage=split_layers(2 * pp, pp), microbatch_share=1.0,
            fwd_time_s=1.0, bwd_time_s=2.0, dp_sync_time_s=0.1, memory_bytes=1e9,
            memory_limit_bytes=8e10))
        first += gpus
    return Plan(spec="handmade", spec_sha256="0" * 64, search="exhaustive", num_gpus=first,
                gpus_used=first, global_batch=16, micro_batch=1, num_microbatches=4,
                schedule="1f1b", iteration_time_s=1.0, warmup_time_s=0.1, steady_time_s=0.8,
                dp_sync_time_s=0.1, model_flops_per_iteration=1e15, mfu=0.5, solve_time_s=0.0,
                candidates=1, convex_solves=0, evaluated=1, units=tuple(out))
