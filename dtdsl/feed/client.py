"""The trainer's side of the feed: a ``runtime.batch.BatchSource`` receiving what the
preprocessing workers ship (``dtdsl.feed.worker``).

Every trainer rank binds one ``wire.Receiver`` in its node's feed directory, named by its
local rank; the node's first trainer (local rank 0) also binds the ``wire.Publisher`` that
tells the node's workers the step the trainers need next and which global ranks the node
holds (``protocol.PROGRESS``; announced again while it waits, since a subscriber that joins
late misses what was said before). ``batch(step)`` returns the
first valid message for that step: messages of later steps wait in a buffer (the workers
run up to ``prefetch`` steps ahead), copies of a step already taken (a restarted worker
sends its steps again) are dropped, and so is anything the wire rejects (wrong secret,
malformed, oversized: counted in ``dropped``). The time spent waiting is the step's
``wait_s``. Decoding happens on a background thread as messages arrive, and so does
pinning the tensors (``batch.pin_batch``) on a rank with an accelerator: the training
thread's host-to-device copies then start without blocking.

A wait is bounded (``timeout_s``, 600 s: then ``FeedTimeout``, and torchrun restarts the
job), but never silent: the node's first trainer prints every ``REPORT_S`` seconds
(``$DTDSL_FEED_REPORT_S``) which step it waits for, for how long, and which of the node's
workers have sent nothing for that long. A dead worker pool ends the launch sooner
(``train.supervise``).
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

__all__ = ["FeedTimeout", "RemoteBatches"]

MAX_ARRAYS = 1 << 16
ANNOUNCE_S = 0.2
REPORT_S = 30.0                     # a waiting trainer's progress line, this often
REPORT_ENV = "DTDSL_FEED_REPORT_S"  # overrides REPORT_S (tests)


def _report_every() -> float:
    try:
        value = float(os.environ.get(REPORT_ENV, REPORT_S))
    except ValueError:
        return REPORT_S
    return value if value > 0 else REPORT_S


class FeedTimeout(RuntimeError):
    """No data for a step within the time limit."""


class RemoteBatches:
    """A BatchSource fed by the preprocessing workers (module docstring).

    A background thread owns the inbox socket: it verifies, decodes and converts messages
    into ``StepBatch``es as they arrive, so by the time the trainer asks for a step that
    the workers delivered ahead, only a dictionary lookup is left on the training path."""

    def __init__(self, job: Any, bundle: Path, program: Any, plan: Any, role: Any, *,
                 feed_dir: Path, local_rank: int, node_ranks: Sequence[int],
                 timeout_s: float = 600.0, pin: bool | None = None):
        from dtdsl.data.batch import pins_memory
        from dtdsl.feed import wire

        self.job, self.role = job, role
        self.units = [u.name for u in plan.units]
        self.generators = [g.name for g in program.generators]
        # Page-locked copies made here, on the inbox thread (None: on an accelerator).
        self.pin = pins_memory() if pin is None else pin
        self.timeout_s = timeout_s
        self.workers = max(1, job.feed.workers_per_node)
        if list(node_ranks)[local_rank] != role.rank:
            raise ValueError(f"rank {role.rank} is not local rank {local_rank} of the node's "
                             f"ranks {list(node_ranks)}")
        self.node_ranks = list(node_ranks)
        secret = wire.read_secret(Path(bundle) / job.secret_file)
        self.context = wire.bounded_context(job.feed.max_sockets(job.gpus_per_node))
        self.receiver = wire.Receiver(
            job.feed.trainer_address(feed_dir, local_rank), secret,
            max_bytes=job.feed.max_message_bytes, max_arrays=MAX_ARRAYS,
            hwm=job.feed.prefetch + 2, context=self.context)
        self.publisher = (wire.Publisher(job.feed.control_address(feed_dir), secret,
                                         context=self.context)
                          if local_rank == 0 else None)
        # Told to the workers with every announcement: a new session (a restarted trainer
        # job) makes them go back and send again the steps it asks for.
        self.session = secrets.token_hex(8)
        self._ready: dict[int, Any] = {}
        # worker index (its steps: step % workers_per_node) -> (when, step) last heard
        self._heard: dict[int, tuple[float, int]] = {}
        self._started = time.monotonic()
        self.report_s = _report_every()
        self._next = 0
        self._announced = 0.0
        self._error: BaseException | None = None
        self._closed = threading.Event()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._pump, name=f"feed-inbox-{role.rank}",
                                        daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> Any:
        """Messages the wire rejected, by reason."""
        return self.receiver.dropped

    def _pump(self) -> None:
        from dtdsl.data.batch import pin_batch
        from dtdsl.feed.protocol import BATCH, read_batch

        try:
            while not self._closed.is_set():
                message = self.receiver.recv(timeout_s=0.1)
                if message is None or message.kind != BATCH:
                    continue
                got = message.meta.get("step")
                with self._cond:
                    if isinstance(got, int) and got >= 0:
                        self._heard[got % self.workers] = (time.monotonic(), got)
                    if not isinstance(got, int) or got < self._next or got in self._ready:
                        continue    # a copy of a step taken or buffered: a worker restarted
                batch = read_batch(message, self.units, self.generators)
                if self.pin:
                    batch = pin_batch(batch)
                with self._cond:
                    if got >= self._next and got not in self._ready:
                        self._ready[got] = batch
                        self._cond.notify_all()
        except BaseException as err:    # handed to the training thread by batch()
            with self._cond:
                self._error = err
                self._cond.notify_all()

    def _announce(self, step: int, done: bool = False) -> None:
        from dtdsl.feed.protocol import PROGRESS

        if self.publisher is not None:
            self.publisher.publish(PROGRESS, {"next_step": step, "done": done,
                                              "session": self.session,
                                              "ranks": self.node_ranks})
            self._announced = time.monotonic()

    def batch(self, step: int) -> Any:
        start = time.perf_counter()
        with self._cond:
            if step < self._next:
                raise ValueError(f"step {step} was already taken (next is {self._next})")
            self._next = step
            for s in [s for s in self._ready if s < step]:
                del self._ready[s]
        self._announce(step)
        began = time.monotonic()
        deadline = began + self.timeout_s
        report = began + self.report_s
        with self._cond:
            while step not in self._ready:
                if self._error is not None:
                    raise RuntimeError(f"rank {self.role.rank}: the feed's inbox failed: "
                                       f"{self._error!r}") from self._error
                now = time.monotonic()
                if now >= deadline:
                    raise FeedTimeout(
                        f"rank {self.role.rank}: no data for step {step} in "
                        f"{self.timeout_s:g} s (are the preprocessing workers running? see "
                        f"the run's logs/); dropped messages: "
                        f"{dict(self.receiver.dropped) or 'none'}")
                if now - self._announced >= ANNOUNCE_S:
                    self._announce(step)
                if now >= report and self.publisher is not None:
                    print(self._waiting(step, now - began, now), flush=True)
                    report = now + self.report_s
                self._cond.wait(timeout=max(0.0, min(ANNOUNCE_S, deadline - now,
                                                     report - now)))
            batch = self._ready.pop(step)
            self._next = step + 1
        return replace(batch, wait_s=time.perf_counter() - start)

    def _waiting(self, step: int, waited_s: float, now: float) -> str:
        """The progress line of a wait (called with the lock held)."""
        silent = []
        for w in range(self.workers):
            heard = self._heard.get(w)
            if heard is None:
                silent.append(f"worker {w} (nothing yet in {now - self._started:.0f} s)")
            elif now - heard[0] >= self.report_s:
                silent.append(f"worker {w} (last step {heard[1]}, {now - heard[0]:.0f} s "
                              "ago)")
        owner = step % self.workers
        dropped = dict(self.receiver.dropped)
        return (f"rank {self.role.rank}: waiting {waited_s:.0f} s for the data of step "
                f"{step} (worker {owner} of the node's {self.workers} makes it); silent: "
                f"{', '.join(silent) or 'none'}"
                + (f"; dropped messages: {dropped}" if dropped else "")
                + f"; giving up after {self.timeout_s:g} s")

    def close(self) -> None:
        """Tell the workers the trainers are done (local rank 0), then close the sockets."""
        if self.publisher is not None:
            for _ in range(3):      # a state announcement: repeat it for late subscribers
                self._announce(self._next, done=True)
                time.sleep(0.05)
            self.publisher.close()
        self._closed.set()
        self._thread.join(timeout=5)
        self.receiver.close()
        self.context.term()
