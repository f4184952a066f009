"""The cost model: FLOPs against published figures and Megatron-LM's formula, memory
under ZeRO and the pipeline schedules, and compute times from a measured profile."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dtdsl.cost import flops
from dtdsl.cost.model import CostParams, Efficiency, build_cost_model, in_flight
from dtdsl.cost.profile import (
    ProfileTable,
)
from dtdsl.cost.samples import draw_samples, microbatch_lengths, positions
from dtdsl.ir import program as ir
from tests.helpers.costs import (
    _linear_profile,
    program,
)

ROOT = Path(__file__).resolve().parents[2]




# ---- FLOPs and parameters ---------------------------------------------------------------

def test_sd21_unet_parameters_match_the_published_count():
    # diffusers' UNet2DConditionModel for stabilityai/stable-diffusion-2-1: 865,910,724.
    assert flops.module_params(program("mllm_72b").module("sd")) == 865_910_724


def test_sd_unet_macs_per_image_match_the_published_figure():
    """SD's U-Net at a 64x64 latent: ~339 GMACs in its convolutions and linear layers
    (the figure SnapFusion and the SD-on-mobile papers tabulate; attention score
    products come on top)."""
    ops = flops.unet_ops(program("mllm_72b").module("sd").arch, cond_tokens=77)
    weighted = sum(op.flops for op in ops if op.kind in ("conv", "linear")) / 2
    assert weighted / 1e9 == pytest.approx(339, rel=0.01)
    total = flops.unet_forward(program("mllm_72b").module("sd").arch).total / 2
    assert total > weighted


def test_backbone_matches_megatron_formula_with_full_attention():
    arch = program("mllm_72b").module("llm").arch
    full = arch.model_copy(update={"causal": False})
    seq, batch = 8192, 3
    ours = flops.backbone_forward(full, seq).total * 3 * batch   # forward + 2x backward
    assert ours == pytest.approx(flops.backbone_flops_megatron(full, seq, batch), rel=1e-12)


def test_causal_attention_is_half_of_full():
    arch = program("mllm_72b").module("llm").arch
    assert arch.causal
    full = flops.backbone_forward(arch.model_copy(update={"causal": False}), 4096)
    causal = flops.backbone_forward(arch, 4096)
    assert causal.attention == pytest.approx(full.attention / 2)
    assert causal.matmul == full.matmul


def test_vit_attention_is_bidirectional_and_quadratic():
    arch = program("mllm_72b").module("vit").arch
    one, two = flops.encoder_item_forward(arch, 256), flops.encoder_item_forward(arch, 512)
    assert two.attention == pytest.approx(4 * one.attention)
    assert one.attention == pytest.approx(arch.layers * 4 * 256 * 256 * arch.hidden)


def test_backward_factors():
    prog = program("mllm_9b")
    vit = prog.module("vit")
    assert flops.backward_factor(vit, upstream_trainable=False) == 2.0
    frozen = vit.model_copy(update={"frozen": True})
    assert flops.backward_factor(frozen, upstream_trainable=False) == 0.0
    assert flops.backward_factor(frozen, upstream_trainable=True) == 1.0


# ---- costs per unit --------------------------------------------------------------------------

def test_costs_grow_with_the_data():
    small = build_cost_model(program("mllm_9b"))
    big = build_cost_model(program("mllm_9b", (
        ("choice([256, 1024, 4096], p=[0.6, 0.3, 0.1])",
         "choice([256, 1024, 4096], p=[0.1, 0.3, 0.6])"),)))
    # Larger images, more encoder work; not in proportion: an image that does not fit in
    # seq_len is dropped, as the data sources drop it.
    assert big.unit("vit").fwd_work.total > 1.5 * small.unit("vit").fwd_work.total
    # The backbone pads a microbatch to its longest sequence: longer sequences, more work,
    # never more than seq_len's.
    prog = program("mllm_9b")
    full = flops.backbone_forward(prog.backbone.arch, prog.train.seq_len).total * \
        prog.train.micro_batch
    assert small.unit("llm").fwd_work.total < big.unit("llm").fwd_work.total <= full
    # MFU counts the sequences' own tokens, not the padding of a microbatch of several.
    tiny = build_cost_model(program("tiny_cpu"))
    assert program("tiny_cpu").train.micro_batch > 1
    llm = tiny.unit("llm")
    assert llm.model_flops < llm.fwd_work.total * (1 + llm.backward_factor)


def test_frozen_encoder_keeps_no_gradients_or_optimizer_state():
    trained = build_cost_model(program("mllm_9b"))
    frozen = build_cost_model(program("mllm_9b", (
        ("arch = transformer(layers=32, hidden=1280",
         "frozen = true\n    arch = transformer(layers=32, hidden=1280"),)))
    t, f = trained.unit("vit"), frozen.unit("vit")
    assert f.backward_factor == 0.0 and f.trainable_params < f.params
    args = {"tp": 1, "pp": 1, "dp": 4, "vpp": 1, "depth": 1, "microbatches": 8, "share": 1.0}
    assert frozen.memory_bytes(f, **args) < 0.3 * trained.memory_bytes(t, **args)
    assert frozen.fwd_bwd_time_s(f, 1)[1] == 0.0
    # Only its projector (trainable, on the encoder's ranks) synchronises gradients.
    assert 0 < float(frozen.dp_sync_time_s(f, 1, 1, 4)) < \
        0.1 * float(trained.dp_sync_time_s(t, 1, 1, 4))


def test_zero1_shards_optimizer_state_across_dp():
    zero0 = build_cost_model(program("mllm_9b", (("zero=1", "zero=0"),)))
    zero1 = build_cost_model(program("mllm_9b"))
    u0, u1 = zero0.unit("llm"), zero1.unit("llm")
    args = {"tp": 4, "pp": 4, "vpp": 1, "depth": 4, "microbatches": 32, "share": 1.0}
    # Without ZeRO, dp changes nothing; with ZeRO-1 the 12 bytes/param of Adam state shrink.
    assert zero0.memory_bytes(u0, dp=1, **args) == zero0.memory_bytes(u0, dp=8, **args)
    saved = zero1.memory_bytes(u1, dp=1, **args) - zero1.memory_bytes(u1, dp=8, **args)
    stage_params = u1.stage_params(4) / 4
    assert saved == pytest.approx(stage_params * 12 * (1 - 1 / 8))


def test_microbatches_in_flight_per_schedule():
    # GPipe holds every microbatch; 1F1B one per stage downstream; interleaved 1F1B
    # Megatron-LM's 2 (p - 1) + (v - 1) p + 1 chunks of L / (p v) layers.
    assert [int(np.asarray(x)) for x in in_flight("gpipe", 32, 4, 1, 4, 16)] == [16, 8]
    assert [int(np.asarray(x)) for x in in_flight("1f1b", 32, 4, 1, 6, 16)] == [6, 8]
    assert [int(np.asarray(x)) for x in in_flight("1f1b", 32, 4, 1, 6, 3)] == [3, 8]
    count, chunk = in_flight("interleaved", 32, 4, 2, 4, 16)
    assert (int(count), int(chunk)) == (2 * 3 + 4 + 1, 4)
    # Arrays broadcast, including the microbatch counts (one per DP candidate).
    count, _ = in_flight("gpipe", 32, np.array([[1, 2, 4]]), 1, np.array([[1, 2, 4]]),
                         np.array([[8], [16]]))
    assert count.shape == (2, 3) and (count[1] == 16).all()


def test_activation_memory_follows_the_schedule():
    gpipe = build_cost_model(program("mllm_9b", (("= zero_bubble", "= gpipe"),)))
    onef = build_cost_model(program("mllm_9b", (("= zero_bubble", "= 1f1b"),)))
    zb = build_cost_model(program("mllm_9b"))
    args = {"tp": 4, "pp": 4, "dp": 8, "vpp": 1, "depth": 4, "microbatches": 32, "share": 1.0}
    assert gpipe.memory_bytes(gpipe.unit("llm"), **args) > \
        2 * onef.memory_bytes(onef.unit("llm"), **args)
    # ZB-H1 keeps 1F1B's microbatches in flight at the first stage.
    assert zb.memory_bytes(zb.unit("llm"), **args) == onef.memory_bytes(onef.unit("llm"), **args)


def test_tp_communication_uses_the_intra_node_link():
    model = build_cost_model(program("mllm_72b"))
    llm = model.unit("llm")
    assert model.tp_comm_time_s(llm, 1) == 0.0
    within, across = model.tp_comm_time_s(llm, 8), model.tp_comm_time_s(llm, 16)
    # 16 ranks span two nodes: the inter-node link is 4x slower on this cluster.
    assert across > 3 * within


def test_efficiency_scales_compute_time():
    fast = build_cost_model(program("mllm_9b"), CostParams(efficiency=Efficiency(1.0, 1.0, 1.0)))
    slow = build_cost_model(program("mllm_9b"), CostParams(efficiency=Efficiency(0.5, 0.5, 0.5)))
    for name in ("vit", "llm", "sd"):
        assert slow.compute_time_s(slow.unit(name), 2) == pytest.approx(
            2 * fast.compute_time_s(fast.unit(name), 2))


# ---- with a measured profile -------------------------------------------------------------------



def test_profile_times_are_expectations_over_the_data():
    """With time linear in x the expected time per microbatch is slope x E[x per
    microbatch]: tokens for the backbone, item tokens for encoders, items for
    generators, tokens through projectors."""
    prog = program("tiny_cpu")
    slope = {"vit": 1e-3, "llm": 2e-4, "gen": 5e-2, "vit_to_llm": 1e-5, "llm_to_gen": 2e-5}
    measured = build_cost_model(prog, profile=ProfileTable(_linear_profile(prog, slope)))
    assert measured.tps(measured.unit("llm")) == (1, 2)
    mb = prog.train.micro_batch
    drawn = draw_samples(prog, measured.params.samples, measured.params.seed)
    fwd, bwd = measured.fwd_bwd_time_s(measured.unit("llm"), 1)
    # The backbone: the expected length of a microbatch padded to its longest sequence.
    padded = microbatch_lengths(positions(drawn), mb)
    assert padded.mean() < prog.train.seq_len
    assert fwd == pytest.approx(slope["llm"] * padded.mean() * mb)
    assert bwd == pytest.approx(2 * fwd)
    # The encoder: the expected item tokens of a microbatch of the drawn samples.
    vit = measured.unit("vit")
    tokens = sum(w * x for q in vit.queries if q.name == "vit" for x, w in
                 zip(q.sizes, q.weights, strict=True))
    assert tokens == pytest.approx(drawn.items["image"].tokens().mean() * mb)
    projected = [q for q in vit.queries if q.name == "vit_to_llm"]
    assert projected[0].sizes == pytest.approx((tokens,))
    assert measured.fwd_bwd_time_s(vit, 1)[0] == pytest.approx(
        (slope["vit"] + slope["vit_to_llm"]) * tokens)
    fwd1, _ = measured.fwd_bwd_time_s(vit, 1)
    fwd2, _ = measured.fwd_bwd_time_s(vit, 2)
    comm = measured.tp_comm_time_s(vit, 2)
    assert fwd2 - comm == pytest.approx(fwd1 / 2)
    # The generator: expected items per microbatch.
    gen = measured.unit("gen")
    items = sum(w * x for q in gen.queries if q.name == "gen" for x, w in
                zip(q.sizes, q.weights, strict=True))
    assert items == pytest.approx(0.4 * mb, rel=0.1)     # gen_count: 1 with p = 0.4


def test_profile_limits_the_tp_degrees():
    prog = program("tiny_cpu")
    slope = dict.fromkeys(["vit", "llm", "gen", "vit_to_llm", "llm_to_gen"], 1e-4)
    model = build_cost_model(prog, profile=ProfileTable(_linear_profile(prog, slope, tps=(1,))))
    assert model.tps(model.unit("llm")) == (1,)
    assert build_cost_model(prog).tps(model.unit("llm")) is None


def test_the_parameter_all_gather_overlaps_the_first_forward():
    """ZeRO-1: each layer's parameter all-gather (started at the step's start) hides
    behind the previous layer's forward, so of L layers' gathers min(a, f) + max(0, a - f)
    L is exposed. The gradient reduce-scatter is exposed on an encoder; a backbone's
    layers reduce during the last backward, each behind the next one's backward (b): of
    L layers' reductions (r) min(r, b) + max(0, r - b) L is exposed. Without ZeRO the
    all-reduce takes the reduce-scatter's place."""
    from dtdsl.cost.model import all_reduce_time_s

    zero0 = build_cost_model(program("mllm_9b", (("zero=1", "zero=0"),)))
    zero1 = build_cost_model(program("mllm_9b"))
    bw = zero1.program.cluster.inter_node_bw_bytes_per_s
    for name, tp, dp in (("llm", 2, 4), ("llm", 8, 16), ("vit", 1, 8)):
        unit = zero1.unit(name)
        per_param = unit.trainable_params / unit.params * 2 / tp
        layer = all_reduce_time_s((unit.params - unit.extra_stage_params) / unit.layers
                                  * per_param, dp, bw) - all_reduce_time_s(0.0, dp, bw)
        ends = all_reduce_time_s(unit.extra_stage_params * per_param, dp, bw)
        f, b = (t / unit.layers for t in zero1.fwd_bwd_time_s(unit, tp))
        early = name == "llm"
        hidden = min(layer, b) if early else 0.0
        assert zero0.dp_sync_coefficients(zero0.unit(name), tp, dp) == \
            pytest.approx((ends + hidden, layer - hidden), rel=1e-12)
        a = r = layer / 2
        hidden = min(r, b) if early else 0.0
        fixed, per_layer = zero1.dp_sync_coefficients(unit, tp, dp)
        assert fixed == pytest.approx(ends + min(a, f) + hidden, rel=1e-12)
        assert per_layer == pytest.approx(r - hidden + max(0.0, a - f), rel=1e-12)
        # Arrays of TP degrees give the same coefficients.
        arr_fixed, arr_layer = zero1.dp_sync_coefficients(unit, np.array([tp, tp]), dp)
        assert arr_fixed == pytest.approx([fixed] * 2) and arr_layer == pytest.approx(
            [per_layer] * 2)


