"""``dtc graph``: print the stage graph (text, or Graphviz DOT)."""

from __future__ import annotations

import argparse
import sys

from dtdsl.cli.common import read_plan
from dtdsl.clihelp import EXIT_OK, load_program, write_file

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

    result, code = load_program(args.spec)
    if result is None:
        return code
    assert result.program is not None
    # Checked against the spec as every command that reads a plan checks it.
    plan = read_plan(args.plan, result.program) if args.plan else None
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
