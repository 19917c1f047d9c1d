"""A failure inside a scheduler step ends only the request it belongs to, on the real model:
that request gets an error event, its sequence is freed, the others finish, and the worker
thread serves the next request."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from pathlib import Path

import llama_cpp as ll
import pytest

from edge_agent.engine.request import DoneEvent, ErrorEvent, Event, SamplingParams
from edge_agent.engine.runtime.llama import LlamaModel
from edge_agent.engine.scheduling.scheduler import GenerationJob, ModelScheduler, _Slot
from edge_agent.errors import EdgeAgentError

pytestmark = pytest.mark.integration

# One llama.cpp thread: the behaviour tested does not depend on it, and on a box whose cores
# are shared, two barrier-synchronised threads can make each decode many times slower.
THREADS = 1

PROMPTS = ["The capital of France is", "Once upon a time, a fox", "def fibonacci(n):"]


class _Collector:
    def __init__(self) -> None:
        self.events: queue.Queue[Event] = queue.Queue()

    def emit(self, event: Event) -> None:
        self.events.put(event)

    def end(self, timeout: float = 120) -> DoneEvent | ErrorEvent:
        while True:
            event = self.events.get(timeout=timeout)
            if isinstance(event, (DoneEvent, ErrorEvent)):
                return event


@pytest.fixture
def scheduler(model_path: Path) -> Iterator[ModelScheduler]:
    sched = ModelScheduler(LlamaModel(model_path, n_gpu_layers=0), parallel=4, n_ctx_seq=256,
                           n_batch=128, n_threads=THREADS, embed_ctx=128, max_queue=8,
                           prefill_chunk=64, aging_s=10.0)
    yield sched
    sched.close()


def _job(sched: ModelScheduler, text: str, max_tokens: int = 12
         ) -> tuple[GenerationJob, _Collector]:
    out = _Collector()
    no_eos = tuple((t, -100.0) for t in range(sched.model.n_vocab) if sched.model.is_eog(t))
    job = GenerationJob(prompt=sched.model.tokenize(text, add_special=True, parse_special=False),
                        params=SamplingParams(temperature=0.0, logit_bias=no_eos),
                        grammar=None, max_tokens=max_tokens, stops=[], emit=out.emit)
    return job, out


def _cells(sched: ModelScheduler, seq: int) -> int:
    """Cells llama.cpp itself holds for a sequence (not the scheduler's own bookkeeping)."""
    return int(ll.llama_memory_seq_pos_max(sched.ctx.mem, seq)) + 1


def _serves_another(sched: ModelScheduler) -> None:
    assert sched.alive
    job, out = _job(sched, "The three primary colours are", max_tokens=4)
    sched.submit(job)
    end = out.end()
    assert isinstance(end, DoneEvent) and end.usage.completion_tokens == 4


def _quiet(sched: ModelScheduler) -> None:
    """No step keeps running (and failing) once every request has ended."""
    deadline = time.monotonic() + 10
    while sched.running and time.monotonic() < deadline:
        time.sleep(0.01)
    steps = sched.stats.steps
    time.sleep(0.3)
    assert sched.stats.steps == steps and sched.running == 0


def test_a_prompt_that_breaks_its_step_ends_alone(scheduler: ModelScheduler) -> None:
    """A token id outside int32 raises inside the prompt pass (it used to fail that step
    again on every iteration, forever); here it ends only its own request."""
    good = [_job(scheduler, p, max_tokens=16) for p in PROMPTS]
    for job, _ in good:
        scheduler.submit(job)
    while scheduler.running < 3:
        time.sleep(0.005)
    bad, bad_out = _job(scheduler, "x")
    bad.prompt = [1, 2**31]
    scheduler.submit(bad)
    end = bad_out.end()
    assert isinstance(end, ErrorEvent) and isinstance(end.error, EdgeAgentError)
    assert end.error.status_code == 500
    for _, out in good:
        done = out.end()
        assert isinstance(done, DoneEvent) and done.usage.completion_tokens == 16
    assert scheduler.stats.failures == 1
    _quiet(scheduler)
    _serves_another(scheduler)


def test_a_request_failing_mid_stream_frees_its_sequence_and_the_others_finish(
        scheduler: ModelScheduler, monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = [_job(scheduler, p, max_tokens=16) for p in PROMPTS]
    victim = jobs[1][0]
    sampled = scheduler._sampled
    seen: list[int] = []

    def flaky(slot: _Slot) -> None:
        if slot.job is victim and len(slot.completion) >= 5:
            seen.append(slot.seq)
            raise RuntimeError("injected failure")
        sampled(slot)

    monkeypatch.setattr(scheduler, "_sampled", flaky)
    for job, _ in jobs:
        scheduler.submit(job)
    end = jobs[1][1].end()
    assert isinstance(end, ErrorEvent) and isinstance(end.error, EdgeAgentError)
    assert end.error.status_code == 500 and "injected" not in str(end.error)
    seq = seen[0]
    for i in (0, 2):
        done = jobs[i][1].end()
        assert isinstance(done, DoneEvent) and done.usage.completion_tokens == 16
    assert scheduler.slots[seq].job is None and scheduler.slots[seq].tokens == []
    assert _cells(scheduler, seq) == 0  # its KV cells are gone, not just forgotten
    assert seen == [seq]  # it failed once, and was not stepped again
    _quiet(scheduler)
    _serves_another(scheduler)


def test_a_failed_decode_pass_ends_the_requests_in_that_pass_only(
        scheduler: ModelScheduler, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass that fails as a whole names no culprit: the requests in it end; requests in
    the step's other pass go on. Then a failed rows pass ends every running stream, and
    the worker still serves the next request."""
    runners = [_job(scheduler, p, max_tokens=40) for p in PROMPTS[:2]]
    for job, _ in runners:
        scheduler.submit(job)
    while not all(s.next_token is not None for s in scheduler.slots if s.job) \
            or scheduler.running < 2:
        time.sleep(0.005)
    decode = scheduler.ctx.decode
    newcomer, new_out = _job(scheduler, PROMPTS[2])
    batch = scheduler.ctx.batch

    def failing_prompt_pass() -> None:
        seqs = set(batch.seq[: batch.n].tolist())
        if batch.n > 1 and any(s.job is newcomer and s.seq in seqs for s in scheduler.slots):
            raise EdgeAgentError("llama_decode failed with code -1")
        decode()

    monkeypatch.setattr(scheduler.ctx, "decode", failing_prompt_pass)
    scheduler.submit(newcomer)
    end = new_out.end()
    assert isinstance(end, ErrorEvent)
    assert scheduler.running == 2  # the streams in the rows pass go on

    def failing_rows_pass() -> None:
        raise EdgeAgentError("llama_decode failed with code -3")

    monkeypatch.setattr(scheduler.ctx, "decode", failing_rows_pass)
    for _, out in runners:
        assert isinstance(out.end(), ErrorEvent)
    monkeypatch.setattr(scheduler.ctx, "decode", decode)
    assert all(_cells(scheduler, s.seq) == 0 for s in scheduler.slots)
    _quiet(scheduler)
    _serves_another(scheduler)


def test_an_event_that_cannot_be_delivered_cancels_only_its_request(
        scheduler: ModelScheduler) -> None:
    good, good_out = _job(scheduler, PROMPTS[0], max_tokens=12)
    broken, _ = _job(scheduler, PROMPTS[1], max_tokens=200)

    def refuse(event: Event) -> None:
        raise RuntimeError("the receiver is gone")

    broken.emit = refuse
    scheduler.submit(broken)
    scheduler.submit(good)
    done = good_out.end()
    assert isinstance(done, DoneEvent) and done.usage.completion_tokens == 12
    assert broken.cancelled.is_set()
    _quiet(scheduler)
    _serves_another(scheduler)
