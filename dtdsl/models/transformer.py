"""Pre-norm transformers built from a ``TransformerArch``: vision towers (CLIP, SigLIP and
dtdsl's own ViT) and Llama-family decoders (Llama 2/3, Mistral, Qwen2), plus the attention
and MLP blocks the U-Net and DiT reuse.

Each module is the architecture its Hugging Face counterpart computes, detail for detail,
as the ``TransformerArch`` fields say (``arch = hf(...)`` fills them from a config; the
defaults are ``transformer(...)``'s plain model):

- norms: RMSNorm or LayerNorm with the config's epsilon; a vision tower's optional
  ``pre_norm`` (CLIP's ``pre_layrnorm``) and ``post_norm`` (SigLIP's ``post_layernorm``);
- attention: grouped-query, a head width that may differ from ``hidden / heads``, biases
  on Q, K, V (Qwen2, CLIP) and on the output projection (CLIP), rotary embeddings with
  the config's theta and scaling on a backbone (``models.rope``);
- MLP: SwiGLU (``w2(silu(w1 x) * w3 x)``) or a plain one with GELU, tanh-GELU (SigLIP) or
  quick-GELU (CLIP), with or without biases; on an MoE backbone's MoE layers a mixture of
  experts (``models.moe.build_moe``) in its place;
- a vision tower's patch embedding (a linear map of flattened patches: the same numbers
  as a ``kernel = stride = patch`` convolution), its class token and learned position
  embedding (interpolated bicubically for another image size, as Hugging Face's
  ``interpolate_pos_encoding``) or dtdsl's sinusoidal code;
- a backbone's tied or untied LM head.

Projections are separate matrices (``wq``, ``wk``, ``wv``, ``wo``; ``w1``, ``w3``, ``w2``): one
to one with a checkpoint's tensors (``models.hf`` maps the names) and a plain cut under
tensor parallelism.

Tensor parallelism (``tp``): every class takes the *per-rank* sizes of a Megatron-style
shard (``tp`` divides heads, KV heads and the FFN width). Column-parallel layers (QKV, the
MLP's first matrices) produce the local slice; row-parallel ones (the attention output,
the MLP's last matrix) consume it and produce full-width partial sums. The all-reduce
that would add those partial sums across ranks is left out: a shard on one device
computes exactly one rank's share, which is what profiling measures (communication is
costed separately). The distributed runtime builds ``tp = 1`` modules and shards them
with DTensor (``parallel.tp``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dtdsl.ir import program as ir
from dtdsl.models.attention import DocumentMask, dense_attention, document_attention
from dtdsl.models.audio import WhisperStem
from dtdsl.models.ffn import MLP, activation
from dtdsl.models.rope import RotaryTable, Rotation, apply_rotary

__all__ = [
    "MLP",
    "Backbone",
    "CrossAttention",
    "Encoder",
    "SelfAttention",
    "TransformerLayer",
    "activation",
    "shard_size",
    "gather_sequence",
    "scatter_sequence",
    "sequence_parallel_degree",
    "sinusoidal_embedding",
]


def sinusoidal_embedding(positions: torch.Tensor, dim: int,
                         max_period: float = 10_000.0) -> torch.Tensor:
    """The transformer's fixed sin/cos code of ``positions`` (any shape; float or int):
    shape ``positions.shape + (dim,)``, float32, cosines first (diffusers'
    ``flip_sin_to_cos``, no frequency shift). Also the diffusion timestep embedding."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) *
                      torch.arange(half, dtype=torch.float32, device=positions.device) / half)
    angles = positions.float().unsqueeze(-1) * freqs
    emb = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)
    if dim % 2:
        emb = F.pad(emb, (0, 1))
    return emb


