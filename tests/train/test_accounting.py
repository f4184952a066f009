"""One token accounting: what each unit of a run takes in, step by step, is what the
simulator is handed for that step (``data.batch.sample_set`` of the step's sizes, as a
launched run's predicted timelines simulate it), and the cost model's drawn sequences are
the runtime's: cut to seq_len, packed as the runtime packs them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dtdsl.cost.samples import draw_samples
from dtdsl.data.batch import SyntheticSource, sample_set
from dtdsl.ir import program as ir
from dtdsl.ir.plan import Plan
from tests.dist import run
from tests.helpers.runs import plan_for
from tests.specs import variant

P8 = ir.ImageTokens(patch=8)      # the tiny spec's image tokens: its patches

# Two steps: each step's counts are checked on their own; a second step draws other sizes.
STEPS = 2
# Two microbatches of two (the phased test's two stages need two; unpacked, fewer samples
# may draw no image in a step); packed on one stage, one microbatch: the claim is per
# sample, not per batch size.
RUN_BATCH = 4
ONE_STAGE_PACKED_BATCH = 2


def tiny(packing: bool, batch: int = 8) -> ir.Program:
    text = "  seed             = 1234\n"
    p = variant(text, text + f"  packing          = {'true' if packing else 'false'}\n")
    return p.model_copy(update={"train": p.train.model_copy(update={"global_batch": batch})})


def _expected(program: ir.Program, sizes) -> dict[str, int]:
    """What the simulator takes a step's units to process."""
    ss = sample_set(program, sizes)
    image = ss.items["image"]
    return {"patches": int(image.sizes.sum()),
            "positions": int(ss.text_tokens.sum() + image.sizes.sum()),
            "text_tokens": int(ss.text_tokens.sum()),
            "targets": int(ss.items["image.gen"].counts.sum())}


def _count(rank: int, world: int, program: ir.Program, plan: Plan) -> None:
    from dtdsl.parallel.mesh import build_groups, hosted_units
    from dtdsl.schedule.lower import lower
    from dtdsl.train.executor import StageExecutor

    groups = build_groups(plan)
    ex = StageExecutor(program, plan, lower(plan, program), rank=rank, groups=groups)
    which = {"encoder": ("patches",), "backbone": ("positions", "text_tokens"),
             "generator": ("targets",)}[ex.role.role]
    # A stage hosting co-located units takes in what they do too.
    which += tuple({"encoder": "patches", "generator": "targets"}[u.role]
                   for u in hosted_units(plan, ex.role))
    for step in range(STEPS):
        got = ex.run_step(step)["processed"]
        want = _expected(program, ex.batch.sizes)
        for key in which:
            assert got[key] == want[key] > 0, (ex.role.unit, step, key, got, want)


@pytest.mark.slow
# (Packed, the same counts of every unit: the co-located and phased tests below.)
@pytest.mark.parametrize("packing", [False], ids=["one-per-sequence"])
def test_each_unit_processes_what_the_simulator_assumed(packing):
    program = tiny(packing, RUN_BATCH)
    plan = plan_for(program, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 1, 1),
                    ("gen", "generator", 1, 1, 1))
    run(_count, plan.gpus_used, program, plan, timeout=180)


def test_a_stage_with_co_located_units_processes_what_the_simulator_assumed():
    from tests.helpers.plans import colocate

    program = tiny(True, ONE_STAGE_PACKED_BATCH)
    plan = colocate(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                      ("llm", "backbone", 1, 1, 1),
                                      ("gen", "generator", 1, 1, 1)), "vit", "gen")
    assert plan.gpus_used == 1
    run(_count, plan.gpus_used, program, plan, timeout=180)


@pytest.mark.parametrize("packing", [False, True], ids=["one-per-sequence", "packed"])
def test_the_cost_models_sequences_are_the_runtimes(packing):
    """The cost model's drawn sequences and the runtime's (synthetic data, 40 steps) agree
    in their means: positions, text tokens, images and patches per sequence."""
    program = tiny(packing, batch=16)
    source = SyntheticSource(program)
    runtime = [sample_set(program, source.sizes(step)) for step in range(40)]
    drawn = draw_samples(program, 4000, seed=5)

    def means(sets):
        text = np.concatenate([s.text_tokens for s in sets])
        counts = np.concatenate([s.items["image"].counts for s in sets])
        patches = np.concatenate([s.items["image"].tokens() for s in sets])
        return {"text": text.mean(), "images": counts.mean(), "patches": patches.mean(),
                "positions": (text + patches).mean()}

    got, want = means(runtime), means([drawn])
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=0.08), (key, got, want)
    assert max((s.text_tokens + s.items["image"].tokens()).max() for s in runtime) <= 512
    if packing:
        assert got["positions"] > 0.9 * 512         # sequences are filled


