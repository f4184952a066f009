"""Local SGD across data-parallel replicas, as EDiT (Cheng et al., ICLR 2025,
arXiv 2412.07210) does it: local inner steps, then a synchronisation every ``period`` steps
(or, A-EDiT, every ``interval`` seconds) with a DiLoCo outer step and EDiT's
pseudo-gradient penalty.

**The replicas.** Every rank holds its replica's copy of a list of parameters: plain
tensors, or FSDP2/DTensor shards (only ``to_local()`` is touched, so with FSDP2 every rank
synchronises its shard only and the anchor and outer momentum are sharded like the model:
EDiT's sharded extra parameters). ``group`` joins the ranks that hold the same shard of
different replicas (the replica group, EDiT's "model synchronisation group");
``shard_group`` joins the ranks that split one replica (EDiT's "model sharding group";
``None``: parameters are whole). Norms are global: squared shard norms are all-reduced
over ``shard_group``, then the per-replica norms are all-gathered over ``group``: every
rank of ``shard_group`` must hold distinct elements (a block replicated inside it, such as
a TP-replicated norm weight, would count once per copy; the executor wiring is to pass
those through a shard group of their own, as ``train.optim`` counts them).

**The outer step** (DiLoCo, Nesterov). With the anchor ``a`` (the parameters at the last
synchronisation), replica ``i``'s parameters ``theta_i`` and the outer momentum ``m``::

    d_i = a - theta_i                      (pseudo-gradient)
    d   = sum_i w_i d_i                    (w_i = 1/R, or the penalty's weights)
    m   = mu * m + d
    u   = d + mu * m                       (Nesterov; u = d when mu = 0)
    theta = a - outer_lr * u ;  a = theta  (every replica)

**The pseudo-gradient penalty** (``penalty=True``). The EDiT paper's three steps, as the
authors' summary (seed 002 of this project) states them: "anomaly elimination: the
pseudo-gradient norm is the measure, a z-test removes the workers above the threshold;
the mean and standard deviation of the norm are updated by an exponential moving
average, with a warm-up at the start of training; if every worker is anomalous, all
parameters are rolled back to those of the last synchronisation"; "weighted averaging:
the pseudo-gradients of the non-anomalous workers are averaged with weights based on
their norms, so that every worker contributes equally to the update direction";
"gradient clipping: finally the update's step is limited by clipping". Here, with
``G_i = ||d_i||`` (global over all parameters and shards)::

    z_i = (G_i - mu_G) / sigma_G ;  anomalous iff the warm-up is over, sigma_G > 0
                                      and z_i > z_threshold (one-sided: large norms)
    all anomalous -> theta_i = a for every replica; m, mu_G, sigma_G unchanged
    w_i = (1/G_i) / sum_{j kept} (1/G_j) for kept i, 0 for dropped i
          (w_i d_i is d_i's direction times one common length: equal contributions)
    d   = d * min(1, clip_norm / ||d||)
    mu_G, sigma_G: for each kept G_i in replica order (exponentially weighted mean and
          variance, alpha = ema_alpha):  delta = G - mu;  mu += alpha * delta;
          var = (1 - alpha) * (var + alpha * delta^2);  the first value sets mu = G, var = 0

The warm-up: the z-test applies from the ``warmup_syncs``-th synchronisation on (counted
from 0, rolled-back ones included), set by the spec's ``local_sgd(penalty_warmup=N)``
(default ``ir.program.PENALTY_WARMUP``). The paper's own formula text was not
available to this project (only the summary above); the 1/G weighting and the
exponentially weighted variance are this module's reading of it and are written down
here so that :func:`reference_local_sgd` and the distributed code share one definition.

**Layer-wise synchronisation.** EDiT synchronises layer by layer in the forward, overlapping
the replica all-reduce of layer ``l`` with the compute of layer ``l-1``. ``begin_sync``
computes the global norms first (one scalar all-reduce and all-gather), so the anomaly
test and weights are known before any layer moves; ``sync_layer(params)`` then averages
one layer's pseudo-gradients and, without clipping, applies its outer step at once. The
clip needs the norm of the *averaged* pseudo-gradient over every layer, which exists only
after the last layer's all-reduce: with ``clip_norm`` set, ``sync_layer`` keeps the layer's
average and ``finish_sync`` applies every layer's outer step (the communication still
overlaps; the element-wise update waits). ``maybe_sync`` is ``begin_sync``, ``sync_layer``
for each layer in order, ``finish_sync``. ``sync_layer`` is ``start_layer`` (the weighted
pseudo-gradients and their all-reduces, optionally not waited for) then ``end_layer``
(wait, apply): ``train.layerwise`` splits the two around the next step's forward.

**A-EDiT.** With ``interval`` set, a replica wants to synchronise once ``elapsed_s`` (its
own clock's seconds since the last synchronisation) reaches ``interval``; the wish is
all-reduced with MAX over both groups every step, so every rank synchronises at the same
step whatever its clock says.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from dtdsl.ir.program import PENALTY_WARMUP

__all__ = ["CORRUPT_ENV", "Corruption", "LocalSGD", "LocalSGDConfig", "NormStats",
           "ReferenceLocalSGD", "ReplicaScaled", "StageSync", "config_of", "corruption",
           "penalty_weights", "reference_local_sgd"]

_TINY = 1e-30   # a zero pseudo-gradient norm: weight it as a very short vector


@dataclasses.dataclass(frozen=True)
class LocalSGDConfig:
    """Local SGD's settings; see the module docstring for what each does."""

    period: int = 1
    interval: float | None = None
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    penalty: bool = False
    z_threshold: float = 3.0
    ema_alpha: float = 0.02
    warmup_syncs: int = PENALTY_WARMUP
    clip_norm: float | None = 1.0

    def __post_init__(self) -> None:
        if self.interval is None and (not isinstance(self.period, int) or self.period < 1):
            raise ValueError(f"local_sgd period {self.period!r} must be a whole number of "
                             "steps >= 1")
        if self.interval is not None and not self.interval > 0:
            raise ValueError(f"local_sgd interval {self.interval!r} must be > 0 seconds")
        if not self.outer_lr > 0:
            raise ValueError(f"local_sgd outer_lr {self.outer_lr!r} must be > 0")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"local_sgd outer_momentum {self.outer_momentum!r} must be in "
                             "[0, 1)")
        if not 0 < self.ema_alpha <= 1:
            raise ValueError(f"local_sgd ema_alpha {self.ema_alpha!r} must be in (0, 1]")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"local_sgd clip_norm {self.clip_norm!r} must be > 0 (or None "
                             "for no clipping)")
        if self.warmup_syncs < 0 or self.z_threshold <= 0:
            raise ValueError("local_sgd warmup_syncs must be >= 0 and z_threshold > 0, got "
                             f"{self.warmup_syncs!r} and {self.z_threshold!r}")

    @property
    def clips(self) -> bool:
        return self.penalty and self.clip_norm is not None


