"""Exit codes of dtdsl's commands, and ``DtdslError``, the base of every error in what a
user gave.

A ``DtdslError`` is about the input (a command line, a file, a dataset, a checkpoint, a
model directory), not about dtdsl: ``dtc`` prints its message once, as ``dtc: error:
<message>``, with no traceback, and exits with the error's ``exit_code``; running again
without changing the input cannot help, so nothing retries it. Each subsystem keeps its
own subclass (``UsageError``, ``DatasetError``, ``HFError``, ``CheckpointError``, ...), so
callers can still catch the kind they expect; the CLI needs only the base. Any other
exception reaching the CLI is a bug in dtdsl (exit ``EXIT_INTERNAL``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["EXIT_ERRORS", "EXIT_INTERNAL", "EXIT_OK", "EXIT_USAGE", "DtdslError",
           "validation_problems"]

# 0 no errors, 1 errors in a spec (or `fmt --check` found changes), 2 bad input (the
# command line, a file or dataset it names), 3 an internal error (a bug in dtdsl).
EXIT_OK, EXIT_ERRORS, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3


class DtdslError(Exception):
    """An error in what the user gave (module docstring): printed once, exit
    ``exit_code``."""

    exit_code = EXIT_USAGE


def validation_problems(err: Any, limit: int = 1) -> str:
    """A pydantic ``ValidationError`` in one line: its first ``limit`` problems, each after
    the field it is in (none for the whole document), and how many more there are."""
    problems = "; ".join(": ".join(filter(None, (".".join(map(str, e["loc"])), e["msg"])))
                         for e in err.errors()[:limit])
    more = err.error_count() - limit
    return problems + (f" (and {more} more)" if more > 0 else "")
