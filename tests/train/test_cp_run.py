"""Context parallelism run by the executor (issue 30 item 2): the tiny spec's backbone
split over CP ranks (ring, Ulysses, hybrid; with pipeline and tensor parallelism) trains
as the single-process reference does, on gloo."""

from __future__ import annotations

import math

import pytest
import torch

from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from dtdsl.parallel.mesh import build_groups, cp_ulysses, rank_groups
from dtdsl.schedule.lower import lower
from tests.dist import run
from tests.helpers.plans import with_cp
from tests.helpers.runs import LOSS_RTOL, PARAM_RMS, PARAM_RTOL, plan_for, reference, spec

STEPS = 8       # the acceptance: 8+ steps
# The runs' global batch: 2 microbatches of 2 (as many as the two-stage pipelines' stages,
# enough for 1F1B); each claim here is per microbatch (its CP shards, their hops).
BATCH = 4


def _train(rank: int, world: int, program: ir.Program, plan: Plan, losses: list[float],
           params: dict, steps: int) -> None:
    from dtdsl.train.executor import StageExecutor

    uly = cp_ulysses(program, plan)
    groups = build_groups(plan, ulysses=uly)
    assert groups.groups() == rank_groups(plan, rank, ulysses=uly)
    ex = StageExecutor(program, plan, lower(plan, program), rank=rank, groups=groups)
    assert ex.p2p.check
    results = ex.train(steps)
    for r, want in zip(results, losses, strict=True):
        assert math.isclose(r["loss"], want, rel_tol=LOSS_RTOL), (r["step"], r["loss"], want)
    for name, p in ex.full_parameters().items():
        init, want = params[name]
        err = (p - want).norm().item()
        assert err <= PARAM_RTOL * (want - init).norm().item() + 1e-7, (name, err)
        assert err <= PARAM_RMS * want.numel() ** 0.5, (name, err)


def check(program: ir.Program, plan: Plan, steps: int = STEPS) -> None:
    losses, params = reference(program, steps)
    run(_train, plan.gpus_used, program, plan, losses, params, steps, timeout=300)


def tiny_cp(cp: int, method: str, *, tp: int = 1, pp: int = 1, batch: int = BATCH
            ) -> tuple[ir.Program, Plan]:
    program = spec(batch)
    plan = plan_for(program, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", tp, 1, pp),
                    ("gen", "generator", 1, 1, 1))
    return with_cp(program, plan, cp, method)


# (Ring attention at cp 2 trains in test_context_parallel_with_a_pipeline.)
@pytest.mark.parametrize("method", ["ulysses"])
def test_backbone_context_parallel_matches_the_reference(method):
    check(*tiny_cp(2, method))


def test_context_parallel_with_a_pipeline():
    # Stage s's CP rank r sends its shard to stage s+1's CP rank r.
    check(*tiny_cp(2, "ring", pp=2))


def test_context_parallel_with_tensor_parallelism():
    # TP innermost, CP next: sequence parallelism cuts each CP shard over the TP ranks.
    check(*tiny_cp(2, "ulysses", tp=2), steps=4)


def test_hybrid_context_parallelism():
    # Two nodes of two: Ulysses over the pair inside a node, the ring across the nodes.
    program, plan = tiny_cp(4, "hybrid")
    cluster = program.cluster.model_copy(update={"gpus_per_node": 2})
    program = program.model_copy(update={"cluster": cluster})
    assert cp_ulysses(program, plan) == {"llm": 2}
    check(program, plan, steps=4)


