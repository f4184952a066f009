"""Pre-norm transformers built from a ``TransformerArch``: ViT-style encoders and
Llama-style backbones, plus the attention and MLP blocks the U-Net and DiT reuse.

Parameters mirror ``dtdsl.cost.flops`` so that the analytic model and the runtime
count the same model: linear layers carry no biases (as in Llama; the ViT's
biases are 0.06% of ViT-H and the analytic model leaves them out), encoders use
LayerNorm (weight and bias) and a parameter-free sinusoidal position code (items
vary in length), backbones use RMSNorm and rotary position embeddings.

One known difference from ``flops.module_params``: it counts 4 h norm parameters
per layer (two LayerNorms) for every transformer, while a backbone's two RMSNorms
hold 2 h, and its final RMSNorm adds h. The torch backbone therefore has
``layers * 2 h - h`` fewer parameters than the analytic count (0.002% of a 70B model).

Tensor parallelism: every class takes the *per-rank* sizes of a Megatron-style
shard (``tp`` divides heads, KV heads and the FFN width). Column-parallel layers
(QKV, the MLP's first matrices) produce the local slice; row-parallel ones (the
attention output, the MLP's last matrix) consume it and produce full-width
partial sums. The all-reduce that would add those partial sums across ranks is
left out: a shard on one device computes exactly one rank's share, which is what
profiling measures (communication is costed separately).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dtdsl.ir import program as ir

__all__ = [
    "MLP",
    "Backbone",
    "CrossAttention",
    "Encoder",
    "SelfAttention",
    "TransformerLayer",
    "shard_size",
    "gather_sequence",
    "scatter_sequence",
    "sequence_parallel_degree",
    "sinusoidal_embedding",
]

_ROPE_THETA = 500_000.0   # Llama 3's base: long packed sequences


def sinusoidal_embedding(positions: torch.Tensor, dim: int,
                         max_period: float = 10_000.0) -> torch.Tensor:
    """The transformer's fixed sin/cos code of ``positions`` (any shape; float or int):
    shape ``positions.shape + (dim,)``, float32. Also the diffusion timestep embedding."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) *
                      torch.arange(half, dtype=torch.float32, device=positions.device) / half)
    angles = positions.float().unsqueeze(-1) * freqs
    emb = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)
    if dim % 2:
        emb = F.pad(emb, (0, 1))
    return emb


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def _apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                  theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embeddings (rotate-half form) on ``[B, S, H, D]`` queries and keys."""
    dim = q.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32,
                                            device=q.device) / dim)
    angles = positions.float().unsqueeze(-1) * inv_freq           # [..., S, D/2]
    angles = torch.cat([angles, angles], dim=-1)
    if angles.dim() == 2:                                          # [S, D]: shared by the batch
        angles = angles.unsqueeze(0)
    cos = angles.cos().unsqueeze(2).to(q.dtype)                    # [B or 1, S, 1, D]
    sin = angles.sin().unsqueeze(2).to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class SelfAttention(nn.Module):
    """Multi-head self-attention with grouped-query attention.

    ``heads`` and ``kv_heads`` are this rank's heads; ``dim`` is the full model width.
    Input and output ``[B, S, dim]``; ``positions`` (``[S]`` or ``[B, S]``) only
    matters with ``rotary``."""

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, *,
                 causal: bool = False, rotary: bool = False, out_bias: bool = False,
                 qkv_bias: bool = False, rope_theta: float = _ROPE_THETA):
        super().__init__()
        if heads % kv_heads:
            raise ValueError(f"{heads} query heads cannot share {kv_heads} KV heads evenly")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.causal, self.rotary, self.rope_theta = causal, rotary, rope_theta
        # Separate Q, K and V projections (as Hugging Face and torchtitan keep them): each
        # is cut by heads under tensor parallelism and maps one to one to a checkpoint.
        self.wq = nn.Linear(dim, heads * head_dim, bias=qkv_bias)
        self.wk = nn.Linear(dim, kv_heads * head_dim, bias=qkv_bias)
        self.wv = nn.Linear(dim, kv_heads * head_dim, bias=qkv_bias)
        self.wo = nn.Linear(heads * head_dim, dim, bias=out_bias)
        self.wo.residual_out = True

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        d = self.head_dim
        # -1 heads: under tensor parallelism a rank's projections hold its heads only.
        q = self.wq(x).view(batch, seq, -1, d)
        k = self.wk(x).view(batch, seq, -1, d)
        v = self.wv(x).view(batch, seq, -1, d)
        if self.rotary:
            if positions is None:
                positions = torch.arange(seq, device=x.device)
            q, k = _apply_rotary(q, k, positions, self.rope_theta)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=self.causal,
            enable_gqa=q.shape[2] != k.shape[2])
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class CrossAttention(nn.Module):
    """Queries from ``x`` ``[B, N, dim]``, keys and values from ``context``
    ``[B, M, context_dim]``; ``heads`` are this rank's heads."""

    def __init__(self, dim: int, context_dim: int, heads: int, head_dim: int, *,
                 out_bias: bool = False):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.wq = nn.Linear(dim, heads * head_dim, bias=False)
        self.wk = nn.Linear(context_dim, heads * head_dim, bias=False)
        self.wv = nn.Linear(context_dim, heads * head_dim, bias=False)
        self.wo = nn.Linear(heads * head_dim, dim, bias=out_bias)
        self.wo.residual_out = True

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        batch, n, _ = x.shape
        m = context.shape[1]
        d = self.head_dim
        q = self.wq(x).view(batch, n, -1, d).transpose(1, 2)
        k = self.wk(context).view(batch, m, -1, d).transpose(1, 2)
        v = self.wv(context).view(batch, m, -1, d).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(batch, n, -1))