def test_the_optimizer_step_ends_a_stage_at_the_profiles_rate():
    """With a profile that timed the optimizer, each stage's end-of-step time grows by its
    trained parameters (its TP shard; its DP shard under ZeRO-1) times the rate."""
    prog = program("tiny_cpu")
    slope = {"vit": 1e-3, "llm": 2e-4, "gen": 5e-2, "vit_to_llm": 1e-5, "llm_to_gen": 2e-5}
    base = _linear_profile(prog, slope)
    without = build_cost_model(prog, profile=ProfileTable(base))
    rate = 3e-9
    timed = build_cost_model(prog, profile=ProfileTable(
        base.model_copy(update={"optimizer_s_per_param": rate})))
    for name, tp, dp in (("llm", 1, 2), ("llm", 2, 1), ("vit", 1, 4)):
        unit = timed.unit(name)
        f0, l0 = without.dp_sync_coefficients(without.unit(name), tp, dp)
        f1, l1 = timed.dp_sync_coefficients(unit, tp, dp)
        shard = tp * dp      # tiny_cpu: zero=1
        assert f1 - f0 == pytest.approx(unit.extra_stage_params / shard * rate, rel=1e-9)
        assert l1 - l0 == pytest.approx(
            (unit.params - unit.extra_stage_params) / unit.layers / shard * rate, rel=1e-9)