@dataclasses.dataclass
class NormStats:
    """The penalty's state: EMA mean and variance of the norms, synchronisations so far."""

    mean: float = 0.0
    var: float = 0.0
    seen: int = 0       # norms fed to the EMA
    syncs: int = 0      # synchronisations, rolled-back ones included

    def feed(self, norm: float, alpha: float) -> None:
        if self.seen == 0:
            self.mean, self.var = norm, 0.0
        else:
            delta = norm - self.mean
            self.mean += alpha * delta
            self.var = (1 - alpha) * (self.var + alpha * delta * delta)
        self.seen += 1


def penalty_weights(norms: Sequence[float], stats: NormStats,
                    cfg: LocalSGDConfig) -> list[float] | None:
    """The replicas' weights for one synchronisation, updating ``stats``; ``None``: every
    replica is anomalous (roll back). Pure arithmetic on the gathered norms, so every rank
    (and the reference) computes the same."""
    stats_syncs = stats.syncs
    stats.syncs += 1
    if not cfg.penalty:
        return [1.0 / len(norms)] * len(norms)
    sigma = math.sqrt(stats.var)
    testing = stats_syncs >= cfg.warmup_syncs and sigma > 0
    kept = [not (testing and (g - stats.mean) / sigma > cfg.z_threshold) for g in norms]
    if not any(kept):
        return None
    inv = [1.0 / max(g, _TINY) if k else 0.0 for g, k in zip(norms, kept, strict=True)]
    total = sum(inv)
    for g, k in zip(norms, kept, strict=True):
        if k:
            stats.feed(g, cfg.ema_alpha)
    return [v / total for v in inv]


def _local(p: torch.Tensor) -> torch.Tensor:
    """The rank's own block of a parameter (a DTensor's local shard, or the tensor)."""
    data = p.data if isinstance(p, torch.nn.Parameter) else p
    return data.to_local() if hasattr(data, "to_local") else data


