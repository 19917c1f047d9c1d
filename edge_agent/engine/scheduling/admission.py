"""The admission queue in front of each model's scheduler: bounded, two priority classes,
and a lane for the jobs that yield.

`interactive` (the default) goes before `batch`; a batch job that has waited `aging_s`
goes first regardless, so batch work is never starved. A yielding job (a batch's line)
waits in a lane of its own, which the scheduler opens only in the pauses of the other
two (`pop(yielding=True)`) and where a job it put back goes first again; it counts
neither in the queue's length nor against the other two's bound. A full queue refuses at
once (503 + Retry-After) instead of letting latency grow without bound. Shared between the
event loop (put) and the model's worker thread (pop), so it locks; the critical sections
are a few deque operations.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Generic, Literal, Protocol, TypeVar

from edge_agent.errors import QueueFull

Priority = Literal["interactive", "batch"]


class Queued(Protocol):
    priority: Priority
    enqueued_at: float
    cancelled: threading.Event
    yields: bool


J = TypeVar("J", bound=Queued)
S = TypeVar("S")


class AdmissionQueue(Generic[J, S]):
    def __init__(self, max_size: int, aging_s: float) -> None:
        self.max_size = max_size
        self.aging_s = aging_s
        self._cond = threading.Condition()
        self._interactive: deque[J] = deque()
        self._batch: deque[J] = deque()
        self._yielding: deque[J] = deque()
        self._side: deque[S] = deque()  # work that needs no sequence (embeddings)
        self._closed = False

    def __len__(self) -> int:
        """Jobs of the two classes waiting (the yielding lane aside)."""
        return len(self._interactive) + len(self._batch)

    @property
    def interactive_waiting(self) -> bool:
        return bool(self._interactive)

    @property
    def yielding(self) -> int:
        return len(self._yielding)

    def put(self, job: J, *, retry_after: float = 1.0) -> None:
        with self._cond:
            self._drop_cancelled()
            lane = self._yielding if job.yields else \
                self._batch if job.priority == "batch" else self._interactive
            if (len(lane) if job.yields else len(self)) >= self.max_size:
                raise QueueFull(
                    f"the queue for this model is full ({self.max_size} waiting); retry later",
                    retry_after=retry_after)
            job.enqueued_at = time.monotonic()
            lane.append(job)
            self._cond.notify()

    def put_back(self, job: J) -> None:
        """A yielding job that gave its sequence back: first in its lane again, unbounded
        (it held a sequence a moment ago)."""
        with self._cond:
            self._yielding.appendleft(job)
            self._cond.notify()

    def put_side(self, item: S) -> None:
        with self._cond:
            self._side.append(item)
            self._cond.notify()

    def pop(self, *, yielding: bool = False) -> J | None:
        """The next job to run, or None; never blocks. A yielding job only with
        `yielding`, and only when neither class has one waiting."""
        with self._cond:
            self._drop_cancelled()
            if self._batch and (
                not self._interactive
                or time.monotonic() - self._batch[0].enqueued_at >= self.aging_s
            ):
                return self._batch.popleft()
            if self._interactive:
                return self._interactive.popleft()
            return self._yielding.popleft() if yielding and self._yielding else None

    def pop_side(self) -> S | None:
        with self._cond:
            return self._side.popleft() if self._side else None

    def wait(self, timeout: float | None = None, *, yielding_held: bool = False) -> None:
        """Blocks the worker until there is something to do (or close); with
        `yielding_held`, the yielding lane's jobs are not (the scheduler holds them back,
        until `timeout`)."""
        with self._cond:
            if not (self._interactive or self._batch or self._side or self._closed
                    or (self._yielding and not yielding_held)):
                self._cond.wait(timeout)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def _drop_cancelled(self) -> None:
        for q in (self._interactive, self._batch, self._yielding):
            if any(j.cancelled.is_set() for j in q):
                kept = [j for j in q if not j.cancelled.is_set()]
                q.clear()
                q.extend(kept)
