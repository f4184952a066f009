"""The trainer's side of the feed: a ``runtime.batch.BatchSource`` receiving what the
preprocessing workers ship (``dtdsl.feed.worker``).

Every trainer rank binds one ``wire.Receiver`` at the address the job names for it;
trainer rank 0 also binds the ``wire.Publisher`` that tells the workers the step the
trainers need next (``protocol.PROGRESS``; announced again while it waits, since a
subscriber that joins late misses what was said before). ``batch(step)`` returns the
first valid message for that step: messages of later steps wait in a buffer (the workers
run up to ``prefetch`` steps ahead), copies of a step already taken (a restarted worker
sends its steps again) are dropped, and so is anything the wire rejects (wrong secret,
malformed, oversized: counted in ``dropped``). The time spent waiting is the step's
``wait_s``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

__all__ = ["FeedTimeout", "RemoteBatches"]

MAX_ARRAYS = 1 << 16
ANNOUNCE_S = 0.2


class FeedTimeout(RuntimeError):
    """No data for a step within the time limit."""


class RemoteBatches:
    """A BatchSource fed by the preprocessing workers (module docstring)."""

    def __init__(self, job: Any, bundle: Path, program: Any, plan: Any, role: Any, *,
                 port_base: int | None = None, timeout_s: float = 600.0):
        from dtdsl.feed import wire

        self.job, self.role = job, role
        self.units = [u.name for u in plan.units]
        self.generators = [g.name for g in program.generators]
        self.timeout_s = timeout_s
        secret = wire.read_secret(Path(bundle) / job.secret_file)
        self.receiver = wire.Receiver(
            job.feed.trainer_address(role.rank, job.gpus_per_node, port_base), secret,
            max_bytes=job.feed.max_message_bytes, max_arrays=MAX_ARRAYS,
            hwm=job.feed.prefetch + 2)
        self.publisher = (wire.Publisher(job.feed.control_address(port_base), secret)
                          if role.rank == 0 else None)
        self._pending: dict[int, Any] = {}
        self._next = 0
        self._announced = 0.0

    @property
    def dropped(self) -> Any:
        """Messages the wire rejected, by reason."""
        return self.receiver.dropped

    def _announce(self, step: int, done: bool = False) -> None:
        from dtdsl.feed.protocol import PROGRESS

        if self.publisher is not None:
            self.publisher.publish(PROGRESS, {"next_step": step, "done": done})
            self._announced = time.monotonic()

    def batch(self, step: int) -> Any:
        from dtdsl.feed.protocol import BATCH, read_batch

        start = time.perf_counter()
        if step < self._next:
            raise ValueError(f"step {step} was already taken (next is {self._next})")
        self._next = step
        self._pending = {s: m for s, m in self._pending.items() if s >= step}
        self._announce(step)
        deadline = time.monotonic() + self.timeout_s
        while step not in self._pending:
            now = time.monotonic()
            if now >= deadline:
                raise FeedTimeout(
                    f"rank {self.role.rank}: no data for step {step} in {self.timeout_s:g} s "
                    f"(are the preprocessing workers running? see the run's logs/); "
                    f"dropped messages: {dict(self.receiver.dropped) or 'none'}")
            if now - self._announced >= ANNOUNCE_S:
                self._announce(step)
            message = self.receiver.recv(timeout_s=min(ANNOUNCE_S, deadline - now))
            if message is None or message.kind != BATCH:
                continue
            got = message.meta.get("step")
            if not isinstance(got, int) or got < step or got in self._pending:
                continue        # a copy of a step taken or buffered: a worker restarted
            self._pending[got] = message
        message = self._pending.pop(step)
        self._next = step + 1
        batch = read_batch(message, self.units, self.generators)
        from dataclasses import replace

        return replace(batch, wait_s=time.perf_counter() - start)

    def close(self) -> None:
        """Tell the workers the trainers are done (rank 0), then close the sockets."""
        if self.publisher is not None:
            for _ in range(3):      # a state announcement: repeat it for late subscribers
                self._announce(self._next, done=True)
                time.sleep(0.05)
            self.publisher.close()
        self.receiver.close()
