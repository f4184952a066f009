"""A training step's data as one rank reads it: where each sample goes, this rank's samples,
and the loss denominators of the whole global batch.

Three layers:

- a ``SampleSource`` says which samples make up a step's global batch and builds any of
  them: ``SyntheticSource`` draws them from the spec's distributions
  (``data.sample.make_sample``), ``dtdsl.feed.source.DatasetSource`` reads a dataset;
- ``route_batch`` decides where every sample of a batch goes under the spec's reorder
  policy, with the simulator's own rule (``dtdsl.reorder.workload.route``: inter-microbatch
  grouping of samples of similar work into steps and their order for 1F1B over the whole
  pipeline, intra-microbatch balancing of every unit's replicas), so predicted and
  measured runs route alike;
- a ``BatchSource`` hands a rank its ``StepBatch`` per training step: ``LocalBatches``
  builds it in the rank's own process (tests, the reference); the preprocessing workers
  (``dtdsl.feed``) build the same thing on CPU nodes and ship it.

A sample's place in the step is its *position* 0..B-1 in the global batch (the order the
source lists the keys); the routing refers to positions only, so any reordering is a
relabelling of where positions go and the loss, a sum over the batch divided by
denominators of the whole batch, does not depend on it.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from dtdsl.cost.samples import SampleSet, sized_samples
from dtdsl.data.sample import join_samples, join_sizes, make_sample, sample_sizes
from dtdsl.ir import program as ir
from dtdsl.ir.layout import layout_of, pack
from dtdsl.ir.modal import EncoderInputs, encoder_inputs
from dtdsl.ir.plan import Plan
from dtdsl.ir.sizes import SampleSizes
from dtdsl.models.inputs import Sample, image_encoder
from dtdsl.models.multimodal import Normalizer
from dtdsl.parallel.broker import StepSamples

if TYPE_CHECKING:
    from dtdsl.parallel.mesh import RankRole
    from dtdsl.reorder.workload import Routing, WorkModel

__all__ = [
    "ALL_PARTS",
    "BatchSource",
    "LocalBatches",
    "SampleSource",
    "StepBatch",
    "SyntheticSource",
    "normalizer_of",
    "parts_of",
    "pin_batch",
    "pins_memory",
    "reads_of",
    "route_batch",
    "routing_of",
    "sample_set",
]

ALL_PARTS = frozenset({"tokens", "images", "targets"})


@dataclass(frozen=True, eq=False)
class StepBatch:
    """One training step's data as one rank reads it."""

    step: int
    keys: tuple[str, ...]               # per position: the sample's key (for samples.jsonl)
    routing: tuple[StepSamples, ...]    # per microbatch step, in execution order
    samples: Mapping[int, Sample]       # position -> this rank's parts of it (its positions)
    normalizer: Normalizer
    sizes: tuple[SampleSizes, ...] = ()  # per position: every sample's sizes (the shapes
                                         # of what ranks exchange follow from them)
    wait_s: float = 0.0                 # how long the rank waited for it


def pins_memory() -> bool:
    """Whether this process's batches are pinned (``pin_batch``): when its rank computes
    on an accelerator (``parallel.device.rank_device``'s rule: one is present and
    ``DTDSL_DEVICE`` does not say ``cpu``)."""
    if os.environ.get("DTDSL_DEVICE", "").strip().lower() == "cpu":
        return False
    return torch.accelerator.is_available()


def _pinned(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.pin_memory() if x.device.type == "cpu" else x
    if isinstance(x, tuple):
        return tuple(_pinned(v) for v in x)
    if isinstance(x, dict):
        return {k: _pinned(v) for k, v in x.items()}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: _pinned(getattr(x, f.name))
                                         for f in dataclasses.fields(x) if f.init})
    return x


def pin_batch(batch: StepBatch) -> StepBatch:
    """``batch`` with its samples' tensors (tokens, images, generation targets) in pinned
    host memory, where the feed builds it (the feed's thread; in process, before the
    step's actions): the training thread's copies to the device
    (``parallel.device.to_device``) then start without blocking and overlap its work."""
    return dataclasses.replace(batch, samples={i: _pinned(s)
                                               for i, s in batch.samples.items()})


class SampleSource(Protocol):
    """Which samples make up each step's global batch, and each of them built."""

    def keys(self, step: int) -> tuple[str, ...]:
        """The keys of step ``step``'s samples, by position."""
        ...

    def sizes(self, step: int) -> list[SampleSizes]:
        """Every position's sizes (cheap: no pixel is decoded)."""
        ...

    def sample(self, step: int, position: int, parts: frozenset[str] = ALL_PARTS,
               sizes: SampleSizes | None = None) -> Sample:
        """The sample at ``position`` of step ``step``, with the ``parts`` asked for
        (``sizes``: its ``sizes(step)`` entry, when the caller has it)."""
        ...