class MLP(nn.Module):
    """The feed-forward block: SwiGLU (``w2(silu(gate) * up)``) or GELU; ``ffn`` is this
    rank's width. ``tanh_gelu`` selects DiT's approximate GELU."""

    def __init__(self, dim: int, ffn: int, *, swiglu: bool = False, tanh_gelu: bool = False):
        super().__init__()
        self.swiglu = swiglu
        self.gelu_approximate = "tanh" if tanh_gelu else "none"
        # SwiGLU as Llama: w2(silu(w1 x) * w3 x); GELU: w2(gelu(w1 x)).
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False) if swiglu else None
        self.w2 = nn.Linear(ffn, dim, bias=False)
        self.w2.residual_out = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate=self.gelu_approximate))


def shard_size(value: int, tp: int, what: str) -> int:
    """``value / tp``, or a ValueError naming ``what`` cannot be split."""
    if value % tp:
        raise ValueError(f"tensor parallelism {tp} cannot split {value} {what} evenly")
    return value // tp


class TransformerLayer(nn.Module):
    """One pre-norm layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    Backbones (``role="backbone"``): RMSNorm, rotary embeddings, causal attention if
    the architecture says so. Encoders: LayerNorm, bidirectional attention.
    Input and output ``[B, S, hidden]``."""

    def __init__(self, arch: ir.TransformerArch, *, tp: int = 1, role: str = "encoder"):
        super().__init__()
        backbone = role == "backbone"
        h = arch.hidden
        heads = shard_size(arch.heads, tp, "attention heads")
        kv_heads = shard_size(arch.kv_heads, tp, "KV heads")
        ffn = shard_size(arch.ffn, tp, "FFN columns")
        def norm() -> nn.Module:
            return nn.RMSNorm(h, eps=1e-5) if backbone else nn.LayerNorm(h, eps=1e-6)

        self.attn_norm = norm()
        self.attn = SelfAttention(h, heads, kv_heads, arch.head_dim, causal=arch.causal,
                                  rotary=backbone)
        self.mlp_norm = norm()
        self.mlp = MLP(h, ffn, swiglu=arch.swiglu)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), positions)
        return x + self.mlp(self.mlp_norm(x))


class Encoder(nn.Module):
    """A ViT-style encoder over flattened patches.

    ``forward(patches)``: ``patches`` is ``[B, N, in_channels * patch^2]`` (one row per
    image patch or audio frame, see ``patchify``); returns the last layer's hidden
    states ``[B, N, hidden]`` (no final norm: the projector follows, as in LLaVA,
    and ``flops.module_params`` counts none)."""

    def __init__(self, arch: ir.TransformerArch, *, tp: int = 1):
        super().__init__()
        self.hidden = arch.hidden
        self.patch_dim = (arch.in_channels or 3) * (arch.patch or 1) ** 2
        # Replicated on every TP rank: a few thousand parameters, not worth a collective.
        self.patch_embed = nn.Linear(self.patch_dim, arch.hidden, bias=False)
        # Keyed by the layer's index: a pipeline stage deletes the layers it does not run
        # and the others keep their names (``layers.<i>.``) whatever the plan.
        self.layers = nn.ModuleDict({str(i): TransformerLayer(arch, tp=tp, role="encoder")
                                     for i in range(arch.layers)})

    @staticmethod
    def patchify(images: torch.Tensor, patch: int) -> torch.Tensor:
        """``[B, C, H, W]`` images to ``[B, (H/p)(W/p), C p^2]`` flattened patches."""
        b, c, hgt, wid = images.shape
        x = images.reshape(b, c, hgt // patch, patch, wid // patch, patch)
        return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (hgt // patch) * (wid // patch),
                                                   c * patch * patch)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(patches)
        positions = torch.arange(x.shape[1], device=x.device)
        x = x + sinusoidal_embedding(positions, self.hidden).to(x.dtype)
        for layer in self.layers.values():
            x = layer(x)
        return x


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
    """A Llama-style decoder: token embedding, layers, final RMSNorm, untied output head.

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
        self.vocab_shard = -(-arch.vocab // tp)
        self.tok_embeddings = nn.Embedding(self.vocab_shard, arch.hidden)
        self.layers = nn.ModuleDict({str(i): TransformerLayer(arch, tp=tp, role="backbone")
                                     for i in range(arch.layers)})
        self.norm = nn.RMSNorm(arch.hidden, eps=1e-5)
        self.output = nn.Linear(arch.hidden, self.vocab_shard, bias=False)

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
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)
        x = scatter_sequence(self, x)
        for layer in self.layers.values():
            x = layer(x, positions)
        return gather_sequence(self, self.norm(x))

    def forward(self, tokens: torch.Tensor | None = None, *,
                embeds: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.output(self.hidden_states(tokens, embeds=embeds, positions=positions))
