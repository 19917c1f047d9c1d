"""What of a request's text the box keeps, and what the model sees of it.

Redaction of prompts (when the tenant wants the model to see them redacted, or when content
is kept) and of answers (when content is kept): each span goes to the redaction log, the
redacted text (only) to the content table. A client's end-user id is kept as a keyed
digest. Never a raw value: not in the ledger, not in a log line.

Only what the model must see redacted is redacted on the request's path. Text that is
redacted just to be kept (an answer; a prompt the model sees as sent) is redacted after the
response, on the ledger's writer thread (`later`), whose rows it becomes: a client never
waits for it, and it is as safe from loss as the request's own row.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import time
from collections.abc import Callable
from typing import Any, Protocol

from edge_agent.engine.request import GenerationRequest
from edge_agent.governance.redaction import Redactor
from edge_agent.governance.tenants import TenantContext
from edge_agent.ledger.store import CONTENTS, REDACTIONS
from edge_agent.ledger.writer import DeferredJob
from edge_agent.logs import current_request_id

Record = Callable[[str, dict[str, Any]], None]


class Later(Protocol):
    """Runs a job that returns rows (table, row) later, off the request's path."""

    def __call__(self, job: DeferredJob, *, request_id: str | None = None) -> None: ...


class RequestPrivacy:
    def __init__(self, redactor: Redactor | None, *, keep_content: bool = False,
                 record: Record | None = None, later: Later | None = None) -> None:
        self.redactor = redactor
        self.keep_content = keep_content  # store redacted text (retention.content_hours > 0)
        self.record = record
        self.later = later  # None: kept text is redacted at once

    def redact_prompt(self, req: GenerationRequest, tenant: TenantContext | None, *,
                      keep: bool = True) -> GenerationRequest:
        """Returns the request the model will see (redacted when the tenant says so). With
        `keep` False nothing reaches the redaction log or the content table: the request
        is only being checked, and is redacted again, and logged, when it runs."""
        policy = tenant.policy if tenant is not None else None
        hide = bool(policy and policy.redact_prompt)
        if self.redactor is None or not (hide or keep and self.keep_content):
            return req
        texts = [(m["role"], str(m.get("content") or "")) for m in req.messages] \
            if req.messages is not None else [("user", req.prompt or "")]
        if not hide:  # only kept: the model sees the prompt as sent
            self._keep([(text, "prompt", i, role) for i, (role, text) in enumerate(texts)])
            return req
        redactor = self.redactor
        redacted = [self.redact_and_log(text, "prompt", i, role) if keep
                    else redactor.redact(text, lenient=False)[0]
                    for i, (role, text) in enumerate(texts)]
        if req.messages is not None:
            messages = [{**m, "content": r} for m, r in zip(req.messages, redacted, strict=True)]
            return dataclasses.replace(req, messages=messages)
        return dataclasses.replace(req, prompt=redacted[0])

    def keep_answer(self, text: str) -> None:
        """An answer, redacted, into the content table (when content is kept)."""
        if self.redactor is not None and self.keep_content:
            self._keep([(text, "response", 0, "assistant")])

    def _keep(self, texts: list[tuple[str, str, int, str]]) -> None:
        """Texts (text, direction, message index, role) redacted into the redaction log
        and the content table later, off the request's path (at once without `later`)."""
        request_id, ts = current_request_id(), time.time()
        if self.later is None:
            for text in texts:
                self.redact_and_log(*text)
            return
        self.later(lambda: [row for text in texts
                            for row in self._rows(*text, request_id=request_id, ts=ts)[1]],
                   request_id=request_id)

    def redact_and_log(self, text: str, direction: str, index: int, role: str) -> str:
        redacted, rows = self._rows(text, direction, index, role,
                                    request_id=current_request_id(), ts=time.time())
        if self.record is not None:
            for table, row in rows:
                self.record(table, row)
        return redacted

    def _rows(self, text: str, direction: str, index: int, role: str, *, request_id: str,
              ts: float) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
        """The text redacted, and its rows: a span each, and the redacted text when
        content is kept."""
        assert self.redactor is not None
        # Model output gets the lenient pass too: over-redaction is cheap there.
        redacted, spans = self.redactor.redact(text, lenient=direction == "response")
        rows: list[tuple[str, dict[str, Any]]] = [(REDACTIONS, {
            "request_id": request_id, "direction": direction, "message_index": index,
            "entity_type": span.entity, "detector": span.detector,
            "detector_version": span.detector_version, "operator": span.operator,
            "start": span.start, "end": span.end,
            "policy_version": self.redactor.policy_version}) for span in spans]
        if self.keep_content:
            rows.append((CONTENTS, {"request_id": request_id, "direction": direction,
                                    "message_index": index, "role": role, "text": redacted,
                                    "ts": ts}))
        return redacted, rows

    def end_user_digest(self, value: str) -> str:
        """A client's end-user id (`user`, `safety_identifier`) as the ledger keeps it: a
        digest keyed per device, so one user's requests correlate and the id never shows."""
        key = self.redactor.key if self.redactor is not None else b""
        return hmac.new(key, value.encode("utf-8", "replace"), hashlib.sha256).hexdigest()[:24]