class SelfAttention(nn.Module):
    """Multi-head self-attention with grouped-query attention.

    ``heads`` and ``kv_heads`` are this rank's heads; ``dim`` is the full model width.
    Input and output ``[B, S, dim]``; ``positions`` (``[S]`` or ``[B, S]``, or their
    ``Rotation`` from the backbone's ``RotaryTable``) only matters with ``rope``;
    ``mask`` (packed documents, ``models.attention.document_mask``) replaces the causal
    rule when given: each query attends its own document up to itself; under context
    parallelism it is the microbatch's ``parallel.cp.CPContext`` and ``x`` this rank's
    shard of the sequence (``positions`` its real positions)."""

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, *,
                 causal: bool = False, rope: ir.RoPE | None = None, out_bias: bool = False,
                 qkv_bias: bool = False, k_bias: bool | None = None,
                 qk_norm_eps: float | None = None):
        super().__init__()
        if heads % kv_heads:
            raise ValueError(f"{heads} query heads cannot share {kv_heads} KV heads evenly")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.causal, self.rope = causal, rope
        # Separate Q, K and V projections (as Hugging Face and torchtitan keep them): each
        # is cut by heads under tensor parallelism and maps one to one to a checkpoint.
        self.wq = nn.Linear(dim, heads * head_dim, bias=qkv_bias)
        self.wk = nn.Linear(dim, kv_heads * head_dim,     # Whisper's K has no bias
                            bias=qkv_bias if k_bias is None else k_bias)
        self.wv = nn.Linear(dim, kv_heads * head_dim, bias=qkv_bias)
        self.wo = nn.Linear(heads * head_dim, dim, bias=out_bias)
        self.wo.residual_out = True
        # Qwen3's QK-norm (``qk_norm_eps`` given): each head's query and key RMS-normed
        # over its head_dim before the rotation, one weight shared by all heads.
        if qk_norm_eps is not None:
            self.q_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps)
            self.k_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps)

    # Selective recomputation (``parallel.recompute``): the attention core runs under a
    # non-reentrant checkpoint, so what only it keeps is made again in backward.
    recompute_core = False

    def forward(self, x: torch.Tensor, positions: torch.Tensor | Rotation | None = None,
                mask: DocumentMask | None = None) -> torch.Tensor:
        if self.recompute_core:
            out = checkpoint(self._core, x, positions, mask, use_reentrant=False)
        else:
            out = self._core(x, positions, mask)
        return self.wo(out)

    def _core(self, x: torch.Tensor, positions: torch.Tensor | Rotation | None,
              mask: DocumentMask | None) -> torch.Tensor:
        """The attention core: the Q, K and V projections, rotary positions, scaled
        dot-product attention, as ``[B, S, heads * D]`` for the output projection. What
        it keeps for backward (the projections' outputs, the rotated queries and keys,
        attention's statistics) is what selective recomputation drops: its input ``x``
        (the normed input, kept by the layer anyway) is all it needs again; its output
        (a view of attention's) the output projection keeps. Starting at the
        projections, not at attention itself, is what makes it save anything: a
        checkpoint keeps its inputs, and attention's are the queries, keys and values."""
        batch, seq, _ = x.shape
        d = self.head_dim
        # -1 heads: under tensor parallelism a rank's projections hold its heads only.
        q = self.wq(x).view(batch, seq, -1, d)
        k = self.wk(x).view(batch, seq, -1, d)
        v = self.wv(x).view(batch, seq, -1, d)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            if isinstance(positions, Rotation):     # the stage's, looked up once
                q, k = positions.apply(q, k)
            else:
                if positions is None:
                    positions = torch.arange(seq, device=q.device)
                q, k = apply_rotary(q, k, positions, self.rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if hasattr(mask, "attend"):
            # Context parallelism (``parallel.cp.CPContext``): this rank holds a shard of
            # the sequence; the ring or Ulysses exchange finds the keys it needs.
            out = mask.attend(q, k, v, causal=self.causal)
        elif mask is not None:
            # Packed documents, each causal within itself: FlexAttention on the blocks
            # the documents touch, K and V heads shared without copies (``models.attention``).
            out = document_attention(q, k, v, mask)
        else:
            out = dense_attention(q, k, v, causal=self.causal)
        return out.transpose(1, 2).reshape(batch, seq, -1)


class CrossAttention(nn.Module):
    """Queries from ``x`` ``[B, N, dim]``, keys and values from ``context``
    ``[B, M, context_dim]``; ``heads`` are this rank's heads; ``bias``: an additive
    ``[B, 1, 1, M]`` mask of padded context rows (``models.attention.key_bias``)."""

    def __init__(self, dim: int, context_dim: int, heads: int, head_dim: int, *,
                 out_bias: bool = False):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.wq = nn.Linear(dim, heads * head_dim, bias=False)
        self.wk = nn.Linear(context_dim, heads * head_dim, bias=False)
        self.wv = nn.Linear(context_dim, heads * head_dim, bias=False)
        self.wo = nn.Linear(heads * head_dim, dim, bias=out_bias)
        self.wo.residual_out = True

    recompute_core = False     # as ``SelfAttention.recompute_core``

    def forward(self, x: torch.Tensor, context: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.recompute_core:     # as ``SelfAttention.recompute_core``
            return self.wo(checkpoint(self._core, x, context, bias, use_reentrant=False))
        return self.wo(self._core(x, context, bias))

    def _core(self, x: torch.Tensor, context: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        """The projections and attention, as ``[B, N, heads * D]`` (``SelfAttention._core``
        says why the projections are in it)."""
        batch, n, _ = x.shape
        m = context.shape[1]
        d = self.head_dim
        q = self.wq(x).view(batch, n, -1, d).transpose(1, 2)
        k = self.wk(context).view(batch, m, -1, d).transpose(1, 2)
        v = self.wv(context).view(batch, m, -1, d).transpose(1, 2)
        out = dense_attention(q, k, v, bias=bias)
        return out.transpose(1, 2).reshape(batch, n, -1)


def shard_size(value: int, tp: int, what: str) -> int:
    """``value / tp``, or a ValueError naming ``what`` cannot be split."""
    if value % tp:
        raise ValueError(f"tensor parallelism {tp} cannot split {value} {what} evenly")
    return value // tp


def _norm(arch: ir.TransformerArch, role: str) -> nn.Module:
    h, eps = arch.hidden, arch.eps(role)
    return nn.RMSNorm(h, eps=eps) if arch.norm_kind(role) == "rms" else nn.LayerNorm(h, eps=eps)


class TransformerLayer(nn.Module):
    """One pre-norm layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    Backbones (``role="backbone"``): rotary embeddings and causal attention if the
    architecture says so; encoders: bidirectional attention without rotation. Norms,
    biases and the activation as the architecture gives them. Input and output
    ``[B, S, hidden]``."""

    def __init__(self, arch: ir.TransformerArch, *, tp: int = 1, role: str = "encoder",
                 layer: int | None = None):
        super().__init__()
        h = arch.hidden
        heads = shard_size(arch.heads, tp, "attention heads")
        kv_heads = shard_size(arch.kv_heads, tp, "KV heads")
        ffn = shard_size(arch.ffn, tp, "FFN columns")
        self.attn_norm = _norm(arch, role)
        self.attn = SelfAttention(h, heads, kv_heads, arch.head_dim, causal=arch.causal,
                                  rope=arch.rope if role == "backbone" else None,
                                  qkv_bias=arch.qkv_bias, out_bias=arch.out_bias,
                                  k_bias=arch.k_bias,
                                  qk_norm_eps=arch.eps(role) if arch.qk_norm else None)
        self.mlp_norm = _norm(arch, role)
        # An MoE backbone's MoE layers hold the mixture of experts in the MLP's place
        # (``models.moe``; ``layer``: this layer's index, which says whether it is one).
        self.moe = role == "backbone" and arch.moe is not None and layer is not None \
            and arch.moe.is_moe_layer(layer)
        if self.moe:
            from dtdsl.models.moe import build_moe

            self.mlp = build_moe(arch, tp=tp)
        else:
            self.mlp = MLP(h, ffn, swiglu=arch.swiglu, act=arch.act, bias=arch.mlp_bias)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | Rotation | None = None,
                mask: DocumentMask | None = None,
                valid: torch.Tensor | None = None) -> torch.Tensor:
        """``valid [B, S]``: an MoE layer's tokens (not padding), all rows when None."""
        x = x + self.attn(self.attn_norm(x), positions, mask)
        if self.moe:
            return x + self.mlp.layer_forward(self.mlp_norm(x), valid)
        return x + self.mlp(self.mlp_norm(x))


class Encoder(nn.Module):
    """A vision transformer over flattened patches (CLIP's, SigLIP's or dtdsl's ViT), or
    an audio tower over log-mel frames (Whisper's encoder: ``stem = "whisper_conv"``; a
    frame-level tower, ``stem = "frames"``: a linear map of each fbank frame, a token per
    frame).

    The work is split for pipeline stages: ``embed(patches, grid)`` (first stage: patch
    embedding, class token, positions, pre-norm), ``layers`` (keyed by global index),
    ``finish(x)`` (last stage: post-norm, then the class token dropped: what a projector
    reads, ``[B, N, hidden]``). ``forward(pixel_values [B, C, H, W])`` runs it all and
    returns what Hugging Face's vision model returns as ``last_hidden_state`` (class
    token included)."""

    def __init__(self, arch: ir.TransformerArch, *, tp: int = 1):
        super().__init__()
        self.hidden = arch.hidden
        self.patch = arch.patch or 1
        self.in_channels = arch.in_channels or 3
        # A video encoder's patch spans ``temporal_patch`` frames, a frame stem's is a
        # whole fbank frame (``ir.TransformerArch.patch_dim``, ``ir.modal``).
        self.patch_dim = arch.patch_dim
        self.frames = arch.stem == "frames"
        self.learned = arch.positions == "learned"
        # Whether each image's rows start with a class token (a plain attribute: a later
        # pipeline stage holds no class embedding but its rows still carry one).
        self.has_cls = arch.cls_token
        self.grid = (arch.image_size or 0) // self.patch if self.learned else 0
        if self.learned and self.grid < 1:
            raise ValueError("learned positions need the image size the tower was trained at")
        # Replicated on every TP rank: a few thousand parameters, not worth a collective.
        # An audio tower's input is frames of in_channels mel bins: Whisper's conv stem
        # takes the patch embedding's place (``models.audio``).
        self.whisper = arch.stem == "whisper_conv"
        self.patch_embed = WhisperStem(self.in_channels, arch.hidden,
                                       arch.max_source_positions or 0) if self.whisper \
            else nn.Linear(self.patch_dim, arch.hidden, bias=arch.patch_bias)
        self.cls_embedding = nn.Parameter(torch.empty(arch.hidden)) if arch.cls_token else None
        self.pos_embed = (nn.Embedding(self.grid ** 2 + int(arch.cls_token), arch.hidden)
                          if self.learned else None)
        if self.pos_embed is not None:
            self.pos_embed.init_std = 0.02      # models.init: not an embedding's N(0, 1)
        self.param_init_std = {"cls_embedding": arch.hidden ** -0.5}
        self.pre_norm = _norm(arch, "encoder") if arch.pre_norm else None
        # Keyed by the layer's index: a pipeline stage deletes the layers it does not run
        # and the others keep their names (``layers.<i>.``) whatever the plan.
        self.layers = nn.ModuleDict({str(i): TransformerLayer(arch, tp=tp, role="encoder")
                                     for i in range(arch.layers)})
        self.post_norm = _norm(arch, "encoder") if arch.post_norm else None

    @staticmethod
    def patchify(images: torch.Tensor, patch: int) -> torch.Tensor:
        """``[B, C, H, W]`` images to ``[B, (H/p)(W/p), C p^2]`` flattened patches, each in
        ``(channel, row, column)`` order: a ``kernel = stride = p`` convolution's weights
        flattened the same way apply to them as a linear map (which, as the convolution,
        never reads the pixels right of and below the last whole patch)."""
        b, c, hgt, wid = images.shape
        if hgt % patch or wid % patch:
            images = images[:, :, :hgt - hgt % patch, :wid - wid % patch]
        x = images.reshape(b, c, hgt // patch, patch, wid // patch, patch)
        return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (hgt // patch) * (wid // patch),
                                                   c * patch * patch)

    def _learned_positions(self, grid: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        weight = self.pos_embed.weight
        cls, patches = (weight[:1], weight[1:]) if self.cls_embedding is not None else \
            (weight[:0], weight)
        if tuple(grid) != (self.grid, self.grid):
            # Hugging Face's interpolate_pos_encoding: the trained grid resized bicubically.
            square = patches.reshape(1, self.grid, self.grid, -1).permute(0, 3, 1, 2)
            square = F.interpolate(square.float(), size=tuple(grid), mode="bicubic",
                                   align_corners=False)
            patches = square.permute(0, 2, 3, 1).reshape(grid[0] * grid[1], -1)
        return torch.cat([cls.to(patches.dtype), patches]).to(dtype)

    def embed(self, patches: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        """``[B, N, patch_dim]`` flattened patches of images whose patch grid is ``grid``
        (rows, columns; default: square) to the first layer's input ``[B, N (+1), hidden]``.
        With Whisper's stem: ``[B, frames, mel_bins]`` features to ``[B, frames / 2, hidden]``;
        with the frame stem, ``[B, frames, in_channels x mel_bins]`` to ``[B, frames,
        hidden]``."""
        x = self.patch_embed(patches)
        if self.whisper:
            return x
        n = x.shape[1]
        if grid is None:
            side = math.isqrt(n)
            grid = (side, n // side) if side * side == n else (1, n)
        if self.cls_embedding is not None:
            x = torch.cat([self.cls_embedding.to(x.dtype).expand(x.shape[0], 1, -1), x], dim=1)
        if self.learned:
            x = x + self._learned_positions(grid, x.dtype)
        else:
            positions = torch.arange(n, device=x.device)
            x = x + sinusoidal_embedding(positions, self.hidden).to(x.dtype)
        return self.pre_norm(x) if self.pre_norm is not None else x

    def finish(self, x: torch.Tensor, *, keep_cls: bool = False) -> torch.Tensor:
        """The last layer's output to what the tower hands on: the post-norm, then (unless
        ``keep_cls``) without the class token."""
        if self.post_norm is not None:
            x = self.post_norm(x)
        return x if keep_cls or not self.has_cls else x[:, 1:]

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if self.whisper:        # Hugging Face's input_features [B, mel_bins, frames]
            x = self.embed(pixel_values.transpose(1, 2))
        elif self.frames:       # fbank [B, frames, (channels,) mel_bins]: a frame a token
            x = self.embed(pixel_values.flatten(2), (pixel_values.shape[1], 1))
        else:
            grid = (pixel_values.shape[-2] // self.patch, pixel_values.shape[-1] // self.patch)
            x = self.embed(self.patchify(pixel_values, self.patch), grid)
        for layer in self.layers.values():
            x = layer(x)
        return self.finish(x, keep_cls=True)


def sequence_parallel_degree(backbone: nn.Module) -> int:
    """How many pieces sequence parallelism cuts the backbone's sequences into (its TP
    degree, ``parallel.tp``), 1 without it."""
    mesh = getattr(backbone, "sp_mesh", None)
    return 1 if mesh is None else mesh.size()


def scatter_sequence(backbone: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """This TP rank's piece ``[B, S / tp, hidden]`` of a replicated ``[B, S, hidden]``
    (sequence parallelism; ``x`` itself without it). In backward the pieces' gradients
    are all-gathered into the whole one."""
    mesh = getattr(backbone, "sp_mesh", None)
    if mesh is None:
        return x
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(
        mesh, [Shard(1)]).to_local()


def gather_sequence(backbone: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The whole ``[B, S, hidden]`` from this TP rank's piece (all-gather; ``x`` itself
    without sequence parallelism)."""
    mesh = getattr(backbone, "sp_mesh", None)
    if mesh is None:
        return x
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(
        mesh, [Replicate()]).to_local()


class Backbone(nn.Module):
    """A Llama-family decoder: token embedding, layers, final norm, LM head (the embedding
    itself when ``tie_embeddings``).

    With ``tp > 1`` the embedding and the head hold this rank's ``ceil(vocab / tp)``
    rows (vocabulary parallelism); token ids outside the slice embed to zero, as on
    the rank that does not own them, and the logits are the local slice.

    ``forward(tokens)``: ``[B, S]`` int64 ids to ``[B, S, vocab / tp]`` logits.
    ``forward(embeds=...)`` starts from ``[B, S, hidden]`` input embeddings (text
    embeddings with projected encoder tokens spliced in). ``hidden_states`` returns
    the final normed states ``[B, S, hidden]`` that a generator's projector reads."""

    def __init__(self, arch: ir.TransformerArch, *, tp: int = 1):
        super().__init__()
        self.tp = tp
        self.tied = arch.tie_embeddings
        self.vocab_shard = -(-arch.vocab // tp)
        self.tok_embeddings = nn.Embedding(self.vocab_shard, arch.hidden)
        self.layers = nn.ModuleDict({str(i): TransformerLayer(arch, tp=tp, role="backbone",
                                                              layer=i)
                                     for i in range(arch.layers)})
        self.norm = _norm(arch, "backbone")
        self.output = nn.Linear(arch.hidden, self.vocab_shard, bias=False)
        # Not a buffer: built on first use on the device that runs it (``models.rope``).
        self.rotary = RotaryTable(arch.rope, arch.head_dim) if arch.rope is not None else None
        if self.tied:
            self.tie()

    def tie(self) -> None:
        """Make the LM head's weight the token embedding's (after anything that replaced
        either parameter, such as tensor parallelism); nothing without tied embeddings or
        on a stage that holds only one of them."""
        if self.tied and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def rotation(self, positions: torch.Tensor | None, length: int,
                 device: torch.device) -> Rotation | torch.Tensor | None:
        """What every layer of one forward over rows of ``length`` positions rotates by:
        the ``Rotation`` of ``positions`` (None: ``0..length-1``), or the positions
        themselves for a backbone without rotary embeddings."""
        if self.rotary is None:
            return positions
        return self.rotary.rotation(positions, length, device)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids ``[B, S]`` to embeddings ``[B, S, hidden]`` (this rank's rows)."""
        if self.tp == 1:
            return self.tok_embeddings(tokens)
        owned = tokens < self.vocab_shard
        return self.tok_embeddings(tokens.clamp(max=self.vocab_shard - 1)) * \
            owned.unsqueeze(-1).to(self.tok_embeddings.weight.dtype)

    def hidden_states(self, tokens: torch.Tensor | None = None, *,
                      embeds: torch.Tensor | None = None,
                      positions: torch.Tensor | None = None) -> torch.Tensor:
        """The final normed hidden states; give ``tokens`` or ``embeds``."""
        if (tokens is None) == (embeds is None):
            raise ValueError("give exactly one of tokens and embeds")
        x = self.embed(tokens) if embeds is None else embeds
        rotation = self.rotation(positions, x.shape[1], x.device)
        x = scatter_sequence(self, x)
        for layer in self.layers.values():
            x = layer(x, rotation)
        return gather_sequence(self, self.norm(x))

    def forward(self, tokens: torch.Tensor | None = None, *,
                embeds: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.output(self.hidden_states(tokens, embeds=embeds, positions=positions))