def test_pipeline_transfers_are_split_by_tp_under_sequence_parallelism():
    """The backbone's TP ranks each send their 1/tp of the sequence to their peer at once;
    an encoder's stages send the whole activations."""
    c = build_cost_model(program("mllm_9b"))
    llm, vit = c.unit("llm"), c.unit("vit")
    for tp in (1, 2, 8):
        assert c.hop_time_s(llm, tp, 2.0) == pytest.approx(
            c.p2p_time_s(llm.boundary_bytes * 2.0 / tp))
        assert c.hop_time_s(vit, tp) == pytest.approx(c.p2p_time_s(vit.boundary_bytes))
    assert np.allclose(c.hop_time_s(llm, np.array([1, 4]), 1.0),
                       [c.hop_time_s(llm, 1), c.hop_time_s(llm, 4)])


def test_a_dits_stages_send_its_tokens_and_context_a_unets_nothing():
    """What a DiT's pipeline stage sends the next per microbatch (``train.generator``):
    the tokens and the cross-attention context of its mean targets, whole on every TP
    rank; a U-Net, which keeps one stage, sends nothing. Both have their projector on the
    first stage, where the conditioning enters."""
    from tests.train.modal_specs import tiny_audio_image

    p = tiny_audio_image()
    params = CostParams()
    samples = draw_samples(p, params.samples, params.seed)
    c = build_cost_model(p, params, samples=samples)
    dit, unet = c.unit("audiogen"), c.unit("sd")
    arch = p.module("audiogen").arch
    targets = float(samples.items["audio.gen"].counts.mean()) * p.train.micro_batch
    per_target = flops.dit_tokens(arch) * arch.hidden + ir.COND_TOKENS * arch.context_dim
    assert dit.boundary_bytes == pytest.approx(targets * per_target * 2)    # bf16
    assert unet.boundary_bytes == 0.0
    for tp in (1, 2):
        assert c.hop_time_s(dit, tp) == pytest.approx(c.p2p_time_s(dit.boundary_bytes))
    for g in (dit, unet):
        assert g.first_stage_params == g.extra_stage_params > 0


