"""``dtc memcheck`` of MoE backbones: the runtime's stages measured on fake tensors against
the cost model's per-stage memory (``train.memplan``), per backbone stage.

Two cases: the tiny MoE spec (``tests/helpers/moe.py``: 4 experts, top 2, in bf16, the
cost model's activations) at dp 2, ep 1 and 2, pp 1 and 2; and with ``--paper`` a copy of
``specs/moe_vl_30b.dt`` with ``tp(llm) == 1`` (the runtime splits experts over EP ranks,
not over TP), planned now (``dtc plan --no-baseline``) or at ``--plan`` (a plan JSON).

On the development machine (error = measured / predicted - 1, backbone stages):

    case                        before (a13cc05)          after
    tiny ep 1 pp 1              +30.3%                    +2.6%
    tiny ep 1 pp 2              +41.2%, +30.6%            +10.2%, +6.2%
    tiny ep 2 pp 1              +28.6%                    +3.1%
    tiny ep 2 pp 2              +40.5%, +29.2%            +11.0%, +6.7%
    30b, a13cc05's plan         +26.8% .. -26.9%          +1.3% .. +5.0%
      (tp 1, dp 8, pp 7, ep 4, in flight 7 .. 1)          (but 77.4 GiB at s0: OVER)
    30b, this plan              -                         +4.0% .. +8.0%
      (tp 1, dp 2, pp 24, ep 1, recomputing, in flight 24 .. 1)

Before, the cost model priced an MoE layer's routed part as ``8 k f + 2 k h`` bytes per
token, and memcheck priced every stage at ep 1 (every expert's weights, gradients and
state on every rank): activations under by 1.8x, the static part over by ~2x, so the error
ran from + on the first stage (7 in flight) to - on the last (1).

    python benchmarks/moe_memcheck.py [--paper] [--plan PLAN]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _rows(stages, label: str) -> None:
    from dtdsl.report import format_bytes

    for s in stages:
        if s.unit == "llm":
            print(f"{label:<22}{'llm.s' + str(s.stage):<9}{s.in_flight:>6}"
                  f"{format_bytes(s.predicted_bytes):>12}{format_bytes(s.measured_bytes):>12}"
                  f"{s.error:>+9.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--paper", action="store_true", help="also the 30B spec at tp 1")
    parser.add_argument("--plan", help="its plan JSON (default: plan it now)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    from dtdsl import cli
    from dtdsl.driver import run_frontend
    from dtdsl.ir.plan import Plan
    from dtdsl.train.memplan import check_memory
    from tests.helpers.moe import moe_spec
    from tests.train.test_ep_run import ARGS, ep_plan

    print(f"{'case':<22}{'stage':<9}{'flight':>6}{'predicted':>12}{'measured':>12}{'error':>9}")
    p = moe_spec(args=ARGS)
    p = p.model_copy(update={"train": p.train.model_copy(update={"precision": "bf16"})})
    for ep in (1, 2):
        for pp in (1, 2):
            _rows(check_memory(p, ep_plan(p, 2, pp, ep), jobs=2), f"tiny ep {ep} pp {pp}")
    if not args.paper:
        return
    text = (ROOT / "specs" / "moe_vl_30b.dt").read_text().replace(
        "tp(llm)   in {1, 2, 4}", "tp(llm)   == 1")
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "moe_vl_30b.dt"
        spec.write_text(text)
        plan_path = args.plan
        if plan_path is None:
            plan_path = str(Path(tmp) / "plan.json")
            assert cli.main(["plan", str(spec), "--no-baseline", "-o", plan_path]) == 0
        result = run_frontend(str(spec), text.encode())
        plan = Plan.model_validate_json(Path(plan_path).read_text())
        _rows(check_memory(result.program, plan, jobs=2), "moe_vl_30b tp 1")


if __name__ == "__main__":
    main()
