"""Plans scored on drawn batches: the planner's stragglers term.

The pipeline formula (``planner.evaluate``) prices mean work. Real batches are not mean:
an encoder replica with a step's largest images holds up the backbone's replicas it
feeds, and the reorder policy (``train.reorder``) removes part of that. ``simulate_plan``
runs the lowered schedule of a plan on ``steps`` global batches drawn from the spec's data
(the same batches for every plan: step k's draw is seeded by the spec's seed and k),
routed under a policy, and returns the mean iteration time; ``plan`` in this package
scores its best candidate layouts with it under the spec's policy and keeps the fastest,
and reports the chosen plan without reordering. ``DrawnBatches`` holds the same batches
for the baselines, which simulate several layouts on them without reordering
(``planner.baseline.choose_on_drawn_batches``).

``packing_figures`` runs the chosen layout again with ``train.packing`` toggled (the
spec's program copied with the other setting, its own cost model, the plan's unit times
scaled to it by ``repriced``) on the same steps, so ``dtc plan`` can say whether packing
would train faster.
"""

from __future__ import annotations

from statistics import fmean

from dtdsl.cost.model import CostModel, build_cost_model
from dtdsl.ir.plan import Packing, Plan

__all__ = ["DrawnBatches", "SpecData", "packing_figures", "repriced", "simulate_plan"]


def simulate_plan(cost: CostModel, plan: Plan, *, policy: frozenset[str], steps: int) -> float:
    """The mean iteration time of ``plan`` over the first ``steps`` drawn global batches,
    routed under ``policy`` (a subset of {"intra", "inter"})."""
    from dtdsl.schedule.lower import lower
    from dtdsl.sim.run import simulate_steps

    if steps < 1:
        raise ValueError(f"steps must be at least 1, not {steps}")
    schedule = lower(plan, cost.program)
    return fmean(s.iteration_time_s for s in simulate_steps(
        cost.program, cost, plan, schedule, steps=steps, policy=policy))


def repriced(plan: Plan, cost: CostModel, other: CostModel) -> Plan:
    """``plan`` (priced by ``cost``) with every unit's forward and backward times priced by
    ``other``, a cost model of the same modules under other training settings: each
    scaled by the ratio of the unit's times under the two at its TP degree (a plan's
    times are linear in them, whatever its stages and shares). Layout, memory and the
    gradient sync (a function of the parameters) stay."""
    units = []
    for u in plan.units:
        tp = 1 if u.tp_replicated else u.tp
        old = cost.fwd_bwd_time_s(cost.unit(u.name), tp)
        new = other.fwd_bwd_time_s(other.unit(u.name), tp)
        units.append(u.model_copy(update={
            "fwd_time_s": u.fwd_time_s * new[0] / old[0] if old[0] > 0 else u.fwd_time_s,
            "bwd_time_s": u.bwd_time_s * new[1] / old[1] if old[1] > 0 else u.bwd_time_s}))
    return plan.model_copy(update={"units": tuple(units)})


def packing_figures(cost: CostModel, plan: Plan, *, steps: int,
                    iteration_time_s: float, data: SpecData | None = None) -> Packing | None:
    """``plan`` on the first ``steps`` drawn batches without reordering, with
    ``train.packing`` as the spec sets it (``iteration_time_s``, already simulated) and
    toggled (``data``: the spec's data both ways, shared with the baselines). Without
    reordering on both sides: it is the same comparison, and intra's search on a packed
    batch's near-equal rows would cost ``dtc plan`` seconds. None with a measured
    profile: it times the backbone on whole sequences, not packed documents."""
    if cost.profile is not None:
        return None
    data = data or SpecData(cost, steps)
    program = cost.program
    spec_packs = program.train.packing
    other = data.cost(not spec_packs)
    toggled = data.batches(not spec_packs)
    other_s = toggled.mean_time(other, repriced(plan, cost, other))
    ours, theirs = data.batches(spec_packs).positions, toggled.positions
    if spec_packs:
        return Packing(spec_packs=True, packed_s=iteration_time_s, unpacked_s=other_s,
                       packed_positions=ours, unpacked_positions=theirs)
    return Packing(spec_packs=False, packed_s=other_s, unpacked_s=iteration_time_s,
                   packed_positions=theirs, unpacked_positions=ours)


