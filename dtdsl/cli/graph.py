"""``dtc graph``: print the stage graph (text, or Graphviz DOT)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dtdsl.clihelp import EXIT_OK, load_program, write_file
from dtdsl.driver import UsageError

__all__ = ["HELP", "NAME", "add_arguments", "run"]

NAME = "graph"
HELP = "print the stage graph (text, or Graphviz DOT)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC", help="spec file ('-' for stdin)")
    parser.add_argument("--dot", action="store_true", help="Graphviz DOT instead of text")
    parser.add_argument("--plan", metavar="PLAN", help="a Plan JSON (`dtc plan -o`): add "
                        "each module's pipeline stages")
    parser.add_argument("-o", "--output", metavar="FILE", help="write here, not to stdout")


def run(args: argparse.Namespace) -> int:
    from dtdsl.cost.graph import build_graph, graph_dot, graph_text
    from dtdsl.ir.plan import Plan

    result, code = load_program(args.spec)
    if result is None:
        return code
    plan = None
    if args.plan:
        try:
            plan = Plan.model_validate_json(Path(args.plan).read_bytes())
        except (OSError, ValueError) as err:
            raise UsageError(f"cannot read plan {args.plan}: {err}") from None
        assert result.program is not None
        if plan.spec_sha256 != result.program.source_sha256:
            print(f"dtc: warning: {args.plan} was planned for another revision of the spec",
                  file=sys.stderr)
    graph = build_graph(result.program, plan)
    text = graph_dot(graph) if args.dot else graph_text(graph)
    if args.output:
        write_file(args.output, text, _is_graph, "a stage graph")
    else:
        sys.stdout.write(text)
    return EXIT_OK


def _is_graph(data: bytes) -> bool:
    """Whether ``data`` is a stage graph as ``dtc graph`` writes it (text or DOT)."""
    head, _, rest = data.partition(b"\n")
    return (head.startswith(b"graph ") and rest.startswith(b"nodes:")) or \
        (head.startswith(b"digraph ") and head.endswith(b"{"))