def _outer(anchor: torch.Tensor, mom: torch.Tensor, d: torch.Tensor,
           cfg: LocalSGDConfig) -> torch.Tensor:
    """Nesterov outer step in place on ``mom`` and ``anchor``; returns the new anchor."""
    if cfg.outer_momentum:
        mom.mul_(cfg.outer_momentum).add_(d)
        d = d + cfg.outer_momentum * mom
    anchor.add_(d, alpha=-cfg.outer_lr)
    return anchor


class LocalSGD:
    """Local SGD over the replica group ``group`` for this rank's ``params`` (see the
    module docstring). ``layers``: the parameters grouped as the executor syncs them, in
    order (default: one layer per parameter). ``offload``: keep the anchor and outer
    momentum on the CPU (pinned where CUDA is available), fetched layer by layer."""

    def __init__(self, params: Sequence[torch.Tensor], cfg: LocalSGDConfig, *,
                 group: dist.ProcessGroup | None = None,
                 shard_group: dist.ProcessGroup | None = None,
                 layers: Sequence[Sequence[torch.Tensor]] | None = None,
                 offload: bool = False, counted: Sequence[bool] | None = None) -> None:
        self.cfg, self.group, self.shard_group = cfg, group, shard_group
        self.params = list(params)
        # Where this sync's small collectives (the interval flag, the norms) live: on the
        # parameters' device, as NCCL (a CUDA group's only backend) takes no CPU tensor.
        self.device = _local(self.params[0]).device if self.params else torch.device("cpu")
        # Whether each parameter's block counts in the penalty's norm on this rank: a
        # block the shard group holds several copies of (a TP-replicated norm weight)
        # counts on one of them only, as ``train.optim`` counts gradient norms.
        flags = [True] * len(self.params) if counted is None else list(counted)
        if len(flags) != len(self.params):
            raise ValueError("local_sgd counted needs one flag per parameter")
        self._uncounted = {id(p) for p, c in zip(self.params, flags, strict=True) if not c}
        self.layers = [list(layer) for layer in layers] if layers is not None else [
            [p] for p in self.params]
        known = {id(p) for p in self.params}
        listed = [id(p) for layer in self.layers for p in layer]
        if sorted(listed) != sorted(known) or len(set(listed)) != len(listed):
            raise ValueError("local_sgd layers must list every parameter exactly once")
        pin = offload and torch.cuda.is_available()
        self._anchor, self._mom = {}, {}
        for p in self.params:
            loc = _local(p)
            keep = loc.detach().to("cpu" if offload else loc.device, copy=True)
            self._anchor[id(p)] = keep.pin_memory() if pin else keep
            self._mom[id(p)] = torch.zeros_like(self._anchor[id(p)])
        self.stats = NormStats()
        self.replicas = dist.get_world_size(group)
        self._weights: list[float] | None = None
        # The replicas' weights at the last synchronisation (0: dropped; empty: rolled
        # back), for metrics and tests.
        self.last_weights: list[float] = []
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._done: set[int] = set()

    # -- when ------------------------------------------------------------------------
    def due(self, step: int, elapsed_s: float | None = None) -> bool:
        """Whether the step just finished (0-based ``step``) ends with a synchronisation;
        with ``interval`` every rank must call it every step (a collective)."""
        if self.cfg.interval is None:
            return (step + 1) % self.cfg.period == 0
        if elapsed_s is None:
            raise ValueError("local_sgd with an interval needs elapsed_s, the seconds since "
                             "the last synchronisation, at every step")
        flag = torch.tensor([1.0 if elapsed_s >= self.cfg.interval else 0.0],
                            device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if self.shard_group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.shard_group)
        return bool(flag.item() > 0)

    @torch.no_grad()
    def maybe_sync(self, step: int, elapsed_s: float | None = None) -> bool:
        """Synchronise if due (see ``due``); returns whether it did."""
        if not self.due(step, elapsed_s):
            return False
        self.begin_sync()
        for layer in self.layers:
            self.sync_layer(layer)
        self.finish_sync()
        return True

    # -- how -------------------------------------------------------------------------
    def _sq_norm(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Global squared norm over the shard group of per-rank blocks, in float64."""
        sq = torch.zeros(1, dtype=torch.float64, device=self.device)
        for t in tensors:
            sq += t.detach().double().pow(2).sum().to(self.device)
        if self.shard_group is not None:
            dist.all_reduce(sq, group=self.shard_group)
        return sq

    def _delta(self, p: torch.Tensor) -> torch.Tensor:
        loc = _local(p)
        return self._anchor[id(p)].to(loc.device, non_blocking=True) - loc

    @torch.no_grad()
    def begin_sync(self) -> None:
        """Start a synchronisation: global norms, anomaly test and weights."""
        if self._weights is not None or self._done:
            raise RuntimeError("local_sgd begin_sync called twice without finish_sync")
        if self.cfg.penalty:
            sq = self._sq_norm([self._delta(p) for p in self.params
                                if id(p) not in self._uncounted])
            norms = [torch.zeros(1, dtype=torch.float64, device=self.device)
                     for _ in range(self.replicas)]
            dist.all_gather(norms, sq, group=self.group)
            norm_list = [math.sqrt(float(n.item())) for n in norms]
        else:
            norm_list = [0.0] * self.replicas
        weights = penalty_weights(norm_list, self.stats, self.cfg)
        self._weights = weights if weights is not None else []   # []: roll back
        self.last_weights = list(self._weights)

    @torch.no_grad()
    def sync_layer(self, params: Sequence[torch.Tensor]) -> None:
        """Average one layer's pseudo-gradients over the replicas (and, without clipping,
        apply its outer step); between ``begin_sync`` and ``finish_sync``."""
        self.end_layer(self.start_layer(params))

    @torch.no_grad()
    def start_layer(self, params: Sequence[torch.Tensor], *, async_op: bool = False
                    ) -> list[tuple[torch.Tensor, torch.Tensor | None, object]]:
        """``sync_layer``'s first half: each block's weighted pseudo-gradient and its
        replica all-reduce, issued (``async_op``: not waited for; ``train.layerwise``
        overlaps it with the forward). ``end_layer`` takes what it returns."""
        if self._weights is None:
            raise RuntimeError("local_sgd sync_layer called outside begin_sync/finish_sync")
        me = dist.get_rank(self.group)
        out: list[tuple[torch.Tensor, torch.Tensor | None, object]] = []
        for p in params:
            if id(p) not in self._anchor or id(p) in self._done:
                raise ValueError("local_sgd sync_layer got a parameter it does not manage "
                                 "or has synced already in this synchronisation")
            self._done.add(id(p))
            if not self._weights:     # every replica anomalous: nothing to average
                out.append((p, None, None))
                continue
            d = self._delta(p).mul_(self._weights[me])
            out.append((p, d, dist.all_reduce(d, group=self.group, async_op=async_op)))
        return out

    @torch.no_grad()
    def end_layer(self, flight: Sequence[tuple[torch.Tensor, torch.Tensor | None, object]]
                  ) -> None:
        """``sync_layer``'s second half: wait for ``start_layer``'s all-reduces, then apply
        the outer step (kept for ``finish_sync`` with clipping), or roll back."""
        for p, d, work in flight:
            if d is None:             # every replica anomalous: back to the anchor
                _local(p).copy_(self._anchor[id(p)])
                continue
            if work is not None:
                work.wait()
            if self.cfg.clips:
                self._pending.append((p, d))
            else:
                self._apply(p, d)

    def _apply(self, p: torch.Tensor, d: torch.Tensor) -> None:
        anchor, mom = self._anchor[id(p)], self._mom[id(p)]
        a, m = anchor.to(d.device), mom.to(d.device)   # the same tensors unless offloaded
        _outer(a, m, d, self.cfg)
        if a is not anchor:         # offloaded: write the new state back to the CPU
            anchor.copy_(a)
            mom.copy_(m)
        _local(p).copy_(a)

    @torch.no_grad()
    def finish_sync(self) -> None:
        """End a synchronisation: clip and apply the deferred layers."""
        if len(self._done) != len(self.params):
            raise RuntimeError(f"local_sgd finish_sync after {len(self._done)} of "
                               f"{len(self.params)} parameters were synced")
        if self._pending:
            norm = math.sqrt(float(self._sq_norm([d for p, d in self._pending
                                                  if id(p) not in self._uncounted]).item()))
            scale = min(1.0, self.cfg.clip_norm / norm) if norm > 0 else 1.0
            for p, d in self._pending:
                self._apply(p, d.mul_(scale))
        self._pending, self._weights, self._done = [], None, set()


    # -- checkpoints ------------------------------------------------------------------
    def anchor_of(self, p: torch.Tensor) -> torch.Tensor:
        """The anchor block of parameter ``p`` (live: a checkpoint saves and loads it)."""
        return self._anchor[id(p)]

    def momentum_of(self, p: torch.Tensor) -> torch.Tensor:
        """The outer momentum block of parameter ``p`` (live, as ``anchor_of``)."""
        return self._mom[id(p)]


class ReferenceLocalSGD:
    """The same synchronisation in one process over R replica copies (``dtc reference``):
    ``sync(replicas)`` with ``replicas[i]`` replica i's parameters (whole tensors) writes
    the synchronised parameters into every copy."""

    def __init__(self, params: Sequence[torch.Tensor], cfg: LocalSGDConfig) -> None:
        self.cfg = cfg
        self.anchor = [p.detach().clone() for p in params]
        self.mom = [torch.zeros_like(a) for a in self.anchor]
        self.stats = NormStats()
        self.last_weights: list[float] = []

    @torch.no_grad()
    def sync(self, replicas: Sequence[Sequence[torch.Tensor]]) -> None:
        deltas = [[a - p.detach() for a, p in zip(self.anchor, rep, strict=True)]
                  for rep in replicas]
        norms = [math.sqrt(sum(float(d.double().pow(2).sum()) for d in ds)) for ds in deltas]
        weights = penalty_weights(norms if self.cfg.penalty else [0.0] * len(replicas),
                                  self.stats, self.cfg)
        self.last_weights = list(weights or [])
        if weights is None:
            new = self.anchor
        else:
            avg = [sum(w * ds[k] for w, ds in zip(weights, deltas, strict=True))
                   for k in range(len(self.anchor))]
            if self.cfg.clips:
                norm = math.sqrt(sum(float(d.double().pow(2).sum()) for d in avg))
                scale = min(1.0, self.cfg.clip_norm / norm) if norm > 0 else 1.0
                avg = [d * scale for d in avg]
            new = [_outer(a, m, d, self.cfg)
                   for a, m, d in zip(self.anchor, self.mom, avg, strict=True)]
        for rep in replicas:
            for p, n in zip(rep, new, strict=True):
                (p.data if isinstance(p, torch.nn.Parameter) else p).copy_(n)


def reference_local_sgd(replicas: Sequence[Sequence[torch.Tensor]],
                        state: ReferenceLocalSGD) -> None:
    """One synchronisation of ``replicas`` (a list of R replicas' parameter lists) in one
    process; ``state = ReferenceLocalSGD(initial_params, cfg)`` carries the anchor, outer
    momentum and norm statistics from one call to the next."""
    state.sync(replicas)


# ---- wiring into training (train.executor, train.reference) ---------------------------------

CORRUPT_ENV = "DTDSL_LOCAL_SGD_CORRUPT"
"""The penalty's test hook: ``replica=R,scale=X,from_step=S`` makes replica ``R`` of
every unit a bad one from step ``S`` (0-based) on: before each synchronisation its drift
from the anchor is multiplied by ``X`` (as if its data had made every update ``X`` times
too large), in the distributed runtime and in ``dtc reference`` alike."""


@dataclasses.dataclass(frozen=True)
class Corruption:
    replica: int
    scale: float
    from_step: int

    def applies(self, replica: int, step: int) -> bool:
        return replica == self.replica and step >= self.from_step


def corruption(environ: dict[str, str] | None = None) -> Corruption | None:
    """``CORRUPT_ENV``'s hook, or None when unset; ValueError naming it when malformed."""
    import os

    text = (os.environ if environ is None else environ).get(CORRUPT_ENV, "").strip()
    if not text:
        return None
    fields: dict[str, str] = {}
    for item in text.split(","):
        key, eq, value = item.partition("=")
        fields[key.strip()] = value.strip() if eq else ""
    try:
        if set(fields) != {"replica", "scale", "from_step"}:
            raise ValueError("needs exactly replica=, scale= and from_step=")
        out = Corruption(replica=int(fields["replica"]), scale=float(fields["scale"]),
                         from_step=int(fields["from_step"]))
        if out.replica < 0 or out.from_step < 0 or not math.isfinite(out.scale):
            raise ValueError("replica and from_step must be >= 0, scale finite")
    except ValueError as err:
        raise ValueError(f"{CORRUPT_ENV}={text!r}: {err}; write e.g. "
                         "replica=1,scale=30,from_step=12") from None
    return out


def config_of(sync: object) -> LocalSGDConfig:
    """The ``LocalSGDConfig`` of a program's ``train.sync`` (``ir.Sync``, local_sgd)."""
    return LocalSGDConfig(period=sync.period, interval=sync.interval_s,
                          outer_lr=sync.outer_lr, outer_momentum=sync.outer_momentum,
                          penalty=sync.penalty, warmup_syncs=sync.penalty_warmup)


@torch.no_grad()
def corrupt(params: Sequence[torch.Tensor], anchors: Sequence[torch.Tensor],
            scale: float) -> None:
    """The test hook's damage: ``p = a - scale * (a - p)`` for each block."""
    for p, a in zip(params, anchors, strict=True):
        loc = _local(p)
        loc.copy_(a.to(loc.device) - scale * (a.to(loc.device) - loc))


class ReplicaScaled:
    """A ``train.optim.StageOptimizer`` of a unit with ``replicas`` Local SGD replicas, as
    ``optim.optimizer_step`` sees it. Each replica's gradient is its own samples' share
    of the batch's loss; times ``replicas`` it estimates the whole batch's gradient (so
    ``period=1``, ``outer_lr=1`` and SGD are synchronous DP): the step's coefficient is
    multiplied by ``replicas``, and the job-wide squared norm it contributes is the mean
    over the replicas of their estimates' squared norms (``replicas**2 / replicas``)."""

    def __init__(self, inner: object, replicas: int) -> None:
        self.inner, self.replicas = inner, replicas

    def grad_sq_norm_and_nonfinite(self) -> tuple[torch.Tensor, torch.Tensor]:
        sq, bad = self.inner.grad_sq_norm_and_nonfinite()
        return sq * self.replicas, bad

    def step(self, step: int, coefficient: float) -> None:
        self.inner.step(step, coefficient * self.replicas)

    def zero_grad(self) -> None:
        self.inner.zero_grad()


class StageSync:
    """Local SGD of one rank's FSDP2 roots (its stage, each phased encoder), built by the
    executor. ``parts``: per root with trainable parameters, ``(mesh, params, counted,
    names, tag, optimizer, module)``: its DeviceMesh laid out for ZeRO 0
    (``ir.Train.mesh_zero``: ``dp_replicate`` joins the replicas, ``dp_shard`` a
    replica's ranks, ``parallel.replicas``: over which FSDP2 shards it), its
    trainable parameters, whether each counts in the penalty's norm on this rank, their
    names, its tag, its torch optimizer and its root module (None: no layer-wise
    overlap); ``tp_group``: the roots' TP group (None at tp 1), over which norms are
    summed; ``unit``: the stage's own unit, whose layers synchronise one by one
    (``train.layerwise``). A root whose unit has one replica has nothing to sync.

    ``overlap`` (True): synchronise layer by layer during the next step's forward
    (``train.layerwise``), except with clipping; False: block at the step's end."""

    def __init__(self, parts: Sequence[tuple[object, Sequence[torch.Tensor], Sequence[bool],
                                             Sequence[str], str, object, object]],
                 cfg: LocalSGDConfig, *, tp_group: dist.ProcessGroup | None = None,
                 unit: str | None = None, overlap: bool = True) -> None:
        import time

        from dtdsl.train.layerwise import Overlap, layer_groups

        self.cfg, self.overlap = cfg, overlap
        # Per sync: its layer-wise synchronisation (None: blocking only).
        self._overlaps: list[Overlap | None] = []
        self.syncs: list[tuple[LocalSGD, int, int]] = []     # (sync, replicas, replica)
        # Per sync: its parameters' names, its tag and its (torch) inner optimizer.
        self._names: list[tuple[list[str], str, object]] = []
        for mesh, params, counted, names, tag, optimizer, module in parts:
            replicas = mesh["dp_replicate"].size()
            if replicas < 2 or not params:
                continue
            groups = layer_groups(module, unit, params) if module is not None else []
            shard_group = tp_group
            if mesh["dp_shard"].size() > 1:     # a replica of several ranks (replica_dp)
                if tp_group is not None:
                    raise NotImplementedError("local_sgd replicas of several ranks beside "
                                              "TP (DT601)")
                shard_group = mesh.get_group("dp_shard")
            sync = LocalSGD(params, cfg, group=mesh.get_group("dp_replicate"),
                            shard_group=shard_group, counted=counted,
                            layers=[ps for _, ps in groups] or None)
            self.syncs.append((sync, replicas, mesh.get_local_rank("dp_replicate")))
            self._names.append((list(names), tag, optimizer))
            self._overlaps.append(Overlap(sync, module, groups) if groups else None)
        self.hook = corruption()
        if self.hook is not None and self.syncs and dist.get_rank() == 0:
            # A test hook that damages a replica: never silently, in a real run.
            print(f"warning: {CORRUPT_ENV} is set: local_sgd scales replica "
                  f"{self.hook.replica}'s drift by {self.hook.scale} from step "
                  f"{self.hook.from_step} (a test hook; unset it to train)", flush=True)
        # Per root, when its last synchronisation ended (A-EDiT's clock).
        self._since = [time.perf_counter()] * len(self.syncs)
        self._due = [False] * len(self.syncs)

    def replicas_of(self, params: Sequence[torch.Tensor]) -> int:
        """The replica count of the root that holds ``params`` (1: not synchronised)."""
        mine = {id(p) for p in params}
        for sync, replicas, _ in self.syncs:
            if any(id(p) in mine for p in sync.params):
                return replicas
        return 1

    def decide(self, step: int, now_s: float) -> bool:
        """Whether step ``step`` ends with a synchronisation (every rank of each replica
        group calls it every step, before the optimizer step: with an interval it is a
        collective). First finishes the last synchronisation's layers that this step's
        forward did not reach (``settle``)."""
        self.settle()
        # Each root decides with its own replica group (they may differ: a phased
        # encoder's DP group is not its stage's).
        self._due = [s.due(step, now_s - since) if self.cfg.interval is not None
                     else (step + 1) % self.cfg.period == 0
                     for (s, _, _), since in zip(self.syncs, self._since, strict=True)]
        return any(self._due)

    def payload_bytes(self) -> int:
        """What this rank puts into the synchronisation's collectives (the pseudo-gradient
        all-reduce, fp32 as the master weights; the penalty's norms), 0 if not due."""
        out = 0
        for (sync, replicas, _), due in zip(self.syncs, self._due, strict=True):
            if not due:
                continue
            out += sum(_local(p).numel() * _local(p).element_size() for p in sync.params)
            out += 8 * replicas if self.cfg.penalty else 0
        return out

    @torch.no_grad()
    def after_step(self, step: int, now_s: float) -> None:
        """After the inner optimizer step ``step``: the test hook's damage, then the
        synchronisation ``decide`` chose: its norms and weights now, its layers during the
        next step's forward (``train.layerwise``), or all now (clipping, ``overlap``
        off, a root without layer groups)."""
        if not any(self._due):
            return
        for (sync, _, replica), due, overlap in zip(self.syncs, self._due, self._overlaps,
                                                    strict=True):
            if not due:
                continue
            if self.hook is not None and self.hook.applies(replica, step):
                corrupt(sync.params, [sync.anchor_of(p) for p in sync.params],
                        self.hook.scale)
            sync.begin_sync()
            if overlap is not None and self.overlap and not self.cfg.clips:
                overlap.start()
            else:
                for layer in sync.layers:
                    sync.sync_layer(layer)
                sync.finish_sync()
            self._report(sync, replica, step)
        self._since = [now_s if due else since
                       for due, since in zip(self._due, self._since, strict=True)]
        self._due = [False] * len(self.syncs)

    def _report(self, sync: LocalSGD, replica: int, step: int) -> None:
        """One line when the penalty dropped replicas or rolled back, from the group's
        first replica on TP index 0 (what an operator needs to see: a replica's data or
        hardware went bad)."""
        weights = sync.last_weights
        if not self.cfg.penalty or replica != 0 or (
                sync.shard_group is not None and dist.get_rank(sync.shard_group) != 0):
            return
        tag = self._names[[s for s, _, _ in self.syncs].index(sync)][1]
        if not weights:
            print(f"local_sgd: {tag} step {step}: every replica anomalous, rolled back to "
                  "the last synchronisation", flush=True)
        elif any(w == 0 for w in weights):
            dropped = [i for i, w in enumerate(weights) if w == 0]
            print(f"local_sgd: {tag} step {step}: dropped replica(s) {dropped} (pseudo-"
                  "gradient norm anomalous)", flush=True)

    def settle(self) -> None:
        """Finish any layer-wise synchronisation still running (collective over the
        replica groups: every rank calls it at the same point). The executor calls it
        before each optimizer step and at the end of training, a checkpoint before it
        reads anything."""
        for overlap in self._overlaps:
            if overlap is not None:
                overlap.settle()

    def pending_modules(self) -> list[torch.nn.Module]:
        """The modules whose outer step the running synchronisation has yet to apply
        (``Stage.begin_step`` leaves them ungathered)."""
        return [m for o in self._overlaps if o is not None for m in o.pending_modules]

    def start_clock(self, now_s: float) -> None:
        """A-EDiT's clock starts (training starts or resumes)."""
        self._since = [now_s] * len(self.syncs)

    def last_weights(self) -> list[list[float]]:
        return [list(s.last_weights) for s, _, _ in self.syncs]

    # -- checkpoints (train.checkpoint) ---------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of Local SGD: per parameter its anchor and outer
        momentum (``anchor.<name>``, ``momentum.<name>``: the same on every replica, shaped
        like the parameter, DTensors with its placements: each rank writes its block,
        once; a running synchronisation is finished first: ``settle``); every replica's
        own parameters and inner optimizer state
        (``replica<r>.<name>``, ``replica<r>.optim.<name>.<state>``: between two
        synchronisations they differ, and the model's and optimizer's entries hold one
        replica's); per synchronised root its norm statistics (``stats.<tag>``: mean,
        variance, norms seen, synchronisations). Anchors and momenta are the live tensors,
        the replicas' values copies (a load must not write them into the parameters
        before the model's entries are set). Empty when nothing is synchronised."""
        self.settle()
        out: dict[str, torch.Tensor] = {}
        for (sync, _, replica), (names, tag, opt) in zip(self.syncs, self._names,
                                                          strict=True):
            for p, name in zip(sync.params, names, strict=True):
                out[f"anchor.{name}"] = _like(sync.anchor_of(p), p)
                out[f"momentum.{name}"] = _like(sync.momentum_of(p), p)
                out[f"replica{replica}.{name}"] = _like(_local(p).detach().clone(), p)
                for key, value in opt.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        copy = _local(value).detach().clone()
                        out[f"replica{replica}.optim.{name}.{key}"] = \
                            _like(copy, p) if copy.dim() else copy
            st = sync.stats
            out[f"stats.{tag}"] = torch.tensor([st.mean, st.var, st.seen, st.syncs],
                                               dtype=torch.float64)
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore ``state_dict``'s values (loaded in place by DCP) into the live state,
        after the model's and optimizer's entries: anchors, momenta, this replica's
        parameters and optimizer state, the statistics. A checkpoint of fewer replicas
        (``train.checkpoint`` leaves out what it lacks) gives a replica it has no entries
        for the model's (one replica's: the same on all after a synchronisation), and
        without an anchor Local SGD starts again from the loaded model: anchored there,
        no outer momentum, no statistics."""
        for (sync, _, replica), (names, tag, opt) in zip(self.syncs, self._names,
                                                          strict=True):
            for p, name in zip(sync.params, names, strict=True):
                if f"anchor.{name}" not in state:
                    sync.anchor_of(p).copy_(_local(p))
                    sync.momentum_of(p).zero_()
                pairs = [(f"anchor.{name}", sync.anchor_of(p)),
                         (f"momentum.{name}", sync.momentum_of(p)),
                         (f"replica{replica}.{name}", _local(p))]
                pairs += [(f"replica{replica}.optim.{name}.{key}", _local(value))
                          for key, value in opt.state.get(p, {}).items()
                          if isinstance(value, torch.Tensor)]
                for key, live in pairs:
                    loaded = _local(state[key]) if key in state else live
                    if loaded.data_ptr() != live.data_ptr():
                        live.copy_(loaded)
            stats = state.get(f"stats.{tag}")
            mean, var, seen, syncs = (0.0, 0.0, 0, 0) if stats is None else stats.tolist()
            sync.stats = NormStats(mean=mean, var=var, seen=int(seen), syncs=int(syncs))


def _like(block: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``block`` (a rank's block of ``param``'s shape) as a DTensor placed as ``param`` is
    (a view: DCP reads and writes the block itself), or itself for a plain tensor."""
    data = param.data if isinstance(param, torch.nn.Parameter) else param
    if not hasattr(data, "to_local"):
        return block
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(block, data.device_mesh, data.placements, run_check=False,
                              shape=data.shape, stride=data.stride())