# ---- attention per document (packed sequences) ----------------------------------------------

def _packed(name: str) -> ir.Program:
    return program(name, (("  seed             = 42\n",
                           "  seed             = 42\n  packing          = true\n"),))


def test_a_packed_row_of_k_documents_costs_k_times_their_attention():
    """k documents of length L packed in one row attend only within themselves: k attn(L),
    not attn(kL); one document is priced as before (its length squared)."""
    from dtdsl.cost.samples import ItemSet, SampleSet, _join, attention_squares

    arch = program("mllm_9b").backbone.arch
    k, length = 4, 1000
    one = flops.backbone_attention(arch, length ** 2)
    assert one == flops.backbone_forward(arch, length).attention
    assert flops.backbone_forward(arch, k * length, k * length ** 2).attention == \
        pytest.approx(k * one)
    assert flops.backbone_forward(arch, k * length).attention == pytest.approx(k * k * one)
    # the linear work is the row's, whatever its documents
    assert flops.backbone_forward(arch, k * length, k * length ** 2).matmul == \
        flops.backbone_forward(arch, k * length).matmul
    # packing keeps each row's documents' squares: rows [0, 1, 2, 3] and [4]
    docs = SampleSet(text_tokens=np.full(5, length),
                     items={"image": ItemSet(counts=np.array([0, 1, 0, 0, 0]),
                                             sizes=np.array([24]))})
    joined = _join(docs, [[0, 1, 2, 3], [4]])
    assert attention_squares(docs).tolist() == [length ** 2, (length + 24) ** 2] + \
        [length ** 2] * 3
    assert attention_squares(joined).tolist() == [3 * length ** 2 + (length + 24) ** 2,
                                                  length ** 2]
    assert positions(joined).tolist() == [4 * length + 24, length]


