"""The batch runner: the lines of open batches through `serving`, as requests of their
batch's tenant, in the capacity interactive requests leave.

Each line is served exactly as the same request sent interactively (scope, rate and quota,
limits, redaction, metrics: `serving` on the line's validated body), with the controls of
a batch's line (`gateway.controls.BATCH_LINE`: the `batch` priority, and a saturated
model's plain 503, never a fallback). Yielding is the scheduler's (`engine.scheduling.scheduler`): a
line's job starts once interactive work has paused for `batches.idle_ms`, leaving
`batches.reserve_slots` sequences free, and when interactive work arrives it is put back
and runs again from its start (at most MAX_PUT_BACKS times). This runner keeps at most
`batches.max_in_flight` lines under way, in file order.

The attempt that gives a line's result leaves one ledger row, written as its request
context (`logs.request_context`, the middleware's) closes: its id the line's `request_id`
in the output file, its `trace_id` the line's `id`, `batch_id` set. Its result is
committed with its state in `batches.db` (`ledger.batches`) after that row is on disk, so
a kill -9 loses no finished line and redoes none; lines running at the kill are still
pending and run again at the restart.

A line refused for a moment (503: a full queue, a model loading; 429 with a wait of a
minute or less) waits and runs again; it is never an error. Everything else a line meets
(400, 403, 404, a 429 that would wait longer, a failure) is its error line in the batch's
error file; other lines go on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edge_agent.api.body import check_values, validate
from edge_agent.api.errors import observe_refusal, openai_body
from edge_agent.api.openai.protocol import (
    ChatBody,
    CompletionBody,
    EmbeddingBody,
    expiry,
    new_id,
)
from edge_agent.api.openai.serving import Answer, OpenAIServing
from edge_agent.config import Settings, TenantPolicy
from edge_agent.errors import (
    EdgeAgentError,
    InvalidRequest,
    ServiceUnavailable,
    ShuttingDown,
)
from edge_agent.gateway.controls import BATCH_LINE
from edge_agent.governance.tenants import Governor, TenantContext
from edge_agent.ledger.batches import BatchStore
from edge_agent.logs import MetadataScrub, request_context
from edge_agent.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

RATE_WAIT_MAX_S = 60.0  # a 429 asking a longer wait (a daily quota) is the line's error
TICK_S = 1.0  # the runner's look at expiries and waits; anything else wakes it at once


class _NoPolicy(EdgeAgentError):
    """The batch's tenant was removed from the policy since it was queued (a 403, as for
    a request of a tenant with no policy)."""

    status_code = 403
    error_type = "permission_error"


@dataclass
class _Line:
    idx: int
    line_id: str
    custom_id: str
    body: dict[str, Any]
    task: asyncio.Task[None] | None = None
    answered: bool = False  # its answer is in: kept even if its batch is cancelled now


@dataclass
class _Open:
    """A batch the runner works on: its row, and the lines running now."""

    row: dict[str, Any]
    running: dict[int, _Line] = field(default_factory=dict)
    resume_at: float = 0.0  # after a refusal for a moment: no new line before

    def stop_unanswered(self) -> None:
        """Cancels its running lines whose answers are not in (they stay pending)."""
        for line in self.running.values():
            if line.task is not None and not line.answered:
                line.task.cancel()


class BatchRunner:
    """One task per app (`start`, `stop`, by `BatchService`), over the batches still
    open in `batches.db`."""

    def __init__(self, settings: Settings, serving: OpenAIServing, governor: Governor | None,
                 *, record: Callable[[dict[str, Any]], None], flushed: Callable[[], bool],
                 scrub: MetadataScrub | None = None, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.serving = serving
        self.governor = governor
        self.record = record
        self.flushed = flushed
        self.scrub = scrub
        self.metrics = metrics
        self.store: BatchStore | None = None
        self._open: dict[str, _Open] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._commits: set[asyncio.Task[None]] = set()  # results being written

    # -- life ----------------------------------------------------------------------------
    def start(self, store: BatchStore) -> None:
        self.store = store
        self._open = {row["id"]: _Open(row) for row in store.open_batches()}
        self._task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        """Cancels the runner and every running line (they stay pending), and waits for
        the results already in to be written."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        tasks = [line.task for b in self._open.values() for line in b.running.values()
                 if line.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*self._commits, return_exceptions=True)  # answers already in
        self.store = None

    # -- what the resources tell it --------------------------------------------------------
    def opened(self, row: dict[str, Any]) -> None:
        """A batch just queued."""
        self._open[row["id"]] = _Open(row)
        self._wake.set()

    def cancelling(self, batch_id: str) -> None:
        """A batch being cancelled: its lines under way stop now (an answer already in is
        kept), and it ends at the next tick."""
        opened = self._open.get(batch_id)
        if opened is not None:
            opened.row["status"] = "cancelling"
            opened.stop_unanswered()
        self._wake.set()

    # -- the loop ------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            try:
                await self._tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # the runner must outlive a bad moment (a disk error)
                log.exception("the batch runner's step failed")
            try:
                await asyncio.wait_for(self._wake.wait(), TICK_S)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    def _db(self) -> BatchStore:
        if self.store is None:
            raise ServiceUnavailable("the batch queue is not running", retry_after=2.0)
        return self.store

    async def _tick(self) -> None:
        store = self._db()
        now = time.time()
        for batch in list(self._open.values()):
            row = batch.row
            if row["status"] == "validating":
                store.set_status(row["id"], "in_progress")
                row["status"] = "in_progress"
            if row["status"] == "cancelling":
                await self._end(batch, "cancelled")
            elif now >= row["expires_at"]:
                await self._end(batch, "expired")
            elif row["status"] == "finalizing":
                await self._finalize(batch, "completed")
        for batch in list(self._open.values()):
            if batch.row["status"] != "in_progress" or batch.resume_at > now:
                continue
            room = self.settings.batches.max_in_flight - self._unanswered()
            if room <= 0:
                break
            lines = store.pending(batch.row["id"], skip=set(batch.running), limit=room)
            if not lines and not batch.running:
                await self._finalize(batch, "completed")
                continue
            for line in lines:
                self._start(batch, line)

    def _unanswered(self) -> int:
        """Lines under way whose answers are not in: a line whose answer is in is only
        being written (its ledger row flushed first), and the next one starts meanwhile."""
        return sum(not line.answered for b in self._open.values()
                   for line in b.running.values())

    def _start(self, batch: _Open, row: dict[str, Any]) -> None:
        try:
            body = json.loads(row["body"])
        except ValueError:
            body = {}
        line = _Line(idx=row["idx"], line_id=row["line_id"], custom_id=row["custom_id"],
                     body=body if isinstance(body, dict) else {})
        batch.running[line.idx] = line
        line.task = asyncio.create_task(self._run(batch, line))

        def ended(_: asyncio.Task[None]) -> None:
            batch.running.pop(line.idx, None)
            self._wake.set()

        line.task.add_done_callback(ended)

    # -- one line ------------------------------------------------------------------------
    async def _run(self, batch: _Open, line: _Line) -> None:
        """One line through `serving`, in a request context of its own (its access line
        and ledger row), its result committed after its row."""
        row = batch.row
        with request_context(line.line_id, "POST", row["endpoint"], record=self.record,
                             scrub=self.scrub, status=None,
                             access={"tenant": row["tenant"],
                                     "key_prefix": row["key_prefix"] or ""},
                             extra={"batch_id": row["id"]},
                             label=f"batch {row['id']}") as served:
            try:
                status, body = 200, await self._answer(row, line.body)
            except ShuttingDown:
                return  # the box stops: the line stays pending
            except EdgeAgentError as exc:
                observe_refusal(self.metrics, "openai", exc)
                if exc.status_code == 503 or (exc.status_code == 429
                                              and exc.retry_after is not None
                                              and exc.retry_after <= RATE_WAIT_MAX_S):
                    batch.resume_at = time.time() + max(1.0, exc.retry_after or 1.0)
                    return  # refused for a moment: it runs again, not an error
                status, body = exc.status_code, openai_body(exc)
            except Exception:  # a failure of this line only: the batch goes on
                log.exception("a batch line failed")
                status, body = 500, openai_body(EdgeAgentError("internal server error"))
            line.answered = True
            self._wake.set()  # the next line may start while this one is written
            served.status = status
            result = {"id": line.line_id, "custom_id": line.custom_id,
                      "response": {"status_code": status, "request_id": served.access["id"],
                                   "body": body}, "error": None}
        # The answer is in: kept even if the line is cancelled now (a stop waits for it).
        commit = asyncio.ensure_future(self._commit(
            batch, line, "done" if status == 200 else "error", result))
        self._commits.add(commit)
        commit.add_done_callback(self._commits.discard)
        await asyncio.shield(commit)

    async def _answer(self, row: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
        """The line's answer body from `serving`, as a request of the batch's tenant;
        raises what refuses it."""
        tenant = self._tenant(row)
        if data.get("stream"):
            raise InvalidRequest("stream is not supported in a batch: each answer is "
                                 "stored whole", param="stream")
        check_values(data)
        endpoint = row["endpoint"]
        answer: object
        if endpoint == "/v1/chat/completions":
            answer = await self.serving.chat(validate(ChatBody, data), BATCH_LINE, tenant)
        elif endpoint == "/v1/completions":
            answer = await self.serving.completions(validate(CompletionBody, data),
                                                    BATCH_LINE, tenant)
        else:
            answer = await self.serving.embeddings(validate(EmbeddingBody, data),
                                                   BATCH_LINE, tenant)
        assert isinstance(answer, Answer)  # never a stream: `stream` is refused above
        return answer.body

    async def _commit(self, batch: _Open, line: _Line, state: str,
                      result: dict[str, Any]) -> None:
        """The line's result with its state, once its ledger row (written as its request
        context closed) is on disk: a crash between the two runs the line again, a crash
        before never loses a row of a result kept."""
        await asyncio.to_thread(self.flushed)
        store = self.store
        if store is not None and store.finish_line(batch.row["id"], line.idx, state, result):
            batch.row["completed" if state == "done" else "failed"] += 1

    def _tenant(self, row: dict[str, Any]) -> TenantContext:
        """The batch's tenant as its policy is now (a restart may have changed it)."""
        if self.governor is None:
            return TenantContext(row["tenant"], TenantPolicy.model_validate({}))
        try:
            policy = self.governor.policy(row["tenant"])
        except EdgeAgentError:
            raise _NoPolicy(f"tenant '{row['tenant']}' has no policy any more") from None
        return TenantContext(row["tenant"], policy, row["key_prefix"] or "")

    async def _end(self, batch: _Open, status: str) -> None:
        """Cancelled or expired: running lines stopped first, then what never ran is
        closed (an expired line is an error line, `batch_expired`, as OpenAI writes it)."""
        batch.stop_unanswered()
        if batch.running:
            return  # the next tick, once they have stopped
        store = self._db()
        if status == "expired":
            store.close_pending(batch.row["id"], "error", {
                "response": None, "error": {
                    "code": "batch_expired",
                    "message": "This request could not be executed before the completion "
                               "window expired."}})
        else:
            store.close_pending(batch.row["id"], "cancelled")
        await self._finalize(batch, status)

    async def _finalize(self, batch: _Open, status: str) -> None:
        """The output and error files from the stored results, and the final status."""
        store = self._db()
        row = batch.row
        if status == "completed" and store.count_pending(row["id"]):
            return
        if row["status"] != "finalizing" and status == "completed":
            store.set_status(row["id"], "finalizing")
            row["status"] = "finalizing"
        outputs, blobs = [], {}
        created = int(time.time())
        for kind, state in (("output", "done"), ("error", "error")):
            results = store.results(row["id"], state)
            if not results:
                continue
            data = ("\n".join(results) + "\n").encode()
            file_id = new_id("file-")
            outputs.append({"id": file_id, "tenant": row["tenant"],
                            "filename": f"{row['id']}_{kind}.jsonl",
                            "purpose": "batch_output", "bytes": len(data),
                            "created_at": created, "expires_at": expiry(self.settings, created),
                            "lines": len(results), "purpose_kind": kind})
            blobs[file_id] = data
        await asyncio.to_thread(store.finalize, row["id"], status, outputs, blobs)
        self._open.pop(row["id"], None)
        log.info("batch %s %s", row["id"], status)

