"""The mixture-of-experts feed-forward block (Qwen2-MoE, Qwen3-MoE, Mixtral).

``MoE(config)`` on ``x [..., hidden]``:

1. **Router**: a bias-free linear map to ``experts`` logits, a softmax (in fp32) and the
   top ``top_k`` experts of each token; with ``norm_topk`` (Mixtral, Qwen3-MoE) the ``k``
   weights are renormalised to sum to one, without it (Qwen2-MoE) they stay the softmax's.
2. **Dispatch**: a token's ``k`` choices (its *slots*, slot ``t * k + j``) are sorted by
   expert, stably, so each expert sees its tokens in token order.
3. **Capacity** (``capacity_factor``; None is dropless, the default): an expert takes at
   most ``ceil(capacity_factor * tokens * top_k / experts)`` slots, the first ones in
   token order; the others are dropped (they add nothing: the caller's residual carries
   the token) and counted (``MoEOutput.dropped``, ``MoEOutput.kept``).
4. **Experts**: SwiGLU, ``w2(silu(w1 x) * w3 x)`` per expert, on the sorted tokens: one
   grouped GEMM per projection (``F.grouped_mm``, torch 2.13) where torch's takes the
   operands (16-byte aligned rows; on CUDA bf16 on sm90+; on CPU fp32 too), else a loop
   over the experts' contiguous runs of rows.
5. **Combine**: each slot's output times its routing weight, summed over the token's
   ``k`` slots, in the input's order; plus the shared expert, a SwiGLU MLP of
   ``shared_ffn`` columns (several experts' worth merged into one, as DeepSeek's), times
   Qwen2-MoE's ``sigmoid(shared_gate x)`` when ``shared_gate``.

The load-balancing loss is Switch/Mixtral's, as transformers' ``load_balancing_loss_func``
computes it for one layer: ``experts * sum_e f_e P_e``, ``f_e`` the fraction of tokens
that chose expert ``e`` among their top ``k`` (the ``f_e`` sum to ``k``) and ``P_e`` the
mean router probability of ``e``. It is computed before any capacity drop.

Expert weights are stacked ``[experts, out, in]`` parameters (``w1``, ``w3``: gate and up,
``[E, ffn, hidden]``; ``w2``: down, ``[E, hidden, ffn]``), each expert's slice laid out as
an ``nn.Linear`` weight, so a Hugging Face checkpoint's per-expert tensor is one slice
(``hf_moe_keys``, ``load_hf_moe``) and expert parallelism shards dimension 0
(``parallel.ep``: a rank holds ``experts / ep`` of them, ``MoE.first_expert`` on).

**Tensor parallelism** (``MoE.tp_mesh``, set by ``parallel.tp.parallelize_moe`` on a
backbone under sequence parallelism): the block gathers the whole sequence from the TP
ranks' pieces (as the dense MLP does), and every TP rank routes all of it, the same way:
the router and the shared expert's gate are replicated, the routing identical on every
rank. Gathering the tokens, not each rank's routed rows, moves ``top_k`` times fewer rows
and keeps the routing (capacity drops, the per-sequence aux loss) the one-process
block's; the router's work repeated on every rank is a ``hidden x experts`` GEMM, small
beside the experts'. Each expert's ``w1``/``w3`` are split by columns (``Shard(1)`` of
``[E, ffn, hidden]``) and ``w2`` by rows (``Shard(2)``), the shared expert likewise, so
a rank computes every routed row through its columns of every expert and holds a partial
sum of the block's output, which a reduce-scatter returns to the sequence pieces. The
parameters stay DTensors of the full ``[E, ...]`` tensors (checkpoints reshard across TP
degrees by themselves). Gradients: the input's and the replicated parameters' on each
rank are its part of the sum (``Partial``, summed over TP once); the aux loss, the same
on every rank, gives each ``1/tp`` of its gradient, so it counts once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dtdsl.models.ffn import MLP, activation

__all__ = ["HF_MOE_FAMILIES", "MoE", "MoEConfig", "MoEOutput", "Routing", "build_moe",
           "can_group", "capacity", "expert_ffn", "hf_moe_keys", "keep_counts",
           "load_balancing_loss", "load_hf_moe", "local_shard", "moe_blocks", "moe_config",
           "place_rows", "set_aux_weight",
           "set_loss_scale", "take_aux_losses", "to_hf_moe"]


@dataclass(frozen=True)
class MoEConfig:
    """One MoE block's shape: ``hidden`` model width, ``ffn`` columns per expert,
    ``experts`` routed experts of which each token takes ``top_k``; ``shared_ffn``
    columns of always-on shared expert (0: none) gated by a sigmoid when ``shared_gate``;
    ``capacity_factor`` None for dropless."""

    hidden: int
    ffn: int
    experts: int
    top_k: int
    norm_topk: bool = True
    shared_ffn: int = 0
    shared_gate: bool = False
    capacity_factor: float | None = None
    act: str = "silu"

    def __post_init__(self) -> None:
        for name in ("hidden", "ffn", "experts", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"an MoE block's {name} of {value!r}: give a positive integer")
        if self.top_k > self.experts:
            raise ValueError(f"top_k={self.top_k} is more than the {self.experts} experts: "
                             f"give top_k <= experts")
        if self.shared_ffn < 0:
            raise ValueError(f"shared_ffn={self.shared_ffn}: give 0 (no shared expert) or "
                             f"its positive width")
        if self.shared_gate and not self.shared_ffn:
            raise ValueError("shared_gate without a shared expert: give shared_ffn > 0")
        cf = self.capacity_factor
        if cf is not None and not (isinstance(cf, (int, float)) and math.isfinite(cf)
                                   and cf > 0):
            raise ValueError(f"capacity_factor={cf!r}: give a positive number, or None for "
                             f"dropless routing")


class Routing(NamedTuple):
    """The router's decision for ``T`` tokens: ``logits [T, E]``, ``probs [T, E]`` (fp32
    softmax), ``weights [T, k]`` (in the input's dtype) and ``experts [T, k]`` (int64)."""

    logits: torch.Tensor
    probs: torch.Tensor
    weights: torch.Tensor
    experts: torch.Tensor


class MoEOutput(NamedTuple):
    """``out`` (the input's shape), ``router_logits [T, E]``, ``aux_loss`` (a 0-d fp32
    tensor), ``dropped`` (slots over capacity, 0-d int64; in an EP group: the group's),
    ``kept [T, k]`` (bool: the slots that reached their expert) and ``tokens_per_expert
    [E]`` (slots routed to each expert before any drop; in an EP group: the group's)."""

    out: torch.Tensor
    router_logits: torch.Tensor
    aux_loss: torch.Tensor
    dropped: torch.Tensor
    kept: torch.Tensor
    tokens_per_expert: torch.Tensor


def capacity(factor: float, tokens: int, top_k: int, experts: int) -> int:
    """The slots one expert takes: ``ceil(factor * tokens * top_k / experts)``."""
    return math.ceil(factor * tokens * top_k / experts)


def load_balancing_loss(counts: torch.Tensor, prob_sum: torch.Tensor,
                        tokens: int | torch.Tensor) -> torch.Tensor:
    """``E * sum_e (counts_e / tokens) * (prob_sum_e / tokens)`` (module docstring):
    ``counts`` the slots routed to each expert, ``prob_sum`` each expert's summed router
    probability, over ``tokens`` tokens."""
    experts = counts.numel()
    if isinstance(tokens, int) and tokens == 0:
        return prob_sum.sum() * 0.0
    f = counts.to(torch.float32) / tokens
    p = prob_sum.to(torch.float32) / tokens
    return experts * torch.sum(f * p)


def _grouped_mm() -> Callable[..., torch.Tensor] | None:
    """torch's grouped GEMM: ``F.grouped_mm`` (torch 2.13), ``torch._grouped_mm`` before."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)   # what it takes on the CPU


def can_group(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes these operands: every row 16-byte aligned, and
    on CUDA bf16 on sm90+ (its kernels' constraint); on CPU fp32, bf16 or fp16."""
    if _grouped_mm() is None or x.dtype not in _GROUPED_DTYPES:
        return False
    if x.is_cuda and (x.dtype != torch.bfloat16
                      or torch.cuda.get_device_capability(x.device) < (9, 0)):
        return False
    dims = [x.shape[-1]] + [d for w in weights for d in w.shape[1:]]
    return all(d * x.element_size() % 16 == 0 for d in dims)


def expert_ffn(x: torch.Tensor, sizes: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
               w2: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor], *,
               grouped: bool | None = None) -> torch.Tensor:
    """SwiGLU experts on rows sorted by expert: rows ``[offset_e, offset_e + sizes[e])``
    of ``x [N, hidden]`` go through expert ``e`` of the stacked ``w1``, ``w3``
    ``[E, ffn, hidden]`` and ``w2 [E, hidden, ffn]``; returns ``[N, hidden]``. One grouped
    GEMM per projection where torch has one for these operands (``can_group``; ``grouped``
    forces the choice), else a loop over the experts."""
    if grouped is None:
        # Fake tensors (``values_unknown``): torch's shape rule for the grouped GEMM takes
        # bf16 only; the loop holds the same memory.
        grouped = can_group(x, w1, w3, w2) and not (values_unknown(x)
                                                     and x.dtype != torch.bfloat16)
    split = sizes if isinstance(sizes, list) else None     # assumed sizes (assumed_kept)
    if split is not None:
        sizes = torch.tensor(split, device=x.device)
    if grouped:
        mm = _grouped_mm()
        offs = torch.cumsum(sizes, 0).to(torch.int32)
        h = (act(mm(x, w1.transpose(-2, -1), offs=offs))
             * mm(x, w3.transpose(-2, -1), offs=offs))
        return mm(h, w2.transpose(-2, -1), offs=offs)
    # Every expert, even one with no rows: its weights then get zero gradients, not None.
    outs = [F.linear(act(F.linear(rows, w1[e])) * F.linear(rows, w3[e]), w2[e])
            for e, rows in enumerate(torch.split(x, split or sizes.tolist()))]
    return torch.cat(outs)


