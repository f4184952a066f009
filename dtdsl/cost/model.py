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
blocks behind the attention of the block before, Ulysses' all-to-alls in full (an
encoder's bidirectional attention splits evenly without load balancing; its output rows
are gathered whole for the projector, priced too).

Mixture of experts (``flops.moe_mlp_per_token``): FLOPs count a token's ``top_k`` experts
(and the router and shared expert), parameter memory every expert, activations what the
block keeps for its ``top_k`` slots (``cost.unit._moe_block_bytes``). Expert parallelism
(``UnitCost.ep``, ``with_ep``): each rank holds ``experts / ep`` of every MoE layer's
experts (their weights and gradients / ep, their optimizer state sharded over the dp / ep
replicas that hold the same experts: the same bytes as without EP), and
``ep_comm_time_s`` prices the dispatch and combine all-to-alls of every MoE layer, each
way, on the EP group's links (NVLink to the peers on the rank's node, the network to the
others); the experts' GEMMs run slower than large ones on few rows per expert, faster with
the ep times more rows EP gives each (``cost.gemm``, ``expert_gemm_slowdown``). Tensor
parallelism inside the experts divides their weights, gradients, optimizer state, GEMMs
and intermediates by tp like a dense MLP's; the router runs whole on every TP rank
(``UnitCost.tp_whole_matmul``), the block's sequence gather and reduce-scatter are a dense
MLP's (``tp_comm_bytes``), and each TP rank's all-to-alls carry all its replica's routed
rows (not 1 / tp of them: ``ep_comm_time_s``). The
experts' gradients are priced as reduced over dp like the rest (their group is dp / ep:
the ring's (n - 1) / n differs a little).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from dtdsl.cost import flops
from dtdsl.cost.comm import async_tp_exposed_s
from dtdsl.cost.gemm import expert_gemm_slowdown
from dtdsl.cost.memo import memo_on_scalars
from dtdsl.cost.profile import ProfileTable
from dtdsl.cost.samples import (
    SampleSet,
    draw_samples,
)
from dtdsl.cost.unit import (
    _BYTES_BF16,
    CostParams,
    Efficiency,
    ProfileQuery,
    UnitCost,
    _unit_cost,
)
from dtdsl.ir import program as ir
from dtdsl.ir.hardware import CPU_ADAM_PARAMS_PER_S, hbm_bandwidth
from dtdsl.ir.plan import cp_split

__all__ = [
    "OFFLOADED_BYTES_PER_PARAM", "CostModel", "CostParams", "Efficiency", "ProfileQuery",
    "UnitCost", "all_reduce_time_s", "build_cost_model", "in_flight", "param_bytes",
]

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


def _state_shard(program: ir.Program, dp):
    """Over how many of a unit's ``dp`` DP ranks FSDP2 shards its fp32 parameters and
    optimizer state: all under ZeRO >= 1; under Local SGD one replica's
    (``ir.Sync.replica_ranks``: ``replica_dp``, 1 by default: whole replicas)."""
    dp = np.asarray(dp)
    if program.train.mesh_zero >= 1:
        return dp
    return np.gcd(np.rint(dp).astype(np.int64), program.train.replica_dp).astype(float)


def _local_sgd_bytes(program: ir.Program, dp):
    """Bytes per trained parameter Local SGD keeps (``train.local_sgd``): the fp32 anchor
    and outer momentum, sharded like the replica (``_state_shard``), on units with more
    than one replica."""
    if not program.train.sync.local:
        return 0.0
    shard = _state_shard(program, dp)
    return np.where(np.asarray(dp) > shard, 2 * _BYTES_FP32 / shard, 0)


def _frozen_master_bytes(program: ir.Program, dp):
    """Bytes per frozen parameter beyond its compute copy: under mixed precision FSDP2 keeps
    the fp32 parameter sharded over DP (a trained one's is in its optimizer bytes)."""
    if program.train.precision == "fp32":
        return 0.0
    return 4 / _state_shard(program, dp)






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


def param_bytes(precision: str) -> int:
    """Bytes per trained parameter in ``precision``: its weights, gradient and optimizer
    state (``_PARAM_BYTES``), before any sharding."""
    return sum(_PARAM_BYTES[precision])


