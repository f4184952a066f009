"""The cost model: time, memory and communication of each parallelism unit.

A *unit* is a module with the projectors that run beside it: an encoder's
projector into the backbone runs on the encoder's last stage, a generator's
projector from the backbone on the generator's first stage (as in DistTrain).

All per-microbatch quantities are for one *backbone* microbatch (``micro_batch``
samples); a unit with data parallelism dp_u while the backbone has dp_lm
processes dp_lm / dp_u of them per step (``Algorithm 1``'s T_me).

Times come from FLOPs divided by the GPU's dense peak times an efficiency per
kind of work (``Efficiency``; calibratable), plus tensor-parallel all-reduces on
the intra-node bandwidth (inter-node once a TP group spans nodes). With a
measured profile (``dtdsl.cost.profile``, DistTrain's profiler) the compute part
is interpolated linearly between measurements instead: each unit keeps the sizes
its module and projectors see per backbone microbatch (``ProfileQuery``: the
distinct item sizes and how many of each a microbatch carries on average), and
the expected time is the weighted sum of the interpolated times.

Memory per GPU: weights, fp32 gradient buffers and optimizer state (fp32 master
weights, Adam m and v; sharded over dp under ZeRO-1; none for frozen units),
plus activations times the microbatches in flight at the unit's first stage.
In a chain encoder -> backbone -> generator under 1F1B, the encoder's first
stage holds one microbatch per stage downstream of it, not only its own.

Optimizer offload (``adamw(..., offload=F)``, ``train.offload``): the device keeps
``1 - F`` of the Adam moments (``optimizer_bytes_per_param``); the optimizer step is the
slower of the device's part and the host's (``_optimizer_coefficients``: the offloaded
parameters' 12 bytes over the host link, ``host_bw``, and the CPU's AdamW at
``ir.hardware.CPU_ADAM_PARAMS_PER_S``), which run at the same time.

Context parallelism (``UnitCost.cp``, ``with_cp``): each of cp ranks holds S / cp of a
microbatch's tokens, so its compute (attention too: the load-balanced causal sharding
gives every rank the same share), TP collectives, pipeline transfers and activations are
/ cp; the parameters are not split, their gradients are reduced and their optimizer
state sharded over dp x cp (Megatron-LM). On top, ``cp_comm_time_s``: the ring's K/V
blocks behind the attention of the block before, Ulysses' all-to-alls in full.

Mixture of experts (``flops.moe_mlp_per_token``): FLOPs count a token's ``top_k`` experts
(and the router and shared expert), memory every expert. Expert parallelism
(``UnitCost.ep``, ``with_ep``): each rank holds ``experts / ep`` of every MoE layer's
experts (their weights and gradients / ep, their optimizer state sharded over the dp / ep
replicas that hold the same experts: the same bytes as without EP), and
``ep_comm_time_s`` prices the dispatch and combine all-to-alls of every MoE layer, each
way, at the EP group's bandwidth (NVLink while ep x tp x cp ranks fit in a node). The
experts' gradients are priced as reduced over dp like the rest (their group is dp / ep:
the ring's (n - 1) / n differs a little).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from dtdsl.cost import flops
from dtdsl.cost.profile import ProfileTable
from dtdsl.cost.samples import (
    SampleSet,
    attention_squares,
    draw_samples,
    item_key,
    microbatch_lengths,
    microbatch_squares,
    positions,
)
from dtdsl.ir import program as ir
from dtdsl.ir.hardware import CPU_ADAM_PARAMS_PER_S
from dtdsl.ir.plan import cp_split

__all__ = [
    "OFFLOADED_BYTES_PER_PARAM", "CostModel", "CostParams", "Efficiency", "ProfileQuery",
    "UnitCost", "all_reduce_time_s", "build_cost_model", "in_flight",
]

_BYTES_BF16 = 2
_BYTES_FP32 = 4
# Bytes per parameter: (weights, gradient buffer, optimizer state) by precision.
_PARAM_BYTES = {"bf16": (2, 4, 12), "fp16": (2, 4, 12), "fp32": (4, 4, 8)}
_COLLECTIVE_LATENCY_S = 20e-6   # per ring step
OFFLOADED_BYTES_PER_PARAM = 8
"""Device bytes the optimizer offload frees per offloaded parameter: Adam's two fp32
moments (FSDP2's fp32 shard stays on the device; ``train.offload``)."""
# Host-link bytes per offloaded parameter and step: its fp32 value and gradient down, its
# new value up (``train.offload`` refreshes the host copy every step).
_OFFLOAD_LINK_BYTES = 12
# Bytes per gradient element the end of a step averages over TP (``train.stage``): FSDP2's
# reduce dtype, fp32, in which the sharded gradients are kept.
_TP_SYNC_GRAD_BYTES = 4


def _local_sgd_bytes(program: ir.Program, dp):
    """Bytes per trained parameter Local SGD keeps (``train.local_sgd``): the fp32 anchor
    and outer momentum, on units with more than one replica."""
    if not program.train.sync.local:
        return 0.0
    return np.where(np.asarray(dp) > 1, 2 * _BYTES_FP32, 0)


def _frozen_master_bytes(precision: str, dp, zero: int):
    """Bytes per frozen parameter beyond its compute copy: under mixed precision FSDP2 keeps
    the fp32 parameter sharded over DP (a trained one's is in its optimizer bytes)."""
    if precision == "fp32":
        return 0.0
    return 4 / (np.asarray(dp) if zero >= 1 else 1)


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


def all_reduce_time_s(num_bytes, ranks, bw_bytes_per_s: float):
    """A ring all-reduce: 2 (n - 1) / n of the data crosses each link, in 2 (n - 1) steps
    (zero for one rank). ``num_bytes`` and ``ranks`` may be arrays."""
    ranks = np.asarray(ranks, dtype=float)
    return 2 * (ranks - 1) / ranks * np.asarray(num_bytes, dtype=float) / bw_bytes_per_s + \
        2 * (ranks - 1) * _COLLECTIVE_LATENCY_S


def in_flight(schedule: str, layers: int, pp, vpp, depth, microbatches):
    """Activations held at a unit's first stage at the peak, as (microbatches in flight,
    layers each of them holds there).

    ``depth`` is the number of pipeline stages from this stage to the end of the chain
    (this unit's own and every unit downstream). GPipe keeps every microbatch; 1F1B
    keeps ``depth`` microbatches of its ``layers / pp`` layers; interleaved 1F1B keeps
    its first stage's warm-up and one more forward, (vpp - 1) G + 2 (pp - 1) + 1 + D
    chunks of ``layers / (pp vpp)`` layers (at most all M vpp), D = depth - pp the stages
    downstream and G the first microbatch group of ``dtdsl.schedule.lower.group_sizes``:
    ceil(M / max(1, M // max(pp, D))): pp where pp divides M and D <= pp (Megatron-LM's
    2 (pp - 1) + (vpp - 1) pp + 1), more otherwise (torch's ScheduleInterleaved1F1B).
    Arguments other than ``schedule`` may be arrays."""
    pp = np.asarray(pp)
    per_stage = np.ceil(layers / pp)
    if schedule == "gpipe":
        shape = np.broadcast(pp, np.asarray(depth), np.asarray(microbatches)).shape
        return np.broadcast_to(microbatches, shape), per_stage
    one_f_one_b = np.minimum(depth, microbatches)
    if schedule != "interleaved":
        return one_f_one_b, per_stage
    vpp = np.asarray(vpp)
    m = np.asarray(microbatches)
    down = np.asarray(depth) - pp
    groups = np.maximum(1, m // np.maximum(np.maximum(pp, down), 1))
    first_group = -(-m // groups)
    chunks = np.minimum(2 * (pp - 1) + (vpp - 1) * first_group + 1 + down, m * vpp)
    interleaved = vpp > 1
    return (np.where(interleaved, chunks, one_f_one_b),
            np.where(interleaved, np.ceil(layers / (pp * vpp)), per_stage))


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
    recompute: bool
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


@dataclass(frozen=True)
class CostModel:
    """Unit costs and the cluster they run on."""

    program: ir.Program
    params: CostParams
    units: tuple[UnitCost, ...]
    profile: ProfileTable | None = None
    # fwd_bwd_time_s per (unit, tp): asked for every layout the planner evaluates.
    _times: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def unit(self, name: str) -> UnitCost:
        for u in self.units:
            if u.name == name:
                return u
        raise KeyError(name)

    @property
    def peak_flops(self) -> float:
        return self.program.cluster.gpu.peak_flops

    def _tp_bandwidth(self, tp: int, across_nodes: bool = False) -> float:
        """The link a TP group's collectives cross: NVLink when the group's ranks are on
        one node, the network when they span two or more (``across_nodes``: where the
        plan places it, ``ir.plan.place_units``; a group larger than a node always does).
        A ring is as fast as its slowest link."""
        cluster = self.program.cluster
        if tp <= cluster.gpus_per_node and not across_nodes:
            return cluster.intra_node_bw_bytes_per_s
        return cluster.inter_node_bw_bytes_per_s

    @property
    def offload_fraction(self) -> float:
        """The fraction of each rank's optimizer state and update on the CPU: the
        program's (none for ``offload=auto`` until ``with_offload`` gives one)."""
        offload = self.program.train.optimizer.offload
        return 0.0 if offload == "auto" else float(offload)

    def with_offload(self, fraction: float) -> CostModel:
        """This cost model of the program with ``offload=fraction`` (the planner's
        choice for ``offload=auto``, a plan's ``offload``): in the program, so that what
        rebuilds costs from ``self.program`` (the baselines, packing) prices it too."""
        train = self.program.train
        optimizer = train.optimizer.model_copy(update={"offload": float(fraction)})
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"offload {fraction}: a fraction between 0 and 1")
        program = self.program.model_copy(update={"train": train.model_copy(
            update={"optimizer": optimizer})})
        return replace(self, program=program)

    def optimizer_bytes_per_param(self) -> float:
        """Device bytes of optimizer state per trained parameter before its DP sharding:
        ``_PARAM_BYTES``'s, less the moments of the offloaded fraction (the runtime's
        ``train.offload`` keeps FSDP2's fp32 shard on the device)."""
        optim_b = _PARAM_BYTES[self.program.train.precision][2]
        return optim_b - self.offload_fraction * OFFLOADED_BYTES_PER_PARAM

    def offload_rate_s_per_param(self) -> float:
        """Seconds per offloaded parameter of the host's part of the step: its value and
        gradient down and its new value up over the host link (fp32 each), and torch's
        CPU AdamW at ``CPU_ADAM_PARAMS_PER_S``."""
        bw = self.program.cluster.host_bw_bytes_per_s
        return _OFFLOAD_LINK_BYTES / bw + 1.0 / CPU_ADAM_PARAMS_PER_S

    def with_cp(self, cps: dict[str, int]) -> CostModel:
        """This cost model with unit ``name`` at context parallelism ``cps[name]`` (the
        others as they are)."""
        units = tuple(replace(u, cp=int(cps.get(u.name, u.cp))) for u in self.units)
        return replace(self, units=units)

    def with_ep(self, eps: dict[str, int]) -> CostModel:
        """This cost model with unit ``name`` at expert parallelism ``eps[name]`` (the
        others as they are)."""
        units = tuple(replace(u, ep=int(eps.get(u.name, u.ep))) for u in self.units)
        return replace(self, units=units)

    def ep_bandwidth(self, unit: UnitCost, tp: int) -> float:
        """The link an EP group's all-to-alls cross: its ep replicas are tp x cp ranks
        apart (TP innermost), so ep x tp x cp consecutive ranks hold it, within a node
        (NVLink) while they fit in one."""
        cluster = self.program.cluster
        if unit.ep * tp * unit.cp <= cluster.gpus_per_node:
            return cluster.intra_node_bw_bytes_per_s
        return cluster.inter_node_bw_bytes_per_s

    def ep_comm_time_s(self, unit: UnitCost, tp: int) -> tuple[float, float]:
        """(forward, backward) seconds of one backbone microbatch's all-to-alls under
        expert parallelism: per MoE layer a dispatch and a combine, each sending the
        (ep - 1) / ep of a rank's routed rows (bf16) that go to other ranks, in ep - 1
        steps; the backward exchanges the gradients the same way. A rank runs its 1 / (tp
        cp) of the tokens (sequence and context parallelism). Zero at ep 1."""
        if unit.ep <= 1 or not unit.ep_elements:
            return 0.0, 0.0
        sent = 2 * unit.ep_elements * _BYTES_BF16 / (tp * unit.cp) * (unit.ep - 1) / unit.ep
        fwd = sent / self.ep_bandwidth(unit, tp) + \
            2 * unit.ep_layers * (unit.ep - 1) * _COLLECTIVE_LATENCY_S
        return fwd, (fwd if unit.backward_factor else 0.0)

    def compute_time_s(self, unit: UnitCost, tp: int) -> float:
        """Forward compute of one backbone microbatch through the whole unit at TP ``tp``
        on one rank of its CP group (analytic, whether or not there is a profile)."""
        eff = self.params.efficiency
        w = unit.fwd_work
        return (w.matmul / eff.matmul + w.attention / eff.attention + w.conv / eff.conv) / \
            (self.peak_flops * tp * unit.cp)

    def _attention_layer_s(self, unit: UnitCost, tp: int) -> float:
        """One layer's forward attention of one microbatch on one rank of the CP group."""
        return unit.fwd_work.attention / self.params.efficiency.attention / \
            (self.peak_flops * tp * unit.cp * max(unit.layers, 1))

    def cp_comm_time_s(self, unit: UnitCost, tp: int) -> tuple[float, float]:
        """Exposed context-parallel communication of one microbatch through the whole
        unit, (forward, backward), on one rank (``ir.plan.cp_split`` says how its cp
        ranks split into a ring of ``r`` and Ulysses of ``u``; a CP group spans tp x cp
        consecutive ranks, on one node's links where tp x cp fits a node).

        Ulysses: four all-to-alls a layer forward (Q, K and V to head shards, the output
        back), four backward, each moving (u - 1) / u of the rank's tokens' elements, on
        NVLink where tp x u fits a node. Ring: r - 1 steps a layer, each sending a block of
        K and V, 2 x (S / r) x kv_width / (tp u) elements in bf16, to the next rank while
        the rank attends over the block it has (its attention / r): max(0, comm -
        compute) exposed per step. Backward sends K, V and their gradients: twice the
        bytes, against the attention's backward."""
        c = unit.cp
        if c <= 1 or unit.cp_tokens <= 0:
            return 0.0, 0.0
        cluster = self.program.cluster
        node = cluster.gpus_per_node
        ring, uly = cp_split(unit.cp_method, c, tp, node)
        layers = max(unit.layers, 1)
        fwd = bwd = 0.0
        if uly > 1:
            bw = cluster.intra_node_bw_bytes_per_s if tp * uly <= node else \
                cluster.inter_node_bw_bytes_per_s
            elements = unit.cp_tokens / c * (2 * unit.cp_q_width + 2 * unit.cp_kv_width) / tp
            one = elements * _BYTES_BF16 * (uly - 1) / uly / bw + \
                4 * (uly - 1) * _COLLECTIVE_LATENCY_S
            fwd += layers * one
            bwd += layers * one
        if ring > 1:
            bw = cluster.intra_node_bw_bytes_per_s if tp * c <= node else \
                cluster.inter_node_bw_bytes_per_s
            block = 2 * unit.cp_tokens / ring * unit.cp_kv_width / (tp * uly) * _BYTES_BF16
            send = block / bw + _COLLECTIVE_LATENCY_S
            attend = self._attention_layer_s(unit, tp) / ring
            fwd += layers * (ring - 1) * max(0.0, send - attend)
            bwd += layers * (ring - 1) * max(0.0, 2 * send - unit.backward_factor * attend)
        return fwd, (bwd if unit.backward_factor else 0.0)

    def tps(self, unit: UnitCost) -> tuple[int, ...] | None:
        """The TP degrees the unit can be costed at: those its profile measured (module
        and projectors alike), or None (any) without a profile."""
        if self.profile is None:
            return None
        common = None
        for q in unit.queries:
            measured = set(self.profile.tps(q.name))
            common = measured if common is None else common & measured
        return tuple(sorted(common or ()))

    def measured_time_s(self, unit: UnitCost, tp: int) -> tuple[float, float]:
        """Forward and backward compute of one backbone microbatch from the profile:
        the expected interpolated time over the sizes the unit sees."""
        assert self.profile is not None
        fwd = bwd = 0.0
        for q in unit.queries:
            for x, w in zip(q.sizes, q.weights, strict=True):
                f, b = self.profile.fwd_bwd_time_s(q.name, tp, x)
                fwd += w * f
                bwd += w * b
        return fwd, bwd

    def fwd_bwd_time_s(self, unit: UnitCost, tp: int, across_nodes: bool = False
                       ) -> tuple[float, float]:
        """Forward and backward time of one backbone microbatch through the whole unit,
        TP communication included (Algorithm 1's C(TP), split into its two passes); a
        generator's VAE encoding in the forward, not divided by TP. ``across_nodes``: its
        TP groups span nodes, their collectives priced at the inter-node bandwidth."""
        key = (id(unit), int(tp), bool(across_nodes))
        hit = self._times.get(key)
        if hit is None or hit[0] is not unit:
            hit = self._times[key] = (unit, self._unit_fwd_bwd_time_s(unit, tp,
                                                                      bool(across_nodes)))
        return hit[1]

    def _unit_fwd_bwd_time_s(self, unit: UnitCost, tp: int, across_nodes: bool
                             ) -> tuple[float, float]:
        fwd, bwd = self._fwd_bwd_time_s(unit, tp, across_nodes)
        eff, w = self.params.efficiency, unit.frozen_fwd_work
        vae = (w.matmul / eff.matmul + w.attention / eff.attention + w.conv / eff.conv) / \
            self.peak_flops
        return fwd + vae, bwd

    def _fwd_bwd_time_s(self, unit: UnitCost, tp: int, across_nodes: bool
                        ) -> tuple[float, float]:
        comm = self.tp_comm_time_s(unit, tp, across_nodes)
        bwd_comm = comm if unit.backward_factor else 0.0
        if self.profile is not None:
            fwd, bwd = self.measured_time_s(unit, tp)
            # Measured on whole sequences: a CP rank runs 1 / cp of the work.
            fwd, bwd = fwd / unit.cp, bwd / unit.cp
            if not unit.backward_factor:
                bwd = 0.0
            elif unit.recompute:   # the profile measures without recomputation
                bwd += fwd
        else:
            fwd = self.compute_time_s(unit, tp)
            bwd = unit.backward_factor * fwd + (fwd if unit.recompute and unit.backward_factor
                                                 else 0.0)
        cp_fwd, cp_bwd = self.cp_comm_time_s(unit, tp)
        ep_fwd, ep_bwd = self.ep_comm_time_s(unit, tp)
        return fwd + comm + cp_fwd + ep_fwd, bwd + bwd_comm + cp_bwd + ep_bwd

    def tp_comm_time_s(self, unit: UnitCost, tp: int, across_nodes: bool = False) -> float:
        """All-reduces (reduce-scatter + all-gather with sequence parallelism) of one
        forward pass: one message per layer with the bytes of that layer's collectives,
        over NVLink unless the group spans nodes (``across_nodes``, or tp larger than a
        node)."""
        if tp <= 1:
            return 0.0
        per_layer = unit.tp_comm_bytes / max(unit.layers, 1) / unit.cp
        return float(unit.layers * all_reduce_time_s(per_layer, tp,
                                                     self._tp_bandwidth(tp, across_nodes)))

    def memory_bytes(self, unit: UnitCost, tp: int, pp, dp: int, vpp, depth,
                     microbatches: int, share: float):
        """Peak memory of one GPU of the unit's first stage (``pp``, ``vpp`` and ``depth``
        may be arrays). ``share``: backbone microbatches per unit microbatch (dp_lm / dp)."""
        program = self.program
        weight_b, grad_b, _ = _PARAM_BYTES[program.train.precision]
        optim_b = self.optimizer_bytes_per_param()
        dp = np.asarray(dp) * unit.cp        # optimizer state sharded over dp x cp
        stage = unit.stage_params(pp) / tp
        trained = stage * unit.trainable_params / unit.params if unit.params else 0.0
        zero = program.train.mesh_zero
        static = stage * weight_b + trained * (grad_b + optim_b / (dp if zero >= 1 else 1)) \
            + (stage - trained) * _frozen_master_bytes(program.train.precision, dp, zero) \
            + trained * _local_sgd_bytes(program, dp) \
            + self._expert_optimizer_bytes(unit, np.ceil(unit.layers / np.asarray(pp)), tp, dp)
        per_layer = (unit.act_bytes_per_layer - unit.act_bytes_per_layer_tp_split
                     + unit.act_bytes_per_layer_tp_split / tp) * share / unit.cp
        if unit.backward_factor == 0:
            # Forward only: nothing is kept for backward, one layer's activations at a time.
            return static + per_layer
        count, chunk = in_flight(program.train.schedule, unit.layers, pp, vpp, depth,
                                 microbatches)
        static = static + self._recompute_bytes(unit, tp, share)
        if unit.role == "backbone":     # the LM head's logits, where it is the first stage
            static = static + np.where(np.asarray(pp) == 1, self.logits_bytes(tp, unit.cp),
                                       0.0)
        # One microbatch in flight may be a large one; the others are average (the sum of
        # several is far less skewed than one).
        return static + chunk * per_layer * (1 + (count - 1) / unit.act_peak_ratio)

    def stage_memory_bytes(self, unit: UnitCost, *, tp: int, pp: int, dp: int, vpp: int,
                           stage: int, layers: int, depth: int, microbatches: int,
                           share: float) -> float:
        """Peak memory of one GPU of pipeline stage ``stage`` (of ``pp``) holding ``layers``
        of the unit's layers, the first stage's embedding and the last stage's head or
        projector; ``depth``: pipeline stages from this stage to the end of the chain.
        ``memory_bytes`` is this for the heaviest stage; ``dtc memcheck`` compares it with
        what the runtime's stage holds."""
        weight_b, grad_b, _ = _PARAM_BYTES[self.program.train.precision]
        optim_b = self.optimizer_bytes_per_param()
        dp = dp * unit.cp                    # optimizer state sharded over dp x cp
        layer_params = (unit.held_params - unit.extra_stage_params) / max(unit.layers, 1)
        params = layer_params * layers
        if stage == 0:
            params += unit.first_stage_params
        if stage == pp - 1:
            params += unit.extra_stage_params - unit.first_stage_params
            if pp > 1:
                params += unit.tied_head_params
        params /= tp
        trained = params * unit.trainable_params / unit.params if unit.params else 0.0
        zero = self.program.train.mesh_zero
        static = params * weight_b + trained * (grad_b + optim_b / (dp if zero >= 1 else 1)) \
            + (params - trained) * _frozen_master_bytes(self.program.train.precision, dp, zero) \
            + trained * _local_sgd_bytes(self.program, dp) \
            + self._expert_optimizer_bytes(unit, layers, tp, dp)
        per_layer = (unit.act_bytes_per_layer - unit.act_bytes_per_layer_tp_split
                     + unit.act_bytes_per_layer_tp_split / tp) * share / unit.cp
        if unit.backward_factor == 0:
            return float(static + per_layer)
        count, _ = in_flight(self.program.train.schedule, unit.layers, pp, vpp, depth,
                             microbatches)
        count = float(count)
        static = static + self._recompute_bytes(unit, tp, share)
        head = 0.0
        if unit.role == "backbone" and stage == pp - 1:
            head = float(self.logits_bytes(tp, unit.cp))
        return float(static + head +
                     layers * per_layer * (1 + (count - 1) / unit.act_peak_ratio))

    def _expert_optimizer_bytes(self, unit: UnitCost, layers, tp, dp):
        """What the optimizer state of ``layers`` layers' experts adds on a rank under
        expert parallelism beyond the dense rule (dp x cp shards of what the rank holds):
        a rank's experts / ep are sharded over the dp / ep replicas holding them, so
        their state is the experts' over dp, ep times the dense rule's. Zero at ep 1,
        frozen or without ZeRO (the state is whole either way)."""
        zero = self.program.train.mesh_zero
        if unit.ep <= 1 or not unit.trainable or zero < 1:
            return 0.0
        optim_b = self.optimizer_bytes_per_param()
        held = unit.expert_params / max(unit.layers, 1) * np.asarray(layers) / unit.ep / \
            np.asarray(tp)
        return held * optim_b * (unit.ep - 1) / np.asarray(dp)

    @staticmethod
    def _recompute_bytes(unit: UnitCost, tp, share: float):
        """With recomputation, the one layer whose activations backward makes again."""
        whole = unit.recompute_layer_bytes - unit.recompute_layer_bytes_tp_split
        return (whole + unit.recompute_layer_bytes_tp_split / np.asarray(tp)) * share / unit.cp

    def logits_bytes(self, tp, cp: int = 1) -> float:
        """What the backbone's LM head holds at its peak: one chunk of its loss
        (``models.multimodal.lm_loss``: ``flops.lm_loss_chunk_rows`` rows of this rank's
        slice of the vocabulary, a microbatch's tokens at most), nothing between a
        microbatch's forward and its backward (the chunks are recomputed). Per entry of
        the chunk, in its backward (measured, ``dtc memcheck``): the recomputed fp32
        log-probabilities (4 bytes), their gradient, the softmax and the bf16 logits'
        gradient (12 bytes). ``tp`` may be an array; ``cp``: each CP rank's loss runs on
        its 1 / cp of the tokens."""
        train, arch = self.program.train, self.program.backbone.arch
        columns = np.ceil(arch.vocab / np.asarray(tp))
        rows = np.minimum(train.micro_batch * train.seq_len / cp,
                          np.vectorize(flops.lm_loss_chunk_rows, otypes=[float])(columns))
        return rows * columns * 16.0

    def dp_sync_coefficients(self, unit: UnitCost, tp, dp, *, replicated_over=1) -> tuple:
        """(fixed_s, per_layer_s) with the end of a step on one stage, its exposed
        data-parallel communication, the TP average of its replicated parameters'
        gradients (``tp_sync_coefficients``) and its optimizer step (measured in a
        profile), = fixed_s + per_layer_s * ceil(L / pp). ``tp`` and ``dp`` may be arrays;
        ``replicated_over``: the TP group a ``tp_replicated`` unit (costed at tp 1) runs
        whole on.

        As the runtime does it (``train.stage``): without ZeRO an all-reduce of the
        gradients after the last backward. With ZeRO-1 the same bytes as a
        reduce-scatter after the last backward (exposed; a backbone's layers' run during
        it, each behind the next layer's backward: of r seconds per layer against b of
        backward, min(r, b) hidden but for one layer) and a parameter all-gather that
        every stage starts, asynchronously, at the start of the next step (FSDP2's
        ``unshard(async_op=True)``), each layer's first forward waiting for its own: a
        layer's gather (a seconds) runs behind the previous layer's forward (f seconds, one
        microbatch), so of the layers' gathers min(a, f) + max(0, a - f) per layer is
        exposed, and the embeddings', heads' and projectors' whole. TP collectives are not
        overlapped (the runtime's DTensor collectives are synchronous)."""
        if not unit.trainable:
            zero = np.zeros(np.broadcast(np.asarray(tp), np.asarray(dp)).shape)
            return zero, zero
        # CP ranks hold the same parameters: gradients reduced over dp x cp (Megatron-LM).
        dp = np.asarray(dp) * unit.cp
        fixed, per_layer = self._dp_sync_coefficients(unit, tp, dp)
        tp_fixed, tp_layer = self.tp_sync_coefficients(unit, tp, dp,
                                                       replicated_over=replicated_over)
        return fixed + tp_fixed, per_layer + tp_layer

    def tp_sync_coefficients(self, unit: UnitCost, tp, dp, *, replicated_over=1) -> tuple:
        """(fixed_s, per_layer_s) of averaging the gradients of the unit's TP-replicated
        parameters over its TP group at the end of a step (``train.stage``: one all-reduce
        of their fp32 DP shards, after the DP reduce-scatter, on the TP link): its
        ``tp_synced_params`` at tp > 1, every trained parameter of a unit replicated whole
        over a TP group of ``replicated_over``. ``tp``, ``dp`` may be arrays."""
        over = np.asarray(replicated_over)
        ranks = np.maximum(np.asarray(tp), over).astype(float)
        whole = over > 1
        extra = np.where(whole, unit.extra_stage_params * unit.trainable_params /
                         max(unit.params, 1.0), unit.tp_synced_extra_params)
        layers = np.where(whole, unit.trainable_params, unit.tp_synced_params) - extra
        # FSDP2 shards every gradient over DP (ZeRO-1); ZeRO-0 keeps it whole.
        shard = np.asarray(dp, dtype=float) if self.program.train.mesh_zero >= 1 else 1.0
        per_param = _TP_SYNC_GRAD_BYTES / shard
        cluster = self.program.cluster
        bw = np.where(ranks <= cluster.gpus_per_node, cluster.intra_node_bw_bytes_per_s,
                      cluster.inter_node_bw_bytes_per_s)
        # One collective per step (a bucket per 256 MiB, ignored): its latency once, and
        # none where nothing is replicated (a Llama backbone: its norms are FSDP2's).
        fixed = np.where(extra + layers > 0, all_reduce_time_s(extra * per_param, ranks, bw),
                         0.0)
        per_layer = all_reduce_time_s(layers / max(unit.layers, 1) * per_param, ranks, bw) - \
            all_reduce_time_s(0.0, ranks, bw)
        return fixed, per_layer

    def _dp_sync_coefficients(self, unit: UnitCost, tp, dp) -> tuple:
        """``dp_sync_coefficients`` without the TP average."""
        if self.program.train.sync.local:
            return self._local_sgd_coefficients(unit, tp, dp)
        bw = self.program.cluster.inter_node_bw_bytes_per_s
        dp = np.asarray(dp, dtype=float)
        # Bytes of trained gradient per parameter on a stage, sharded by TP.
        per_param = unit.trainable_params / unit.params * _BYTES_BF16 / np.asarray(tp)
        latency = all_reduce_time_s(0.0, dp, bw)
        fixed = all_reduce_time_s(unit.extra_stage_params * per_param, dp, bw)
        per_layer = all_reduce_time_s(
            (unit.held_params - unit.extra_stage_params) / unit.layers * per_param, dp, bw) - \
            latency
        opt_fixed, opt_layer = self._optimizer_coefficients(unit, tp, dp)
        zero = self.program.train.optimizer.zero >= 1
        # Reduce-scatter and all-gather move half an all-reduce each.
        reduce = per_layer / 2 if zero else per_layer
        if unit.role == "backbone":
            # A backbone's layers reduce during the last backward, each behind the
            # backward of the layer before it (``train.stage.Stage.reduce_early``): of
            # each layer's reduction min(r, b) is hidden, but for the last one's.
            hidden = np.minimum(reduce, self._layer_backward_s(unit, tp))
            fixed, per_layer = fixed + hidden, per_layer - hidden
        if not zero:
            return fixed + opt_fixed, per_layer + opt_layer
        gather = reduce
        forward = self._layer_forward_s(unit, tp)
        hidden = np.minimum(gather, forward)
        return fixed + hidden + opt_fixed, per_layer - hidden + opt_layer

    def _local_sgd_coefficients(self, unit: UnitCost, tp, dp) -> tuple:
        """``_dp_sync_coefficients`` under ``sync = local_sgd`` (``train.local_sgd``): no
        gradient crosses replicas; every ``period`` steps the replicas all-reduce their
        fp32 pseudo-gradients (the master weights' dtype), after the optimizer step and
        not overlapped, priced per step as 1 / period of it. An ``interval`` depends on
        the step time this model is computing: priced as a sync every step (an upper
        bound). Each replica's optimizer steps its whole TP shard (ZeRO 0)."""
        sync = self.program.train.sync
        every = 1.0 if sync.interval_s is not None else float(sync.period)
        bw = self.program.cluster.inter_node_bw_bytes_per_s
        dp = np.asarray(dp, dtype=float)
        per_param = unit.trainable_params / unit.params * _BYTES_FP32 / np.asarray(tp)
        latency = all_reduce_time_s(0.0, dp, bw)
        fixed = all_reduce_time_s(unit.extra_stage_params * per_param, dp, bw) / every
        per_layer = (all_reduce_time_s((unit.params - unit.extra_stage_params) / unit.layers
                                       * per_param, dp, bw) - latency) / every
        opt_fixed, opt_layer = self._optimizer_coefficients(unit, tp, dp)
        return fixed + opt_fixed, per_layer + opt_layer

    def dp_sync_bytes(self, unit: UnitCost, tp: int, pp: int, dp: int) -> float:
        """Bytes one GPU of the unit's heaviest stage sends over its DP links per step, as
        ``dp_sync_coefficients`` prices them (a ring collective sends (n - 1) / n of its
        data per step of reduce-scatter or all-gather): synchronous DP's gradient
        reduce-scatter (bf16 in this model) and ZeRO-1's parameter all-gather, or
        Local SGD's fp32 all-reduce every ``period`` steps, amortised."""
        if not unit.trainable or dp * unit.cp <= 1:
            return 0.0
        n = float(dp * unit.cp)
        params = unit.stage_params(pp) / tp * unit.trainable_params / unit.params
        sync = self.program.train.sync
        if sync.local:
            every = 1.0 if sync.interval_s is not None else float(sync.period)
            return float(params * _BYTES_FP32 * 2 * (n - 1) / n / every)
        # An all-reduce (ZeRO 0), or a reduce-scatter and an all-gather (ZeRO-1): the same.
        return float(params * _BYTES_BF16 * 2 * (n - 1) / n)

    def _optimizer_coefficients(self, unit: UnitCost, tp, dp) -> tuple:
        """(fixed_s, per_layer_s) of the optimizer step on a stage's trained parameters
        (its TP shard, and its DP shard under ZeRO-1), at the profile's measured
        seconds per parameter (none without a profile that measured it). With offload
        ``F`` the device steps ``1 - F`` of them while the host link and CPU take the
        rest (``offload_rate_s_per_param``), overlapped: the slower of the two. Both
        are proportional to the same parameters, so the maximum is one rate."""
        device = self.profile.profile.optimizer_s_per_param if self.profile is not None \
            else None
        fraction = self.offload_fraction
        rate = max((1.0 - fraction) * (device or 0.0),
                   fraction * self.offload_rate_s_per_param())
        shape = np.broadcast(np.asarray(tp), np.asarray(dp)).shape
        if not rate:
            return np.zeros(shape), np.zeros(shape)
        shard = np.asarray(tp, dtype=float) * (
            np.asarray(dp, dtype=float) if self.program.train.mesh_zero >= 1 else 1.0)
        trained = unit.trainable_params / unit.params
        fixed = unit.extra_stage_params * trained / shard * rate
        per_layer = (unit.params - unit.extra_stage_params) / unit.layers * trained / shard \
            * rate
        return np.broadcast_to(fixed, shape) + 0.0, np.broadcast_to(per_layer, shape) + 0.0

    def _layer_forward_s(self, unit: UnitCost, tp) -> np.ndarray:
        """One layer's forward of one microbatch at each ``tp`` (may be an array)."""
        return self._per_layer_s(unit, tp, 0)

    def _layer_backward_s(self, unit: UnitCost, tp) -> np.ndarray:
        """One layer's backward of one microbatch at each ``tp`` (may be an array)."""
        return self._per_layer_s(unit, tp, 1)

    def _per_layer_s(self, unit: UnitCost, tp, which: int) -> np.ndarray:
        tps = np.asarray(tp)
        out = np.empty(tps.shape)
        for t in np.unique(tps):
            out[tps == t] = self.fwd_bwd_time_s(unit, int(t))[which] / max(unit.layers, 1)
        return out if out.ndim else out[()]

    def dp_sync_time_s(self, unit: UnitCost, tp, pp, dp, *, replicated_over=1):
        """The end of a step on the unit's heaviest stage: its exposed gradient
        synchronisation and its optimizer step (``dp_sync_coefficients``)."""
        fixed, per_layer = self.dp_sync_coefficients(unit, tp, dp,
                                                     replicated_over=replicated_over)
        return fixed + per_layer * np.ceil(unit.layers / np.asarray(pp))

    def hop_time_s(self, unit: UnitCost, tp, share=1.0):
        """One pipeline transfer of a unit microbatch (``share`` backbone microbatches)
        between two of the unit's own stages. With sequence parallelism every TP rank of
        the backbone sends its 1/tp of the sequence to its peer, all at once
        (``train.executor``'s PP messages); an encoder's or generator's stages send the
        whole activations. ``tp`` and ``share`` may be arrays."""
        # Each CP rank sends its 1 / cp of the tokens to its peer, all at once.
        bytes_ = unit.boundary_bytes * np.asarray(share, dtype=float) / unit.cp
        if unit.role == "backbone":
            bytes_ = bytes_ / np.asarray(tp, dtype=float)
        return self.p2p_time_s(bytes_)

    def p2p_time_s(self, num_bytes: float) -> float:
        return num_bytes / self.program.cluster.inter_node_bw_bytes_per_s + \
            _COLLECTIVE_LATENCY_S


# ---- building the unit costs ---------------------------------------------------------------

def _mlp_factor(arch: ir.TransformerArch) -> int:
    """Bytes per FFN column and token that a layer's MLP keeps for backward (bf16): the
    activation's input and output (4), SwiGLU's gate and product too (8), quick-GELU's
    sigmoid and input of its product too (6; measured with saved-tensor hooks)."""
    if arch.swiglu:
        return 8
    return 6 if arch.act == "quick_gelu" else 4


def _active_ffn(arch: ir.TransformerArch) -> float:
    """The FFN columns a token's activations run through, on average over the layers: an
    MoE layer's ``top_k`` experts and shared expert (with the ``top_k`` rows of ``hidden``
    its dispatch and combine keep, as columns), the MLP's elsewhere."""
    moe = arch.moe
    if moe is None:
        return arch.ffn
    n = moe.num_moe_layers(arch.layers)
    per_moe = moe.top_k * moe.ffn + moe.shared_ffn + \
        moe.top_k * arch.hidden * 2 / _mlp_factor(arch)
    return (n * per_moe + (arch.layers - n) * arch.ffn) / arch.layers


def _transformer_activation_bytes(hidden: int, ffn: int, kv_ratio: float, mlp_factor: int,
                                  tokens: float, cross_attention: bool = False, *,
                                  rms_norm: bool = True,
                                  sequence_parallel: bool = True) -> tuple[float, float]:
    """Activation bytes one of the runtime's transformer layers keeps for backward (bf16
    activations), per ``tokens``: (all, the part TP divides).

    What autograd keeps in ``models.transformer`` (measured with saved-tensor hooks; no
    dropout, flash attention, so no s x s scores): each norm's saved state (RMSNorm: its
    fp32 upcast input and bf16 normalised output, 14 h bytes per token for the two;
    LayerNorm: its input, 4 h); each block's normed input, which its projections keep
    (4 h); attention's rotated queries and keys, values, output and the output
    projection's input (6 h + 4 kv h); the MLP's intermediates (``mlp_factor`` f bytes:
    SwiGLU 8 f, GELU 4 f, see ``_mlp_factor``).
    Tensor parallelism divides the attention and MLP internals; with sequence
    parallelism (the backbone, ``parallel.tp``) the norms' state too, while the normed
    inputs the projections keep are gathered whole on every TP rank."""
    h, f = hidden, ffn
    norms = (14 if rms_norm else 4) * h
    whole = 4 * h
    inner = 6 * h + 4 * kv_ratio * h + mlp_factor * f
    if cross_attention:     # its norm's input, normed input, queries, output, projection
        norms += 2 * h
        whole += 2 * h
        inner += 6 * h
    split = inner + (norms if sequence_parallel else 0)
    return tokens * (norms + whole + inner), tokens * split


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
    act_tokens: float = 0.0       # tokens whose layer inputs recomputation keeps
    peak_ratio: float = 1.0       # the large microbatch over the mean one
    width: int = 0
    comm: float = 0.0
    ep: tuple[float, float, int] = (0.0, 0.0, 0)   # experts' parameters, elements per
                                                  # all-to-all, MoE layers
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
        params = flops.projector_params(proj.arch) + flops.compression_params(proj)
        self.params += params
        self.extra += params
        if not proj.frozen:
            self.trainable_params += params
            # Replicated under the unit's TP (``models.mlp``): averaged over it.
            self.synced += params
            self.synced_extra += params


def _unit_cost(program: ir.Program, module: ir.Module, samples: SampleSet,
               params: CostParams) -> UnitCost:
    train = program.train
    mb = train.micro_batch
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
    boundary = 0.0

    if module.role == "backbone":
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
            arch.hidden, _active_ffn(arch), arch.kv_heads / arch.heads, _mlp_factor(arch),
            tokens, rms_norm=True, sequence_parallel=True)
        acc.act_tokens, acc.width, acc.peak_items = tokens, arch.hidden, tokens
        if arch.moe is not None:
            acc.ep = (flops.expert_params(module),
                      mean_tokens * flops.moe_dispatch_elements_per_token(arch),
                      arch.moe.num_moe_layers(arch.layers))
        acc.comm = arch.layers * 2 * mean_tokens * arch.hidden * _BYTES_BF16
        acc.cp = (mean_tokens, arch.hidden, arch.hidden * arch.kv_heads / arch.heads)
        # The embedding on the first stage; the head (none of its own when tied to the
        # embedding) and the final norm on the last.
        acc.extra = flops.backbone_ends_params(arch)
        acc.first = arch.vocab * arch.hidden
        acc.tied = arch.vocab * arch.hidden if arch.tie_embeddings else 0.0
        boundary = mean_tokens * arch.hidden * _BYTES_BF16
        acc.model_flops = useful.total * (1 + bwd)
    elif module.role == "encoder":
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
        for proj in program.projectors:
            if proj.source == module.name:
                acc.add_projector(proj, mean_out, upstream=not module.frozen,
                                  compression=flops.compression_forward(proj, mean_patches,
                                                                        images))
        boundary = mean_out * program.backbone.arch.hidden * _BYTES_BF16
    else:
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
            conv_out = sum(op.out_elements for op in ops if op.kind == "conv")
            acc.comm = conv_out / 2 * _BYTES_BF16 * count   # one all-reduce per two convs
        else:
            per_item = flops.dit_forward(arch, cond_tokens)
            n = flops.dit_tokens(arch)
            acc.act, acc.act_split = _transformer_activation_bytes(
                arch.hidden, arch.ffn, 1.0, 4, n * peak_items, cross_attention=True,
                rms_norm=False, sequence_parallel=False)
            acc.act_tokens, acc.width = n * peak_items, arch.hidden
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
    recompute_layer = (0.0, 0.0)
    if module.recompute:
        # Full recomputation keeps only each layer's input; backward redoes the forward,
        # one layer at a time: that layer's activations exist again while it runs.
        recompute_layer = (acc.act, acc.act_split)
        acc.act, acc.act_split = acc.act_tokens * acc.width * _BYTES_BF16, 0.0
    return UnitCost(
        name=module.name, role=module.role, layers=arch.pipeline_layers,
        params=acc.params, extra_stage_params=min(acc.extra, acc.params),
        trainable_params=acc.trainable_params, backward_factor=bwd,
        frozen_fwd_work=acc.frozen,
        recompute=module.recompute, fwd_work=acc.work, model_flops=acc.model_flops,
        act_bytes_per_layer=acc.act, act_bytes_per_layer_tp_split=acc.act_split,
        act_peak_ratio=acc.peak_ratio,
        tp_comm_bytes=acc.comm, boundary_bytes=boundary, queries=tuple(acc.queries),
        first_stage_params=min(acc.first, acc.params), peak_items=acc.peak_items,
        recompute_layer_bytes=recompute_layer[0],
        recompute_layer_bytes_tp_split=recompute_layer[1], tied_head_params=acc.tied,
        model_attention_flops=acc.model_attention, tp_synced_params=acc.synced,
        tp_synced_extra_params=acc.synced_extra, cp_method=module.context_parallel,
        cp_tokens=acc.cp[0], cp_q_width=acc.cp[1], cp_kv_width=acc.cp[2],
        expert_params=acc.ep[0], ep_elements=acc.ep[1], ep_layers=int(acc.ep[2]))


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


def build_cost_model(program: ir.Program, params: CostParams | None = None, *,
                     profile: ProfileTable | None = None,
                     samples: SampleSet | None = None) -> CostModel:
    """Unit costs for a program, expectations taken over synthetic samples of its data;
    compute times measured in ``profile`` when given (see ``check_profile`` for whether
    it covers the program). ``samples``: that draw, ``draw_samples(program,
    params.samples, params.seed)``, where the caller has it already (variants of one
    program's costs: packed draws take a while)."""
    params = params or CostParams()
    if samples is None:
        samples = draw_samples(program, params.samples, params.seed)
    units = tuple(_unit_cost(program, m, samples, params) for m in program.modules)
    return CostModel(program=program, params=params, units=units, profile=profile)
