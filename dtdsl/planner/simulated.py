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

from collections.abc import Callable
from statistics import fmean

from dtdsl.cost.model import CostModel, build_cost_model
from dtdsl.ir.plan import Packing, Plan
from dtdsl.ir.program import Recompute
from dtdsl.planner.result import Infeasible

__all__ = ["ESTIMATED", "SIMULATED", "DrawnBatches", "SpecData", "near_plans",
           "packing_figures", "repriced", "simulate_plan"]

Progress = Callable[[int, int, str], None]


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


# The drawn-batch objective: how many layouts near the optimum in expectation
# (``planner.shortlist``) the estimate ranks (``sim.estimate``: a few chain passes each),
# and how many of its best the simulator then runs on every drawn batch (about a second
# each on the 72B spec). The estimate ranks the simulator's fastest first on the shipped
# specs; the second is the margin for its error.
ESTIMATED = 8
SIMULATED = 2


def near_plans(cost: CostModel, searched: Plan, count: int = ESTIMATED) -> list[Plan]:
    """The Plans of the layouts near ``searched`` (``near_layouts``: one per backbone
    layout, up to ``count``, fastest at mean work first), with ``searched``'s search
    figures; ``[searched]`` where there are none."""
    from dtdsl.planner.evaluate import Evaluator
    from dtdsl.planner.result import make_plan
    from dtdsl.planner.shortlist import near_layouts

    num_gpus = searched.num_gpus
    ev = Evaluator(cost, num_gpus)
    layouts = near_layouts(cost, num_gpus, ceiling=searched.iteration_time_s, count=count)
    return [make_plan(ev, searched.search, layout, solve_time_s=searched.solve_time_s,
                      candidates=searched.candidates, convex_solves=searched.convex_solves,
                      evaluated=searched.evaluated) for layout in layouts] or [searched]


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


def packing_figures(cost: CostModel, plan: Plan, *, steps: int, iteration_time_s: float,
                    replan: Callable[[CostModel, Plan], Plan], data: SpecData | None = None,
                    policy: frozenset[str] = frozenset()) -> Packing | None:
    """``plan`` on the first ``steps`` drawn batches routed under ``policy`` (the spec's
    reorder policy: what a run does either way), with ``train.packing`` as the spec sets
    it (``iteration_time_s``, already simulated so) and toggled (``data``: the spec's data
    both ways, shared with the baselines): the same layout repriced, or where it does not
    fit in memory the other way, the planner's layout for that setting at mean work
    (``Packing.replanned``: ``replan(cost, plan)`` plans it, or raises ``Infeasible``).
    None with a measured profile (it times the backbone on whole
    sequences, not packed documents), or where nothing fits the other way."""
    if cost.profile is not None:
        return None
    data = data or SpecData(cost, steps)
    program = cost.program
    spec_packs = program.train.packing
    # A plan that recomputes where the spec does not: the other setting likewise.
    other = _pricing(data.cost(not spec_packs), plan)
    toggled = data.batches(not spec_packs)
    layout = repriced(plan, cost, other)
    replanned = not _fits(other, plan)
    if replanned:
        # Packed rows hold more positions than a sample (or the reverse): where the layout
        # does not fit in memory the other way, compare with what the planner gives that
        # setting (every placement, with and without recomputation, at mean work), not
        # with a layout no run could use.
        try:
            layout = replan(other, plan)
        except Infeasible:
            return None
        other = _pricing(other, layout)
    other_s = toggled.mean_time(other, layout, policy)
    ours, theirs = data.batches(spec_packs).positions, toggled.positions
    order = tuple(sorted(policy))
    if spec_packs:
        return Packing(spec_packs=True, packed_s=iteration_time_s, unpacked_s=other_s,
                       packed_positions=ours, unpacked_positions=theirs, policy=order,
                       replanned=replanned)
    return Packing(spec_packs=False, packed_s=other_s, unpacked_s=iteration_time_s,
                   packed_positions=theirs, unpacked_positions=ours, policy=order,
                   replanned=replanned)


def _pricing(cost: CostModel, plan: Plan) -> CostModel:
    """``cost``, or where ``plan`` recomputes more than ``cost``'s program (the planner's
    selective or full variant), ``cost`` with that recomputation: the model that priced
    ``plan`` (at its units' context parallelism)."""
    raised = {u.name: Recompute.of(u.recompute) for u in plan.units
              if Recompute.of(u.recompute).rank >
              Recompute.of(cost.program.module(u.name).recompute).rank}
    if raised:
        from dtdsl.planner.baseline import with_recompute

        # First: it builds the model again from the program, units at cp and ep 1.
        cost = with_recompute(cost, modes=raised) or cost
    if any(u.cp != cost.unit(u.name).cp for u in plan.units):
        cost = cost.with_cp({u.name: u.cp for u in plan.units})
    if any(u.ep != cost.unit(u.name).ep for u in plan.units):
        cost = cost.with_ep({u.name: u.ep for u in plan.units})
    return cost


def _fits(other: CostModel, plan: Plan) -> bool:
    """Whether ``plan``'s layout fits in memory priced by ``other`` (the same modules under
    other training settings)."""
    from dtdsl.planner.placement import plan_fits

    return plan_fits(other, plan)


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
            spec = self.spec_cost
            self._references[packing] = (
                spec.drawn() if packing == spec.program.train.packing else
                draw_samples(self.program(packing), spec.params.samples, spec.params.seed))
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
        from dtdsl.reorder.workload import batch_samples

        if steps < 1:
            raise ValueError(f"steps must be at least 1, not {steps}")
        self.cost = cost
        self.steps = steps
        self.samples = [batch_samples(cost.program, k) for k in range(steps)]
        # The mean positions (text and encoder tokens) a step trains.
        self.positions = fmean(float(positions(s).sum()) for s in self.samples)
        self._work_model = None
        self._first_work = None

    @property
    def work_model(self):
        """The per-sample work's reference (``reorder.workload.WorkModel``), made when first
        simulated: it draws the cost model's samples again."""
        from dtdsl.reorder.workload import WorkModel

        if self._work_model is None:
            self._work_model = WorkModel(self.cost)
        return self._work_model

    def mean_time(self, cost: CostModel, plan: Plan, policy: frozenset[str] = frozenset(),
                  progress: Callable[[int], None] | None = None) -> float:
        """``plan``'s mean iteration time over the batches, routed under ``policy`` (equal
        to ``simulate_plan(cost, plan, policy=policy, steps=self.steps)``); ``progress``
        is called with each step simulated."""
        from dtdsl.reorder.workload import route
        from dtdsl.schedule.lower import lower
        from dtdsl.sim.run import simulate_routed
        from dtdsl.sim.simulate import Simulator

        simulator = Simulator(lower(plan, cost.program))
        times = []
        for step, samples in enumerate(self.samples):
            work = self.work_model.relative(samples)
            routing = route(plan, work, policy)
            times.append(simulate_routed(cost, plan, simulator, self.work_model, step,
                                         samples, routing).iteration_time_s)
            if progress is not None:
                progress(step)
        return fmean(times)

    def estimate(self, plan: Plan, policy: frozenset[str]) -> float:
        """``plan``'s estimated iteration time on the first batch (``sim.estimate``): what
        the planner ranks layouts by before it simulates the best few."""
        from dtdsl.sim.estimate import drawn_estimate

        if self._first_work is None:
            self._first_work = self.work_model.relative(self.samples[0])
        return drawn_estimate(plan, self._first_work, policy)

