"""One worker thread per loaded model: it alone calls llama.cpp for that model.

Requests wait in a FIFO and run one at a time on the model's generation context; the
KV prefix of the previous request is reused when the next prompt starts the same way.
The event loop never blocks on llama.cpp: jobs hand their events back with
`loop.call_soon_threadsafe`. A job whose client went away is skipped, or stopped at the
next token.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from edge_agent.engine.request import (
    DoneEvent,
    DoneReason,
    EmbeddingResult,
    ErrorEvent,
    Event,
    SamplingParams,
    Timings,
    TokenEvent,
    Usage,
)
from edge_agent.engine.runtime import EmbeddingContext, GenerationContext, LlamaModel, Sampler
from edge_agent.engine.textstream import TextStream

log = logging.getLogger(__name__)


@dataclass
class GenerationJob:
    prompt: list[int]
    params: SamplingParams
    grammar: str | None
    max_tokens: int
    stops: list[str]
    emit: Callable[[Event], None]
    load_ns: int = 0
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted_ns: int = field(default_factory=time.perf_counter_ns)


@dataclass
class EmbeddingJob:
    inputs: list[list[int]]
    done: Callable[[EmbeddingResult | Exception], None]
    truncated_tokens: int = 0
    submitted_ns: int = field(default_factory=time.perf_counter_ns)


_STOP = object()


class ModelWorker:
    def __init__(
        self, model: LlamaModel, *, n_ctx: int, n_batch: int, n_threads: int, embed_ctx: int
    ) -> None:
        self.model = model
        self.context = GenerationContext(model, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads)
        self._embed_ctx_size = min(embed_ctx, n_ctx)
        self._n_threads = n_threads
        self._embedder: EmbeddingContext | None = None
        self._jobs: queue.Queue[object] = queue.Queue()
        self.running = 0  # read by /api/ps and metrics; written only by the worker
        self._thread = threading.Thread(target=self._loop, name="model-worker", daemon=True)
        self._thread.start()

    @property
    def n_ctx(self) -> int:
        return self.context.n_ctx

    @property
    def embed_ctx(self) -> int:
        return self._embed_ctx_size

    @property
    def queued(self) -> int:
        return self._jobs.qsize()

    def submit(self, job: GenerationJob | EmbeddingJob) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        self._jobs.put(_STOP)
        self._thread.join()
        if self._embedder is not None:
            self._embedder.close()
        self.context.close()
        self.model.close()

    # -- the worker thread ----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            self.running = 1
            try:
                if isinstance(job, GenerationJob):
                    self._generate(job)
                elif isinstance(job, EmbeddingJob):
                    self._embed(job)
            finally:
                self.running = 0

    def _generate(self, job: GenerationJob) -> None:
        start = time.perf_counter_ns()
        if job.cancelled.is_set():
            return
        try:
            cached = self.context.prefill(job.prompt)
            prompt_done = time.perf_counter_ns()
            reason, text, completion = self._decode_loop(job)
        except Exception as exc:  # report to the client; the worker keeps serving
            log.exception("generation failed")
            job.emit(ErrorEvent(exc))
            return
        end = time.perf_counter_ns()
        job.emit(
            DoneEvent(
                reason=reason,
                usage=Usage(len(job.prompt), cached, len(completion)),
                timings=Timings(
                    queue_ns=start - job.submitted_ns,
                    load_ns=job.load_ns,
                    prompt_ns=prompt_done - start,
                    eval_ns=end - prompt_done,
                    total_ns=end - job.submitted_ns + job.load_ns,
                ),
                text=text,
                context=tuple(job.prompt + completion),
            )
        )

    def _decode_loop(self, job: GenerationJob) -> tuple[DoneReason, str, list[int]]:
        model, ctx = self.model, self.context
        stream = TextStream(job.stops)
        parts: list[str] = []
        completion: list[int] = []
        reason: DoneReason = "length"
        sampler = Sampler.build(model, job.params, job.grammar)
        try:
            while len(completion) < job.max_tokens:
                if job.cancelled.is_set():
                    reason = "cancelled"
                    break
                token = sampler.sample(ctx)
                if model.is_eog(token):
                    reason = "stop"
                    break
                completion.append(token)
                text = stream.feed(model.piece(token))
                if text:
                    parts.append(text)
                    job.emit(TokenEvent(text))
                if stream.stopped:
                    reason = "stop"
                    break
                if len(completion) < job.max_tokens:
                    ctx.decode([token])
        finally:
            sampler.close()
        tail = stream.finish()
        if tail:
            parts.append(tail)
            job.emit(TokenEvent(tail))
        return reason, "".join(parts), completion

    def _embed(self, job: EmbeddingJob) -> None:
        start = time.perf_counter_ns()
        try:
            if self._embedder is None:
                self._embedder = EmbeddingContext(
                    self.model, n_ctx=self._embed_ctx_size, n_threads=self._n_threads
                )
            vectors = [self._embedder.embed(tokens) for tokens in job.inputs]
        except Exception as exc:
            job.done(exc)
            return
        end = time.perf_counter_ns()
        job.done(
            EmbeddingResult(
                vectors=vectors,
                prompt_tokens=sum(len(t) for t in job.inputs),
                truncated_tokens=job.truncated_tokens,
                timings=Timings(queue_ns=start - job.submitted_ns, prompt_ns=end - start,
                                total_ns=end - job.submitted_ns),
            )
        )


def thread_emitter(loop: asyncio.AbstractEventLoop, q: asyncio.Queue[Event]) -> Callable[
    [Event], None
]:
    """An `emit` for jobs: hands events from the worker thread to an asyncio queue."""

    def emit(event: Event) -> None:
        loop.call_soon_threadsafe(q.put_nowait, event)

    return emit
