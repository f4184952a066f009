"""``dtc memcheck`` counts NCCL's communicator buffers (issue 28 item 6): per communicator a
rank is in, NCCL_BUFFSIZE per channel and peer connection, on NCCL only."""

from __future__ import annotations

from dtdsl.train.memplan import (
    NCCL_BUFFSIZE_BYTES,
    NCCL_P2P_CHANNELS,
    NCCL_RING_CHANNELS,
    StageMemory,
    broker_peers,
    check_memory,
    format_stages,
    nccl_buffer_bytes,
)
from tests.helpers.runs import plan_for, spec

RING_PEER = NCCL_RING_CHANNELS * NCCL_BUFFSIZE_BYTES     # one ring neighbour
P2P_PEER = NCCL_P2P_CHANNELS * NCCL_BUFFSIZE_BYTES       # one point-to-point peer


def _plan(tp: int, dp: int, pp: int, batch: int = 16):
    program = spec(batch)
    return plan_for(program, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", tp, dp, pp),
                    ("gen", "generator", 1, 1, 1))


def test_buffers_scale_with_the_groups_a_rank_is_in():
    # The backbone's first rank (its first stage's TP leader of replica 0) as its unit
    # gains a TP group, then a DP group, then a PP group.
    totals = []
    for tp, dp, pp in ((1, 1, 1), (2, 1, 1), (2, 2, 1), (2, 2, 2)):
        plan = _plan(tp, dp, pp)
        got = nccl_buffer_bytes(plan, 1)
        want = {"world": 2 * RING_PEER}     # the job's ring: two neighbours
        if tp > 1:
            want["tp"] = RING_PEER          # a group of two: one neighbour
        if dp > 1:
            want["dp"] = RING_PEER
        if pp > 1:
            want["pp"] = P2P_PEER           # the first stage: the next one only
        # The ViT's leader feeds it; with one stage it feeds the U-Net too.
        assert broker_peers(plan, 1) == ((0,) if pp > 1 else (0, 1 + tp * dp * pp))
        want["broker"] = len(broker_peers(plan, 1)) * P2P_PEER
        assert got == want, (tp, dp, pp)
        totals.append(sum(v for k, v in got.items() if k != "broker"))
    # Each group more is a communicator more (the broker links change with the stages).
    assert totals == sorted(totals) and len(set(totals)) == len(totals)
    # A TP rank other than the leader has no broker link; gloo has no NCCL buffers.
    plan = _plan(2, 2, 2)
    assert "broker" not in nccl_buffer_bytes(plan, 2)
    assert nccl_buffer_bytes(plan, 1, backend="gloo") == {}


def test_a_data_parallel_unit_links_every_replica():
    # An encoder leader may be routed samples for any backbone replica.
    plan = _plan(1, 3, 1, batch=12)
    assert broker_peers(plan, 0) == (1, 2, 3)
    assert broker_peers(plan, 2) == (0, 4)     # a backbone replica: the ViT and the U-Net


def test_memcheck_reports_the_buffers_on_a_line_of_their_own():
    # The backbone's stage alone (it has a broker link both ways), on 2 microbatches: the
    # claim is how a stage's report shows its buffers.
    plan = _plan(1, 1, 1, batch=4)
    stages = check_memory(spec(4), plan, jobs=2, units=("llm",))
    assert all(s.nccl == nccl_buffer_bytes(plan, s.rank) for s in stages)
    lines = format_stages(stages)
    nccl = [line for line in lines if line.lstrip().startswith("+ NCCL buffers")]
    assert len(nccl) == len(stages)
    assert all("world" in line and "broker" in line for line in nccl)
    doc = stages[0].as_json()
    assert doc["nccl_bytes"] == sum(doc["nccl_by_group"].values()) > 0
    # The capacity check counts them: a stage whose tensors fit but not with NCCL's.
    s = stages[0]
    tight = StageMemory(**{**s.__dict__, "capacity_bytes": s.measured_bytes + 1})
    assert format_stages([tight])[1].endswith("OVER")
