"""``dtc memcheck`` of a video encoder under tensor and context parallelism (issue 30): the
ViT stage of the long-video variant of ``specs/mllm_72b_128k.dt``
(``tests/helpers/planning.py``'s ``long_video``: one clip of 64 to 128 frames a sample,
32K to 64K rows, Ulysses on the ViT), planned now, and its miniature
(``tests/train/test_memplan.py``'s ``_video_vit``: tp 2 x cp 2). Only the ViT's stages
are measured (the 72B backbone's take minutes each).

On the development machine (error = measured / predicted - 1; plan: ViT tp 4 x cp 4 x
dp 4, 8 microbatches in flight; capacity 74.5 GiB, 90% of it 67.1 GiB):

    case                          predicted   measured    error
    72b, before (aa4d1a0)          65.8 GiB  105.9 GiB   +60.8%   OVER
      memcheck's inputs fixed      65.8 GiB   93.3 GiB   +41.8%   OVER
      Ulysses' masks fixed         65.8 GiB   75.3 GiB   +14.4%   OVER
      both (now)                   65.8 GiB   68.6 GiB    +4.2%   (+0.5 GiB NCCL: fits)
    tiny tp 2 x cp 2, before       53.2 MiB  117.0 MiB  +119.9%
      now                          53.2 MiB   57.0 MiB    +7.1%

The memory model was right: a layer keeps what ``cost.unit``'s encoder formula says
(measured with saved-tensor hooks, per layer: the norms' inputs and the normed inputs
whole on every TP rank, 8 h bytes a row; Q, K, V, the output and the output projection's
input, 10 h / tp; the MLP's activation input and output, 4 f / tp). Two things were not:
memcheck's large microbatch was two whole average clips (98568 rows where the cost model
budgets 65536: ``memplan._encoder_images``), and Ulysses' bidirectional attention ran as
a ring of one rank whose blocks kept an additive ``[B, 1, m, m]`` mask for each block a
clip's padding crosses (3 x 1.2 GB an average clip, until its backward: now
``parallel.cp._span_attention``).

    python benchmarks/vit_cp_memcheck.py [--no-paper]
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _rows(stages, label: str) -> None:
    from dtdsl.report import format_bytes

    for s in stages:
        over = "  OVER" if s.total_bytes > s.capacity_bytes else ""
        print(f"{label:<26}{s.unit + '.s' + str(s.stage):<8}{s.in_flight:>6}"
              f"{format_bytes(s.predicted_bytes):>12}{format_bytes(s.measured_bytes):>12}"
              f"{s.error:>+9.1%}{over}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-paper", action="store_true",
                        help="only the miniature (the 72B ViT stage takes a minute or more)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    from dtdsl.cost.model import build_cost_model
    from dtdsl.planner import plan
    from dtdsl.train.memplan import check_memory
    from tests.helpers.planning import long_video
    from tests.train.test_memplan import _video_vit

    print(f"{'case':<26}{'stage':<8}{'flight':>6}{'predicted':>12}{'measured':>12}"
          f"{'error':>9}")
    _rows(check_memory(*_video_vit(), jobs=1, units=["vit"]), "tiny tp 2 x cp 2")
    if args.no_paper:
        return
    cost = build_cost_model(long_video("cp(vit) in {1, 2, 4, 8}"))
    p = plan(cost, compare_baseline=False)
    vit = p.unit("vit")
    _rows(check_memory(cost.program, p, cost=cost, units=["vit"]),
          f"72b tp {vit.tp} x cp {vit.cp} x dp {vit.dp}")


if __name__ == "__main__":
    main()
