"""FLOPs and parameters of each architecture, by kind of work.

Every count is of one forward pass, 2 FLOPs per multiply-accumulate. Work is
kept by kind (``matmul``, ``attention``, ``conv``) because GPUs reach different
fractions of their peak on each (see ``dtdsl.cost.model``).

Attention convention: the backbone's attention is causal and counted as half of
full attention (what FlashAttention computes); encoders and generators attend
bidirectionally. A packed sequence's documents attend only within themselves, so its
attention is the sum over its documents (``backbone_attention``: k documents of length
L cost k attn(L), not attn(kL)), and that is all MFU counts. MFU in dtdsl uses the same
counts, so it is comparable to Megatron-LM's only after adding back the masked half of the
backbone's attention
(``backbone_flops_megatron`` gives Megatron's full-attention figure for checks).

Backward passes: a trainable module costs 2x its forward (input and weight
gradients); a frozen module whose input needs a gradient (a generator or a
backbone fed by trainable modules) costs 1x (input gradients only); a frozen
module with nothing trainable upstream costs nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from dtdsl.ir import program as ir

__all__ = [
    "UNetOp", "Work", "backbone_attention", "backbone_ends_params", "backbone_flops_megatron",
    "backbone_forward", "backward_factor", "compression_forward", "compression_params",
    "dit_forward", "encoder_ends_params", "encoder_item_forward", "encoder_tokens",
    "expert_params", "moe_dispatch_elements_per_token", "moe_layer_params",
    "moe_mlp_per_token",
    "LM_LOSS_CHUNK_BYTES", "input_needs_grad", "lm_loss_chunk_rows", "mlp_forward_per_token",
    "module_params",
    "projector_params", "tp_synced_params", "transformer_layer_matmul_per_token",
    "transformer_layer_params", "unet_forward", "unet_ops",
]


@dataclass(frozen=True)
class Work:
    """FLOPs by kind."""

    matmul: float = 0.0
    attention: float = 0.0
    conv: float = 0.0

    @property
    def total(self) -> float:
        return self.matmul + self.attention + self.conv

    def __add__(self, other: Work) -> Work:
        return Work(self.matmul + other.matmul, self.attention + other.attention,
                    self.conv + other.conv)

    def __mul__(self, k: float) -> Work:
        return Work(self.matmul * k, self.attention * k, self.conv * k)

    __rmul__ = __mul__


# ---- transformers ------------------------------------------------------------------------

def _attention_width(arch: ir.TransformerArch) -> int:
    """The queries' width: heads x head width (``hidden`` unless the head width is set)."""
    return arch.heads * arch.head_dim


def transformer_layer_matmul_per_token(arch: ir.TransformerArch) -> float:
    """Projection and MLP FLOPs of one layer for one token: Q and O (h x heads d), K and
    V (h x kv_heads d, grouped-query attention), the MLP (2 or, with SwiGLU, 3 matrices).
    An MoE backbone's layers on average (``moe_mlp_per_token``: its MoE layers' router,
    ``top_k`` experts and shared expert in place of the MLP)."""
    h, f, d = arch.hidden, arch.ffn, arch.head_dim
    qkvo = 2 * h * d * (2 * arch.heads + 2 * arch.kv_heads)
    mlp = 2 * h * f * (3 if arch.swiglu else 2)
    return qkvo + _layers_mean(arch, mlp, moe_mlp_per_token(arch))


def _layers_mean(arch: ir.TransformerArch, dense: float, moe: float) -> float:
    """The mean over the layers of a per-layer figure: ``moe`` on the MoE layers, ``dense``
    on the others (all of them without experts)."""
    if arch.moe is None:
        return dense
    n = arch.moe.num_moe_layers(arch.layers)
    return (n * moe + (arch.layers - n) * dense) / arch.layers


