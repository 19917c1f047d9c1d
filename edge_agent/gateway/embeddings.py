"""An embedding request: bounded, fed to the model between its generation steps, and
stopped as soon as nobody waits for it: its client gone, or its deadline passed."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable

from edge_agent.engine.prompt import embedding_tokens
from edge_agent.engine.registry import ModelRegistry
from edge_agent.engine.request import EmbeddingRequest, EmbeddingResult
from edge_agent.errors import ClientDisconnected, InvalidRequest, RequestTimeout
from edge_agent.gateway.observe import as_edge_error
from edge_agent.logs import note
from edge_agent.names import ModelName

# How often a waiting embedding request asks whether its client is still there.
DISCONNECT_POLL_S = 0.25


def check_count(req: EmbeddingRequest, most: int) -> None:
    if len(req.inputs) > most:
        raise InvalidRequest(f"{len(req.inputs)} inputs; at most {most} per request",
                             param="input")


async def embed(registry: ModelRegistry, req: EmbeddingRequest, name: ModelName, *,
                keep_alive: float | None = None,
                disconnected: Callable[[], Awaitable[bool]] | None = None,
                deadline: float | None = None) -> EmbeddingResult:
    """Embeds every input, in chunks between the model's generation steps. Bounded per
    request (`max_embedding_inputs`, `max_embedding_tokens`: 400 naming `input`); the work
    stops at its next chunk when the caller is cancelled, `disconnected()` (polled while
    waiting) says the client has gone, or the `deadline` (loop time) passes (504)."""
    runtime = registry.settings.runtime
    loop = asyncio.get_running_loop()
    model, load_ns = await registry.acquire(name, keep_alive)
    try:
        inputs, truncated = embedding_tokens(req.inputs, model, truncate=req.truncate,
                                             max_tokens=runtime.max_embedding_tokens)
        if deadline is not None and deadline <= loop.time():
            raise RequestTimeout("the request timed out before it was queued")
        future: asyncio.Future[EmbeddingResult | Exception] = loop.create_future()

        def done(result: EmbeddingResult | Exception) -> None:
            try:
                loop.call_soon_threadsafe(_settle, future, result)
            except RuntimeError:  # the loop is gone (shutdown): nobody is waiting
                pass

        cancelled = model.embed(inputs, truncated, done)
        try:
            result = await _wait_unless_gone(future, disconnected, deadline)
        finally:
            cancelled.set()  # a no-op once done; else the worker stops at once
    finally:
        await registry.release(model)
    if isinstance(result, Exception):
        raise as_edge_error(result)
    note(model=model.info.name, model_digest=model.info.digest,
         prompt_tokens=result.prompt_tokens, truncated_tokens=result.truncated_tokens)
    return dataclasses.replace(
        result, timings=dataclasses.replace(result.timings, load_ns=load_ns,
                                            total_ns=result.timings.total_ns + load_ns))


async def _wait_unless_gone(future: asyncio.Future[EmbeddingResult | Exception],
                            disconnected: Callable[[], Awaitable[bool]] | None,
                            deadline: float | None) -> EmbeddingResult | Exception:
    loop = asyncio.get_running_loop()
    while True:
        timeout = DISCONNECT_POLL_S if disconnected is not None else None
        if deadline is not None:
            left = deadline - loop.time()
            if left <= 0:
                raise RequestTimeout("the request passed its deadline")
            timeout = left if timeout is None else min(timeout, left)
        finished, _ = await asyncio.wait({future}, timeout=timeout)
        if finished:
            return future.result()
        if disconnected is not None and await disconnected():
            raise ClientDisconnected("the client disconnected")


def _settle(future: asyncio.Future[EmbeddingResult | Exception],
            result: EmbeddingResult | Exception) -> None:
    if not future.done():  # the waiter may have been cancelled meanwhile
        future.set_result(result)
