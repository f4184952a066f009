"""fp16 tests' shared run: the tiny spec in fp16 on its 4-rank layout, trained in forked
ranks, and the bf16 tolerance it is held to against the fp32 reference."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import torch

from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from dtdsl.parallel.mesh import build_groups
from dtdsl.schedule.lower import lower
from dtdsl.train.executor import StageExecutor
from dtdsl.train.reference import train_reference
from tests.helpers import shared

STEPS = 8



BF16_RTOL = 0.03        # test_executor's bf16 test: within 3% of the fp32 reference



# Four ranks: the encoder, the backbone over two DP replicas, the generator; every
# gradient crosses the broker (the backbone sends the encoder's, the generator the
# backbone's) and FSDP2 reduces the backbone's over DP.
UNITS = (("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 2, 1),
         ("gen", "generator", 1, 1, 1))



def fp16(program: ir.Program, **train: object) -> ir.Program:
    return program.model_copy(update={"train": program.train.model_copy(
        update={"precision": "fp16", **train})})



@cache
def _reference(program: ir.Program, steps: int) -> tuple[tuple[float, float], ...]:
    """The fp32 reference's (loss, gradient norm) per step: computed once a test run
    (``tests.helpers.shared``)."""
    def make() -> list[list[float]]:
        torch.set_num_threads(1)
        return [[r["loss"], r["grad_norm"]] for r in train_reference(program, steps)]

    pairs = shared.json_value(f"fp32-{shared.digest(program, steps)}", make)
    return tuple((loss, norm) for loss, norm in pairs)



def _train(rank: int, world: int, program: ir.Program, plan: Plan, out: str,
           steps: int = STEPS) -> None:
    ex = StageExecutor(program, plan, lower(plan, program), rank=rank,
                       groups=build_groups(plan))
    # fp16 compute: the stage's parameters (fp32 shards) are gathered into fp16 ones.
    assert ex.stage.compute_dtype == torch.float16
    assert all(p.dtype == torch.float32 for p in ex.named_parameters().values())
    # The gradients the generator sends the backbone: far below fp16's smallest
    # subnormal (2**-24) unscaled in this model, so they cross in fp16 only scaled.
    elements = [0, 0]       # nonzero, all: of the messages not wholly zero
    send = ex.broker.send_backward

    def counted(index: int, producer: str, consumer: str, grads: dict, samples: object
                ) -> None:
        for g in grads.values():
            assert g.dtype == torch.float16
            if g.any():
                elements[0] += int((g != 0).sum())
                elements[1] += g.numel()
        send(index, producer, consumer, grads, samples)

    ex.broker.send_backward = counted
    results = ex.train(steps)
    Path(out, f"{rank}.json").write_text(json.dumps(
        {"steps": [{k: r[k] for k in ("loss", "grad_norm", "skipped", "loss_scale",
                                      "skipped_steps")} for r in results],
         "role": ex.role.role, "elements": elements}))



def check_within_bf16(program: ir.Program, plan: Plan, out: Path) -> None:
    """``plan`` of ``program`` trained in fp16 on forked ranks (``_train``, results in
    ``out``): every rank's losses and unscaled gradient norms within ``BF16_RTOL`` of the
    fp32 reference, no step skipped."""
    from tests.dist import run

    want = _reference(program, STEPS)
    run(_train, plan.gpus_used, fp16(program), plan, str(out), timeout=300)
    for rank in range(plan.gpus_used):
        got = json.loads((out / f"{rank}.json").read_text())["steps"]
        assert [g["skipped"] for g in got] == [False] * STEPS, rank
        for step, (g, (loss, norm)) in enumerate(zip(got, want, strict=True)):
            assert abs(g["loss"] - loss) <= BF16_RTOL * abs(loss), (rank, step, g, loss)
            assert abs(g["grad_norm"] - norm) <= BF16_RTOL * norm, (rank, step, g, norm)