def test_a_checkpoint_saved_at_cp_2_resumes_at_cp_1_and_back(tmp_path):
    # The CP ranks hold FSDP2 shards over dp x cp: DCP reshards them to any layout.
    from tests.helpers.checkpoints import PLAN_A, PROGRAM, _close, _go, _reference

    ref, _ = _reference()
    # cp 2 at dp 1 (4 ranks, FSDP2 over its 2 CP ranks), plan A (dp 2) between.
    _, cp2 = with_cp(PROGRAM, plan_for(PROGRAM, ("vit", "encoder", 1, 1, 1),
                                       ("llm", "backbone", 1, 1, 1),
                                       ("gen", "generator", 1, 1, 1)), 2, "ring")
    assert cp2.gpus_used == 4
    run_dir = tmp_path / "run"
    # 2 steps at cp 2 before the first save (Adam's state through two updates), 2 at cp 1,
    # 2 at cp 2 again: the cp 2 run's parameters are checked at its end (step 6).
    a = _go(cp2, run_dir, 2, {2: "sync"}, tmp_path / "a.json")
    assert a["first"] == 0
    _close(a["losses"], ref[:2])
    b = _go(PLAN_A, run_dir, 2, {4: "thread"}, tmp_path / "b.json", want_at=4)
    assert b["first"] == 2
    assert "resharded from vit:tp1dp1pp1 llm:tp1cp2dp1pp1" in b["logs"][0], b["logs"]
    _close(b["losses"], ref[2:4])
    c = _go(cp2, run_dir, 2, {}, tmp_path / "c.json", want_at=6)
    assert c["first"] == 4 and "resharded from" in c["logs"][0]
    _close(c["losses"], ref[4:6])


def test_memcheck_replays_a_cp_stage_at_its_shard():
    # A CP rank holds 1 / cp of the sequence's activations; the memory model divides
    # them by cp too, so its error at cp 2 is its error at cp 1.
    from dtdsl.train.memplan import check_memory

    def llm(cp: int) -> dict[int, tuple[float, float]]:
        program, plan = tiny_cp(cp, "ring", pp=2, batch=8)
        # Only the backbone's stages replayed: the claim is about them alone.
        return {s.stage: (s.measured_bytes, s.error)
                for s in check_memory(program, plan, units=("llm",)) if s.unit == "llm"}

    one, two = llm(1), llm(2)
    for stage in (0, 1):
        assert two[stage][0] < 0.65 * one[stage][0], (stage, one, two)
        assert abs(two[stage][1] - one[stage][1]) < 0.1, (stage, one, two)


@pytest.mark.slow
def test_a_compiled_cp_bundle_dry_runs_and_trains_as_the_reference(tmp_path):
    # One bundle with the backbone and the encoder both at cp 2 (one launch for both;
    # 5 ranks: vit 2, llm 2, gen 1).
    import json
    from pathlib import Path

    from dtdsl import cli
    from dtdsl.train import dryrun
    from tests.helpers.bundle import launch_ok, read_jsonl

    root = Path(__file__).resolve().parents[2]
    text = (root / "specs" / "tiny_cpu.dt").read_text()
    spec = tmp_path / "tiny_cp.dt"
    for old, new in (("  tp(*) in {1, 2}\n", "  tp(*) in {1, 2}\n  cp(llm) == 2\n  cp(vit) == 2\n"),
                     ("  gpus          = 4\n", "  gpus          = 5\n"),
                     ("  gpus_per_node = 4\n", "  gpus_per_node = 5\n")):
        assert old in text
        text = text.replace(old, new)
    spec.write_text(text)
    bundle = tmp_path / "bundle"
    assert cli.main(["compile", str(spec), "-o", str(bundle), "--synthetic",
                     "--workers", "0"]) == 0
    plan = json.loads((bundle / "plan.json").read_text())
    cps = {u["name"]: u["cp"] for u in plan["units"]}
    assert cps["llm"] == cps["vit"] == 2
    report = dryrun.dry_run(bundle)
    assert report.ok, report.problems
    for unit in ("llm", "vit"):
        assert any(f"{unit}.cp" in c.groups for c in report.ranks), unit
    run_dir = tmp_path / "run"
    launch_ok(bundle, run_dir, "--steps", "2")
    ref = tmp_path / "reference.jsonl"
    assert cli.main(["reference", str(spec), "--steps", "2", "--out", str(ref)]) == 0
    want = [r["loss"] for r in read_jsonl(ref)]
    got = [m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    assert got == pytest.approx(want, rel=LOSS_RTOL)


def test_local_sgd_beside_context_parallelism_is_refused():
    # Local SGD makes every DP rank a whole replica (ZeRO-0's mesh): a replica's CP ranks
    # would not sum their gradients, so dtc compile refuses the pair (DT601), and only it.
    from dtdsl.codegen.support import runtime_support
    from dtdsl.ir.program import Sync

    program, plan = tiny_cp(2, "ring")
    local = program.model_copy(update={"train": program.train.model_copy(
        update={"sync": Sync(kind="local_sgd", period=2)})})
    assert not [d for d in runtime_support(program, plan) if d.code == "DT601"]
    found = [d for d in runtime_support(local, plan) if d.code == "DT601"]
    assert len(found) == 1 and "local_sgd beside context parallelism" in found[0].message


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_encoder_context_parallel_matches_the_reference(method):
    # The encoder unit shards each image's patch rows over its 2 CP ranks and gathers
    # them whole before the projector; its leader sends the backbone what it gets at cp 1.
    program = spec(BATCH)
    plan = plan_for(program, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 1, 1),
                    ("gen", "generator", 1, 1, 1))
    check(*with_cp(program, plan, 2, method, name="vit"))