def moe_mlp_per_token(arch: ir.TransformerArch) -> float:
    """An MoE layer's feed-forward FLOPs for one token (0 without experts): the router
    (h x E), its ``top_k`` SwiGLU experts and the shared expert (3 matrices each; the
    shared expert's sigmoid gate h x 1). What a token costs, not what the layer holds:
    FLOPs count the active parameters."""
    moe = arch.moe
    if moe is None:
        return 0.0
    h = arch.hidden
    return 2 * h * moe.experts + 2 * h * 3 * (moe.top_k * moe.ffn + moe.shared_ffn) + \
        (2 * h if moe.shared_gate else 0)


def moe_layer_params(arch: ir.TransformerArch) -> tuple[float, float]:
    """(routed experts', the rest's) parameters of an MoE layer's feed-forward block: all
    ``experts`` (memory counts every parameter), and the router, shared expert and gate."""
    moe = arch.moe
    if moe is None:
        return 0.0, 0.0
    h = arch.hidden
    return 3.0 * h * moe.ffn * moe.experts, \
        float(h * moe.experts + 3 * h * moe.shared_ffn + (h if moe.shared_gate else 0))


def expert_params(module: ir.Module) -> float:
    """The routed experts' parameters of a module over all its layers (0 without experts):
    what expert parallelism divides."""
    arch = module.arch
    if not isinstance(arch, ir.TransformerArch) or arch.moe is None:
        return 0.0
    return arch.moe.num_moe_layers(arch.layers) * moe_layer_params(arch)[0]


def moe_dispatch_elements_per_token(arch: ir.TransformerArch) -> float:
    """Elements one token sends to its experts in one all-to-all of expert parallelism,
    over all MoE layers: ``top_k`` rows of ``hidden`` per MoE layer (the combine brings
    as many back; 0 without experts)."""
    moe = arch.moe
    if moe is None:
        return 0.0
    return moe.num_moe_layers(arch.layers) * moe.top_k * arch.hidden


def _attention(seq: float, hidden: int, causal: bool) -> float:
    """Scores (Q K^T) and their application to V for one sequence, all heads."""
    return _attention_of_squares(seq * seq, hidden, causal)


def _attention_of_squares(squares, hidden: int, causal: bool):
    full = 4.0 * squares * hidden
    return full / 2 if causal else full


def _norm_params(arch: ir.TransformerArch, role: str) -> int:
    return arch.hidden * (1 if arch.norm_kind(role) == "rms" else 2)


def transformer_layer_params(arch: ir.TransformerArch, role: str = "encoder") -> float:
    """One layer's parameters: projections (and their biases where the architecture has
    them), the MLP, two norms (RMSNorm: a weight; LayerNorm: a weight and a bias)."""
    h, f, d = arch.hidden, arch.ffn, arch.head_dim
    q, kv = arch.heads * d, arch.kv_heads * d
    attn = 2 * h * q + 2 * h * kv
    if arch.qkv_bias:
        attn += q + kv
    if arch.qkv_bias if arch.k_bias is None else arch.k_bias:
        attn += kv              # Whisper's key projection has no bias (``k_bias``)
    if arch.out_bias:
        attn += h
    if arch.qk_norm:
        attn += 2 * d           # one RMSNorm weight for the query heads, one for the keys
    mats = 3 if arch.swiglu else 2
    mlp = mats * h * f + ((mats - 1) * f + h if arch.mlp_bias else 0)
    experts, rest = moe_layer_params(arch)
    return attn + _layers_mean(arch, mlp, experts + rest) + 2 * _norm_params(arch, role)


def encoder_tokens(arch: ir.TransformerArch, patches: float) -> float:
    """The rows an encoder's layers run on for an item of ``patches`` patches (its class
    token included)."""
    return patches + (1 if arch.cls_token else 0)


