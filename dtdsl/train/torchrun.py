"""``python -m dtdsl.train.torchrun ARGS``: torchrun (``torch.distributed.run``, the same
arguments) as a bundle's ``launch.sh`` runs it under ``train.supervise``.

The supervisor stops torchrun with SIGTERM (a signal to the launch, or a fatal error of a
rank or worker) and then says why in one line; torchrun's agent meets the signal as a
``SignalException`` and would print it with its traceback. Here it ends quietly with the
shell's status for the signal, 128 + its number; its warnings that the workers are being
stopped still go to stderr. Everything else is torchrun's own.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    try:
        torchrun(list(sys.argv[1:] if argv is None else argv))
    except SignalException as exc:
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
