"""One upstream ([upstreams.NAME]): an OpenAI-compatible server the box may hand a request
to, its health, and the bounds every answer from it is read within.

Health is what its answers say and what a probe says. Each failure (no connection, a
timeout, a 5xx, an answer broken off or past its bound) counts; `failures_to_open` in a row
open its circuit breaker, and then no request is sent there: `available` says no at once,
so a dead, slow or absent link costs local work nothing. After `open_s` the breaker is
half-open: one probe (`GET /models`) runs in the background, and its success closes it
again. A 4xx is the request's fault, not the upstream's, and does not count.

An answer is read as server-sent events, each within its bound: the first within
`first_token_timeout_s`, each next within `read_timeout_s`, all of them within
`max_response_bytes`; a stream that hangs, trickles past those, closes before its end or
sends what is not JSON fails with `UpstreamFailed` (502), never a hung request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Literal

import httpx

from edge_agent.config import UpstreamSettings
from edge_agent.errors import UpstreamFailed
from edge_agent.names import ModelName
from edge_agent.telemetry.metrics import Metrics

BreakerState = Literal["closed", "open", "half_open"]
JSON = {"content-type": "application/json"}


class Failed(UpstreamFailed):
    """An upstream's failure, with its kind for the metrics (timeout, broken, …)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class Breaker:
    """Closed (requests go), open (none go, until `open_s` has passed) or half-open (a
    probe is deciding)."""

    def __init__(self, failures_to_open: int, open_s: float) -> None:
        self.failures_to_open = failures_to_open
        self.open_s = open_s
        self.state: BreakerState = "closed"
        self.failures = 0
        self.opened_at = 0.0

    def success(self) -> None:
        self.state, self.failures = "closed", 0

    def failure(self) -> None:
        self.failures += 1
        if self.state == "half_open" or self.failures >= self.failures_to_open:
            self.state, self.opened_at = "open", time.monotonic()

    def due_probe(self) -> bool:
        """Open past its wait: it turns half-open, and the caller probes."""
        if self.state == "open" and time.monotonic() - self.opened_at >= self.open_s:
            self.state = "half_open"
            return True
        return False