def _encoder_at_cp(rank: int, world: int, cls: bool) -> None:
    """The tiny spec's ViT on two groups of images (9 and 16 rows, or 10 and 17 with a
    class token: padding to 2 x cp chunks in three of them),
    whole in this process and sharded over ``world`` CP ranks (ring, then Ulysses), each
    image bidirectional within itself: outputs and parameter gradients (summed over the
    CP ranks, as the DP x CP reduction sums them) equal the whole tower's."""
    import torch.distributed as dist

    from dtdsl.models.multimodal import encoder_input, encoder_layers, encoder_output
    from dtdsl.models.transformer import Encoder
    from dtdsl.parallel.cp import CPGroup, gather_sequence
    from dtdsl.train.cp_run import encoder_context

    arch = spec(8).module("vit").arch
    if cls:     # CLIP's tower: a class token, learned positions (bicubic to each grid)
        arch = arch.model_copy(update={"cls_token": True, "positions": "learned",
                                       "image_size": 32})
    enc = Encoder(arch)
    g = torch.Generator().manual_seed(0)
    for p in enc.parameters():      # every rank the same weights
        p.data = torch.randn(p.shape, generator=g) * 0.2
    groups = [torch.randn(3, n, arch.patch_dim, generator=g) for n in (9, 16)]
    grids = [(3, 3), (4, 4)]
    seeds = [torch.randn(3, n, arch.hidden, generator=g) for n in (9, 16)]

    def run(shards: CPGroup | None) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        enc.zero_grad()
        xs = encoder_input(enc, groups, grids)
        if shards is None:
            ys = encoder_layers(enc, xs)
        else:
            lengths = [x.shape[1] for x in xs]
            xs = [shards.shard(x) for x in xs]
            ys = encoder_layers(enc, xs, cp=[encoder_context(shards, 3, n, x.device)
                                             for x, n in zip(xs, lengths, strict=True)])
            ys = [gather_sequence(y, shards, n) for y, n in zip(ys, lengths, strict=True)]
        outs = encoder_output(enc, ys)
        # Every CP rank holds the whole output and its loss: 1 / cp of the gradient each.
        scale = 1.0 if shards is None else 1.0 / shards.size
        loss = sum((o * s).sum() for o, s in zip(outs, seeds, strict=True)) * scale
        loss.backward()
        grads = {n: p.grad.clone() for n, p in enc.named_parameters() if p.grad is not None}
        if shards is not None:
            for t in grads.values():
                dist.all_reduce(t)
        return [o.detach() for o in outs], grads

    want, want_grads = run(None)
    assert set(want_grads) == {n for n, _ in enc.named_parameters()}
    for method in ("ring", "ulysses"):
        group = dist.new_group(list(range(world)))
        got, got_grads = run(CPGroup(method=method, size=world, rank=rank, group=group))
        for o, w in zip(got, want, strict=True):
            assert o.shape == w.shape
            assert torch.allclose(o, w, rtol=1e-4, atol=1e-5), (method, (o - w).abs().max())
        assert set(got_grads) == set(want_grads)
        for name, w in want_grads.items():
            err = (got_grads[name] - w).abs().max().item()
            assert err <= 1e-4 * max(1.0, w.abs().max().item()), (method, name, err)


@pytest.mark.parametrize("cls", [False, True])
def test_encoder_cp_attention_equals_the_whole_tower(cls):
    run(_encoder_at_cp, 2, cls, timeout=120)