class SpecData:
    """The spec's data with ``train.packing`` as the spec sets it and toggled: per
    setting, the program, its cost model (``cost`` itself for the spec's own), the draw
    that cost model takes expectations over, and the first ``steps`` global batches
    (``DrawnBatches``), each made once, when first asked for (packed draws take a
    while)."""

    def __init__(self, cost: CostModel, steps: int) -> None:
        self.spec_cost = cost
        self.steps = steps
        self._programs: dict = {}
        self._references: dict = {}
        self._costs: dict = {cost.program.train.packing: cost}
        self._batches: dict = {}

    def program(self, packing: bool):
        if packing not in self._programs:
            program = self.spec_cost.program
            if program.train.packing != packing:
                program = program.model_copy(update={"train": program.train.model_copy(
                    update={"packing": packing})})
            self._programs[packing] = program
        return self._programs[packing]

    def reference(self, packing: bool):
        """The cost model's draw (``build_cost_model``'s)."""
        from dtdsl.cost.samples import draw_samples

        if packing not in self._references:
            params = self.spec_cost.params
            self._references[packing] = draw_samples(self.program(packing), params.samples,
                                                     params.seed)
        return self._references[packing]

    def cost(self, packing: bool) -> CostModel:
        if packing not in self._costs:
            spec = self.spec_cost
            self._costs[packing] = build_cost_model(self.program(packing), spec.params,
                                                    profile=spec.profile,
                                                    samples=self.reference(packing))
        return self._costs[packing]

    def batches(self, packing: bool) -> DrawnBatches:
        if packing not in self._batches:
            self._batches[packing] = DrawnBatches(self.cost(packing), self.steps)
        return self._batches[packing]

    def expected_positions(self, packing: bool) -> float:
        """The positions (text and encoder tokens) a global batch trains on average: over
        the cost model's draw."""
        from dtdsl.cost.samples import positions

        return float(positions(self.reference(packing)).mean()) * \
            self.program(packing).train.global_batch


class DrawnBatches:
    """The first ``steps`` global batches drawn from ``cost``'s program (as
    ``simulate_plan`` draws them) and their per-sample work, drawn once for every layout
    simulated on them without reordering. ``cost`` prices the data; a layout priced by
    another cost model of the same modules and data (padding, recomputation) is simulated
    with that one."""

    def __init__(self, cost: CostModel, steps: int) -> None:
        from dtdsl.cost.samples import positions
        from dtdsl.sim.workload import batch_samples

        if steps < 1:
            raise ValueError(f"steps must be at least 1, not {steps}")
        self.cost = cost
        self.steps = steps
        self.samples = [batch_samples(cost.program, k) for k in range(steps)]
        # The mean positions (text and encoder tokens) a step trains.
        self.positions = fmean(float(positions(s).sum()) for s in self.samples)
        self._work_model = None

    @property
    def work_model(self):
        """The per-sample work's reference (``sim.workload.WorkModel``), made when first
        simulated: it draws the cost model's samples again."""
        from dtdsl.sim.workload import WorkModel

        if self._work_model is None:
            self._work_model = WorkModel(self.cost)
        return self._work_model

    def mean_time(self, cost: CostModel, plan: Plan) -> float:
        """``plan``'s mean iteration time over the batches, without reordering (equal to
        ``simulate_plan(cost, plan, policy=frozenset(), steps=self.steps)``)."""
        from dtdsl.schedule.lower import lower
        from dtdsl.sim.run import simulate_routed
        from dtdsl.sim.simulate import Simulator
        from dtdsl.sim.workload import route

        simulator = Simulator(lower(plan, cost.program))
        times = []
        for step, samples in enumerate(self.samples):
            work = self.work_model.relative(samples)
            routing = route(plan, work, frozenset())
            times.append(simulate_routed(cost, plan, simulator, self.work_model, step,
                                         samples, routing).iteration_time_s)
        return fmean(times)