class Upstream:
    def __init__(self, name: str, settings: UpstreamSettings,
                 metrics: Metrics | None = None) -> None:
        self.name = name
        self.settings = settings
        self.metrics = metrics
        self.breaker = Breaker(settings.failures_to_open, settings.open_s)
        self.in_flight = 0
        self._probe: asyncio.Task[None] | None = None
        key = settings.api_key()
        verify: ssl.SSLContext | bool = True
        if settings.ca_file is not None:
            verify = ssl.create_default_context(cafile=str(settings.ca_file))
        longest = max(settings.first_token_timeout_s, settings.read_timeout_s)
        self.client = httpx.AsyncClient(
            base_url=settings.base_url, verify=verify, trust_env=False,
            headers={"authorization": f"Bearer {key}"} if key else {},
            timeout=httpx.Timeout(longest, connect=settings.connect_timeout_s),
            limits=httpx.Limits(max_connections=settings.max_concurrency))
        self._report()

    def model_for(self, name: ModelName) -> str | None:
        """The upstream's name for the model clients call `name`, or None: not served."""
        return self.settings.models.get(str(name))

    def available(self) -> bool:
        """Whether a request may be sent now: breaker closed, a place free. Never waits;
        starts the half-open probe when it is due."""
        if self.breaker.due_probe():
            self._probe = asyncio.get_running_loop().create_task(self.probe())
            self._report()
        return self.breaker.state == "closed" and \
            self.in_flight < self.settings.max_concurrency

    async def probe(self) -> None:
        """`GET /models` within the connect and first-token bounds: the breaker closes on
        a 200, opens again otherwise."""
        try:
            answer = await asyncio.wait_for(self.client.get("/models"),
                                            self.settings.first_token_timeout_s)
            ok = answer.status_code == 200
        except (httpx.HTTPError, TimeoutError, asyncio.TimeoutError, OSError):
            ok = False
        if ok:
            self.breaker.success()
        else:
            self.breaker.failure()
        self._report()

    async def events(self, path: str, data: bytes, *, streamed: bool, reason: str
                     ) -> AsyncGenerator[dict[str, Any], None]:
        """The JSON objects of the answer to `data` (a JSON body): of a streamed one
        (`data:` lines, up to `[DONE]`), or the one object of a whole one; each answer
        counted toward the breaker. The caller holds a place (`in_flight`) for the whole
        iteration."""
        s = self.settings
        self.in_flight += 1
        outcome = "ok"
        try:
            async with contextlib.AsyncExitStack() as stack:
                try:
                    response = await asyncio.wait_for(stack.enter_async_context(
                        self.client.stream("POST", path, content=data, headers=JSON)),
                        s.first_token_timeout_s)
                except (TimeoutError, asyncio.TimeoutError):
                    raise self._failed("timeout", f"no answer within "
                                       f"{s.first_token_timeout_s:g} s") from None
                if response.status_code >= 400:
                    text = (await _bounded_read(response, 4096)).decode("utf-8", "replace")
                    kind = "server_error" if response.status_code >= 500 else "client_error"
                    raise self._failed(kind, f"answered {response.status_code}: "
                                       f"{_message(text)}", count=kind == "server_error")
                async for obj in self._read(response, streamed=streamed):
                    yield obj
        except Failed as exc:
            outcome = exc.kind
            raise
        except httpx.HTTPError as exc:
            outcome = "unreachable"
            raise self._failed("unreachable", f"{type(exc).__name__}: {exc}") from None
        finally:
            self.in_flight -= 1
            if outcome == "ok":
                self.breaker.success()
            if self.metrics is not None:
                self.metrics.observe_upstream(self.name, reason, outcome)
            self._report()

    async def _read(self, response: httpx.Response, *, streamed: bool
                    ) -> AsyncIterator[dict[str, Any]]:
        """The answer's objects, read as bytes arrive and split into lines here, so that
        neither a line that never ends nor one that trickles can hold more than
        `max_response_bytes` or take longer than its bound: each event must be whole
        within `read_timeout_s` of the last (the first within `first_token_timeout_s`)."""
        s = self.settings
        loop = asyncio.get_running_loop()
        chunks = response.aiter_bytes()
        deadline = loop.time() + s.first_token_timeout_s
        pending = b""
        size = 0
        whole: list[bytes] = []
        while True:
            try:
                chunk = await asyncio.wait_for(anext(chunks), max(0.0, deadline - loop.time()))
            except StopAsyncIteration:
                break
            except (TimeoutError, asyncio.TimeoutError):
                raise self._failed("timeout", "sent no whole event within its bound "
                                   f"({s.first_token_timeout_s:g} s first, "
                                   f"{s.read_timeout_s:g} s after)") from None
            size += len(chunk)
            if size > s.max_response_bytes:
                raise self._failed("too_large", f"its answer passed {s.max_response_bytes} "
                                   "bytes")
            if not streamed:
                whole.append(chunk)
                continue
            pending += chunk
            while b"\n" in pending:
                raw, pending = pending.split(b"\n", 1)
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                deadline = loop.time() + s.read_timeout_s
                yield _json(data, self._failed)
        if not streamed:
            yield _json(b"".join(whole).decode("utf-8", "replace"), self._failed)
            return
        raise self._failed("broken", "its stream ended before [DONE]")

    def _failed(self, kind: str, why: str, *, count: bool = True) -> Failed:
        if count:
            self.breaker.failure()
        return Failed(f"upstream '{self.name}' {why}", kind)

    def _report(self) -> None:
        if self.metrics is not None:
            self.metrics.set_upstream_breaker(self.name, self.breaker.state)

    async def aclose(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
        await self.client.aclose()


async def _bounded_read(response: httpx.Response, limit: int) -> bytes:
    out = b""
    async for part in response.aiter_bytes():
        out += part
        if len(out) >= limit:
            break
    return out[:limit]


def _message(text: str) -> str:
    """An error body's message (OpenAI's or Ollama's shape), else its start."""
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        body = json.loads(text)
        error = body.get("error")
        return str(error.get("message") if isinstance(error, dict) else error)[:300]
    return text[:300]


def _json(data: str, failed: Any) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except ValueError:
        raise failed("broken", "sent what is not JSON") from None
    if not isinstance(obj, dict):
        raise failed("broken", "sent JSON that is not an object")
    return obj