@dataclass(frozen=True)
class CostModel:
    """Unit costs and the cluster they run on."""

    program: ir.Program
    params: CostParams
    units: tuple[UnitCost, ...]
    profile: ProfileTable | None = None
    # The draw of the program's data the units were priced on (``build_cost_model``):
    # variants of the program that draw alike (recomputation, cp, ep) price on it again.
    samples: SampleSet | None = field(default=None, repr=False, compare=False)
    # fwd_bwd_time_s per (unit, tp): asked for every layout the planner evaluates.
    _times: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def drawn(self) -> SampleSet:
        """The draw the units were priced on: ``samples``, or drawn as
        ``build_cost_model`` draws it."""
        if self.samples is not None:
            return self.samples
        return draw_samples(self.program, self.params.samples, self.params.seed)

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

    def ep_comm_time_s(self, unit: UnitCost, tp: int) -> tuple[float, float]:
        """(forward, backward) seconds of one backbone microbatch's all-to-alls under
        expert parallelism: per MoE layer a dispatch and a combine, each sending the
        (ep - 1) / ep of a rank's routed rows (bf16) that go to other ranks; the backward
        exchanges the gradients the same way. A rank exchanges its 1 / cp of the tokens
        (context parallelism), not 1 / tp: every TP rank routes the whole sequence and
        sends all its routed rows, to the ranks holding its columns of their experts
        (``models.moe``). The EP group's ranks are tp x cp apart (TP innermost): those on
        the rank's node get their rows over NVLink, the others over the network, at the
        same time (the slower of the two). One all-to-all sends to every peer at once (one
        group of sends, ``torch.distributed.all_to_all_single``): one collective step's
        latency, not one a peer. Zero at ep 1."""
        if unit.ep <= 1 or not unit.ep_elements:
            return 0.0, 0.0
        cluster = self.program.cluster
        data = 2 * unit.ep_elements * _BYTES_BF16 / unit.cp
        near = max(1, min(unit.ep, cluster.gpus_per_node // (tp * unit.cp)))
        fwd = max(data * (near - 1) / unit.ep / cluster.intra_node_bw_bytes_per_s,
                  data * (unit.ep - near) / unit.ep / cluster.inter_node_bw_bytes_per_s) + \
            2 * unit.ep_layers * _COLLECTIVE_LATENCY_S
        return fwd, (fwd if unit.backward_factor else 0.0)

    def expert_gemm_slowdown(self, unit: UnitCost, tp: int) -> tuple:
        """(forward, input gradient, weight gradient) slowdown of the unit's routed
        experts' GEMMs at TP ``tp`` (``cost.gemm``): each local expert gets ep / cp times
        its rows at ep 1 (the EP group's rows for its experts, each of cp ranks a 1 / cp
        of the tokens) on every TP rank, over ``ffn / tp`` of its columns. 1s without
        experts."""
        if not unit.expert_matmul:
            return 1.0, 1.0, 1.0
        hidden, ffn = unit.expert_dims
        rows = unit.expert_rows * unit.ep / unit.cp
        return tuple(float(x) for x in expert_gemm_slowdown(
            rows, hidden, ffn / tp, flops_per_s=self.peak_flops * self.params.efficiency.matmul,
            hbm_bytes_per_s=hbm_bandwidth(self.program.cluster.gpu.name)))

    def compute_time_s(self, unit: UnitCost, tp: int) -> float:
        """Forward compute of one backbone microbatch through the whole unit at TP ``tp``
        on one rank of its CP group (analytic, whether or not there is a profile)."""
        eff = self.params.efficiency
        w = unit.fwd_work
        # An MoE backbone's routers run whole on every TP rank (``tp_whole_matmul``); its
        # experts' GEMMs run slower than large ones (``expert_gemm_slowdown``).
        whole = unit.tp_whole_matmul * (1 - 1 / tp) / eff.matmul
        experts = unit.expert_matmul * (self.expert_gemm_slowdown(unit, tp)[0] - 1) / \
            eff.matmul
        return (w.matmul / eff.matmul + w.attention / eff.attention + w.conv / eff.conv
                + whole * tp + experts) / (self.peak_flops * tp * unit.cp)

    def expert_backward_extra_s(self, unit: UnitCost, tp: int) -> float:
        """What the experts' backward GEMMs take beyond ``backward_factor`` times their
        forward (``compute_time_s``): an input gradient at the forward's slowdown, a weight
        gradient (trained units) at its own."""
        if not unit.expert_matmul or not unit.backward_factor:
            return 0.0
        fwd, _, wgrad = self.expert_gemm_slowdown(unit, tp)
        base = unit.expert_matmul / self.params.efficiency.matmul / \
            (self.peak_flops * tp * unit.cp)
        return base * max(unit.backward_factor - 1, 0.0) * (wgrad - fwd)

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
        bytes, against the attention's backward. An encoder adds the gather of its
        output rows before the projector (the whole unit's: spread over its stages as
        the rest)."""
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
        if unit.role == "encoder":
            # An encoder's last stage gathers each item's rows whole for its projector
            # (``train.passes``): an all-gather of the rows' (c - 1) / c forward, an
            # all-reduce of their gradients (twice the bytes) backward.
            bw = cluster.intra_node_bw_bytes_per_s if tp * c <= node else \
                cluster.inter_node_bw_bytes_per_s
            gather = unit.cp_tokens * unit.cp_q_width * _BYTES_BF16 * (c - 1) / c / bw + \
                _COLLECTIVE_LATENCY_S
            fwd += gather
            bwd += 2 * gather
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
        if self.program.train.async_tp and unit.role == "backbone":     # cost.comm
            mm = unit.fwd_work.matmul / self.params.efficiency.matmul / \
                (self.peak_flops * tp * unit.cp)
            comm, bwd_comm = (async_tp_exposed_s(comm, mm, tp), async_tp_exposed_s(
                bwd_comm, unit.backward_factor * mm, tp))
        if self.profile is not None:
            fwd, bwd = self.measured_time_s(unit, tp)
            # Measured on whole sequences: a CP rank runs 1 / cp of the work.
            fwd, bwd = fwd / unit.cp, bwd / unit.cp
            if not unit.backward_factor:
                bwd = 0.0
            else:   # the profile measures without recomputation
                bwd += self._recomputed_s(unit, tp, fwd)
        else:
            fwd = self.compute_time_s(unit, tp)
            bwd = unit.backward_factor * fwd + (self._recomputed_s(unit, tp, fwd)
                                                 if unit.backward_factor else 0.0) + \
                self.expert_backward_extra_s(unit, tp)
        cp_fwd, cp_bwd = self.cp_comm_time_s(unit, tp)
        ep_fwd, ep_bwd = self.ep_comm_time_s(unit, tp)
        return fwd + comm + cp_fwd + ep_fwd, bwd + bwd_comm + cp_bwd + ep_bwd

    @staticmethod
    def weight_grad_share(unit: UnitCost) -> float:
        """Of ``unit``'s backward, the share its weight gradients take: what the zero_bubble
        schedule's ``W`` pass runs, its ``B`` the rest (``dtdsl.sim.simulate.Durations.
        weight_s``, ``planner.evaluate``). The one rule: the backward's time split by
        FLOPs. Every forward GEMM (and convolution) has one weight-gradient GEMM of its
        FLOPs; the input gradients (one GEMM more each), the attention cores' backward (no
        weights) and what recomputation runs again are the ``B``'s. TP, CP and EP
        collectives are split the same way (the input gradients' all-reduce is the
        ``B``'s in truth: a small share at NVLink speed). A unit without trainable
        parameters has no ``W``."""
        if not unit.trainable or not unit.backward_factor:
            return 0.0
        w = unit.fwd_work
        if unit.recompute is ir.Recompute.FULL:
            again = w.total
        elif unit.recompute is ir.Recompute.SELECTIVE:
            again = unit.selective_work.total
        else:
            again = 0.0
        backward = unit.backward_factor * w.total + again
        return min(1.0, (w.matmul + w.conv) / backward) if backward > 0 else 0.0

    def _recomputed_s(self, unit: UnitCost, tp: int, fwd: float) -> float:
        """What backward runs again of one microbatch's forward ``fwd``: all of it (full
        recomputation), its attention cores (selective: the Q, K, V projections and
        attention, ``UnitCost.selective_work``, analytic even with a profile), or
        nothing."""
        if unit.recompute is ir.Recompute.FULL:
            return fwd
        if unit.recompute is ir.Recompute.SELECTIVE:
            eff, w = self.params.efficiency, unit.selective_work
            return (w.matmul / eff.matmul + w.attention / eff.attention) / \
                (self.peak_flops * tp * unit.cp)
        return 0.0

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

    @memo_on_scalars
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
        static = stage * weight_b + trained * (grad_b + optim_b / _state_shard(program, dp)) \
            + (stage - trained) * _frozen_master_bytes(program, dp) \
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
                                       0.0) + self.embedding_bytes()
        # One microbatch in flight may be a large one; the others are average (the sum of
        # several is far less skewed than one).
        first = static + chunk * per_layer * (1 + (count - 1) / unit.act_peak_ratio)
        if not unit.last_stage_act_bytes:
            return first
        # The last stage keeps more per microbatch (an encoder's projector), with fewer in
        # flight: the heavier of the two (its parameters priced as the first's).
        pp = np.asarray(pp)
        held = microbatches if program.train.schedule == "gpipe" else np.minimum(
            np.asarray(depth) - pp + 1, microbatches)
        kept = np.ceil(unit.layers / pp) * per_layer + self._last_stage_bytes(unit, tp, share)
        return np.maximum(first, static + kept * (1 + (held - 1) / unit.act_peak_ratio))

    @memo_on_scalars
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
        shard = _state_shard(self.program, dp)
        static = params * weight_b + trained * (grad_b + optim_b / shard) \
            + (params - trained) * _frozen_master_bytes(self.program, dp) \
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
        if unit.role == "backbone" and stage == 0:
            head += self.embedding_bytes()
        if stage == pp - 1:
            per_layer = per_layer + self._last_stage_bytes(unit, tp, share) / max(layers, 1)
        return float(static + head +
                     layers * per_layer * (1 + (count - 1) / unit.act_peak_ratio))

    @staticmethod
    def _last_stage_bytes(unit: UnitCost, tp, share: float):
        """What the last stage keeps per large microbatch outside its layers (an
        encoder's projector: on whole rows, gathered over CP before it)."""
        whole = unit.last_stage_act_bytes - unit.last_stage_act_bytes_tp_split
        return (whole + unit.last_stage_act_bytes_tp_split / np.asarray(tp)) * share

    def _expert_optimizer_bytes(self, unit: UnitCost, layers, tp, dp):
        """What the optimizer state of ``layers`` layers' experts adds on a rank under
        expert parallelism beyond the dense rule (dp x cp shards of what the rank holds):
        a rank's experts / ep are sharded over the dp / ep replicas holding them, so
        their state is the experts' over dp, ep times the dense rule's. Under Local SGD
        the same inside a replica of N ranks (``_state_shard``): experts / ep over the
        N / ep ranks holding them, the anchor and outer momentum too. Zero at ep 1,
        frozen or with whole state (ZeRO 0 without Local SGD)."""
        local = self.program.train.sync.local
        if unit.ep <= 1 or not unit.trainable or (self.program.train.mesh_zero < 1
                                                   and not local):
            return 0.0
        shard = _state_shard(self.program, dp)
        per_param = self.optimizer_bytes_per_param() / shard + \
            _local_sgd_bytes(self.program, dp)
        held = unit.expert_params / max(unit.layers, 1) * np.asarray(layers) / unit.ep / \
            np.asarray(tp)
        return held * per_param * (unit.ep - 1)

    @staticmethod
    def _recompute_bytes(unit: UnitCost, tp, share: float):
        """With recomputation, the one layer whose activations backward makes again."""
        whole = unit.recompute_layer_bytes - unit.recompute_layer_bytes_tp_split
        return (whole + unit.recompute_layer_bytes_tp_split / np.asarray(tp)) * share / unit.cp

    def embedding_bytes(self) -> float:
        """What the backbone's first stage holds in a microbatch's backward beyond its
        layers: every TP and CP rank embeds the whole microbatch
        (``models.multimodal.backbone_input``) and keeps its piece, so the embedding's
        backward meets the whole sequence's gradient (bf16) and its fp32 copy, which the
        embedding's weight gradient is accumulated from: 6 bytes per element."""
        train = self.program.train
        return float(train.micro_batch * train.seq_len * self.program.backbone.arch.hidden
                     * (_BYTES_BF16 + _BYTES_FP32))

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

    @memo_on_scalars
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
        shard = _state_shard(self.program, np.asarray(dp, dtype=float))
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
        gradient crosses replicas; every ``period`` steps the ``dp / N`` replicas (N =
        ``replica_dp`` ranks each) all-reduce their fp32 pseudo-gradients (the master
        weights' dtype), each rank its 1 / N shard, priced per step as 1 / period of it
        and not overlapped (the layer-wise overlap with the next forward,
        ``train.layerwise``, is not credited: an upper bound). An ``interval`` depends on
        the step time this model is computing: priced as a sync every step (an upper
        bound). Inside a replica of N > 1 ranks FSDP2 reduce-scatters the bf16 gradients
        and all-gathers the parameters every step (half an all-reduce each, within a
        node where N fits in one). Each replica's optimizer steps its TP shard's 1 / N."""
        sync = self.program.train.sync
        every = 1.0 if sync.interval_s is not None else float(sync.period)
        cluster = self.program.cluster
        bw = cluster.inter_node_bw_bytes_per_s
        dp = np.asarray(dp, dtype=float)
        shard = _state_shard(self.program, dp)
        replicas = dp / shard
        trained = unit.trainable_params / unit.params / np.asarray(tp)
        per_param = trained * _BYTES_FP32 / shard
        layer = (unit.params - unit.extra_stage_params) / unit.layers
        latency = all_reduce_time_s(0.0, replicas, bw)
        fixed = all_reduce_time_s(unit.extra_stage_params * per_param, replicas, bw) / every
        per_layer = (all_reduce_time_s(layer * per_param, replicas, bw) - latency) / every
        inside = np.where(shard <= cluster.gpus_per_node, cluster.intra_node_bw_bytes_per_s, bw)
        fixed = fixed + all_reduce_time_s(unit.extra_stage_params * trained * _BYTES_BF16,
                                          shard, inside)
        # Under EP a rank's experts / ep go over the shard / ep ranks holding them.
        experts = unit.expert_params / unit.layers if unit.ep > 1 else 0.0
        own = np.maximum(shard / unit.ep, 1.0) if unit.ep > 1 else shard
        per_layer = per_layer + all_reduce_time_s((layer - experts) * trained * _BYTES_BF16,
                                                  shard, inside) \
            - all_reduce_time_s(0.0, shard, inside) \
            + all_reduce_time_s(experts / unit.ep * trained * _BYTES_BF16, own, inside) \
            - all_reduce_time_s(0.0, own, inside)
        opt_fixed, opt_layer = self._optimizer_coefficients(unit, tp, dp)
        return fixed + opt_fixed, per_layer + opt_layer

    def dp_sync_bytes(self, unit: UnitCost, tp: int, pp: int, dp: int) -> float:
        """Bytes one GPU of the unit's heaviest stage sends over its DP links per step, as
        ``dp_sync_coefficients`` prices them (a ring collective sends (n - 1) / n of its
        data per step of reduce-scatter or all-gather): synchronous DP's gradient
        reduce-scatter (bf16 in this model) and ZeRO-1's parameter all-gather, or
        Local SGD's fp32 all-reduce of a replica's shard across the replicas every
        ``period`` steps, amortised, plus FSDP2's traffic inside a replica of several
        ranks (``_local_sgd_coefficients``)."""
        if not unit.trainable or dp * unit.cp <= 1:
            return 0.0
        n = float(dp * unit.cp)
        params = unit.stage_params(pp) / tp * unit.trainable_params / unit.params
        sync = self.program.train.sync
        if sync.local:
            every = 1.0 if sync.interval_s is not None else float(sync.period)
            shard = float(_state_shard(self.program, n))
            r = n / shard
            # Under EP the stage's experts / ep (in ``params``) are sharded over the
            # shard / ep ranks of the replica holding them: a rank syncs experts / shard.
            experts = float(unit.expert_params / max(unit.layers, 1) *
                            np.ceil(unit.layers / pp) / unit.ep / tp *
                            unit.trainable_params / unit.params)
            own = max(shard / unit.ep, 1.0)
            synced = (params + experts * (unit.ep - 1)) / shard
            return float(synced * _BYTES_FP32 * 2 * (r - 1) / r / every
                         + (params - experts) * _BYTES_BF16 * 2 * (shard - 1) / shard
                         + experts * _BYTES_BF16 * 2 * (own - 1) / own)
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
        shard = np.asarray(tp, dtype=float) * _state_shard(self.program, dp)
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

    @memo_on_scalars
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
    return CostModel(program=program, params=params, units=units, profile=profile,
                     samples=samples)