@pytest.mark.parametrize("packing", [False, True], ids=["one-per-sequence", "packed"])
@pytest.mark.parametrize("n", [1, 5, 16, 30])
def test_the_cost_model_draws_as_many_sequences_as_asked(packing, n):
    assert len(draw_samples(tiny(packing), n, seed=2)) == n


def test_the_cost_models_cut_is_the_sources():
    """Sample by sample, the cost model's cut (``cost.samples``) keeps what ``ir.layout.fit``
    keeps of the same sizes, at a seq_len that cuts many of them."""
    from dtdsl.cost.samples import _cut, _draw_documents
    from dtdsl.ir.layout import fit
    from dtdsl.ir.sizes import SampleSizes

    program = variant("seq_len          = 512", "seq_len          = 80")
    drawn = _draw_documents(program, 400, np.random.default_rng(3))
    cut = _cut(program, drawn)
    image, kept = drawn.items["image"], cut.items["image"]
    at = np.concatenate([[0], np.cumsum(image.counts)])
    k_at = np.concatenate([[0], np.cumsum(kept.counts)])
    changed = 0
    for i in range(len(drawn)):
        sides = [int(round(p ** 0.5)) * 8 for p in image.sizes[at[i]:at[i + 1]]]
        sizes = SampleSizes(text_tokens=int(drawn.text_tokens[i]),
                            image_shapes=tuple((s, s) for s in sides), gen_counts={})
        want = fit(sizes, P8, 80)
        assert cut.text_tokens[i] == want.text_tokens, i
        assert [(s // 8) ** 2 for s, _ in want.image_shapes] == \
            kept.sizes[k_at[i]:k_at[i + 1]].tolist(), i
        changed += want.cut
    assert changed > 50


def test_samples_cut_to_nothing_keep_their_text_and_train():
    """A sample whose first image alone exceeds seq_len keeps its text (no images); its
    tensors have exactly its sizes' tokens, and a packed batch's loss is computed."""
    from dtdsl.ir.layout import layout_of
    from dtdsl.models.multimodal import build_model, loss_normalizer, microbatch_loss

    p = variant("seq_len          = 512", "seq_len          = 48")
    p = p.model_copy(update={"train": p.train.model_copy(update={"packing": True,
                                                                  "global_batch": 4})})
    source = SyntheticSource(p)
    sizes = source.sizes(0)
    samples = [source.sample(0, i) for i in range(4)]
    for z, s in zip(sizes, samples, strict=True):
        assert len(s.tokens) == z.text_tokens
        assert all(layout_of(d, P8, 48).length > 0 for d in z.docs())
    assert sum(z.cut for z in sizes) > 0
    model = build_model(p)
    loss = microbatch_loss(model, samples, loss_normalizer(model, samples))
    assert torch.isfinite(loss.total)


def _count_phased(rank: int, world: int, program: ir.Program, plan: Plan) -> None:
    from dtdsl.parallel.mesh import build_groups
    from dtdsl.schedule.lower import lower
    from dtdsl.train.executor import StageExecutor

    groups = build_groups(plan)
    ex = StageExecutor(program, plan, lower(plan, program), rank=rank, groups=groups)
    for step in range(STEPS):
        got = ex.run_step(step)["processed"]
        want = _expected(program, ex.batch.sizes)
        if ex.role.role == "backbone" and ex.role.is_first_stage:
            for key in ("positions", "text_tokens"):
                assert got[key] == want[key] > 0, (step, key, got, want)
        # Each backbone rank encodes its share of the images: the shares add up to
        # the batch's patches.
        patches = torch.tensor([got["patches"]], dtype=torch.int64)
        torch.distributed.all_reduce(patches)
        assert int(patches) == want["patches"] > 0, (step, int(patches), want)


def test_phased_encoder_ranks_process_what_the_simulator_assumed():
    from tests.helpers.plans import phase

    program = tiny(True, RUN_BATCH)
    plan = phase(program, plan_for(program, ("vit", "encoder", 1, 1, 1),
                                   ("llm", "backbone", 1, 1, 2),
                                   ("gen", "generator", 1, 1, 1)))
    run(_count_phased, plan.gpus_used, program, plan, timeout=180)