def encoder_item_forward(arch: ir.TransformerArch, tokens: float) -> Work:
    """A ViT-style encoder on one item of ``tokens`` rows (``encoder_tokens``): patch
    embedding (a video's patches span ``temporal_patch`` frames, an audio frame stem's
    inputs are whole fbank frames, ``TransformerArch.patch_dim``; Whisper's stem is two
    kernel-3 convolutions, over ``2 * tokens`` frames of ``in_channels`` mel bins and, at
    stride 2, over ``tokens``), then every layer with bidirectional attention over the
    item."""
    if arch.stem == "whisper_conv":
        mel = arch.in_channels or 80
        embed = 2 * (2 * tokens) * 3 * mel * arch.hidden + 2 * tokens * 3 * arch.hidden ** 2
    else:
        embed = 2 * tokens * arch.patch_dim * arch.hidden
    layers = arch.layers * (tokens * transformer_layer_matmul_per_token(arch))
    attention = arch.layers * _attention(tokens, _attention_width(arch), causal=False)
    return Work(matmul=embed + layers, attention=attention)


def backbone_attention(arch: ir.TransformerArch, squares):
    """The backbone's forward attention FLOPs (all layers) on one sequence whose documents'
    lengths squared add up to ``squares`` (a sequence of one document: its length
    squared): each document attends only within itself. Every price of the backbone's
    attention (cost model, simulator, MFU) is this function of a sequence's documents."""
    return arch.layers * _attention_of_squares(squares, _attention_width(arch), arch.causal)


def backbone_forward(arch: ir.TransformerArch, seq_len, squares=None) -> Work:
    """The LLM on one sequence of ``seq_len`` positions, with its output head; its
    attention over documents whose lengths squared add up to ``squares``
    (``backbone_attention``; default ``seq_len ** 2``, one document). Arrays broadcast."""
    layers = arch.layers * seq_len * transformer_layer_matmul_per_token(arch)
    head = 2 * seq_len * arch.hidden * arch.vocab
    squares = seq_len * seq_len if squares is None else squares
    return Work(matmul=layers + head, attention=backbone_attention(arch, squares))


def backbone_flops_megatron(arch: ir.TransformerArch, seq_len: int, batch: int) -> float:
    """Megatron-LM's forward+backward FLOPs per iteration (full attention counted):
    12 B s L h^2 (1 + (f/h) k + g/a + s/h + V / (2 L h)), k = 1.5 with SwiGLU else 1."""
    h, L = arch.hidden, arch.layers
    k = 1.5 if arch.swiglu else 1.0
    return 12 * batch * seq_len * L * h * h * (
        1 + arch.ffn / h * k + arch.kv_heads / arch.heads + seq_len / h
        + arch.vocab / (2 * L * h))


# ---- U-Net ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class UNetOp:
    """One weighted operation of a U-Net forward pass on one image."""

    kind: str          # "conv", "linear" or "attention"
    params: float      # weights and biases
    flops: float
    out_elements: float  # size of its output (activation memory)
    level: int
    tp_sharded: float = 0.0  # of ``params``, those tensor parallelism shards (``parallel.tp``)


def _conv(cin: int, cout: int, k: int, res: int, level: int) -> UNetOp:
    return UNetOp("conv", k * k * cin * cout + cout, 2.0 * k * k * cin * cout * res * res,
                  cout * res * res, level)


def _linear(din: int, dout: int, tokens: float, level: int, bias: bool = True,
            tp: str = "") -> UNetOp:
    """``tp``: "col" for a column-parallel projection (weight and bias sharded), "row" for
    a row-parallel one (its weight sharded, its bias replicated), "" for a replicated one."""
    params = din * dout + (dout if bias else 0)
    sharded = {"": 0, "col": params, "row": din * dout}[tp]
    return UNetOp("linear", params, 2.0 * din * dout * tokens, dout * tokens, level, sharded)