def place_rows(y: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """``[n, ...]`` rows: ``y[i]`` at row ``rows[i]``, zeros elsewhere. Written with
    ``index_put``, whose backward keeps only the index: ``index_copy`` would keep ``y``
    itself for backward (a copy of every slot's output per MoE layer;
    ``cost.unit._moe_block_bytes`` prices what stays)."""
    return y.new_zeros(n, *y.shape[1:]).index_put((rows,), y)


def values_unknown(t: torch.Tensor) -> bool:
    """Whether ``t``'s values cannot be read: a fake tensor (``dtc memcheck`` measures the
    stages on them), on which the routing's data-dependent sizes cannot be computed."""
    from torch._subclasses.fake_tensor import is_fake
    return is_fake(t)


def mean_counts(slots: int, experts: int) -> list[int]:
    """The one rule for routed sizes where they cannot be known (``values_unknown``): every
    expert gets the mean share of the slots (the first ``slots % experts`` one more), as
    the cost model prices an MoE block (``cost.model``). Used only there: a real run
    always routes by its router."""
    base, extra = divmod(slots, experts)
    return [base + (e < extra) for e in range(experts)]


def assumed_kept(processes: int, tokens: int, config: MoEConfig) -> list[list[int]]:
    """``kept_counts [processes, E]`` under ``mean_counts`` (every process ``tokens``
    tokens, capacity applied as ``keep_counts`` does), as lists: sizes to read, where a
    fake mode allows no real tensor."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily():
        counts = torch.tensor([mean_counts(tokens * config.top_k, config.experts)]
                              * processes)
        if config.capacity_factor is not None:
            counts = keep_counts(counts, capacity(config.capacity_factor, tokens * processes,
                                                  config.top_k, config.experts))
        return counts.tolist()


def _keep_within_capacity(sorted_experts: torch.Tensor, counts: torch.Tensor,
                          keep: torch.Tensor) -> torch.Tensor:
    """For slots sorted by expert (``counts`` per expert), which ones are among the first
    ``keep[e]`` of their expert."""
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(sorted_experts.numel(), device=counts.device) - starts[sorted_experts]
    return position < keep[sorted_experts]


class _Unscaled:
    """No loss scale (``set_loss_scale``): training outside fp16."""

    scale = 1.0


class MoE(nn.Module):
    """The MoE block (module docstring). ``forward(x) -> MoEOutput``. ``first_expert`` and
    ``local_experts`` say which experts this module holds (all, unless expert parallelism
    built it, ``parallel.ep``)."""

    rank = 0        # this process's row of ``exchange_counts`` (an EP rank sets its own)
    # Tensor parallelism inside the block (``parallel.tp.parallelize_moe``): the TP mesh,
    # None without it (module docstring, "Tensor parallelism").
    tp_mesh: Any = None
    # Under context parallelism, the stage's ``parallel.cp.CPGroup`` (``train.cp_run.use_cp``):
    # a sequence's tokens are spread over its ranks, and so are its balance statistics.
    cp: Any = None
    # The stacked experts' TP mesh where it is not ``tp_mesh``: under expert parallelism
    # the expert DP mesh's (``parallel.mesh.ExpertGroups.mesh["tp"]``, same ranks), as
    # FSDP2 shards them over that mesh.
    experts_tp_mesh: Any = None

    def __init__(self, config: MoEConfig, *, first_expert: int = 0,
                 local_experts: int | None = None):
        super().__init__()
        self.config = config
        self.first_expert = first_expert
        self.local_experts = config.experts if local_experts is None else local_experts
        if not (0 <= first_expert and self.local_experts >= 1
                and first_expert + self.local_experts <= config.experts):
            raise ValueError(f"experts {first_expert}..{first_expert + self.local_experts - 1}"
                             f" are not among the block's {config.experts}")
        n, h, f = self.local_experts, config.hidden, config.ffn
        self.act = activation(config.act)
        self.router = nn.Linear(h, config.experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(n, f, h))
        self.w3 = nn.Parameter(torch.empty(n, f, h))
        self.w2 = nn.Parameter(torch.empty(n, h, f))
        self.shared = MLP(h, config.shared_ffn, swiglu=True, act=config.act) \
            if config.shared_ffn else None
        self.shared_gate = nn.Linear(h, 1, bias=False) if config.shared_gate else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Experts as ``nn.Linear`` initialises its weights (uniform, bound 1/sqrt(in))."""
        for w in (self.w1, self.w3, self.w2):
            bound = 1.0 / math.sqrt(w.shape[-1])
            nn.init.uniform_(w, -bound, bound)

    def global_block(self, attr: str, shape: tuple[int, ...], offsets: tuple[int, ...]
                     ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Where parameter ``attr``'s block (``shape`` at ``offsets`` in what this module
        holds) lies in the one-process block's (``models.init.local_block``): the stacked
        experts' rows start at ``first_expert`` of ``config.experts``."""
        if attr not in ("w1", "w3", "w2") or self.local_experts == self.config.experts:
            return shape, offsets
        return ((self.config.experts, *shape[1:]),
                (offsets[0] + self.first_expert, *offsets[1:]))

    # -- the steps ------------------------------------------------------------------------

    def route(self, x: torch.Tensor) -> Routing:
        """The router on ``x [T, hidden]``."""
        logits = F.linear(x, self.replicated(self.router.weight))
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.config.top_k, dim=-1)
        if self.config.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(logits, probs, weights.to(x.dtype), experts)

    def replicated(self, weight: torch.Tensor) -> torch.Tensor:
        """A parameter replicated over TP (the router, the shared expert's gate) as this
        rank computes with it: under TP its gradient here is this rank's part of the sum
        (its experts' columns' share of the combine), so it is marked ``Partial`` and
        summed over TP once (FSDP2, before its reduce-scatter), not averaged."""
        if self.tp_mesh is None:
            return weight
        from torch.distributed.tensor import Partial

        return weight.to_local(grad_placements=[Partial()] * weight.device_mesh.ndim)

    def shared_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert (times its gate, when it has one) on ``x [T, hidden]``; under
        TP this rank's columns of it, a partial sum as the routed experts' output is."""
        s = self.shared
        out = s(x) if self.tp_mesh is None else F.linear(
            s.act(F.linear(x, local_shard(s.w1.weight))) * F.linear(x, local_shard(
                s.w3.weight)), local_shard(s.w2.weight))
        if self.shared_gate is not None:
            out = torch.sigmoid(F.linear(x, self.replicated(self.shared_gate.weight))) * out
        return out

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Every process's slots per expert ``[processes, E]``, this one's row at
        ``self.rank``: here, this process alone (expert parallelism gathers its group's)."""
        return counts[None]

    def reduce_prob_sum(self, prob_sum: torch.Tensor) -> torch.Tensor:
        """The summed router probabilities over the processes that share the aux loss
        (here, this one)."""
        return prob_sum

    def experts_forward(self, x: torch.Tensor, sizes: Any) -> torch.Tensor:
        """The local experts on rows sorted by expert, ``sizes[e]`` rows each."""
        return expert_ffn(x, sizes, local_shard(self.w1), local_shard(self.w3),
                          local_shard(self.w2), self.act)

    def run_experts(self, x: torch.Tensor, routing: Routing, kept_counts: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each slot's expert output ``[T * k, hidden]`` (zero where dropped) and the kept
        mask ``[T * k]``; ``kept_counts [processes, E]``: the slots each process keeps for
        each expert (its first ones in token order), all experts local here."""
        if self.local_experts != self.config.experts:
            raise RuntimeError(f"this block holds {self.local_experts} of the "
                               f"{self.config.experts} experts: run it as "
                               f"parallel.ep.ExpertParallelMoE over its EP group")
        rows = self.kept_slots(routing, kept_counts[self.rank])
        y = self.experts_forward(x[rows // self.config.top_k], kept_counts[self.rank])
        return self.scatter_slots(x, routing, rows, y)

    def kept_slots(self, routing: Routing, keep: torch.Tensor) -> torch.Tensor:
        """This process's kept slots sorted by expert, then token (``keep[e]``: the first
        slots of expert ``e`` it keeps)."""
        flat = routing.experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        if values_unknown(flat):    # under ``mean_counts``: a static number of them
            return order[:sum(keep)]
        sorted_experts = flat[order]
        counts = torch.bincount(flat, minlength=self.config.experts)
        return order[_keep_within_capacity(sorted_experts, counts, keep)]

    @staticmethod
    def scatter_slots(x: torch.Tensor, routing: Routing, rows: torch.Tensor,
                      y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert outputs ``y`` of slots ``rows`` placed at their slots (zero elsewhere),
        and the kept mask."""
        n = routing.experts.numel()
        kept = torch.zeros(n, dtype=torch.bool, device=x.device).index_fill(0, rows, True)
        return place_rows(y, rows, n), kept

    def sequence_loss(self, routing: Routing, sequences: torch.Tensor,
                      n: int | None = None) -> torch.Tensor:
        """The load-balancing loss of each sequence over its own tokens, summed over the
        sequences (DeepSeek-V3's sequence-wise balance loss; Megatron-LM's
        ``seq_aux_loss``): ``sequences [T]`` the sequence of each token, of ``n`` (default:
        as many as they name). What a step adds up is then the same however its sequences
        are grouped into microbatches and spread over ranks. Under context parallelism
        (``cp``) each statistic is summed over the CP ranks first (the probabilities'
        gradients flow back to each rank's tokens), so every CP rank has the sequence's
        whole loss."""
        cfg = self.config
        unknown = values_unknown(sequences)
        # Unknown values: as many sequences as tokens, at most (the sizes stay static).
        if n is None or unknown:
            n = sequences.numel() if unknown else \
                int(sequences.max()) + 1 if sequences.numel() else 0
        if n == 0:
            return routing.probs.sum() * 0.0
        tokens = torch.zeros(n, device=sequences.device).index_add(
            0, sequences, torch.ones(sequences.shape, device=sequences.device))
        counts = torch.zeros(n, cfg.experts, device=sequences.device).index_put_(
            (sequences.repeat_interleave(cfg.top_k), routing.experts.reshape(-1)),
            torch.ones((), device=sequences.device), accumulate=True)
        probs = routing.probs.new_zeros(n, cfg.experts).index_add(0, sequences, routing.probs)
        if self.cp is not None:
            import torch.distributed as dist
            from torch.distributed.nn.functional import all_reduce

            for group in self.cp.groups():
                dist.all_reduce(tokens, group=group)
                dist.all_reduce(counts, group=group)
                probs = all_reduce(probs, group=group)
        tokens = tokens.clamp(min=1)
        return cfg.experts * torch.sum(counts / tokens[:, None] * probs / tokens[:, None])

    def _balance(self, routing: Routing, all_counts: torch.Tensor, tokens: int | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(aux loss, kept slots ``[processes, E]``, dropped slots, slots per expert) over
        the group's tokens (this process's alone without expert parallelism); ``tokens``:
        each process's, where the counts' values are unknown (``mean_counts``)."""
        cfg = self.config
        g_counts = all_counts.sum(0)
        g_tokens = int(g_counts.sum()) // cfg.top_k if tokens is None \
            else tokens * all_counts.shape[0]       # every token has k slots
        aux = load_balancing_loss(g_counts, self.reduce_prob_sum(routing.probs.sum(0)),
                                  g_tokens)
        if cfg.capacity_factor is None:
            return aux, all_counts, torch.zeros_like(g_counts.sum()), g_counts
        cap = capacity(cfg.capacity_factor, g_tokens, cfg.top_k, cfg.experts)
        return aux, keep_counts(all_counts, cap), (g_counts - cap).clamp(min=0).sum(), g_counts

    def forward(self, x: torch.Tensor, sequences: torch.Tensor | None = None,
                n_sequences: int | None = None) -> MoEOutput:
        """The block on ``x [..., hidden]``; with ``sequences`` (the sequence of each of
        its tokens, of ``n_sequences``) the aux loss is ``sequence_loss``'s, else the whole
        batch's."""
        cfg = self.config
        shape = x.shape
        x2 = x.reshape(-1, cfg.hidden)
        tokens = x2.shape[0]
        routing = self.route(x2)
        unknown = values_unknown(x2)
        counts = torch.tensor(mean_counts(tokens * cfg.top_k, cfg.experts),
                              device=x.device) if unknown else \
            torch.bincount(routing.experts.reshape(-1), minlength=cfg.experts)
        all_counts = self.exchange_counts(counts)
        aux, kept_counts, dropped, g_counts = self._balance(routing, all_counts,
                                                            tokens if unknown else None)
        if unknown:     # sizes to read (the all-to-all's splits): the same rule's, real
            kept_counts = assumed_kept(all_counts.shape[0], tokens, cfg)
        if sequences is not None:
            aux = self.sequence_loss(routing, sequences, n_sequences)
        slots, kept = self.run_experts(x2, routing, kept_counts)
        # Slot ``t * k + j`` is token ``t``'s ``j``-th: one batched product of each token's
        # weights and slots, which keeps those two for backward and makes no weighted
        # copy of the slots (an ``index_add`` of them would keep that copy too).
        out = torch.bmm(routing.weights[:, None, :],
                        slots.view(tokens, cfg.top_k, cfg.hidden)).squeeze(1)
        if self.shared is not None:
            out = out + self.shared_forward(x2)
        return MoEOutput(out.reshape(shape), routing.logits, aux, dropped,
                         kept.reshape(tokens, cfg.top_k), g_counts)


    # -- in a transformer layer -------------------------------------------------------------

    aux_weight = 1.0    # what the aux loss counts for in the training loss (set_aux_weight)
    dropped_slots: Any = 0      # slots over capacity since the block was built (layer_output)
    loss_scale: Any = _Unscaled     # fp16's loss scale, its .scale (set_loss_scale)

    def layer_forward(self, x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """The block in a transformer layer on ``x [B, S, hidden]``: only the rows that
        ``valid [B, S]`` marks (a microbatch's tokens, not its padding) are routed, each
        sequence's balance loss over its own tokens (``sequence_loss``); padding rows
        get zeros. ``valid`` None: every row is a token."""
        if self.tp_mesh is not None:    # this rank's piece of the sequence: gather it
            x = _tp_gather(x, self.tp_mesh)
        batch, seq, hidden = x.shape
        if valid is None:
            valid = torch.ones(batch, seq, dtype=torch.bool, device=x.device)
        # Unknown values (``values_unknown``): every row a token, a static size.
        rows = torch.arange(batch * seq, device=x.device) if values_unknown(valid) \
            else valid.reshape(-1).nonzero().squeeze(1)
        flat = x.reshape(-1, hidden)
        y = self.layer_output(self(flat[rows], sequences=torch.div(rows, seq,
                                                                   rounding_mode="floor"),
                                   n_sequences=batch))
        out = place_rows(y, rows, flat.shape[0]).view_as(x)
        return out if self.tp_mesh is None else _tp_reduce_scatter(out, self.tp_mesh)

    def layer_output(self, out: MoEOutput) -> torch.Tensor:
        """The block's output as a transformer layer adds it to the residual: ``out.out``,
        through which the backward also gives the aux loss its gradient (``aux_weight``
        times it joins the loss, Megatron-LM's ``MoEAuxLossAutoScaler``: on every pipeline
        stage, without sending it to the last). Its weighted value is kept for the loss
        report (``take_aux_losses``), but not when the backward recomputes the forward;
        so are the slots capacity dropped, summed into ``dropped_slots`` (a tensor on the
        device, never read here: in an EP group, the group's drops)."""
        aux = out.aux_loss * self.aux_weight
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            self.__dict__.setdefault("_aux_values", []).append(aux.detach())
            self.dropped_slots = self.dropped_slots + out.dropped.detach()
        if not (torch.is_grad_enabled() and aux.requires_grad):
            return out.out
        # Under TP (and CP) every rank computes the same aux loss: each gives it 1/tp
        # (1/(tp cp)) of its gradient, so the sums over TP (the router's, the input's) and
        # over CP (the probabilities') count it once.
        share = (1 if self.tp_mesh is None else self.tp_mesh.size()) * \
            (1 if self.cp is None else self.cp.size)
        return _AuxGrad.apply(out.out, aux, self.loss_scale.scale / share)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's block of a TP-sharded parameter (a DTensor; its gradient is that
    block's), or ``t`` itself off a mesh."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _tp_gather(x: torch.Tensor, mesh: Any) -> torch.Tensor:
    """The whole ``[B, S, hidden]`` from this TP rank's piece ``[B, S / tp, hidden]``
    (all-gather); its gradient on each rank is a part of the sum (the rank's columns of
    the experts), reduce-scattered back to the pieces in backward."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    return DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(
        mesh, [Replicate()]).to_local(grad_placements=[Partial()])


def _tp_reduce_scatter(y: torch.Tensor, mesh: Any) -> torch.Tensor:
    """This rank's piece ``[B, S / tp, hidden]`` of the sum over TP of the ranks' partial
    outputs ``[B, S, hidden]`` (reduce-scatter); in backward its gradient is gathered."""
    from torch.distributed.tensor import DTensor, Partial, Shard

    return DTensor.from_local(y, mesh, [Partial()], run_check=False).redistribute(
        mesh, [Shard(1)]).to_local()


class _AuxGrad(torch.autograd.Function):
    """The identity on ``x``; backward: gradient ``scale`` for ``aux`` (a loss term; fp16's
    loss scale, one otherwise), as the loss's own backward starts from the scale."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


def moe_config(arch) -> MoEConfig:
    """The block of an MoE backbone's architecture (``ir.TransformerArch`` with ``moe``)."""
    moe = arch.moe
    return MoEConfig(hidden=arch.hidden, ffn=moe.ffn, experts=moe.experts, top_k=moe.top_k,
                     norm_topk=moe.norm_topk, shared_ffn=moe.shared_ffn,
                     shared_gate=moe.shared_gate, capacity_factor=moe.capacity_factor,
                     act=arch.act if arch.swiglu else "silu")


def build_moe(arch, *, tp: int = 1) -> MoE:
    """The block of one MoE layer of ``arch``, all experts local (expert parallelism
    replaces it, ``parallel.ep``). Its aux loss counts ``aux_loss_coef`` times until
    ``set_aux_weight`` says how many sequences a step has. ``tp``: one TP rank's shard as
    ``models.transformer``'s classes take it (each expert's and the shared expert's
    columns over ``tp``: what a rank computes, for timing a layer); the runtime builds
    ``tp = 1`` and shards the block with DTensor (``parallel.tp.parallelize_moe``).
    ValueError when ``tp`` does not divide those columns."""
    config = moe_config(arch)
    if config.ffn % tp or config.shared_ffn % tp:
        raise ValueError(f"tensor parallelism {tp} cannot split an expert's {config.ffn} "
                         f"columns (shared expert: {config.shared_ffn}) evenly")
    if tp > 1:
        config = replace(config, ffn=config.ffn // tp, shared_ffn=config.shared_ffn // tp)
    block = MoE(config)
    block.aux_weight = arch.moe.aux_loss_coef
    # The experts' down projections write into the residual stream (models.init).
    block.param_init_std = {"w2": 0.02 / math.sqrt(2 * max(1, arch.layers))}
    return block


def set_aux_weight(module: nn.Module, coef: float, sequences: int) -> None:
    """Make every MoE block in ``module`` count ``coef / sequences`` of its summed
    per-sequence aux losses (``MoE.layer_forward``): the step's aux loss is ``coef`` times
    the mean over the step's ``sequences`` sequences (its global batch), summed over the
    MoE layers."""
    for m in module.modules():
        if isinstance(m, MoE):
            m.aux_weight = coef / max(1, sequences)


def moe_blocks(module: nn.Module) -> list[MoE]:
    """The MoE blocks in ``module``, in module order: found once where a model is built,
    not walked again every microbatch (``take_aux_losses``, ``set_loss_scale``)."""
    return [m for m in module.modules() if isinstance(m, MoE)]


def take_aux_losses(blocks: Sequence[MoE]) -> torch.Tensor | None:
    """The weighted aux losses MoE blocks ``blocks`` (``moe_blocks``) kept since the last
    call, summed (and forgotten); None when there is no block."""
    if not blocks:
        return None
    values = [v for m in blocks for v in m.__dict__.pop("_aux_values", [])]
    return torch.stack(values).sum() if values else torch.zeros(())


def set_loss_scale(blocks: Sequence[MoE], scale: Any) -> None:
    """Give MoE blocks ``blocks`` fp16's dynamic loss scale ``scale`` (a
    ``train.optim.LossScale``, read at each forward: its ``scale`` changes between steps;
    None: no scaling). Their aux losses' gradient joins the backward inside the layers
    (``MoE.layer_output``), not through the scaled loss, so it carries the scale itself."""
    for m in blocks:
        m.loss_scale = _Unscaled if scale is None else scale


def keep_counts(all_counts: torch.Tensor, cap: int) -> torch.Tensor:
    """The slots each process keeps for each expert ``[processes, E]`` when an expert
    takes ``cap``, the first ones in (process, token) order: what the processes before it
    leave, at most its own."""
    before = torch.cumsum(all_counts, 0) - all_counts
    return (cap - before).clamp(min=0).minimum(all_counts)


# ---- Hugging Face names -----------------------------------------------------------------

# The Hub's per-expert layout: (block prefix, router, expert's gate/up/down, shared expert).
HF_MOE_FAMILIES = {
    "qwen2_moe": ("mlp.", "gate", ("gate_proj", "up_proj", "down_proj"),
                  ("shared_expert", "shared_expert_gate")),
    "qwen3_moe": ("mlp.", "gate", ("gate_proj", "up_proj", "down_proj"), None),
    "mixtral": ("block_sparse_moe.", "gate", ("w1", "w3", "w2"), None),
}
_FUSED_PREFIX = "mlp."      # transformers 5 keeps every family's block as ``mlp``


def _family(family: str) -> tuple:
    if family not in HF_MOE_FAMILIES:
        raise ValueError(f"no MoE layout for the model family {family!r}: give one of "
                         f"{', '.join(sorted(HF_MOE_FAMILIES))}")
    return HF_MOE_FAMILIES[family]


def hf_moe_keys(family: str, config: MoEConfig, experts: range | None = None
                ) -> dict[str, tuple[str, ...]]:
    """dtdsl's block parameter names mapped to the Hub checkpoint keys of one decoder
    layer (relative to ``model.layers.N.``): one key each, but ``w1``, ``w3`` and ``w2``,
    whose slice ``i`` is expert ``experts[i]``'s key (``experts``: the experts this rank
    holds, all by default)."""
    prefix, router, (gate, up, down), shared = _family(family)
    experts = range(config.experts) if experts is None else experts
    out: dict[str, tuple[str, ...]] = {"router.weight": (f"{prefix}{router}.weight",)}
    for mine, theirs in (("w1", gate), ("w3", up), ("w2", down)):
        out[mine] = tuple(f"{prefix}experts.{e}.{theirs}.weight" for e in experts)
    if config.shared_ffn:
        if shared is None:
            raise ValueError(f"a {family} block has no shared expert: give shared_ffn=0")
        mlp, gate_name = shared
        if not config.shared_gate:
            raise ValueError(f"a {family} block's shared expert has a gate "
                             f"({prefix}{gate_name}): give shared_gate=True")
        for mine, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            out[f"shared.{mine}.weight"] = (f"{prefix}{mlp}.{theirs}.weight",)
        out["shared_gate.weight"] = (f"{prefix}{gate_name}.weight",)
    return out


def _fused_source(state: Mapping[str, torch.Tensor], mine: str,
                  config: MoEConfig, experts: range) -> torch.Tensor | None:
    """``w1``/``w3``/``w2`` from transformers 5's in-memory stacked layout
    (``mlp.experts.gate_up_proj [E, 2 ffn, hidden]``, ``mlp.experts.down_proj``), or None
    when ``state`` does not have it."""
    key = _FUSED_PREFIX + ("experts.down_proj" if mine == "w2" else "experts.gate_up_proj")
    if key not in state:
        return None
    t = state[key][experts.start:experts.stop]
    if mine == "w2":
        return t
    f = config.ffn
    return t[:, :f] if mine == "w1" else t[:, f:2 * f]


def load_hf_moe(state: Mapping[str, torch.Tensor], family: str, config: MoEConfig,
                experts: range | None = None) -> dict[str, torch.Tensor]:
    """The block's parameters (``experts``' slices of the stacked ones) from one decoder
    layer's tensors ``state`` (keys relative to ``model.layers.N.``), in the Hub's
    per-expert layout (``hf_moe_keys``) or transformers 5's stacked one. KeyError naming
    the key that is missing, ValueError for a tensor of the wrong shape."""
    experts = range(config.experts) if experts is None else experts
    keys = hf_moe_keys(family, config, experts)
    out: dict[str, torch.Tensor] = {}
    for mine, theirs in keys.items():
        if mine in ("w1", "w3", "w2"):
            t = _fused_source(state, mine, config, experts)
            if t is None:
                t = torch.stack([_get(state, k) for k in theirs])
        else:
            # transformers 5 calls every family's block ``mlp`` (Mixtral's Hub name differs).
            t = _get(state, theirs[0], _FUSED_PREFIX + theirs[0].partition(".")[2])
        out[mine] = t
    _check_shapes(out, config, len(experts))
    return out


def _get(state: Mapping[str, torch.Tensor], key: str, *other: str) -> torch.Tensor:
    for k in (key, *other):
        if k in state:
            return state[k]
    raise KeyError(f"the checkpoint has no tensor {key!r}")


def _check_shapes(params: Mapping[str, torch.Tensor], config: MoEConfig, n: int) -> None:
    h, f, s = config.hidden, config.ffn, config.shared_ffn
    want = {"router.weight": (config.experts, h), "w1": (n, f, h), "w3": (n, f, h),
            "w2": (n, h, f), "shared.w1.weight": (s, h), "shared.w3.weight": (s, h),
            "shared.w2.weight": (h, s), "shared_gate.weight": (1, h)}
    for name, t in params.items():
        if tuple(t.shape) != want[name]:
            raise ValueError(f"the checkpoint's tensor for {name} has shape "
                             f"{tuple(t.shape)}, the block expects {want[name]}: check the "
                             f"config's expert count and widths")


def to_hf_moe(params: Mapping[str, torch.Tensor], family: str, config: MoEConfig,
              experts: range | None = None) -> dict[str, torch.Tensor]:
    """The inverse of ``load_hf_moe``: the Hub's per-expert tensors of one decoder layer
    from the block's parameters (``experts``: those the stacked ones hold)."""
    experts = range(config.experts) if experts is None else experts
    out: dict[str, torch.Tensor] = {}
    for mine, theirs in hf_moe_keys(family, config, experts).items():
        t = params[mine]
        if mine in ("w1", "w3", "w2"):
            for i, key in enumerate(theirs):
                out[key] = t[i]
        else:
            out[theirs[0]] = t
    return out