class BatchSource(Protocol):
    """Hands a rank its data, one training step at a time (steps in increasing order)."""

    def batch(self, step: int) -> StepBatch: ...


class SyntheticSource:
    """Samples drawn from the spec's data distributions (``data.sample.make_sample``): document
    ``i`` of step ``s`` is seeded from ``(train.seed, s, i)`` alone. Position ``i`` is
    document ``i``; with ``train.packing``, the documents ``0, 1, 2, ...`` of the step
    packed into ``global_batch`` sequences (``ir.layout.pack``; those left in sequences
    still open when the batch is full are not used)."""

    def __init__(self, program: ir.Program):
        self.program = program
        self._tokens = _image_tokens(program)
        self._rows = lru_cache(maxsize=8)(self._step_rows)

    def _step_rows(self, step: int) -> tuple[tuple[tuple[int, ...], ...],
                                             dict[int, SampleSizes]]:
        """Per position its documents, and the documents' sizes."""
        program, batch = self.program, self.program.train.global_batch
        if not program.train.packing:
            docs = {i: sample_sizes(program, step, i) for i in range(batch)}
            return tuple((i,) for i in range(batch)), docs
        docs = {}
        seq_len = program.train.seq_len

        def lengths() -> Iterator[int]:
            for i in itertools.count():
                docs[i] = sample_sizes(program, step, i)
                yield layout_of(docs[i], self._tokens, seq_len).length

        rows = pack(lengths(), seq_len, rows=batch)
        return tuple(tuple(r) for r in rows), docs

    def keys(self, step: int) -> tuple[str, ...]:
        rows, _ = self._rows(step)
        return tuple("+".join(f"synthetic/{step}/{i}" for i in r) for r in rows)

    def sizes(self, step: int) -> list[SampleSizes]:
        rows, docs = self._rows(step)
        return [join_sizes([docs[i] for i in r]) for r in rows]

    def sample(self, step: int, position: int, parts: frozenset[str] = ALL_PARTS,
               sizes: SampleSizes | None = None) -> Sample:
        rows, docs = self._rows(step)
        row = rows[position]
        made = [make_sample(self.program, step, i, parts=parts, sizes=docs[i]) for i in row]
        return join_samples(made, sizes or join_sizes([docs[i] for i in row]), position)


def parts_of(role: RankRole, plan: Plan | None = None) -> frozenset[str]:
    """What of its samples a rank reads: images on every encoder stage (the ``images``
    part is every encoder's items: the images and the other encoders' ``inputs``; their
    shapes group the packed activations), tokens on the backbone's first stage, generation
    targets on a generator; and on a backbone stage that hosts co-located units of
    ``plan`` (``mesh.hosted_units``) what they read too: the encoder's images on its
    first stage, the generators' targets on its last. Nothing elsewhere."""
    if role.role == "encoder":
        return frozenset({"images"})
    if role.role == "generator":
        return frozenset({"targets"})
    parts = {"tokens"} if role.is_first_stage else set()
    if plan is not None:
        from dtdsl.parallel.mesh import hosted_units

        for u in hosted_units(plan, role):
            parts.add("images" if u.role == "encoder" else "targets")
    return frozenset(parts)


def reads_of(role: RankRole, plan: Plan, routing: Sequence[StepSamples]
             ) -> dict[int, frozenset[str]]:
    """The positions of a step whose parts a rank reads, and the parts of each: its
    stage's samples with ``parts_of(role, plan)``, and on a backbone rank that runs a
    phased encoder (``mesh.phased_units``) the images of its share of the encoder's
    samples (its replica there, ``mesh.phased_role``), which are also its replica's.
    Empty where the rank reads nothing."""
    from dtdsl.parallel.mesh import phased_role, phased_units

    out: dict[int, frozenset[str]] = {}
    parts = parts_of(role, plan)
    if parts:
        for s in routing:
            for i in s.samples_of(role.unit, role.replica):
                out[i] = parts
    for u in phased_units(plan, role):
        replica = phased_role(plan, u, role.rank).replica
        for s in routing:
            for i in s.samples_of(u.name, replica):
                out[i] = out.get(i, frozenset()) | {"images"}
    return out


def _image_tokens(program: ir.Program) -> EncoderInputs:
    """Every encoder's rule for its items' tokens (``ir.modal.encoder_inputs``: an
    image's as ``Program.image_tokens``); ValueError for encoders the runtime has no data
    for (``models.inputs.image_encoder``)."""
    image_encoder(program)
    return encoder_inputs(program)


