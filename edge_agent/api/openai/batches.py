"""OpenAI's Files and Batches resources: files and batches per tenant, kept in
`batches.db` (`ledger.batches`), their lines run by the runner beside it (`batch_runner`).

An uploaded file is checked whole before it is kept (400 naming the first bad line): JSONL,
one request object a line as OpenAI's batch input has it. A line's body is not checked
here: the line runs through `serving` as the same request sent interactively would, and a
body it refuses is that line's error.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

from edge_agent.api.openai.batch_runner import BatchRunner
from edge_agent.api.openai.protocol import (
    ENDPOINTS,
    batch_object,
    expiry,
    file_object,
    new_id,
    page,
)
from edge_agent.config import Settings
from edge_agent.errors import InvalidRequest, NotFound, PayloadTooLarge, ServiceUnavailable
from edge_agent.governance.tenants import TenantContext
from edge_agent.ledger.batches import BatchStore

WINDOWS = {"24h": 86400}
# A JSON escape of a UTF-16 surrogate (`\ud800`); alone, it decodes to text no UTF-8 file,
# message or row can hold. Most lines have none, and are not checked further.
_SURROGATE_ESCAPE = re.compile(rb"\\[uU][dD][89a-fA-F]")


def _now() -> int:
    return int(time.time())


class BatchService:
    """Files and batches of each tenant, kept in `batches.db`; their lines are run by the
    `runner`, both started and stopped by the app's lifespan."""

    def __init__(self, settings: Settings, runner: BatchRunner) -> None:
        self.settings = settings
        self.runner = runner
        self.store: BatchStore | None = None

    # -- life ----------------------------------------------------------------------------
    def start(self) -> None:
        """Opens `batches.db` and starts the runner; batches a stop or a crash left open
        go on where their lines are."""
        self.store = BatchStore(self.settings.state_dir)
        self.runner.start(self.store)

    async def stop(self) -> None:
        """Stops the runner (running lines stay pending), then closes the store."""
        await self.runner.stop()
        if self.store is not None:
            await asyncio.to_thread(self.store.close)
            self.store = None

    def _db(self) -> BatchStore:
        if self.store is None:
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
        row = {"id": new_id("file-"), "tenant": tenant.name, "filename": filename[:255],
               "purpose": "batch", "bytes": len(data), "created_at": created,
               "expires_at": expiry(self.settings, created), "lines": len(lines)}
        store = self._db()
        await asyncio.to_thread(store.add_file, row, data)
        return file_object(row)

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
        return page([file_object(r) for r in rows], after, limit)

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
            "id": new_id("batch_"), "tenant": tenant.name, "key_prefix": tenant.key_prefix,
            "endpoint": endpoint, "input_file_id": input_file_id,
            "completion_window": window, "status": "validating", "created_at": created,
            "expires_at": created + WINDOWS[window],
            "metadata": json.dumps(metadata) if metadata else None, "errors": None,
            "total": len(lines), "completed": 0, "failed": 0}
        items = [(new_id("batch_req_"), line["custom_id"],
                  json.dumps(line["body"], ensure_ascii=False)) for line in lines]
        await asyncio.to_thread(self._db().add_batch, row, items)
        self.runner.opened(dict(row))
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
        return page([batch_object(r) for r in self._db().batches(tenant.name)], after, limit)

    async def cancel_batch(self, tenant: TenantContext, batch_id: str) -> dict[str, Any]:
        """OpenAI's cancel: `cancelling` at once, `cancelled` once its running lines have
        stopped (their answers are not kept); what finished before stays in its files. An
        ended batch is returned as it is."""
        row = self._batch_row(tenant, batch_id)
        if row["status"] in ("validating", "in_progress"):
            await asyncio.to_thread(self._db().set_status, batch_id, "cancelling")
            self.runner.cancelling(batch_id)
            row = self._batch_row(tenant, batch_id)
        return batch_object(row)

    def purge(self) -> int:
        """Retention (`retention.batch_days`): files and ended batches past it."""
        store = self.store
        if store is None:
            return 0
        return store.purge(older_than_s=self.settings.retention.batch_days * 86400)


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