def _pointwise_conv(cin: int, cout: int, tokens: float, level: int) -> UNetOp:
    """A 1x1 convolution over ``tokens`` pixels (SD 1.x's proj_in/proj_out)."""
    return UNetOp("conv", cin * cout + cout, 2.0 * cin * cout * tokens, cout * tokens, level)


def _res_block(cin: int, cout: int, res: int, emb: int, level: int) -> Iterator[UNetOp]:
    yield UNetOp("linear", 2 * cin, 0.0, cin * res * res, level)   # GroupNorm (scale, shift)
    yield _conv(cin, cout, 3, res, level)
    yield _linear(emb, cout, 1, level)                              # timestep embedding
    yield UNetOp("linear", 2 * cout, 0.0, cout * res * res, level)  # GroupNorm
    yield _conv(cout, cout, 3, res, level)
    if cin != cout:
        yield _conv(cin, cout, 1, res, level)                       # skip connection


def _spatial_transformer(ch: int, res: int, arch: ir.UNetArch, cond_tokens: int,
                         level: int) -> Iterator[UNetOp]:
    """GroupNorm, proj_in (linear in SD 2.x, a 1x1 convolution in SD 1.x),
    `transformer_depth` blocks of self-attention, cross-attention to the conditioning and
    a GEGLU MLP, proj_out."""
    n = res * res
    m = cond_tokens
    ctx = arch.context_dim
    proj = _linear if arch.linear_proj else _pointwise_conv
    yield UNetOp("linear", 2 * ch, 0.0, ch * n, level)
    yield proj(ch, ch, n, level)
    for _ in range(arch.transformer_depth):
        yield UNetOp("linear", 6 * ch, 0.0, 3 * ch * n, level)     # three LayerNorms
        for _ in range(3):
            yield _linear(ch, ch, n, level, bias=False, tp="col")   # self-attention q, k, v
        yield UNetOp("attention", 0, 4.0 * n * n * ch, ch * n, level)
        yield _linear(ch, ch, n, level, tp="row")                   # out
        yield _linear(ch, ch, n, level, bias=False, tp="col")       # cross-attention q
        yield _linear(ctx, ch, m, level, bias=False, tp="col")      # k, v from the conditioning
        yield _linear(ctx, ch, m, level, bias=False, tp="col")
        yield UNetOp("attention", 0, 4.0 * n * m * ch, ch * n, level)
        yield _linear(ch, ch, n, level, tp="row")
        yield _linear(ch, 8 * ch, n, level, tp="col")               # GEGLU
        yield _linear(4 * ch, ch, n, level, tp="row")
    yield proj(ch, ch, n, level)                                    # proj_out


def unet_ops(arch: ir.UNetArch, cond_tokens: int = 77) -> list[UNetOp]:
    """The operations of one forward pass, built the way Stable Diffusion builds its U-Net."""
    c0 = arch.channels
    emb = 4 * c0
    res = arch.latent
    ops = [_conv(arch.latent_channels, c0, 3, res, 0),
           _linear(c0, emb, 1, 0), _linear(emb, emb, 1, 0)]         # conv_in, time embedding
    skips = [c0]
    ch = c0
    levels = len(arch.mult)
    for level, mult in enumerate(arch.mult):
        for _ in range(arch.res_blocks):
            ops += _res_block(ch, c0 * mult, res, emb, level)
            ch = c0 * mult
            if 2 ** level in arch.attn_res:
                ops += _spatial_transformer(ch, res, arch, cond_tokens, level)
            skips.append(ch)
        if level != levels - 1:
            res //= 2
            ops.append(_conv(ch, ch, 3, res, level))                # strided downsample
            skips.append(ch)
    ops += _res_block(ch, ch, res, emb, levels - 1)
    ops += _spatial_transformer(ch, res, arch, cond_tokens, levels - 1)
    ops += _res_block(ch, ch, res, emb, levels - 1)
    for level in reversed(range(levels)):
        for i in range(arch.res_blocks + 1):
            ops += _res_block(ch + skips.pop(), c0 * arch.mult[level], res, emb, level)
            ch = c0 * arch.mult[level]
            if 2 ** level in arch.attn_res:
                ops += _spatial_transformer(ch, res, arch, cond_tokens, level)
            if level and i == arch.res_blocks:
                res *= 2
                ops.append(_conv(ch, ch, 3, res, level))            # upsample
    ops.append(UNetOp("linear", 2 * ch, 0.0, ch * res * res, 0))
    ops.append(_conv(ch, arch.latent_channels, 3, res, 0))          # conv_out
    return ops