def normalizer_of(program: ir.Program, sizes: Sequence[SampleSizes]) -> Normalizer:
    """``models.multimodal.loss_normalizer`` of a batch from its samples' sizes alone
    (``ir.layout``'s rule: each sample's trained tokens that fit in ``seq_len``)."""
    tokens, seq_len = _image_tokens(program), program.train.seq_len
    text = sum(layout_of(sz, tokens, seq_len).loss_tokens for sz in sizes)
    gen = sum(sz.num_gen_targets for sz in sizes)
    return Normalizer(text_tokens=text, gen_targets=gen)


def sample_set(program: ir.Program, sizes: Sequence[SampleSizes]) -> SampleSet:
    """``cost.samples.sized_samples`` (the cost model's view of real samples) of a program
    the runtime has data for (``_image_tokens``: ValueError otherwise)."""
    _image_tokens(program)
    return sized_samples(program, sizes)


def route_batch(plan: Plan, program: ir.Program, sizes: Sequence[SampleSizes],
                policy: frozenset[str], work_model: WorkModel | None = None
                ) -> tuple[StepSamples, ...]:
    """Where every sample of a batch goes under ``policy`` (a subset of ``{"intra",
    "inter"}``): per microbatch step in execution order, its positions (increasing) and
    every unit's replica per position. ``work_model`` (a ``reorder.workload.WorkModel`` of the
    spec's cost model) is needed when ``policy`` is not empty."""
    from dtdsl.reorder.workload import route

    n = len(sizes)
    if policy:
        if work_model is None:
            raise ValueError(f"reorder policy {sorted(policy)} needs a work model")
        work = work_model.relative(sample_set(program, sizes))
    else:   # data order: only the batch size matters
        work = {u.name: np.ones(n) for u in plan.units}
    routing = route(plan, work, policy)
    out = []
    for j in range(plan.num_microbatches):
        members = np.flatnonzero(routing.step == j)
        out.append(StepSamples(
            sample_ids=tuple(int(i) for i in members),
            assignment={u.name: tuple(int(r) for r in routing.replica[u.name][members])
                        for u in plan.units}))
    return tuple(out)


def routing_of(plan: Plan, steps: Sequence[StepSamples]) -> Routing:
    """``route_batch``'s result as the simulator's ``Routing`` (per position: its
    microbatch step and every unit's replica): to simulate the batch a run trains on."""
    from dtdsl.reorder.workload import Routing

    n = sum(len(s.sample_ids) for s in steps)
    step = np.full(n, -1, dtype=np.int64)
    replica = {u.name: np.zeros(n, dtype=np.int64) for u in plan.units}
    for j, s in enumerate(steps):
        ids = np.asarray(s.sample_ids, dtype=np.int64)
        step[ids] = j
        for unit, where in s.assignment.items():
            replica[unit][ids] = where
    if (step < 0).any():
        raise ValueError("the routing leaves positions of the batch out")
    return Routing(num_microbatches=len(steps), step=step, replica=replica)


class LocalBatches:
    """A ``BatchSource`` that builds every step's batch in this process from ``source``:
    routing under ``policy`` (default the spec's ``train.reorder``), this rank's samples
    with the parts it reads (``reads_of``) and the denominators; ``pin``: their tensors
    pinned (``pin_batch``; default ``pins_memory()``)."""

    def __init__(self, program: ir.Program, plan: Plan, role: RankRole, *,
                 source: SampleSource | None = None, policy: frozenset[str] | None = None,
                 work_model: WorkModel | None = None, pin: bool | None = None):
        self.program, self.plan, self.role = program, plan, role
        self.pin = pins_memory() if pin is None else pin
        self.source = source if source is not None else SyntheticSource(program)
        self.policy = frozenset(program.train.reorder) if policy is None else policy
        if self.policy and work_model is None:
            from dtdsl.cost.model import build_cost_model
            from dtdsl.reorder.workload import WorkModel

            work_model = WorkModel(build_cost_model(program))
        self.work_model = work_model
        self.parts = parts_of(role, plan)
        self._static: tuple[StepSamples, ...] | None = None

    def batch(self, step: int) -> StepBatch:
        sizes = self.source.sizes(step)
        if self.policy:
            routing = route_batch(self.plan, self.program, sizes, self.policy, self.work_model)
        else:   # data order does not depend on the samples: route once
            if self._static is None:
                self._static = route_batch(self.plan, self.program, sizes, frozenset())
            routing = self._static
        samples = {i: self.source.sample(step, i, parts, sizes=sizes[i])
                   for i, parts in reads_of(self.role, self.plan, routing).items()}
        batch = StepBatch(step=step, keys=self.source.keys(step), routing=routing,
                          samples=samples, normalizer=normalizer_of(self.program, sizes),
                          sizes=tuple(sizes))
        return pin_batch(batch) if self.pin else batch
