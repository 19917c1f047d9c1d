"""The batch queue (OpenAI's Batch API): files and batches per tenant, and the runner that
feeds their lines to the models in the capacity interactive requests leave.

Each line runs through the same request path as an interactive request of its tenant
(`RunLine`, the OpenAI dialect's own handler: scope, rate and quota, limits, redaction,
metrics), at the `batch` priority, and the attempt that gives its result leaves one
ledger row: its id the line's `request_id` in the output file, its `trace_id` the line's
`id`, `batch_id` set. Its result is committed with its state in `batches.db`
(`ledger.batches`) after its ledger row is, so a kill -9 loses no finished line and
redoes none; lines running at the kill are still pending and run again at the restart.

Yielding: a line starts only once interactive work has paused for `batches.idle_ms`
(on a CPU every row of a step costs the others time: a batch fills the gaps between
interactive requests), while the model has a free sequence beyond
`batches.reserve_slots` and no interactive request waits for one, at most
`batches.max_in_flight` at once. When interactive work arrives, the lines generating on
its model are cancelled at the scheduler's next step and put back (they run again later,
from their start; a line put back MAX_PUT_BACKS times runs to its end); with `idle_ms`
0, only when an interactive request waits with every sequence taken, the newest.

A line refused for a moment (503: a full queue, a model loading; 429 with a wait of a
minute or less) waits and runs again; it is never an error. Everything else a line meets
(400, 403, 404, a 429 that would wait longer, a failure) is its error line in the batch's
error file; other lines go on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from edge_agent.config import Settings
from edge_agent.engine.registry import ModelRegistry
from edge_agent.errors import EdgeAgentError, InvalidRequest, NotFound, PayloadTooLarge
from edge_agent.governance.tenants import Governor, TenantContext
from edge_agent.ledger.batches import DONE_STATES, BatchStore
from edge_agent.logs import access_log, access_var, request_id_var
from edge_agent.names import ModelName

log = logging.getLogger(__name__)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
WINDOWS = {"24h": 86400}
RATE_WAIT_MAX_S = 60.0  # a 429 asking a longer wait (a daily quota) is the line's error
TICK_BUSY_S = 0.02  # the runner's look at the queues while lines run (a step is longer)
TICK_IDLE_S = 1.0
PUT_BACK_GAP_S = 0.25  # a sequence given back is free by then (a step is shorter)
MAX_PUT_BACKS = 3  # then a line runs to its end whatever arrives
MAX_LIST = 100
# A JSON escape of a UTF-16 surrogate (`\ud800`); alone, it decodes to text no UTF-8 file,
# message or row can hold. Most lines have none, and are not checked further.
_SURROGATE_ESCAPE = re.compile(rb"\\[uU][dD][89a-fA-F]")


class RunLine(Protocol):
    """One line through the dialect's own handler, as a request of `tenant` to
    `endpoint`: its HTTP status, its response body (an error's in the dialect's shape)
    and a refusal's Retry-After (None). Never raises but CancelledError."""

    def __call__(self, tenant: TenantContext, endpoint: str, body: dict[str, Any]
                 ) -> Awaitable[tuple[int, dict[str, Any], float | None]]: ...


class MetadataScrub(Protocol):
    def model(self, value: str) -> str: ...


@dataclass
class _Line:
    idx: int
    line_id: str
    custom_id: str
    body: dict[str, Any]
    model: str | None
    task: asyncio.Task[None] | None = None
    started: float = 0.0
    generating: bool = True  # False once its answer is in: it holds no sequence any more
    batch_id: str = ""

    @property
    def key(self) -> tuple[str, int]:
        return self.batch_id, self.idx


@dataclass
class _Open:
    """A batch the runner works on: its row, and the lines running now."""

    row: dict[str, Any]
    running: dict[int, _Line] = field(default_factory=dict)
    resume_at: float = 0.0  # after a refusal for a moment: no new line before


def _now() -> int:
    return int(time.time())


def _new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


