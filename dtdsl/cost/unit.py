"""What the cost model knows of each unit (``UnitCost``) and how it is built from a
module, its projectors and the drawn samples (``unit_cost``): FLOPs per microbatch,
parameters, activation bytes, the sizes a profile is queried at; and the knobs
(``Efficiency``, ``CostParams``). ``cost.model``'s docstring says what they feed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from dtdsl.cost import flops
from dtdsl.cost.samples import (
    SampleSet,
    attention_squares,
    item_key,
    microbatch_lengths,
    microbatch_squares,
    positions,
)
from dtdsl.ir import program as ir

_BYTES_BF16 = 2                 # an activation's bytes (bf16 training)


@dataclass(frozen=True)
class Efficiency:
    """The fraction of the GPU's dense peak that each kind of work reaches.

    Defaults are what large bf16 GEMMs, FlashAttention and cuDNN convolutions reach
    on H100-class GPUs in practice; `dtc profile` measures the real thing.
    """

    matmul: float = 0.70
    attention: float = 0.50
    conv: float = 0.45


@dataclass(frozen=True)
class CostParams:
    efficiency: Efficiency = field(default_factory=Efficiency)
    samples: int = 4096        # synthetic samples drawn to take expectations
    seed: int = 0
    # The backbone pads every microbatch to ``seq_len`` rather than to its longest sequence:
    # Megatron-LM's LLaVA under pipeline parallelism (``planner.baseline``).
    pad_to_seq_len: bool = False


@dataclass(frozen=True)
class ProfileQuery:
    """What one module or projector of a unit sees per backbone microbatch, in the
    profile's terms: on average ``weights[j]`` passes of size ``sizes[j]`` (see
    ``dtdsl.cost.profile`` for what a size means per role)."""

    name: str
    sizes: tuple[float, ...]
    weights: tuple[float, ...]

    @staticmethod
    def of(name: str, values: np.ndarray, per: float) -> ProfileQuery:
        """Passes of the sizes in ``values``, ``per`` of them per microbatch on average
        spread as ``values`` are."""
        sizes, counts = np.unique(np.asarray(values, dtype=float), return_counts=True)
        keep = sizes > 0
        weights = counts[keep] / max(len(values), 1) * per
        return ProfileQuery(name, tuple(float(x) for x in sizes[keep]),
                            tuple(float(w) for w in weights))


@dataclass(frozen=True)
class UnitCost:
    """Everything the planner needs to know about one unit."""

    name: str
    role: str
    layers: int                      # what pipeline parallelism splits
    params: float                    # module and co-located projectors
    extra_stage_params: float        # embeddings, heads, projectors: on one stage
    trainable_params: float          # those that get gradients and optimizer state
    backward_factor: float
    recompute: ir.Recompute
    fwd_work: flops.Work             # per backbone microbatch, whole unit (expected)
    model_flops: float               # fwd + bwd FLOPs per backbone microbatch, for MFU
    act_bytes_per_layer: float       # per backbone microbatch, tp = 1, a large one (99th pct)
    act_bytes_per_layer_tp_split: float  # the part of it that TP divides
    act_peak_ratio: float            # that large microbatch over the mean one (>= 1)
    tp_comm_bytes: float             # all-reduced bytes per microbatch, forward, all layers
    boundary_bytes: float            # activations leaving the unit per microbatch
    queries: tuple[ProfileQuery, ...] = ()   # for a measured profile: module, projectors
    first_stage_params: float = 0.0  # of extra_stage_params, those on the first stage (the
                                     # embedding); the rest sit on the last (head, projector)
    peak_items: float = 0.0          # a large microbatch's tokens (backbone: text, encoder:
                                     # image tokens) or generation targets (generator)
    recompute_layer_bytes: float = 0.0       # with recompute: one layer's activations, made
    recompute_layer_bytes_tp_split: float = 0.0  # again in backward (and what TP divides)
    last_stage_act_bytes: float = 0.0        # kept on the last stage outside the layers
    last_stage_act_bytes_tp_split: float = 0.0   # (an encoder's projector), like act_bytes
    selective_work: flops.Work = flops.Work()  # of fwd_work, the attention cores' (what
                                     # selective recomputation runs again in backward)
    tied_head_params: float = 0.0    # a tied LM head: the embedding again on the last stage
                                     # when the first is another (pp > 1)
    frozen_fwd_work: flops.Work = flops.Work()   # forward only, whole on every TP rank:
                                     # a generator's VAE encoder on its targets
    model_attention_flops: float = 0.0   # a backbone's forward attention FLOPs per
                                     # microbatch as model_flops counts them (causal: half)
    tp_synced_params: float = 0.0    # trained parameters TP leaves replicated whose
                                     # gradients a step averages over TP (flops.tp_synced_params)
    tp_synced_extra_params: float = 0.0  # of those, the ones outside the layers (one stage)
    # Context parallelism: the degree, the module's method (``ir.plan.cp_split``) and what
    # its collectives move per layer: mean tokens a backbone microbatch runs through the
    # layers, and the elements per token of Q (and of the attention output) and of K (V).
    cp: int = 1
    cp_method: str = "ring"
    cp_tokens: float = 0.0
    cp_q_width: float = 0.0
    cp_kv_width: float = 0.0
    # Expert parallelism (an MoE backbone): the degree, the routed experts' parameters over
    # all layers (``flops.expert_params``: what ep divides), the elements a backbone
    # microbatch's tokens send in one all-to-all over all MoE layers (mean, at ep 1), and
    # the MoE layers.
    ep: int = 1
    expert_params: float = 0.0
    ep_elements: float = 0.0
    ep_layers: int = 0
    # The routed experts' GEMMs (``cost.gemm``): their forward FLOPs per microbatch (of
    # ``fwd_work.matmul``), the rows each expert gets per microbatch at ep 1 and cp 1 (its
    # tokens x top_k / experts), and an expert's (hidden, columns).
    expert_matmul: float = 0.0
    expert_rows: float = 0.0
    expert_dims: tuple[int, int] = (0, 0)
    # Forward matmul FLOPs per microbatch that every TP rank runs whole: an MoE backbone's
    # routers and shared-expert gates (each TP rank routes the whole sequence, models.moe).
    tp_whole_matmul: float = 0.0

    @property
    def held_params(self) -> float:
        """The parameters a unit's ranks hold together on one pipeline replica: its
        experts / ep."""
        return self.params - self.expert_params * (1 - 1 / self.ep)

    @property
    def trainable(self) -> bool:
        return self.trainable_params > 0

    def stage_params(self, pp):
        """Parameters on the heaviest pipeline stage (``pp`` may be an array): its share
        of the layers, plus the embeddings, heads or projectors that sit on one stage."""
        layer_params = self.held_params - self.extra_stage_params
        return layer_params / self.layers * np.ceil(self.layers / np.asarray(pp)) + \
            self.extra_stage_params + np.where(np.asarray(pp) > 1, self.tied_head_params, 0.0)


def _mlp_factor(arch: ir.TransformerArch) -> int:
    """Bytes per FFN column and token that a layer's MLP keeps for backward (bf16): the
    activation's input and output (4), SwiGLU's gate and product too (8), quick-GELU's
    sigmoid and input of its product too (6; measured with saved-tensor hooks)."""
    if arch.swiglu:
        return 8
    return 6 if arch.act == "quick_gelu" else 4


def _moe_block_bytes(arch: ir.TransformerArch) -> tuple[float, float]:
    """Bytes per token that one MoE block (``models.moe.MoE.layer_forward``) keeps for
    backward beyond its normed input (the gathered copy of it that the router, the
    experts' dispatch and the shared expert read, priced as a dense MLP's input in
    ``_transformer_activation_bytes``), bf16 activations: (all, the part TP divides).

    Measured with saved-tensor hooks (``tests/cost/test_moe.py``), per token with ``k``
    slots: the rows sorted by expert that the experts' first GEMMs keep (``2 k h``), each
    slot's SwiGLU intermediates (``8 k f``), the slots' outputs that the combine's batched
    product with the routing weights keeps (``2 k h``; placing them keeps only an index,
    ``models.moe.place_rows``);
    the router's fp32 probabilities (``4 E``); the routing weights (bf16, and with
    ``norm_topk`` their fp32 values and sum) and the int64 indices (the top-k choices,
    each slot's token and place, the token's row and sequence: ``24 k + 16``); the
    shared expert's SwiGLU (``8 s``) and its gate's output and product (``2 h + 2``). At
    ep > 1 the same (but for the regrouping's two int64 indices, ``16 k``, left out): the
    all-to-alls keep nothing, the received rows regrouped by expert are the sorted rows.
    Under TP every rank keeps all of this for the whole sequence (it routes all of it,
    ``models.moe``), but the experts' and shared expert's intermediates, which TP
    divides (their columns): the part returned second."""
    moe, h = arch.moe, arch.hidden
    k = moe.top_k
    split = 8 * k * moe.ffn + 8 * moe.shared_ffn
    routing = 4 * moe.experts + 2 * k + (4 * k + 4 if moe.norm_topk else 0) + 24 * k + 16
    gate = 2 * h + 2 if moe.shared_gate else 0
    return split + 4 * k * h + routing + gate, split


def _layers_mlp_bytes(arch: ir.TransformerArch) -> tuple[float, float]:
    """A layer's MLP bytes per token kept for backward beyond its normed input, on average
    over the layers: an MoE layer's block (``_moe_block_bytes``), the MLP's
    (``_mlp_factor`` per column) elsewhere; (all, the part TP divides)."""
    dense = _mlp_factor(arch) * arch.ffn
    if arch.moe is None:
        return dense, dense
    n = arch.moe.num_moe_layers(arch.layers)
    moe, moe_split = _moe_block_bytes(arch)
    rest = (arch.layers - n) * dense
    return (n * moe + rest) / arch.layers, (n * moe_split + rest) / arch.layers


def _transformer_activation_bytes(hidden: int, ffn: int, kv_ratio: float, mlp_factor: int,
                                  tokens: float, cross_attention: bool = False, *,
                                  rms_norm: bool = True, sequence_parallel: bool = True,
                                  mlp_bytes: tuple[float, float] | None = None
                                  ) -> tuple[float, float]:
    """Activation bytes one of the runtime's transformer layers keeps for backward (bf16
    activations), per ``tokens``: (all, the part TP divides).

    What autograd keeps in ``models.transformer`` (measured with saved-tensor hooks; no
    dropout, flash attention, so no s x s scores): each norm's saved state (RMSNorm: its
    fp32 upcast input and bf16 normalised output, 14 h bytes per token for the two;
    LayerNorm: its input, 4 h); each block's normed input, which its projections keep
    (4 h); attention's rotated queries and keys, values, output and the output
    projection's input (6 h + 4 kv h); the MLP's intermediates (``mlp_factor`` f bytes:
    SwiGLU 8 f, GELU 4 f, see ``_mlp_factor``), or ``mlp_bytes`` per token (all, the
    part TP divides) in their place (an MoE backbone's, ``_layers_mlp_bytes``).
    Tensor parallelism divides the attention and MLP internals; with sequence
    parallelism (the backbone, ``parallel.tp``) the norms' state too, while the normed
    inputs the projections keep are gathered whole on every TP rank."""
    h, f = hidden, ffn
    norms = (14 if rms_norm else 4) * h
    whole = 4 * h
    # Q, K and V: what selective recomputation drops (``_attention_core_bytes``).
    mlp, mlp_split = mlp_bytes or (mlp_factor * f, mlp_factor * f)
    whole += mlp - mlp_split
    inner = _attention_core_bytes(h, kv_ratio, 1.0) + 4 * h + mlp_split
    if cross_attention:     # its norm's input, normed input, queries, output, projection
        norms += 2 * h
        whole += 2 * h
        inner += _attention_core_bytes(h, 0.0, 1.0) + 4 * h
    split = inner + (norms if sequence_parallel else 0)
    return tokens * (norms + whole + inner), tokens * split


def _attention_core_bytes(hidden: float, kv_ratio: float, tokens: float) -> float:
    """What one attention core of a layer (``models.transformer.SelfAttention._core``:
    the Q, K and V projections, rotary positions, scaled dot-product attention) alone
    keeps for backward, per ``tokens``, bf16: the rotated queries (``hidden``) and keys
    and the values (``kv_ratio`` x ``hidden`` each; 0 for a cross-attention's, whose keys
    and values are the conditioning's, not per token). Its output stays (the output
    projection's input is a view of it); its log-sum-exp statistics (4 bytes a head) are
    left out as in ``_transformer_activation_bytes``. Selective recomputation saves this,
    all of it divided by TP."""
    return tokens * hidden * (1 + 2 * kv_ratio) * _BYTES_BF16


def _qkv_share(arch: ir.TransformerArch) -> float:
    """The Q, K and V projections' share of a layer's matmul FLOPs
    (``flops.transformer_layer_matmul_per_token``): what selective recomputation runs
    again of a unit's matmuls (the layers' share; an LM head's FLOPs are counted in the
    whole, so a backbone's is a slight overestimate)."""
    qkv = 2 * arch.hidden * arch.head_dim * (arch.heads + 2 * arch.kv_heads)
    return qkv / flops.transformer_layer_matmul_per_token(arch)


def _per_microbatch(values: np.ndarray, micro_batch: int) -> np.ndarray:
    """Sums of per-sample values over consecutive microbatches of the draw."""
    n = len(values) // micro_batch * micro_batch
    if n == 0:
        return np.array([values.sum()], dtype=float)
    return values[:n].reshape(-1, micro_batch).sum(axis=1)


def _quantile_per_microbatch(values: np.ndarray, micro_batch: int, q: float = 0.99) -> float:
    """A high quantile of the per-microbatch sum of per-sample values (memory must hold
    the large microbatches, not the average one)."""
    return float(np.quantile(_per_microbatch(values, micro_batch), q))


def _ratio(peak: float, mean: float) -> float:
    return max(peak / mean, 1.0) if mean > 0 else 1.0


@dataclass
class _Acc:
    """What a unit costs, accumulated over its module and projectors."""

    work: flops.Work = field(default_factory=flops.Work)
    frozen: flops.Work = field(default_factory=flops.Work)   # forward only (a VAE)
    model_flops: float = 0.0
    model_attention: float = 0.0  # the backbone's forward attention FLOPs in model_flops
    params: float = 0.0
    trainable_params: float = 0.0
    extra: float = 0.0            # parameters that sit on a single stage
    first: float = 0.0            # of those, the ones on the first stage
    tied: float = 0.0             # a tied head's copy on the last stage
    synced: float = 0.0           # trained parameters averaged over TP at a step's end
    synced_extra: float = 0.0     # of those, the ones outside the layers
    peak_items: float = 0.0       # a large microbatch's tokens or generation targets
    act: float = 0.0
    act_split: float = 0.0
    last_act: tuple[float, float] = (0.0, 0.0)   # UnitCost.last_stage_act_bytes, _tp_split
    act_tokens: float = 0.0       # tokens whose layer inputs recomputation keeps
    core: float = 0.0             # what a layer's attention cores alone keep (selective
                                  # recomputation drops it), like act
    core_work: flops.Work = field(default_factory=flops.Work)  # their forward, run again
    peak_ratio: float = 1.0       # the large microbatch over the mean one
    width: int = 0
    comm: float = 0.0
    ep: tuple[float, float, int] = (0.0, 0.0, 0)   # experts' parameters, elements per
                                                  # all-to-all, MoE layers
    experts: tuple[float, float, tuple[int, int]] = (0.0, 0.0, (0, 0))  # UnitCost.expert_*
    tp_whole: float = 0.0       # UnitCost.tp_whole_matmul
    cp: tuple[float, float, float] = (0.0, 0.0, 0.0)   # UnitCost.cp_tokens, _q_, _kv_width

    queries: list[ProfileQuery] = field(default_factory=list)

    def add_projector(self, proj: ir.Projector, tokens: float, upstream: bool,
                      compression: flops.Work | None = None) -> None:
        """``tokens``: what its MLP runs on; ``compression``: the work of its token
        compression before the MLP (``flops.compression_forward``)."""
        self.queries.append(ProfileQuery(proj.name, (tokens,), (1.0,)))
        w = flops.Work(matmul=flops.mlp_forward_per_token(proj.arch) * tokens) + \
            (compression or flops.Work())
        self.work = self.work + w
        self.model_flops += w.total * (1 + flops.backward_factor(proj, upstream))
        params = flops.projector_total_params(proj)
        self.params += params
        self.extra += params
        if not proj.frozen:
            self.trainable_params += params
            # Replicated under the unit's TP (``models.mlp``): averaged over it.
            self.synced += params
            self.synced_extra += params


def _backbone_cost(acc: _Acc, program: ir.Program, module: ir.Module, samples: SampleSet,
                   params: CostParams, bwd: float) -> float:
    """The backbone's part of ``_unit_cost``: ``acc`` filled from the drawn sequences; its
    boundary bytes (the hidden states a stage sends) returned."""
    train = program.train
    mb = train.micro_batch
    arch = module.arch
    # The runtime pads a microbatch to its longest sequence: compute and transfers are
    # priced at the padded lengths of the drawn microbatches, the model FLOPs (MFU) at
    # the sequences' own lengths, activation memory at seq_len (a microbatch may reach
    # it). Attention is priced per document (packed documents attend only within
    # themselves, ``flops.backbone_attention``), padded and useful alike.
    lengths = positions(samples).astype(float)
    padded = microbatch_lengths(lengths, mb)
    squares = microbatch_squares(samples, mb, packed=train.packing)
    if params.pad_to_seq_len:
        padded, squares = _padded_to_seq_len(samples, mb, train.seq_len, train.packing)
    sizes, counts = np.unique(padded, return_counts=True)
    acc.queries.append(ProfileQuery(module.name, tuple(float(x) for x in sizes),
                                    tuple(float(c) * mb / len(padded) for c in counts)))
    acc.work = _mean_work(flops.backbone_forward(arch, padded, squares)) * mb
    useful = _mean_work(flops.backbone_forward(arch, lengths,
                                               attention_squares(samples))) * mb
    acc.model_attention = useful.attention
    tokens = train.seq_len * mb
    mean_tokens = float(padded.mean()) * mb
    acc.act, acc.act_split = _transformer_activation_bytes(
        arch.hidden, arch.ffn, arch.kv_heads / arch.heads, _mlp_factor(arch),
        tokens, rms_norm=True, sequence_parallel=True, mlp_bytes=_layers_mlp_bytes(arch))
    acc.act_tokens, acc.width, acc.peak_items = tokens, arch.hidden, tokens
    acc.core = _attention_core_bytes(arch.hidden, arch.kv_heads / arch.heads, tokens)
    acc.core_work = flops.Work(matmul=acc.work.matmul * _qkv_share(arch),
                               attention=acc.work.attention)
    if arch.moe is not None:
        acc.ep = (flops.expert_params(module),
                  mean_tokens * flops.moe_dispatch_elements_per_token(arch),
                  arch.moe.num_moe_layers(arch.layers))
        acc.tp_whole = mean_tokens * acc.ep[2] * 2 * arch.hidden * (
            arch.moe.experts + (1 if arch.moe.shared_gate else 0))
        moe = arch.moe
        acc.experts = (mean_tokens * acc.ep[2] * moe.top_k * 2 * arch.hidden * 3 * moe.ffn,
                       mean_tokens * moe.top_k / moe.experts, (arch.hidden, moe.ffn))
    acc.comm = arch.layers * 2 * mean_tokens * arch.hidden * _BYTES_BF16
    acc.cp = (mean_tokens, arch.hidden, arch.hidden * arch.kv_heads / arch.heads)
    # The embedding on the first stage; the head (none of its own when tied to the
    # embedding) and the final norm on the last.
    acc.extra = flops.backbone_ends_params(arch)
    acc.first = arch.vocab * arch.hidden
    acc.tied = arch.vocab * arch.hidden if arch.tie_embeddings else 0.0
    acc.model_flops = useful.total * (1 + bwd)
    return mean_tokens * arch.hidden * _BYTES_BF16


def _encoder_cost(acc: _Acc, program: ir.Program, module: ir.Module, samples: SampleSet,
                  params: CostParams, bwd: float) -> float:
    """An encoder's part of ``_unit_cost``: ``acc`` filled from its own items and its
    projectors; its boundary bytes (the embeddings the backbone receives) returned."""
    train = program.train
    mb = train.micro_batch
    arch = module.arch
    items = samples.items[item_key(program, module)]   # its own (cost.samples)
    # The layers run on each item's patches and its class token, if it has one; the
    # projector and the backbone see the patches.
    p = flops.encoder_tokens(arch, items.sizes.astype(float))
    linear = flops.encoder_item_forward(arch, 1.0).matmul        # per token
    quadratic = flops.encoder_item_forward(arch, 1.0).attention  # per token^2
    patch_tokens = items.tokens()
    tokens = patch_tokens + items.counts * (flops.encoder_tokens(arch, 0.0))
    acc.queries.append(ProfileQuery.of(module.name, items.sizes,
                                       float(items.counts.mean()) * mb))
    acc.work = flops.Work(matmul=float(items.per_sample(linear * p).mean()) * mb,
                          attention=float(items.per_sample(quadratic * p * p).mean()) * mb)
    peak = _quantile_per_microbatch(tokens, mb)
    acc.peak_ratio = _ratio(peak, float(tokens.mean()) * mb)
    acc.act, acc.act_split = _transformer_activation_bytes(
        arch.hidden, arch.ffn, arch.kv_heads / arch.heads, _mlp_factor(arch), peak,
        rms_norm=False, sequence_parallel=False)
    acc.act_tokens, acc.width, acc.peak_items = peak, arch.hidden, peak
    acc.core = _attention_core_bytes(arch.hidden, arch.kv_heads / arch.heads, peak)
    acc.core_work = flops.Work(matmul=acc.work.matmul * _qkv_share(arch),
                               attention=acc.work.attention)
    mean_tokens = float(tokens.mean()) * mb
    acc.comm = arch.layers * 2 * mean_tokens * arch.hidden * _BYTES_BF16
    acc.cp = (mean_tokens, arch.hidden, arch.hidden * arch.kv_heads / arch.heads)
    acc.extra = flops.encoder_ends_params(arch)
    acc.first = acc.extra                       # the embeddings; projectors last
    acc.model_flops = acc.work.total * (1 + bwd)
    mean_patches = float(patch_tokens.mean()) * mb
    # The backbone's tokens of these items: their patches, or fewer where the projector
    # compresses them (``ir.program.ImageTokens``); its MLP runs on those.
    mean_out = float(items.backbone_tokens().mean()) * mb
    images = float(items.counts.mean()) * mb
    # What the last stage keeps of a large microbatch outside the layers (which full
    # recomputation does not redo): the post-norm's input, and each projector's linear
    # maps' inputs and activations' inputs, on the rows its MLP runs on (whole on every
    # TP rank: the projector is replicated over the encoder's TP, ``add_projector``).
    peak_out = peak * mean_out / max(float(tokens.mean()) * mb, 1.0)
    kept = peak * arch.hidden * _BYTES_BF16 if arch.post_norm else 0.0
    for proj in program.projectors:
        if proj.source == module.name:
            acc.add_projector(proj, mean_out, upstream=not module.frozen,
                              compression=flops.compression_forward(proj, mean_patches,
                                                                    images))
            kept += peak_out * (proj.arch.in_dim + 2 * (proj.arch.depth - 1) *
                                proj.arch.hidden) * _BYTES_BF16
    acc.last_act = (kept, 0.0)
    return mean_out * program.backbone.arch.hidden * _BYTES_BF16


def _generator_cost(acc: _Acc, program: ir.Program, module: ir.Module, samples: SampleSet,
                    params: CostParams, bwd: float) -> float:
    """A generator's part of ``_unit_cost``: ``acc`` filled from its targets and its
    projector; its boundary bytes returned: what a DiT's stage sends the next for a mean
    microbatch's targets (``flops.dit_stage_message``: the tokens and the context every
    block reads, the gradients of both back), nothing for a U-Net, which no pipeline cuts."""
    train = program.train
    mb = train.micro_batch
    arch = module.arch
    items = samples.items[f"{module.modality}.gen"]
    count = float(items.counts.mean()) * mb
    peak_items = _quantile_per_microbatch(items.counts.astype(float), mb)
    acc.peak_ratio = _ratio(peak_items, count)
    acc.peak_items = peak_items
    cond_tokens = ir.COND_TOKENS
    acc.queries.append(ProfileQuery.of(
        module.name, _per_microbatch(items.counts.astype(float), mb), 1.0))
    if isinstance(arch, ir.UNetArch):
        per_item = flops.unet_forward(arch, cond_tokens)
        ops = flops.unet_ops(arch, cond_tokens)
        # Norm layers (no FLOPs) keep their inputs whole on every TP rank.
        whole = sum(op.out_elements for op in ops if op.flops == 0 and op.kind != "attention")
        total = sum(op.out_elements for op in ops)
        per_layer = _BYTES_BF16 * peak_items / arch.pipeline_layers
        acc.act, acc.act_split = total * per_layer, (total - whole) * per_layer
        acc.act_tokens = total / arch.pipeline_layers / arch.channels * peak_items
        acc.width = arch.channels
        # Each attention op's core: the Q, K and V projections just before it.
        qkv = [proj for i, op in enumerate(ops) if op.kind == "attention"
               for proj in ops[i - 3:i]]
        acc.core = sum(op.out_elements for op in qkv) * per_layer
        acc.core_work = flops.Work(
            matmul=sum(op.flops for op in qkv) * count,
            attention=sum(op.flops for op in ops if op.kind == "attention") * count)
        conv_out = sum(op.out_elements for op in ops if op.kind == "conv")
        acc.comm = conv_out / 2 * _BYTES_BF16 * count   # one all-reduce per two convs
    else:
        per_item = flops.dit_forward(arch, cond_tokens)
        n = flops.dit_tokens(arch)
        acc.act, acc.act_split = _transformer_activation_bytes(
            arch.hidden, arch.ffn, 1.0, 4, n * peak_items, cross_attention=True,
            rms_norm=False, sequence_parallel=False)
        acc.act_tokens, acc.width = n * peak_items, arch.hidden
        # Self-attention's Q, K, V and cross-attention's Q per token (its K and V: the
        # conditioning's); their projections' FLOPs as ``flops.dit_forward`` counts them.
        acc.core = _attention_core_bytes(arch.hidden, 1.0, acc.act_tokens) + \
            _attention_core_bytes(arch.hidden, 0.0, acc.act_tokens)
        h, m = arch.hidden, cond_tokens
        acc.core_work = flops.Work(
            matmul=arch.layers * (n * 2 * h * h * 4 + 2 * 2 * m * arch.context_dim * h) * count,
            attention=per_item.attention * count)
        acc.comm = arch.layers * 3 * n * arch.hidden * _BYTES_BF16 * count
        acc.cp = (n * count, arch.hidden, arch.hidden)
    acc.work = per_item * count
    acc.model_flops = acc.work.total * (1 + bwd)
    if module.vae is not None:
        acc.frozen = flops.vae_encoder_forward(module.vae, arch.latent *
                                               module.vae.downscale) * count
        acc.model_flops += acc.frozen.total
    for proj in program.projectors:
        if proj.target == module.name:
            acc.add_projector(proj, cond_tokens * count, upstream=True)
    acc.first = acc.extra       # the projector runs where the conditioning enters
    if isinstance(arch, ir.UNetArch):
        return 0.0
    return sum(math.prod(shape) for shape in flops.dit_stage_message(arch, count)) * \
        _BYTES_BF16


def _unit_cost(program: ir.Program, module: ir.Module, samples: SampleSet,
               params: CostParams) -> UnitCost:
    """What ``module`` costs (``UnitCost``): its parameters, and per backbone microbatch its
    work, activations, transfers and profile queries over ``samples``; the role's part in
    ``_backbone_cost``, ``_encoder_cost`` or ``_generator_cost``."""
    arch = module.arch
    upstream = flops.input_needs_grad(program, module)
    bwd = flops.backward_factor(module, upstream)
    acc = _Acc(params=flops.module_params(module))
    acc.trainable_params = 0.0 if module.frozen else acc.params
    if not module.frozen:
        acc.synced = flops.tp_synced_params(module)
        # An encoder's parameters outside its layers (embeddings, pre- and post-norm) are
        # all replicated; a backbone's (embedding, head, sequence-parallel norm) none.
        acc.synced_extra = flops.encoder_ends_params(arch) if module.role == "encoder" \
            else 0.0
    part = {"backbone": _backbone_cost, "encoder": _encoder_cost}.get(module.role,
                                                                     _generator_cost)
    boundary = part(acc, program, module, samples, params, bwd)
    recompute_layer = (0.0, 0.0)
    mode = ir.Recompute.of(module.recompute)   # a bool where a caller copied one in
    if mode is ir.Recompute.FULL:
        # Full recomputation keeps only each layer's input; backward redoes the forward,
        # one layer at a time: that layer's activations exist again while it runs.
        recompute_layer = (acc.act, acc.act_split)
        kept = acc.act_tokens * acc.width * _BYTES_BF16
        # A backbone's layer input is its TP rank's piece of the sequence (sequence
        # parallelism, ``parallel.tp``): TP divides it; an encoder's is whole on every rank.
        acc.act, acc.act_split = kept, kept if module.role == "backbone" else 0.0
    elif mode is ir.Recompute.SELECTIVE:
        # Selective: each layer keeps all but its attention cores' own tensors, made again
        # one layer at a time in backward.
        recompute_layer = (acc.core, acc.core)
        acc.act, acc.act_split = acc.act - acc.core, acc.act_split - acc.core
    return UnitCost(
        name=module.name, role=module.role, layers=arch.pipeline_layers,
        params=acc.params, extra_stage_params=min(acc.extra, acc.params),
        trainable_params=acc.trainable_params, backward_factor=bwd,
        frozen_fwd_work=acc.frozen,
        recompute=mode, fwd_work=acc.work, selective_work=acc.core_work,
        model_flops=acc.model_flops,
        act_bytes_per_layer=acc.act, act_bytes_per_layer_tp_split=acc.act_split,
        act_peak_ratio=acc.peak_ratio,
        tp_comm_bytes=acc.comm, boundary_bytes=boundary, queries=tuple(acc.queries),
        first_stage_params=min(acc.first, acc.params), peak_items=acc.peak_items,
        recompute_layer_bytes=recompute_layer[0],
        recompute_layer_bytes_tp_split=recompute_layer[1], tied_head_params=acc.tied,
        last_stage_act_bytes=acc.last_act[0], last_stage_act_bytes_tp_split=acc.last_act[1],
        model_attention_flops=acc.model_attention, tp_synced_params=acc.synced,
        tp_synced_extra_params=acc.synced_extra, cp_method=module.context_parallel,
        cp_tokens=acc.cp[0], cp_q_width=acc.cp[1], cp_kv_width=acc.cp[2],
        expert_params=acc.ep[0], ep_elements=acc.ep[1], ep_layers=int(acc.ep[2]),
        expert_matmul=acc.experts[0], expert_rows=acc.experts[1],
        expert_dims=acc.experts[2],
        tp_whole_matmul=acc.tp_whole)


def _padded_to_seq_len(samples: SampleSet, micro_batch: int, seq_len: int,
                       packed: bool) -> tuple[np.ndarray, np.ndarray]:
    """``microbatch_lengths`` and ``microbatch_squares`` when every sequence is padded to
    ``seq_len``: packed, the padding after a sequence's documents is one more document;
    unpacked, causal attention runs over the whole padded row."""
    lengths = positions(samples).astype(float)
    groups = -(-len(lengths) // micro_batch)
    padded = np.full(groups, float(seq_len))
    if not packed:
        return padded, padded ** 2
    rows = attention_squares(samples) + (seq_len - lengths) ** 2
    group = np.arange(len(lengths)) // micro_batch
    return padded, np.bincount(group, weights=rows) / np.bincount(group)


def _mean_work(work: flops.Work) -> flops.Work:
    """The mean of a Work of arrays."""
    return flops.Work(matmul=float(np.mean(work.matmul)),
                      attention=float(np.mean(work.attention)),
                      conv=float(np.mean(work.conv)))