def test_packed_samples_are_priced_per_document_and_mfu_counts_only_that():
    from dtdsl.cost.samples import attention_squares, microbatch_squares

    packed = _packed("mllm_9b")
    cost = build_cost_model(packed)
    llm = cost.unit("llm")
    drawn = draw_samples(packed, cost.params.samples, cost.params.seed)
    lengths = positions(drawn).astype(float)
    squares = attention_squares(drawn)
    assert np.all(squares <= lengths ** 2) and np.all(squares > 0)
    assert np.mean(squares < lengths ** 2) > 0.5            # most rows: several documents
    arch = packed.backbone.arch
    mb = packed.train.micro_batch
    assert llm.model_attention_flops == pytest.approx(
        float(np.mean(flops.backbone_attention(arch, squares))) * mb)
    # MFU's numerator: fwd + bwd of every kind of work, attention per document
    useful = flops.backbone_forward(arch, lengths, squares)
    bwd = llm.backward_factor
    assert llm.model_flops == pytest.approx(float(np.mean(useful.total)) * mb * (1 + bwd))
    whole_rows = flops.backbone_forward(arch, lengths)
    assert llm.model_flops < float(np.mean(whole_rows.total)) * mb * (1 + bwd)
    # the priced work: the padding after a microbatch's shorter rows is one more document
    padded = microbatch_lengths(lengths, mb)
    assert llm.fwd_work.attention == pytest.approx(float(np.mean(flops.backbone_attention(
        arch, microbatch_squares(drawn, mb, packed=True)))) * mb)
    assert llm.fwd_work.attention < float(np.mean(flops.backbone_attention(
        arch, padded ** 2))) * mb