class BatchService:
    """Files and batches of each tenant (the API's side) and the runner (`run`, one task
    per app, started and stopped by the app's lifespan)."""

    def __init__(self, settings: Settings, registry: ModelRegistry, governor: Governor | None,
                 run_line: RunLine, *, record: Callable[[dict[str, Any]], None],
                 flushed: Callable[[], bool], scrub: MetadataScrub | None = None) -> None:
        self.settings = settings
        self.registry = registry
        self.governor = governor
        self.run_line = run_line
        self.record = record
        self.flushed = flushed
        self.scrub = scrub
        self.store: BatchStore | None = None
        self._open: dict[str, _Open] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._commits: set[asyncio.Task[None]] = set()  # results being written
        self._put_back_at: dict[str, float] = {}  # model → the last line put back
        self.put_back = 0  # lines put back for an interactive request, since the start
        self._interactive_at = 0.0  # when interactive work was last seen (monotonic)
        self._released: list[tuple[float, str]] = []  # (when, model) of lines put back
        self._put_backs: dict[tuple[str, int], int] = {}  # a line's put-backs so far

    # -- life ----------------------------------------------------------------------------
    def start(self) -> None:
        """Opens `batches.db` and starts the runner; batches a stop or a crash left open
        go on where their lines are."""
        self.store = BatchStore(self.settings.state_dir)
        self._open = {row["id"]: _Open(row) for row in self.store.open_batches()}
        self._task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        """Cancels the runner and every running line (they stay pending), then closes the
        store."""
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
        if self.store is not None:
            await asyncio.to_thread(self.store.close)
            self.store = None

    def _db(self) -> BatchStore:
        if self.store is None:
            from edge_agent.errors import ServiceUnavailable
            raise ServiceUnavailable("the batch queue is not running", retry_after=2.0)
        return self.store

    # -- files ---------------------------------------------------------------------------
    async def create_file(self, tenant: TenantContext, filename: str, purpose: str,
                          data: bytes) -> dict[str, Any]:
        """An uploaded batch input file, checked whole before it is kept (400 naming the
        first bad line)."""
        if purpose != "batch":
            raise InvalidRequest(f"purpose '{purpose[:40]}' is not supported here; only "
                                 "'batch'", param="purpose")
        limits = self.settings.batches
        if len(data) > limits.max_file_bytes:
            raise PayloadTooLarge(f"file of {len(data)} bytes exceeds the limit of "
                                  f"{limits.max_file_bytes}")
        lines = await asyncio.to_thread(self._parse_lines, data)
        created = _now()
        row = {"id": _new_id("file-"), "tenant": tenant.name, "filename": filename[:255],
               "purpose": "batch", "bytes": len(data), "created_at": created,
               "expires_at": self._expiry(created), "lines": len(lines)}
        store = self._db()
        await asyncio.to_thread(store.add_file, row, data)
        return file_object(row)

    def _expiry(self, created: int) -> int:
        return created + int(self.settings.retention.batch_days * 86400)

    def _parse_lines(self, data: bytes) -> list[dict[str, Any]]:
        """The file's requests, each checked for its shape (not its body: the handler does
        that when the line runs, and an unacceptable body is that line's error)."""
        limits = self.settings.batches
        longest = min(limits.max_line_bytes, self.settings.server.max_body_bytes)
        out: list[dict[str, Any]] = []
        seen: set[str] = set()
        for n, raw in enumerate(data.split(b"\n"), start=1):
            if not raw.strip():
                continue
            if len(raw) > longest:
                raise InvalidRequest(f"line {n} of the file is {len(raw)} bytes; at most "
                                     f"{longest} per line", param="file")
            if len(out) >= limits.max_lines:
                raise InvalidRequest(f"the file has more than {limits.max_lines} lines "
                                     "(requests); split it into several batches",
                                     param="file")
            try:
                obj = json.loads(raw, parse_constant=_not_json)
            except (ValueError, RecursionError) as exc:
                raise InvalidRequest(f"line {n} of the file is not JSON: the file must be "
                                     f"JSONL, one request object a line ({str(exc)[:100]})",
                                     param="file") from None
            if _SURROGATE_ESCAPE.search(raw) and not _valid_text(obj):
                raise InvalidRequest(f"line {n} of the file is not valid Unicode (a lone "
                                     "surrogate in a string or key)", param="file")
            out.append(_checked(obj, n, seen))
        if not out:
            raise InvalidRequest("the file holds no request (JSONL: one request object a "
                                 "line)", param="file")
        return out

    def _file_row(self, tenant: TenantContext, file_id: str) -> dict[str, Any]:
        row = self._db().file(file_id)
        if row is None or row["tenant"] != tenant.name:
            raise NotFound(f"no file with id '{file_id[:80]}'", param="file_id")
        return row

    def get_file(self, tenant: TenantContext, file_id: str) -> dict[str, Any]:
        return file_object(self._file_row(tenant, file_id))

    def list_files(self, tenant: TenantContext, *, purpose: str | None = None,
                   after: str | None = None, limit: int = 10000,
                   order: str = "desc") -> dict[str, Any]:
        rows = self._db().files(tenant.name, purpose=purpose)
        if order == "asc":
            rows.reverse()
        return _page([file_object(r) for r in rows], after, limit)

    async def delete_file(self, tenant: TenantContext, file_id: str) -> dict[str, Any]:
        self._file_row(tenant, file_id)
        await asyncio.to_thread(self._db().delete_file, file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    async def file_content(self, tenant: TenantContext, file_id: str) -> bytes:
        self._file_row(tenant, file_id)
        try:
            return await asyncio.to_thread(self._db().content, file_id)
        except FileNotFoundError:
            raise NotFound(f"file '{file_id[:80]}' has no content any more",
                           param="file_id") from None

    # -- batches -------------------------------------------------------------------------
    async def create_batch(self, tenant: TenantContext, input_file_id: str, endpoint: str,
                           completion_window: str = "24h",
                           metadata: dict[str, str] | None = None) -> dict[str, Any]:
        """A batch of the file's lines, each of which must be for `endpoint` (400 naming
        the first that is not); queued at once, its lines run in file order."""
        if endpoint not in ENDPOINTS:
            raise InvalidRequest(f"endpoint '{endpoint[:80]}' is not supported; one of "
                                 f"{', '.join(ENDPOINTS)}", param="endpoint")
        if completion_window not in WINDOWS:
            raise InvalidRequest("completion_window must be '24h'", param="completion_window")
        source = self._file_row(tenant, input_file_id)
        if source["purpose"] != "batch":
            raise InvalidRequest(f"file '{input_file_id}' is not a batch input file "
                                 f"(purpose '{source['purpose']}')", param="input_file_id")
        store = self._db()
        data = await asyncio.to_thread(store.content, input_file_id)
        lines = await asyncio.to_thread(self._parse_lines, data)
        for n, line in enumerate(lines, start=1):
            if line["url"] != endpoint:
                raise InvalidRequest(
                    f"request {n} of the file (custom_id '{line['custom_id'][:64]}') is for "
                    f"{line['url']}; every request of a batch must be for its endpoint "
                    f"{endpoint}", param="input_file_id")
        return await self._queue(tenant, endpoint, input_file_id, completion_window,
                                 metadata, lines)

    async def submit_one(self, tenant: TenantContext, endpoint: str, body: dict[str, Any],
                         *, custom_id: str = "request-1",
                         metadata: dict[str, str] | None = None) -> dict[str, Any]:
        """One request as a batch of one line (its input file made here), for code that
        turns an interactive request into queued work (a low-risk request under
        pressure): returns the batch object; its output file has the answer."""
        if endpoint not in ENDPOINTS:
            raise InvalidRequest(f"endpoint '{endpoint[:80]}' is not supported",
                                 param="endpoint")
        line = {"custom_id": custom_id, "method": "POST", "url": endpoint, "body": body}
        data = (json.dumps(line, ensure_ascii=False) + "\n").encode()
        source = await self.create_file(tenant, "request.jsonl", "batch", data)
        return await self._queue(tenant, endpoint, source["id"], "24h", metadata,
                                 [_checked(line, 1, set())])

    async def _queue(self, tenant: TenantContext, endpoint: str, input_file_id: str,
                     window: str, metadata: dict[str, str] | None,
                     lines: list[dict[str, Any]]) -> dict[str, Any]:
        created = _now()
        row: dict[str, Any] = {
            "id": _new_id("batch_"), "tenant": tenant.name, "key_prefix": tenant.key_prefix,
            "endpoint": endpoint, "input_file_id": input_file_id,
            "completion_window": window, "status": "validating", "created_at": created,
            "expires_at": created + WINDOWS[window],
            "metadata": json.dumps(metadata) if metadata else None, "errors": None,
            "total": len(lines), "completed": 0, "failed": 0}
        items = [(_new_id("batch_req_"), line["custom_id"],
                  json.dumps(line["body"], ensure_ascii=False)) for line in lines]
        await asyncio.to_thread(self._db().add_batch, row, items)
        self._open[row["id"]] = _Open(dict(row))
        self._wake.set()
        return batch_object(row)

    def _batch_row(self, tenant: TenantContext, batch_id: str) -> dict[str, Any]:
        row = self._db().batch(batch_id)
        if row is None or row["tenant"] != tenant.name:
            raise NotFound(f"no batch with id '{batch_id[:80]}'", param="batch_id")
        return row

    def get_batch(self, tenant: TenantContext, batch_id: str) -> dict[str, Any]:
        return batch_object(self._batch_row(tenant, batch_id))

    def list_batches(self, tenant: TenantContext, *, after: str | None = None,
                     limit: int = 20) -> dict[str, Any]:
        return _page([batch_object(r) for r in self._db().batches(tenant.name)], after, limit)

    async def cancel_batch(self, tenant: TenantContext, batch_id: str) -> dict[str, Any]:
        """OpenAI's cancel: `cancelling` at once, `cancelled` once its running lines have
        stopped (their answers are not kept); what finished before stays in its files. An
        ended batch is returned as it is."""
        row = self._batch_row(tenant, batch_id)
        if row["status"] in ("validating", "in_progress"):
            await asyncio.to_thread(self._db().set_status, batch_id, "cancelling")
            opened = self._open.get(batch_id)
            if opened is not None:
                opened.row["status"] = "cancelling"
                for line in opened.running.values():
                    if line.task is not None and line.generating:
                        line.task.cancel()
            self._wake.set()
            row = self._batch_row(tenant, batch_id)
        return batch_object(row)

    # -- the runner ----------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            try:
                await self._tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # the runner must outlive a bad moment (a disk error)
                log.exception("the batch runner's step failed")
            busy = any(b.running for b in self._open.values())
            try:
                await asyncio.wait_for(self._wake.wait(),
                                       TICK_BUSY_S if busy or self._open else TICK_IDLE_S)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

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
        self._preempt()
        for batch in list(self._open.values()):
            if batch.row["status"] != "in_progress" or batch.resume_at > now:
                continue
            room = self._room()
            if room <= 0:
                break
            lines = store.pending(batch.row["id"], skip=set(batch.running), limit=room)
            if not lines and not batch.running:
                await self._finalize(batch, "completed")
                continue
            for line in lines:
                self._start(batch, line)

    def _loaded(self) -> dict[str, Any]:
        return {m.info.name: m.slots for m in self.registry.loaded()}

    def _generating(self) -> int:
        return sum(line.generating for b in self._open.values() for line in b.running.values())

    def _mine(self) -> dict[str, int]:
        """Sequences of each model this runner's lines hold: those generating, and those
        put back within PUT_BACK_GAP_S (a sequence is freed at the scheduler's next step,
        after the line's task has ended)."""
        now = time.monotonic()
        self._released = [(t, name) for t, name in self._released if now - t < PUT_BACK_GAP_S]
        mine: dict[str, int] = {}
        for _, name in self._released:
            mine[name] = mine.get(name, 0) + 1
        for b in self._open.values():
            for line in b.running.values():
                if line.generating and line.model is not None:
                    key = _canonical(line.model)
                    mine[key] = mine.get(key, 0) + 1
        return mine

    def _busy_models(self) -> set[str]:
        """Models with interactive work now (running or waiting sequences beyond this
        runner's own lines); notes the time, for `batches.idle_ms`."""
        mine = self._mine()
        busy = {name for name, slots in self._loaded().items()
                if slots.running + slots.interactive_waiting + slots.batch_waiting
                > mine.get(name, 0)}
        if busy:
            self._interactive_at = time.monotonic()
        return busy

    def _room(self) -> int:
        """Lines that may start now: none until interactive work has paused for
        `batches.idle_ms`, none while an interactive request waits; else at most
        `max_in_flight` in all, within the sequences free beyond `reserve_slots`."""
        limits = self.settings.batches
        if time.monotonic() - self._interactive_at < limits.idle_ms / 1000:
            return 0
        generating = self._generating()
        room = limits.max_in_flight - generating
        loaded = self._loaded()
        if not loaded:  # the model is loading: one line may wait for it
            return min(room, 1 - generating)
        for slots in loaded.values():
            if slots.interactive_waiting:
                return 0
            busy = max(0, slots.running + slots.interactive_waiting + slots.batch_waiting
                       - generating)  # the others' load, less this runner's own lines
            # A model with one sequence lends it while idle (a line gives it back at the
            # next step when a request arrives): else a batch would never run there.
            reserve = min(limits.reserve_slots, slots.parallel - 1)
            room = min(room, slots.parallel - reserve - busy - generating)
        return room

    def _preempt(self) -> None:
        """Lines give their sequences back to interactive requests (they run again later,
        from their start):

        - with `batches.idle_ms` set, every line generating on a model where interactive
          work arrives, unless it was put back MAX_PUT_BACKS times already (so that a
          line always ends, however busy the box): the interactive requests then run
          alone from the scheduler's next step;
        - in any case, when an interactive request waits with every sequence of its model
          taken, the newest line generating on it (one a model per PUT_BACK_GAP_S, so that
          a sequence being freed is not counted as taken and a second line put back)."""
        now = time.monotonic()
        busy = self._busy_models()
        lines = [(line.started, line) for b in self._open.values()
                 for line in b.running.values() if line.task is not None and line.generating]
        if self.settings.batches.idle_ms:
            for _, line in lines:
                if line.model is not None and _canonical(line.model) in busy \
                        and self._put_backs.get(line.key, 0) < MAX_PUT_BACKS:
                    self._put_back(line, _canonical(line.model), now)
        for name, slots in self._loaded().items():
            if not slots.interactive_waiting or slots.running < slots.parallel \
                    or now - self._put_back_at.get(name, 0.0) < PUT_BACK_GAP_S:
                continue
            mine = [(started, line) for started, line in lines
                    if line.generating and _same_model(line.model, name)]
            if mine:
                self._put_back(max(mine, key=lambda pair: pair[0])[1], name, now)

    def _put_back(self, line: _Line, model: str, now: float) -> None:
        log.info("batch line %s put back: interactive work arrived", line.line_id)
        assert line.task is not None
        line.generating = False  # its sequence is on its way back
        line.task.cancel()
        self._put_back_at[model] = now
        self._released.append((now, model))
        self._put_backs[line.key] = self._put_backs.get(line.key, 0) + 1
        self.put_back += 1

    def _start(self, batch: _Open, row: dict[str, Any]) -> None:
        try:
            body = json.loads(row["body"])
        except ValueError:
            body = {}
        model = body.get("model") if isinstance(body, dict) else None
        line = _Line(idx=row["idx"], line_id=row["line_id"], custom_id=row["custom_id"],
                     batch_id=batch.row["id"],
                     body=body if isinstance(body, dict) else {},
                     model=model if isinstance(model, str) else None, started=time.monotonic())
        batch.running[line.idx] = line
        line.task = asyncio.create_task(self._run(batch, line))

        def ended(_: asyncio.Task[None]) -> None:
            batch.running.pop(line.idx, None)
            self._wake.set()

        line.task.add_done_callback(ended)

    async def _run(self, batch: _Open, line: _Line) -> None:
        """One line through the request path, in a request context of its own (its access
        line and ledger row), its result committed after its row."""
        row = batch.row
        tenant = self._tenant(row)
        access: dict[str, Any] = {"id": uuid.uuid4().hex, "tenant": row["tenant"],
                                  "key_prefix": row["key_prefix"] or ""}
        access_var.set(access)
        request_id_var.set(line.line_id)
        started_at, start = time.time(), time.perf_counter()
        if tenant is None:
            status, body, retry_after = 403, _error_body(
                f"tenant '{row['tenant']}' has no policy any more", "permission_error"), None
        else:
            status, body, retry_after = await self.run_line(tenant, row["endpoint"],
                                                            line.body)
        line.generating = False
        if status == 503 and body.get("error", {}).get("code") == "shutting_down":
            return  # the box stops: the line stays pending
        if status == 503 or (status == 429 and retry_after is not None
                             and retry_after <= RATE_WAIT_MAX_S):
            batch.resume_at = time.time() + max(1.0, retry_after or 1.0)
            return  # refused for a moment: it runs again, not an error
        fields = {"method": "POST", "path": row["endpoint"], "status": status,
                  "dialect": "openai", **access,
                  "total_ms": round((time.perf_counter() - start) * 1000, 1)}
        if isinstance(fields.get("model"), str) and self.scrub is not None:
            try:
                fields["model"] = self.scrub.model(fields["model"])
            except Exception:
                fields["model"] = "<REDACTION_FAILED>"
        access_log.info("POST %s %s (batch %s)", row["endpoint"], status, row["id"],
                        extra={"fields": {**fields, "batch_id": row["id"]},
                               "request_id": line.line_id})
        result = {"id": line.line_id, "custom_id": line.custom_id,
                  "response": {"status_code": status, "request_id": access["id"],
                               "body": body}, "error": None}
        # The answer is in: kept even if the line is cancelled now (a stop waits for it).
        commit = asyncio.ensure_future(self._commit(
            batch, line, "done" if status == 200 else "error", result,
            {**fields, "trace_id": line.line_id, "ts": started_at,
             "endpoint": row["endpoint"], "batch_id": row["id"]}))
        self._commits.add(commit)
        commit.add_done_callback(self._commits.discard)
        await asyncio.shield(commit)

    async def _commit(self, batch: _Open, line: _Line, state: str, result: dict[str, Any],
                      ledger_row: dict[str, Any]) -> None:
        """The line's ledger row, then (once it is on disk) its result with its state: a
        crash between the two runs the line again, a crash before never loses a row of a
        result kept."""
        self.record(ledger_row)
        await asyncio.to_thread(self.flushed)
        store = self.store
        if store is not None and store.finish_line(batch.row["id"], line.idx, state, result):
            batch.row["completed" if state == "done" else "failed"] += 1

    def _tenant(self, row: dict[str, Any]) -> TenantContext | None:
        """The batch's tenant as its policy is now (a restart may have changed it)."""
        if self.governor is None:
            from edge_agent.config import TenantPolicy
            return TenantContext(row["tenant"], TenantPolicy.model_validate({}))
        try:
            policy = self.governor.policy(row["tenant"])
        except EdgeAgentError:
            return None
        return TenantContext(row["tenant"], policy, row["key_prefix"] or "")

    async def _end(self, batch: _Open, status: str) -> None:
        """Cancelled or expired: running lines stopped first, then what never ran is
        closed (an expired line is an error line, `batch_expired`, as OpenAI writes it)."""
        for line in batch.running.values():
            if line.task is not None and line.generating:
                line.task.cancel()  # a line whose answer is in is kept
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
        created = _now()
        for kind, state in (("output", "done"), ("error", "error")):
            results = store.results(row["id"], state)
            if not results:
                continue
            data = ("\n".join(results) + "\n").encode()
            file_id = _new_id("file-")
            outputs.append({"id": file_id, "tenant": row["tenant"],
                            "filename": f"{row['id']}_{kind}.jsonl",
                            "purpose": "batch_output", "bytes": len(data),
                            "created_at": created, "expires_at": self._expiry(created),
                            "lines": len(results), "purpose_kind": kind})
            blobs[file_id] = data
        await asyncio.to_thread(store.finalize, row["id"], status, outputs, blobs)
        self._open.pop(row["id"], None)
        self._put_backs = {k: v for k, v in self._put_backs.items() if k[0] != row["id"]}
        log.info("batch %s %s", row["id"], status)

    def purge(self) -> int:
        """Retention (`retention.batch_days`): files and ended batches past it."""
        store = self.store
        if store is None:
            return 0
        return store.purge(older_than_s=self.settings.retention.batch_days * 86400)


def _canonical(asked: str) -> str:
    try:
        return str(ModelName.parse(asked))
    except EdgeAgentError:
        return asked


def _same_model(asked: str | None, loaded: str) -> bool:
    return asked is not None and _canonical(asked) == loaded


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _valid_text(obj: Any) -> bool:
    """Whether every string and key of a parsed line is valid Unicode: a line's key or
    custom_id is named in its refusal and kept in the batch's rows, which a lone surrogate
    cannot be written into."""
    try:
        json.dumps(obj, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return True


def _checked(obj: Any, n: int, seen: set[str]) -> dict[str, Any]:
    """A line's request object as OpenAI's batch input has it: custom_id, method POST,
    url one of the endpoints, body an object; a custom_id once per file."""
    where = f"line {n} of the file"
    if not isinstance(obj, dict):
        raise InvalidRequest(f"{where} is not a JSON object", param="file")
    unknown = set(obj) - {"custom_id", "method", "url", "body"}
    if unknown:
        raise InvalidRequest(f"{where} has unknown field(s): "
                             f"{', '.join(sorted(str(k)[:40] for k in unknown))}", param="file")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid or len(cid) > 512:
        raise InvalidRequest(f"{where} needs a custom_id: a string of 1 to 512 characters",
                             param="file")
    if cid in seen:
        raise InvalidRequest(f"{where} repeats custom_id '{cid[:64]}': each request of a "
                             "file needs its own", param="file")
    seen.add(cid)
    if obj.get("method") != "POST":
        raise InvalidRequest(f"{where}: method must be 'POST'", param="file")
    if obj.get("url") not in ENDPOINTS:
        raise InvalidRequest(f"{where}: url must be one of {', '.join(ENDPOINTS)}",
                             param="file")
    if not isinstance(obj.get("body"), dict):
        raise InvalidRequest(f"{where}: body must be a JSON object (the request's body)",
                             param="file")
    return obj


def _error_body(message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def _page(items: list[dict[str, Any]], after: str | None, limit: int) -> dict[str, Any]:
    """OpenAI's cursor page: the items after the one with id `after`, `limit` of them."""
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    limit = max(1, min(limit, 10000))
    page = items[:limit]
    return {"object": "list", "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


def file_object(row: dict[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"],
            "created_at": row["created_at"], "expires_at": row["expires_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed",
            "status_details": None}


def batch_object(row: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's batch object from its row."""
    stamps = {key: row.get(key) for key in (
        "in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
        "cancelling_at", "cancelled_at")}
    errors = json.loads(row["errors"]) if row.get("errors") else None
    return {"id": row["id"], "object": "batch", "endpoint": row["endpoint"],
            "errors": errors, "input_file_id": row["input_file_id"],
            "completion_window": row["completion_window"], "status": row["status"],
            "output_file_id": row.get("output_file_id"),
            "error_file_id": row.get("error_file_id"), "created_at": row["created_at"],
            "expires_at": row["expires_at"], **stamps,
            "request_counts": {"total": row["total"], "completed": row["completed"],
                               "failed": row["failed"]},
            "metadata": json.loads(row["metadata"]) if row.get("metadata") else None}


__all__ = ["DONE_STATES", "ENDPOINTS", "BatchService", "RunLine", "batch_object",
           "file_object"]