def test_encoder_context_parallel_with_a_pipeline():
    # The encoder's stage s CP rank r sends its shards of each group to stage s+1's CP
    # rank r; its last stage gathers them whole.
    program = spec(BATCH)
    plan = plan_for(program, ("vit", "encoder", 1, 1, 2), ("llm", "backbone", 1, 1, 1),
                    ("gen", "generator", 1, 1, 1))
    check(*with_cp(program, plan, 2, "ring", name="vit"), steps=4)


def test_memcheck_replays_an_encoder_cp_stage_at_its_shard():
    # Each CP rank of the encoder's stages holds its shard of every image's rows (the
    # first stage embeds them whole, the last gathers them whole for the projector).
    from dtdsl.train.memplan import check_memory

    def vit(cp: int) -> dict[int, float]:
        program = spec(8)
        plan = plan_for(program, ("vit", "encoder", 1, 1, 2), ("llm", "backbone", 1, 1, 1),
                        ("gen", "generator", 1, 1, 1))
        # Only the encoder's stages replayed: the claim is about them alone.
        return {s.stage: s.measured_bytes
                for s in check_memory(*with_cp(program, plan, cp, "ring", name="vit"),
                                      units=("vit",))
                if s.unit == "vit"}

    one, two = vit(1), vit(2)
    for stage in (0, 1):
        assert two[stage] < 0.9 * one[stage], (stage, one, two)


@pytest.mark.parametrize("cp, method, pp", [(2, "ulysses", 1), (2, "ring", 2), (1, "ring", 2)])
def test_a_video_encoder_at_cp_matches_the_reference(cp, method, pp):
    # A Qwen2-VL-style clip encoder (2-frame patches: clips of 4 to 27 rows, odd ones
    # among them) on its own CP ranks beside the image encoder at cp 1; over two stages
    # the hops carry each CP rank's shards (whole rows, unpadded, at cp 1).
    from tests.train.modal_specs import tiny_modal

    program = tiny_modal(audio=False, video=True, batch=BATCH)
    plan = plan_for(program, ("vit", "encoder", 1, 1, 1), ("clip", "encoder", 1, 1, pp),
                    ("llm", "backbone", 1, 1, 1), ("gen", "generator", 1, 1, 1))
    check(*with_cp(program, plan, cp, method, name="clip"), steps=4)


def test_hybrid_context_parallelism_on_an_encoder():
    # The ViT over two nodes of two: Ulysses inside a node, the ring across.
    program = spec(BATCH)
    plan = plan_for(program, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 1, 1),
                    ("gen", "generator", 1, 1, 1))
    program, plan = with_cp(program, plan, 4, "hybrid", name="vit")
    cluster = program.cluster.model_copy(update={"gpus_per_node": 2})
    program = program.model_copy(update={"cluster": cluster})
    assert cp_ulysses(program, plan) == {"vit": 2}
    check(program, plan, steps=4)


def test_encoder_context_parallel_with_tensor_parallelism():
    # TP 2 x CP 2 on the ViT: each TP rank's 2 heads, Ulysses over its CP pair.
    program = spec(BATCH)
    plan = plan_for(program, ("vit", "encoder", 2, 1, 1), ("llm", "backbone", 1, 1, 1),
                    ("gen", "generator", 1, 1, 1))
    check(*with_cp(program, plan, 2, "ulysses", name="vit"), steps=4)


# Ring attention with TP 2: one run covers its MoE routing at cp 2 and TP together.
@pytest.mark.parametrize("method,tp", [("ulysses", 1), ("ring", 2)])
def test_an_moe_backbone_under_context_parallelism_matches_the_reference(method, tp):
    """Each CP rank routes its shard's tokens; a sequence's balance loss sums its
    statistics over the CP ranks (an aux weight large enough to show in the losses)."""
    from tests.helpers.moe import moe_spec

    # Its text lengths two (fewer widths for TP's DTensor propagation to pay for).
    program = moe_spec(batch=BATCH, args="experts=4, top_k=2, expert_ffn=64, aux_loss=0.1",
                       two_lengths=True)
    plan = plan_for(program, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", tp, 1, 1),
                    ("gen", "generator", 1, 1, 1))
    check(*with_cp(program, plan, 2, method), steps=STEPS if tp == 1 else 4)
