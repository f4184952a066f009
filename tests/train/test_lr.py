"""The learning-rate schedule: values at the edges of warmup and decay, and LambdaLR."""

from __future__ import annotations

import math

import pytest
import torch

from dtdsl.ir.program import LRSchedule
from dtdsl.train.lr import lr_at, lr_factor, lr_lambda

PEAK = 3e-4


def test_the_default_is_a_constant_rate():
    for step in (0, 1, 999, 5000):
        assert lr_at(LRSchedule(), PEAK, 1000, step) == PEAK


def test_warmup_edges():
    s = LRSchedule(name="constant", warmup=4)
    assert [lr_factor(s, PEAK, 10, i) for i in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_at(s, PEAK, 10, 0) == PEAK * 0.25
    assert lr_at(s, PEAK, 10, 3) == PEAK                        # the last warmup step: peak
    # a warmup of the whole run ramps up to the last step
    whole = LRSchedule(name="cosine", warmup=10, min_lr=1e-5)
    assert lr_at(whole, PEAK, 10, 9) == PEAK


@pytest.mark.parametrize("name", ["linear", "cosine"])
def test_decay_starts_at_the_peak_and_ends_at_min_lr(name):
    s = LRSchedule(name=name, warmup=5, min_lr=3e-5)
    steps = 105
    assert lr_at(s, PEAK, steps, 4) == PEAK      # warmup's last step
    assert lr_at(s, PEAK, steps, 5) == PEAK      # the decay's first step
    values = [lr_at(s, PEAK, steps, i) for i in range(5, steps + 1)]
    assert all(a > b for a, b in zip(values, values[1:], strict=False))   # strictly falling
    # min_lr at step N (after the last step trained), and from then on
    for step in (steps, steps + 1, 10 * steps):
        assert math.isclose(lr_at(s, PEAK, steps, step), 3e-5, rel_tol=1e-15)
    assert lr_at(s, PEAK, steps, steps - 1) > 3e-5   # the last step trained still decays


def test_decay_formulas_midway():
    # progress (s - W) / (N - W) = 50 / 100 at s = 60
    cos = LRSchedule(name="cosine", warmup=10, min_lr=1e-5)
    lin = LRSchedule(name="linear", warmup=10, min_lr=1e-5)
    assert math.isclose(lr_at(cos, PEAK, 110, 60), 1e-5 + (PEAK - 1e-5) * 0.5, rel_tol=1e-14)
    assert math.isclose(lr_at(lin, PEAK, 110, 60), 1e-5 + (PEAK - 1e-5) * 0.5, rel_tol=1e-14)
    # a quarter of the way: cosine stays higher than linear
    quarter = 1e-5 + (PEAK - 1e-5) * 0.5 * (1 + math.cos(math.pi / 4))
    assert math.isclose(lr_at(cos, PEAK, 110, 35), quarter, rel_tol=1e-14)
    assert math.isclose(lr_at(lin, PEAK, 110, 35), 1e-5 + (PEAK - 1e-5) * 0.75, rel_tol=1e-14)
    # min_lr 0 decays to exactly 0
    assert lr_at(LRSchedule(name="linear"), PEAK, 10, 10) == 0.0
    assert lr_at(LRSchedule(name="cosine"), PEAK, 10, 10) == 0.0


@pytest.mark.parametrize("schedule", [
    LRSchedule(),
    LRSchedule(name="constant", warmup=3),
    LRSchedule(name="linear", warmup=3, min_lr=1e-5),
    LRSchedule(name="cosine", warmup=3, min_lr=1e-5),
    LRSchedule(name="cosine", warmup=0, min_lr=0.0),
])
def test_lambda_lr_gives_exactly_lr_at(schedule):
    steps = 17
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([param], lr=PEAK)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(schedule, PEAK, steps))
    for step in range(steps + 3):
        assert opt.param_groups[0]["lr"] == lr_at(schedule, PEAK, steps, step), step
        param.grad = torch.ones(3)
        opt.step()
        sched.step()


@pytest.mark.parametrize("call, message", [
    (lambda: lr_at(LRSchedule(), 0.0, 10, 0), "peak_lr"),
    (lambda: lr_at(LRSchedule(), PEAK, 0, 0), "steps"),
    (lambda: lr_at(LRSchedule(), PEAK, 10, -1), "step must"),
    (lambda: lr_at(LRSchedule(name="cosine", min_lr=1.0), PEAK, 10, 0), "min_lr"),
    (lambda: lr_lambda(LRSchedule(name="cosine", warmup=-1), PEAK, 10), "warmup"),
])
def test_bad_arguments_are_value_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()
