"""A TensorBoard writer for the telemetry process that records whether that process
imported torch (``tests/train/test_telemetry.py``). Torch-free itself, so that the spawned
child, which unpickles the class by name, imports nothing more than the real writer."""

from __future__ import annotations

import sys
from pathlib import Path

from dtdsl.sim.tensorboard import TimelineWriter


class TorchWatchingWriter(TimelineWriter):
    """``TimelineWriter``, and at ``close`` a file ``torch`` beside its log dir: "True"
    when torch was imported in this process by then, else "False"."""

    def close(self) -> None:
        super().close()
        (Path(self.logdir).parent / "torch").write_text(str("torch" in sys.modules))
