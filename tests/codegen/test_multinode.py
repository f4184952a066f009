"""A bundle of two nodes, launched as two `launch.sh --nnodes 2` on this machine (torchrun's
c10d rendezvous, the feed's workers on node 0): it trains like the single-process
reference, and a rank killed on node 1 restarts the job on both nodes from a checkpoint."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from dtdsl import cli
from dtdsl.feed import wire
from tests.codegen.test_bundle_run import (  # noqa: F401  (dataset is a fixture)
    RTOL,
    SPEC,
    dataset,
    read_jsonl,
    reference_losses,
)

STEPS = 5


@pytest.mark.slow
def test_two_nodes_train_like_the_reference_and_survive_a_killed_rank(tmp_path,
                                                                     dataset):  # noqa: F811
    text = SPEC.read_text()
    assert "gpus_per_node = 4" in text and "checkpoint_every = 10" in text
    spec = tmp_path / "two_nodes.dt"
    spec.write_text(text.replace("gpus_per_node = 4", "gpus_per_node = 2")
                    .replace("checkpoint_every = 10", "checkpoint_every = 2"))
    bundle = tmp_path / "bundle"
    assert cli.main(["compile", str(spec), "-o", str(bundle), "--data", str(dataset),
                     "--workers", "2"]) == 0
    run_dir = tmp_path / "run"
    rdzv = wire.free_port_base(1)
    env = {**os.environ, "PYTHON": sys.executable, "DTDSL_FAULT": "rank3@3"}
    procs = []
    for node in (0, 1):     # node 0 first: c10d numbers nodes of one host by process id
        procs.append(subprocess.Popen(
            ["bash", str(bundle / "launch.sh"), "--nnodes", "2", "--node-rank", str(node),
             "--rdzv", f"127.0.0.1:{rdzv}", "--run-dir", str(run_dir),
             "--steps", str(STEPS)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
        time.sleep(1.0)
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-4000:]
    out = "".join(outs)
    assert "DTDSL_FAULT: killing rank3 at step 3" in out
    # The job restarted on both nodes: from ckpt-2 if its background save had committed
    # when rank 3 died, else from the start.
    # (node 0's workers restart with or without a counted torchrun restart: either way)
    assert re.search(r"^resuming\b", out, re.M), out[-4000:]
    assert re.search(r"checkpoint: (resumed from \S+/ckpt-2 at step 2|none in)", out), \
        out[-4000:]
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(STEPS))
    for m, ref in zip(metrics, reference_losses(STEPS, dataset), strict=True):
        assert m["loss"] == pytest.approx(ref, rel=RTOL)
    assert len(list((run_dir / "launches").iterdir())) == 1    # one launch, resumed in it
