"""The cost model's optimizer offload (``adamw(..., offload=F)``): the device keeps 1 - F of
the Adam moments, the step pays the host link (the cluster's ``host_bw``) and the CPU's
AdamW for the offloaded part, overlapped with the device's own step."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from dtdsl.cost.model import OFFLOADED_BYTES_PER_PARAM, build_cost_model
from dtdsl.ir.hardware import CPU_ADAM_PARAMS_PER_S, HOST_BW_BYTES_PER_S
from tests.helpers.costs import program

ARGS = {"tp": 4, "pp": 4, "vpp": 1, "depth": 4, "microbatches": 32, "share": 1.0}


@pytest.fixture(scope="module")
def cost():
    return build_cost_model(program("mllm_9b"))


def test_offload_saves_the_moments_of_its_fraction(cost):
    llm = cost.unit("llm")
    assert cost.offload_fraction == 0.0 and OFFLOADED_BYTES_PER_PARAM == 8
    stage_params = llm.stage_params(4) / 4          # its TP shard
    # A middle stage of 8 layers: its layers' parameters only.
    layer_params = (llm.params - llm.extra_stage_params) / llm.layers
    assert llm.trainable_params == llm.params
    for dp in (1, 8):
        full = cost.memory_bytes(llm, dp=dp, **ARGS)
        for fraction in (0.25, 0.5, 1.0):
            offloaded = cost.with_offload(fraction)
            saved = full - offloaded.memory_bytes(llm, dp=dp, **ARGS)
            # ZeRO-1: the moments are sharded over DP, so is the saving.
            assert saved == pytest.approx(stage_params * 8 * fraction / dp)
            per_stage = cost.stage_memory_bytes(llm, stage=1, layers=8, dp=dp, vpp=1, tp=4,
                                                pp=4, depth=3, microbatches=32, share=1.0)
            assert per_stage - offloaded.stage_memory_bytes(
                llm, stage=1, layers=8, dp=dp, vpp=1, tp=4, pp=4, depth=3, microbatches=32,
                share=1.0) == pytest.approx(layer_params * 8 / 4 * 8 * fraction / dp)


def test_with_offload_puts_the_fraction_in_the_program(cost):
    half = cost.with_offload(0.5)
    assert half.program.train.optimizer.offload == 0.5 and half.offload_fraction == 0.5
    assert cost.program.train.optimizer.offload == 0.0     # not mutated
    with pytest.raises(ValueError, match="offload 1.5"):
        cost.with_offload(1.5)


def test_the_step_pays_the_host_link_and_the_cpu(cost):
    """Without a profile the device's step is not priced (as before): the offloaded part
    adds 12 bytes per parameter over the host link and a CPU AdamW update."""
    llm = cost.unit("llm")
    tp, pp, dp = 4, 4, 8
    base = float(cost.dp_sync_time_s(llm, tp, pp, dp))
    trained_on_stage = llm.trainable_params / llm.params * llm.stage_params(pp) / (tp * dp)
    rate = 12 / HOST_BW_BYTES_PER_S + 1 / CPU_ADAM_PARAMS_PER_S
    for fraction in (0.5, 1.0):
        extra = float(cost.with_offload(fraction).dp_sync_time_s(llm, tp, pp, dp)) - base
        assert extra == pytest.approx(fraction * rate * trained_on_stage, rel=1e-6)
    # A slower host link costs more: the cluster's host_bw is read.
    slow = program("mllm_9b", (("cpu_workers", "host_bw = 16 GB/s\n  cpu_workers"),))
    assert slow.cluster.host_bw_bytes_per_s == 16e9
    slow_cost = replace(cost, program=slow).with_offload(1.0)
    assert float(slow_cost.dp_sync_time_s(llm, tp, pp, dp)) > \
        float(cost.with_offload(1.0).dp_sync_time_s(llm, tp, pp, dp))


def test_the_device_and_host_parts_overlap(cost):
    """With a measured device rate the step is the slower of the device's 1 - F and the
    host's F, not their sum."""
    llm = cost.unit("llm")
    host = cost.offload_rate_s_per_param()
    for device in (host / 10, host * 10):
        measured = replace(cost, profile=SimpleNamespace(
            profile=SimpleNamespace(optimizer_s_per_param=device)))
        none = measured._optimizer_coefficients(llm, 4, 8)[1]
        half = measured.with_offload(0.5)._optimizer_coefficients(llm, 4, 8)[1]
        assert np.allclose(half, none * max(0.5 * device, 0.5 * host) / device)