def test_unpacked_samples_are_priced_as_one_document_each():
    from dtdsl.cost.samples import attention_squares, microbatch_squares

    plain = program("mllm_9b")
    cost = build_cost_model(plain)
    drawn = draw_samples(plain, cost.params.samples, cost.params.seed)
    assert drawn.doc_squares is None
    lengths = positions(drawn).astype(float)
    assert np.array_equal(attention_squares(drawn), lengths ** 2)
    mb = 3
    padded = microbatch_lengths(lengths, mb)
    assert np.array_equal(microbatch_squares(drawn, mb, packed=False), padded ** 2)
    arch = plain.backbone.arch
    llm = cost.unit("llm")
    assert llm.model_attention_flops == pytest.approx(
        float(np.mean(flops.backbone_forward(arch, lengths).attention)))
    # a packed microbatch's shorter row: its documents, then its padding as one more
    rows = np.array([10.0, 4.0])
    from dtdsl.cost.samples import SampleSet

    two = SampleSet(text_tokens=rows.astype(np.int64), items={},
                    doc_squares=np.array([50.0, 16.0]))
    assert microbatch_squares(two, 2, packed=True).tolist() == [(50 + 16 + 36) / 2]


def test_the_end_of_a_step_averages_tp_replicated_gradients_over_tp():
    """A unit at tp > 1 pays one all-reduce of its TP-replicated parameters' fp32
    gradients (their DP shards under ZeRO-1) over its TP group on the TP link, as
    ``train.stage`` does; none at tp 1 nor for a Llama backbone (its norms are FSDP2's);
    a unit replicated whole over a TP group averages all of its trained parameters."""
    from dtdsl.cost.model import all_reduce_time_s

    model = build_cost_model(program("mllm_9b"))
    bw = model.program.cluster.intra_node_bw_bytes_per_s
    for name in ("vit", "sd"):
        unit = model.unit(name)
        module = model.program.module(name)
        projectors = sum(flops.projector_params(p.arch) + flops.compression_params(p)
                         for p in model.program.projectors
                         if name in (p.source, p.target) and not p.frozen)
        trained = 0.0 if module.frozen else flops.tp_synced_params(module)
        assert unit.tp_synced_params == trained + projectors
        assert 0 < unit.tp_synced_params < unit.params
        tp, dp, pp = 4, 2, 1
        base = model._dp_sync_coefficients(unit, tp, dp)
        fixed, layer = model.tp_sync_coefficients(unit, tp, dp)
        total = fixed + layer * unit.layers
        assert total == pytest.approx(all_reduce_time_s(unit.tp_synced_params * 4 / dp, tp, bw))
        assert model.dp_sync_time_s(unit, tp, pp, dp) == pytest.approx(
            base[0] + base[1] * unit.layers + total)
        assert model.tp_sync_coefficients(unit, 1, dp) == (0.0, 0.0)
        # Replicated whole over a TP group of 4, costed at tp 1: every trained parameter.
        fixed, layer = model.tp_sync_coefficients(unit, 1, dp, replicated_over=4)
        assert fixed + layer * unit.layers == pytest.approx(
            all_reduce_time_s(unit.trainable_params * 4 / dp, 4, bw))
    llm = model.unit("llm")
    assert llm.tp_synced_params == 0
    assert model.tp_sync_coefficients(llm, 8, 2) == (0.0, 0.0)


def test_scalar_questions_are_answered_from_the_memo_as_computed():
    """``CostModel``'s memory and synchronisation answers for scalar arguments are kept
    (the planner asks them again for every placement): the same values as a fresh model's,
    and array arguments computed as arrays."""
    import numpy as np

    from dtdsl.cost.model import build_cost_model
    from tests.helpers.planning import program

    spec = program("mllm_9b")
    warm, fresh = build_cost_model(spec), build_cost_model(spec)
    unit = warm.unit("llm")
    args = (unit, 2, 4, 8, 1, 4, 16, 1.0)
    first = warm.memory_bytes(*args)
    assert warm.memory_bytes(*args) == first == build_cost_model(spec).memory_bytes(
        fresh.unit("llm"), *args[1:])
    assert warm.dp_sync_time_s(unit, 2, 4, 8) == fresh.dp_sync_time_s(fresh.unit("llm"), 2, 4, 8)
    many = warm.memory_bytes(unit, 2, np.array([4, 8]), 8, 1, 4, 16, 1.0)
    assert isinstance(many, np.ndarray) and many[0] == first
