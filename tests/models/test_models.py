"""The torch models: parameter counts against the analytic model, forward and backward
on the tiny spec, tensor-parallel shards."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch

from dtdsl.cost import flops
from dtdsl.driver import run_frontend
from dtdsl.ir import program as ir
from dtdsl.models import (
    Backbone,
    DiT,
    Encoder,
    build_layer,
    build_module,
    build_projector,
)

ROOT = Path(__file__).resolve().parents[2]
SPECS = sorted(p.name for p in (ROOT / "specs").glob("*.dt"))


@cache
def load(name: str) -> ir.Program:
    path = ROOT / "specs" / name
    result = run_frontend(str(path), path.read_bytes())
    assert result.ok, [d.message for d in result.diagnostics]
    return result.program



def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("spec", SPECS)
def test_param_counts_match_the_analytic_model(spec):
    program = load(spec)
    with torch.device("meta"):   # the 70B backbone costs nothing here
        for module in program.modules:
            model = build_module(module)
            assert num_params(model) == flops.module_params(module), module.name
        for proj in program.projectors:
            assert num_params(build_projector(proj)) == flops.projector_params(proj.arch)


def test_known_models_have_their_published_sizes():
    program = load("mllm_9b.dt")
    with torch.device("meta"):
        assert num_params(build_module(program.module("sd"))) == 865_910_724    # SD 2.1 U-Net
        assert num_params(build_module(program.backbone)) == 8_030_261_248      # Llama 3 8B


def test_tiny_modules_train_on_cpu():
    program = load("tiny_cpu.dt")
    torch.manual_seed(0)
    vit, llm, gen = (build_module(m) for m in program.modules)

    images = torch.randn(2, 3, 32, 32)
    out = vit(images)
    assert out.shape == (2, 16, 64)
    out.square().mean().backward()

    tokens = torch.randint(0, 512, (2, 32))
    logits = llm(tokens)
    assert logits.shape == (2, 32, 512)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    assert llm.hidden_states(tokens).shape == (2, 32, 128)

    latent = torch.randn(3, 4, 8, 8)
    context = torch.randn(3, 77, 64, requires_grad=True)
    noise = gen(latent, torch.randint(0, 1000, (3,)), context)
    assert noise.shape == latent.shape
    noise.square().mean().backward()
    assert context.grad is not None and context.grad.abs().sum() > 0

    for model in (vit, llm, gen):
        assert all(p.grad is not None for p in model.parameters())

    vit_to_llm, llm_to_gen = (build_projector(p) for p in program.projectors)
    assert vit_to_llm(out.detach()).shape == (2, 16, 128)
    assert llm_to_gen(torch.randn(2, 5, 128)).shape == (2, 5, 64)


def test_causal_backbone_ignores_the_future():
    program = load("tiny_cpu.dt")
    torch.manual_seed(0)
    llm = build_module(program.backbone).eval()
    tokens = torch.randint(0, 512, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 512
    with torch.no_grad():
        a, b = llm(tokens), llm(changed)
    torch.testing.assert_close(a[0, :8], b[0, :8])
    assert not torch.allclose(a[0, 8:], b[0, 8:])


def test_patchify_flattens_patches():
    images = torch.arange(2 * 3 * 16 * 16, dtype=torch.float32).reshape(2, 3, 16, 16)
    patches = Encoder.patchify(images, 8)
    assert patches.shape == (2, 4, 3 * 64)
    assert torch.equal(patches[0, 1].reshape(3, 8, 8), images[0, :, :8, 8:])


def test_dit_forward_backward_and_params():
    arch = ir.DiTArch(layers=2, hidden=64, heads=4, ffn=128, patch=2, latent=8,
                      latent_channels=4, context_dim=32)
    module = ir.Module(name="dit", role="generator", modality="image", arch=arch,
                       span=load("tiny_cpu.dt").modules[0].span)
    torch.manual_seed(0)
    model = build_module(module)
    assert isinstance(model, DiT)
    assert num_params(model) == flops.module_params(module)
    latent = torch.randn(2, 4, 8, 8)
    out = model(latent, torch.tensor([3, 700]), torch.randn(2, 7, 32))
    assert out.shape == latent.shape
    out.sum().backward()
    shard = build_module(module, tp=2)
    assert shard(latent, torch.tensor([3, 700]), torch.randn(2, 7, 32)).shape == latent.shape
    layer_params = num_params(build_layer(module))
    assert num_params(build_layer(module, tp=2)) == pytest.approx(layer_params / 2, rel=0.05)


@pytest.mark.parametrize("name", ["vit", "llm"])
def test_a_tp2_layer_holds_half_the_weights(name):
    module = load("tiny_cpu.dt").module(name)
    h = module.arch.hidden
    norms = 4 * h if module.role == "encoder" else 2 * h   # replicated on every rank
    full, half = num_params(build_layer(module)), num_params(build_layer(module, tp=2))
    assert half == (full - norms) / 2 + norms


def test_tp2_shards_run_with_full_width_outputs():
    program = load("tiny_cpu.dt")
    torch.manual_seed(0)
    vit, llm, gen = (build_module(m, tp=2) for m in program.modules)
    assert vit(torch.randn(1, 3, 32, 32)).shape == (1, 16, 64)
    layer = build_layer(program.backbone, tp=2)
    h = torch.randn(1, 10, 128, requires_grad=True)
    layer(h).sum().backward()
    assert h.grad.shape == h.shape
    assert isinstance(llm, Backbone) and llm.vocab_shard == 256
    assert llm(torch.randint(0, 512, (1, 10))).shape == (1, 10, 256)   # the local vocab slice
    # Attention and GEGLU weights are halved; convolutions and norms are replicated.
    full = build_module(program.module("gen"))
    split = sum(p.numel() for n, p in full.named_parameters()
                if n.rsplit(".", 2)[-2] in ("wq", "wk", "wv", "value", "gate")
                or n.endswith((".wo.weight", ".ff.out.weight")))
    assert num_params(gen) == num_params(full) - split // 2
    latent = torch.randn(2, 4, 8, 8)
    gen(latent, torch.tensor([1, 2]), torch.randn(2, 77, 64)).sum().backward()


def test_vocab_parallel_embedding_zeroes_tokens_it_does_not_own():
    llm = build_module(load("tiny_cpu.dt").backbone, tp=2)
    out = llm.embed(torch.tensor([[0, 255, 256, 511]]))
    assert out[0, :2].abs().sum() > 0
    assert torch.equal(out[0, 2:], torch.zeros(2, 128))


def test_unsplittable_tp_and_unsupported_layers_are_refused():
    program = load("mllm_9b.dt")
    with pytest.raises(ValueError, match="5 attention heads at level 0"):
        build_module(program.module("sd"), tp=2)
    with pytest.raises(ValueError, match="32 attention heads"):
        build_layer(program.backbone, tp=3)
    with pytest.raises(ValueError, match="whole module"):
        build_layer(program.module("sd"))


# ---- rotary embeddings looked up once per forward ------------------------------------------

@pytest.mark.parametrize("rope", [
    ir.RoPE(),
    ir.RoPE(scaling="llama3", factor=8.0, original_max_positions=64),
    ir.RoPE(scaling="yarn", factor=4.0, original_max_positions=64),
], ids=["default", "llama3", "yarn"])
def test_the_rotary_table_rotates_as_apply_rotary(rope):
    from dtdsl.models.rope import RotaryTable, apply_rotary

    torch.manual_seed(0)
    q, k = torch.randn(2, 37, 4, 16), torch.randn(2, 37, 2, 16)
    table = RotaryTable(rope, 16)
    # positions 0..S-1, after a shorter row built a smaller table (grown, not stale)
    table.rotation(None, 5, q.device)
    got = table.rotation(None, 37, q.device).apply(q, k)
    want = apply_rotary(q, k, torch.arange(37), rope)
    # The same float32 angles; cos/sin of one value may differ by an ulp between a
    # vectorised and a scalar lane, hence a tolerance of a few float32 ulps.
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    # packed documents: positions restart per document, per row
    positions = torch.tensor([list(range(20)) + list(range(17)),
                              list(range(37))])
    got = table.rotation(positions, 37, q.device).apply(q.bfloat16(), k.bfloat16())
    want = apply_rotary(q.bfloat16(), k.bfloat16(), positions, rope)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g, w, rtol=1e-2, atol=1e-2)


def test_a_backbone_forward_builds_its_rotary_table_once():
    from dtdsl.models import rope as rope_module

    arch = ir.TransformerArch(layers=3, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64,
                              swiglu=True, causal=True, rope=ir.RoPE())
    model = Backbone(arch)
    calls = []
    original = rope_module.inverse_frequencies

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    rope_module.inverse_frequencies = counted
    try:
        tokens = torch.randint(0, 64, (2, 9))
        model(tokens)
        model(tokens[:, :7])
    finally:
        rope_module.inverse_frequencies = original
    assert len(calls) == 1      # one table for both forwards and every layer


@pytest.mark.parametrize("kind", ["unet", "dit"])
def test_a_padded_masked_context_conditions_as_the_unpadded_one(kind):
    # models.multimodal pads every target's conditioning to COND_TOKENS rows and masks the
    # padding out of the cross-attention: each target's prediction (and its gradients)
    # equals the prediction on its own unpadded context (fp32; the mask removes the padded
    # keys exactly, the softmax's sums differ only in rounding order).
    from dtdsl.models.attention import key_bias

    program = load("tiny_cpu.dt")
    module = next(m for m in program.modules if m.role == "generator")
    if kind == "dit":
        arch = ir.DiTArch(layers=2, hidden=64, heads=4, ffn=128, patch=2, latent=8,
                          latent_channels=4, context_dim=module.arch.context_dim)
        module = module.model_copy(update={"arch": arch})
    torch.manual_seed(0)
    model = build_module(module).double()
    with torch.no_grad():   # no zero-initialised gate or output (DiT's adaLN-Zero)
        for p in model.parameters():
            p.normal_(0, 0.2)
    size = module.arch.latent
    rows, width = (3, ir.COND_TOKENS), module.arch.context_dim
    latent = torch.randn(2, module.arch.latent_channels, size, size, dtype=torch.float64)
    steps = torch.tensor([5, 600])
    context = torch.randn(2, rows[1], width, dtype=torch.float64, requires_grad=True)
    keep = torch.arange(rows[1])[None] < torch.tensor(rows)[:, None]
    # the padded rows hold garbage: the mask alone must keep them out
    padded = torch.where(keep[..., None], context, torch.full_like(context, 1e3))
    both = model(latent, steps, padded, key_bias(keep, torch.float64))
    both.square().sum().backward()
    grad = context.grad.clone()
    for i, n in enumerate(rows):
        context.grad = None
        alone = model(latent[i:i + 1], steps[i:i + 1], context[i:i + 1, :n])
        torch.testing.assert_close(both[i:i + 1], alone, rtol=1e-10, atol=1e-10)
        alone.square().sum().backward()
        torch.testing.assert_close(grad[i, :n], context.grad[i, :n], rtol=1e-9, atol=1e-9)
        assert not grad[i, n:].any()