def unet_forward(arch: ir.UNetArch, cond_tokens: int = 77) -> Work:
    """One image through the U-Net."""
    conv = matmul = attention = 0.0
    for op in unet_ops(arch, cond_tokens):
        if op.kind == "conv":
            conv += op.flops
        elif op.kind == "attention":
            attention += op.flops
        else:
            matmul += op.flops
    return Work(matmul=matmul, attention=attention, conv=conv)


# ---- DiT -----------------------------------------------------------------------------------------

def dit_tokens(arch: ir.DiTArch) -> int:
    return (arch.latent // arch.patch) ** 2


def dit_stage_message(arch: ir.DiTArch, targets: float) -> tuple[tuple[float, ...], ...]:
    """The shapes a DiT's pipeline stage sends the next for a microbatch of ``targets``
    generation targets, and their gradients back: the tokens ``[targets, patches,
    hidden]`` and the cross-attention context ``[targets, COND_TOKENS, context_dim]``
    every block reads. What ``train.generator`` sends and the cost model's hop prices."""
    return ((targets, dit_tokens(arch), arch.hidden),
            (targets, ir.COND_TOKENS, arch.context_dim))


def dit_forward(arch: ir.DiTArch, cond_tokens: int = 77) -> Work:
    """One image through a DiT with cross-attention: patch embedding, layers of
    self-attention, cross-attention and MLP, the final projection to patches."""
    n, h, m = dit_tokens(arch), arch.hidden, cond_tokens
    patch_dim = arch.latent_channels * arch.patch ** 2
    per_token = 2 * h * h * 4 + 2 * h * h * 2 + 2 * h * arch.ffn * 2   # self qkvo, cross q o, MLP
    per_layer = n * per_token + 2 * 2 * m * arch.context_dim * h + 2 * h * 6 * h  # cross kv, adaLN
    matmul = arch.layers * per_layer + 2 * n * patch_dim * h * 2
    attention = arch.layers * (_attention(n, h, causal=False) + 4.0 * n * m * h)
    return Work(matmul=matmul, attention=attention)


# ---- projectors, parameters, backward -------------------------------------------------------

def mlp_forward_per_token(arch: ir.MLPArch) -> float:
    if arch.depth == 1:
        return 2.0 * arch.in_dim * arch.out_dim
    return 2.0 * (arch.in_dim * arch.hidden + (arch.depth - 2) * arch.hidden ** 2
                  + arch.hidden * arch.out_dim)


def projector_params(arch: ir.MLPArch) -> float:
    """The MLP's parameters (a projector's compression adds ``compression_params``)."""
    return mlp_forward_per_token(arch) / 2


def compression_params(proj: ir.Projector) -> float:
    """The parameters of a projector's token compression (``models.mlp``): a resampler's
    queries, its four projections and two norms; pixel shuffle and pooling have none."""
    c = proj.compress
    if not isinstance(c, ir.Resampler):
        return 0.0
    w = proj.arch.in_dim
    return c.queries * w + 4 * w * w + 4 * w


def projector_total_params(proj: ir.Projector) -> float:
    """A projector's parameters: its MLP's and its compression's."""
    return projector_params(proj.arch) + compression_params(proj)


def program_params(program: ir.Program) -> float:
    """Every module's and projector's parameters: the whole model."""
    return sum(module_params(m) for m in program.modules) + \
        sum(projector_total_params(p) for p in program.projectors)


def compression_forward(proj: ir.Projector, patches: float, images: float) -> Work:
    """The forward work of a projector's token compression on ``images`` images of
    ``patches`` patches in all (the MLP after it runs on the tokens it leaves): a
    resampler's keys and values per patch, its queries and output per query and image, and
    each query's attention over the image's patches. Pixel shuffle is a reshape and pooling
    a mean: no matmul, memory-bound, nothing next to the MLP."""
    c = proj.compress
    if not isinstance(c, ir.Resampler):
        return Work()
    w = proj.arch.in_dim
    return Work(matmul=4.0 * patches * w * w + 4.0 * c.queries * images * w * w,
                attention=4.0 * c.queries * patches * w)


def encoder_ends_params(arch: ir.TransformerArch) -> float:
    """An encoder's parameters outside its layers: the patch embedding (and its bias), or
    Whisper's two convolutions with their biases (``models.audio.WhisperStem``), the class
    token, learned positions, the pre- and post-norm."""
    h = arch.hidden
    if arch.stem == "whisper_conv":
        params = ((arch.in_channels or 80) * 3 * h + h) + (h * 3 * h + h)
    else:
        params = arch.patch_dim * h + (h if arch.patch_bias else 0)
    if arch.cls_token:
        params += h
    if arch.positions == "learned":
        params += (((arch.image_size or 0) // (arch.patch or 1)) ** 2 + int(arch.cls_token)) * h
    norm = _norm_params(arch, "encoder")
    return params + norm * (int(arch.pre_norm) + int(arch.post_norm))


def backbone_ends_params(arch: ir.TransformerArch) -> float:
    """A backbone's parameters outside its layers: the token embedding, the LM head (none
    of its own when tied to the embedding) and the final norm."""
    return arch.vocab * arch.hidden * (1 if arch.tie_embeddings else 2) + \
        _norm_params(arch, "backbone")


def module_params(module: ir.Module) -> float:
    """Parameters of a module, exactly those of its torch model (``dtdsl.models``)."""
    arch = module.arch
    if isinstance(arch, ir.TransformerArch):
        params = arch.layers * transformer_layer_params(arch, module.role)
        if module.role == "backbone":
            params += backbone_ends_params(arch)
        else:
            params += encoder_ends_params(arch)
        return params
    if isinstance(arch, ir.UNetArch):
        return sum(op.params for op in unet_ops(arch))
    h = arch.hidden
    per_layer = h * h * 4 + h * h * 2 + 2 * arch.context_dim * h + 2 * h * arch.ffn + 6 * h * h
    return arch.layers * per_layer + 2 * arch.latent_channels * arch.patch ** 2 * h


def tp_synced_params(module: ir.Module) -> float:
    """Parameters of ``module`` that tensor parallelism (``parallel.tp``) leaves whole on
    every TP rank and whose gradients the end of a step averages over the TP group
    (``train.stage``: nondeterministic GPU kernels would let the copies drift): everything
    but the attention and MLP blocks' column-parallel projections (weights and biases) and
    row-parallel weights, and but a backbone's norms, whose sequence-parallel gradients
    FSDP2 sums over TP itself. A unit's projectors are replicated too (count them with
    ``projector_params`` and ``compression_params``); a ``tp_replicated`` module is all
    replicated (``module_params``). ``tests/train/test_tp_sync.py`` holds this equal to
    what the runtime averages."""
    arch = module.arch
    if isinstance(arch, ir.TransformerArch):
        h = arch.hidden
        # Row-parallel biases: the attention output's and the MLP's second projection's.
        per_layer = (h if arch.out_bias else 0) + (h if arch.mlp_bias else 0)
        if module.role == "backbone":
            return arch.layers * per_layer
        return arch.layers * (per_layer + 2 * _norm_params(arch, module.role)) + \
            encoder_ends_params(arch)
    if isinstance(arch, ir.UNetArch):
        return sum(op.params - op.tp_sharded for op in unet_ops(arch))
    # DiT: each block's adaLN projection, the patch embedding and the final projection.
    return arch.layers * 6 * arch.hidden ** 2 + 2 * arch.latent_channels * arch.patch ** 2 * \
        arch.hidden


# The LM head's cross-entropy runs over chunks of rows (``models.multimodal.lm_loss``), each
# chunk's logits made, upcast to fp32 and reduced under activation checkpointing, so a
# rank never holds more than one chunk's fp32 logits (this many bytes of its vocabulary
# columns) and keeps none between a microbatch's forward and its backward. 256 MiB is 512
# rows of a 128K vocabulary on one rank (a 0.5 TFLOP head matmul at hidden 4096: still
# large enough for the GPU), 4K rows at TP 8. The memory model prices the same chunk.
LM_LOSS_CHUNK_BYTES = 256 * 2**20


def lm_loss_chunk_rows(vocab_columns: int) -> int:
    """Rows per chunk of the LM loss on a rank holding ``vocab_columns`` columns of the
    logits (the vocabulary, or its TP shard): ``LM_LOSS_CHUNK_BYTES`` of fp32 logits."""
    return max(1, LM_LOSS_CHUNK_BYTES // (4 * max(int(vocab_columns), 1)))


def input_needs_grad(program: ir.Program, module: ir.Module) -> bool:
    """Does anything feeding ``module`` train, so that its backward must produce input
    gradients? Encoders read data; the backbone's inputs need gradients when a
    projector or encoder feeding it trains; a generator's when the backbone or anything
    before it trains, or its projector does."""
    if module.role == "encoder":
        return False
    feeders = [p for p in program.projectors if p.target == module.name]
    if module.role == "backbone":
        return any(not p.frozen or not program.module(p.source).frozen for p in feeders)
    backbone = program.backbone
    return any(not p.frozen for p in feeders) or not backbone.frozen or \
        input_needs_grad(program, backbone)


def backward_factor(module: ir.Module | ir.Projector, upstream_trainable: bool) -> float:
    """Backward FLOPs as a multiple of forward FLOPs (see the module docstring)."""
    if not module.frozen:
        return 2.0
    return 1.0 if upstream_trainable else 0.0


def vae_encoder_forward(vae: ir.VAEArch, side: int) -> Work:
    """diffusers' AutoencoderKL encoder (``models.vae``) on one ``side x side`` image: its
    convolutions (3x3 unless said), the mid block's one-head attention over all positions,
    and ``quant_conv``."""
    ch, per = vae.block_out_channels, vae.layers_per_block

    def conv(res: float, cin: int, cout: int, k: int = 3) -> float:
        return 2.0 * res * res * cin * cout * k * k

    def resnet(res: float, cin: int, cout: int) -> float:
        return conv(res, cin, cout) + conv(res, cout, cout) + (
            conv(res, cin, cout, 1) if cin != cout else 0.0)

    total = conv(side, vae.in_channels, ch[0])
    res, prev = float(side), ch[0]
    for i, c in enumerate(ch):
        for j in range(per):
            total += resnet(res, prev if j == 0 else c, c)
        prev = c
        if i < len(ch) - 1:
            res /= 2
            total += conv(res, c, c)          # the stride-2 downsampling conv
    c = ch[-1]
    total += 2 * resnet(res, c, c) + conv(res, c, 2 * vae.latent_channels)
    if vae.quant_conv:
        total += conv(res, 2 * vae.latent_channels, 2 * vae.latent_channels, 1)
    n = res * res
    matmul = 4 * 2.0 * n * c * c if vae.mid_attention else 0.0
    attention = 2 * 2.0 * n * n * c if vae.mid_attention else 0.0
    return Work(matmul=matmul, attention=attention, conv=total)
