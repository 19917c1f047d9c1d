"""The batching scheduler on the real model, below HTTP."""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import jsonschema
import llama_cpp as ll
import numpy as np
import pytest

from edge_agent.engine.constrained.json_grammar import schema_to_grammar
from edge_agent.engine.request import (
    DoneEvent,
    ErrorEvent,
    Event,
    RestartEvent,
    SamplingParams,
    TokenEvent,
)
from edge_agent.engine.runtime.llama import BatchContext, LlamaModel
from edge_agent.engine.scheduling.admission import AdmissionQueue
from edge_agent.engine.scheduling.scheduler import MAX_PUT_BACKS, GenerationJob, ModelScheduler
from edge_agent.errors import QueueFull, ServiceUnavailable
from edge_agent.telemetry.metrics import rejection_reason

pytestmark = pytest.mark.integration


def _logits(ctx: BatchContext, row: int, n_vocab: int) -> np.ndarray:
    return np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx.ptr, row), shape=(n_vocab,)).copy()


def test_sequences_are_isolated_with_the_batch_shape_fixed(model_path: Path) -> None:
    """Same batch shape, different neighbours: a sequence's logits are bit-identical."""
    model = LlamaModel(model_path, n_gpu_layers=0)
    ctx = BatchContext(model, n_seq=4, n_ctx_seq=256, n_batch=256, n_threads=2)
    prompt = model.tokenize("The lighthouse keeper climbed the stairs and", add_special=True,
                            parse_special=False)
    rng = np.random.default_rng(7)

    def run(neighbours: dict[int, list[int]]) -> np.ndarray:
        for seq in range(4):
            ctx.clear(seq)
        b = ctx.batch
        b.clear()
        b.add_span(prompt, 0, 0, last_logits=True)
        for seq, toks in neighbours.items():
            b.add_span(toks, 0, seq, last_logits=True)
        ctx.decode()
        b.clear()
        row = b.add(42, len(prompt), 0, True)
        for seq, toks in neighbours.items():
            b.add(toks[-1], len(toks), seq, True)
        ctx.decode()
        return _logits(ctx, row, model.n_vocab)

    try:
        first = run({s: rng.integers(0, model.n_vocab, 20).tolist() for s in (1, 2, 3)})
        second = run({s: rng.integers(0, model.n_vocab, 20).tolist() for s in (1, 2, 3)})
        assert np.array_equal(first, second)
    finally:
        ctx.close()
        model.close()


class _Collector:
    def __init__(self) -> None:
        self.events: queue.Queue[Event] = queue.Queue()

    def emit(self, event: Event) -> None:
        self.events.put(event)

    def result(self, timeout: float = 60) -> DoneEvent:
        while True:
            event = self.events.get(timeout=timeout)
            if isinstance(event, DoneEvent):
                return event
            if isinstance(event, ErrorEvent):
                raise event.error


@pytest.fixture
def make_scheduler(model_path: Path) -> Iterator[Callable[..., ModelScheduler]]:
    made: list[ModelScheduler] = []

    def make(**overrides: object) -> ModelScheduler:
        options: dict[str, object] = {"parallel": 4, "max_queue": 8, "prefill_chunk": 64,
                                      "deterministic": False, **overrides}
        sched = ModelScheduler(LlamaModel(model_path, n_gpu_layers=0), n_ctx_seq=512,
                               n_batch=256, n_threads=2, embed_ctx=256, aging_s=10.0,
                               **options)  # type: ignore[arg-type]
        made.append(sched)
        return sched

    yield make
    for sched in made:
        sched.close()


@pytest.fixture
def scheduler(make_scheduler: Callable[..., ModelScheduler]) -> ModelScheduler:
    return make_scheduler()


def _job(sched: ModelScheduler, text: str, *, max_tokens: int = 24, temperature: float = 0.0,
         **kw: object) -> tuple[GenerationJob, _Collector]:
    out = _Collector()
    tokens = sched.model.tokenize(text, add_special=True, parse_special=False)
    # Fixed seed, end-of-generation biased away: the jobs run as long as asked.
    no_eos = tuple((t, -100.0) for t in range(sched.model.n_vocab) if sched.model.is_eog(t))
    params = SamplingParams(temperature=temperature, seed=1234, logit_bias=no_eos)
    job = GenerationJob(prompt=tokens, params=params,
                        grammar=None, max_tokens=max_tokens, stops=[], emit=out.emit,
                        **kw)  # type: ignore[arg-type]
    return job, out


PROMPTS = ["The capital of France is", "Once upon a time, a fox",
           "def fibonacci(n):", "The three primary colours are"]


def test_deterministic_mode_gives_the_same_text_batched_or_alone(
        make_scheduler: Callable[..., ModelScheduler]) -> None:
    scheduler = make_scheduler(deterministic=True)
    solo = []
    for p in PROMPTS:
        job, out = _job(scheduler, p)
        scheduler.submit(job)
        solo.append(out.result().text)
    jobs = [_job(scheduler, p) for p in PROMPTS]
    for job, _ in jobs:
        scheduler.submit(job)
    batched = [out.result().text for _, out in jobs]
    assert batched == solo
    assert len(set(batched)) == 4  # four different continuations, none leaked into another


def test_a_whole_answer_sends_its_first_text_only_and_the_rest_at_its_end(
        scheduler: ModelScheduler) -> None:
    """Not streamed: one TokenEvent (the time to the first token), then the DoneEvent with
    the same whole text a streamed job of the same request gets piece by piece."""

    def run(**kw: object) -> tuple[list[str], DoneEvent]:
        job, out = _job(scheduler, PROMPTS[1], max_tokens=32, **kw)
        scheduler.submit(job)
        pieces = []
        while True:
            event = out.events.get(timeout=60)
            if isinstance(event, DoneEvent):
                return pieces, event
            assert isinstance(event, TokenEvent), event
            pieces.append(event.text)

    streamed, s_done = run()
    whole, w_done = run(stream=False)
    assert w_done.text == s_done.text and w_done.usage.completion_tokens == 32
    assert "".join(streamed) == s_done.text and len(streamed) > 10
    assert whole == streamed[:1]


def test_four_sequences_run_in_one_step_and_cells_are_reused(
        scheduler: ModelScheduler) -> None:
    jobs = [_job(scheduler, p, max_tokens=40) for p in PROMPTS]
    for job, _ in jobs:
        scheduler.submit(job)
    results = [out.result() for _, out in jobs]
    generated = sum(r.usage.completion_tokens for r in results)
    assert generated == 160  # 4 x 40, greedy, no EOS that early
    # Decoded together: about one step per token of the longest job, not per token overall.
    assert scheduler.stats.steps <= 40 + 4
    # The same prompt again reuses the cells its sequence kept.
    job, out = _job(scheduler, PROMPTS[0], max_tokens=4)
    scheduler.submit(job)
    again = out.result()
    assert again.usage.cached_tokens == again.usage.prompt_tokens - 1


def test_a_shared_prefix_is_copied_from_another_sequence(scheduler: ModelScheduler) -> None:
    system = "You are the assistant of a hardware store. " * 12
    first, out1 = _job(scheduler, system + "Where are the nails?", max_tokens=2)
    scheduler.submit(first)
    out1.result()
    # Occupy the sequence that holds the prefix, so the next job lands elsewhere.
    blocker, _ = _job(scheduler, system + "Where are the nails?", max_tokens=200)
    scheduler.submit(blocker)
    second, out2 = _job(scheduler, system + "Do you sell paint?", max_tokens=2)
    scheduler.submit(second)
    r = out2.result()
    blocker.cancelled.set()
    assert r.usage.cached_tokens >= len(scheduler.model.tokenize(
        system, add_special=True, parse_special=False)) - 2


def test_an_unrelated_prompt_leaves_a_long_cache_alone(scheduler: ModelScheduler) -> None:
    """A chat that shares only a few opening tokens with a long cached prompt (a tool
    call's system prompt) goes to another sequence, and the next request with that long
    prompt still finds its cells."""
    tools = "Tools: record_order(order_id, customer, quantity, price, express). " * 10
    first, out1 = _job(scheduler, tools + "Order 1: Ana buys 3 boxes.", max_tokens=2)
    scheduler.submit(first)
    out1.result()
    other, out2 = _job(scheduler, "Tools: none today. Tell me a joke.", max_tokens=2)
    scheduler.submit(other)
    out2.result()
    again, out3 = _job(scheduler, tools + "Order 2: Bo buys 5 boxes.", max_tokens=2)
    scheduler.submit(again)
    assert out3.result().usage.cached_tokens >= len(scheduler.model.tokenize(
        tools, add_special=True, parse_special=False)) - 2


def test_cancelled_job_frees_its_sequence_within_a_step(scheduler: ModelScheduler) -> None:
    job, out = _job(scheduler, "Write a long story.", max_tokens=400, temperature=1.0)
    scheduler.submit(job)
    assert isinstance(out.events.get(timeout=30), TokenEvent)
    job.cancelled.set()
    steps = scheduler.stats.steps
    while scheduler.stats.running:
        assert scheduler.stats.steps <= steps + 2
    slot = scheduler.slots[0]
    assert slot.job is None and slot.tokens == []  # cells freed
    assert scheduler.stats.kv_used == 0


def test_queue_bound_and_batch_class_is_not_starved() -> None:
    q: AdmissionQueue[GenerationJob, object] = AdmissionQueue(max_size=3, aging_s=0.05)
    mk = lambda prio: GenerationJob(prompt=[1], params=SamplingParams(), grammar=None,  # noqa: E731
                                    max_tokens=1, stops=[], emit=lambda e: None, priority=prio)
    batch, i1, i2 = mk("batch"), mk("interactive"), mk("interactive")
    for j in (batch, i1, i2):
        q.put(j)
    with pytest.raises(QueueFull) as err:
        q.put(mk("interactive"), retry_after=3)
    assert err.value.retry_after == 3 and err.value.status_code == 503
    assert rejection_reason(err.value) == "queue_full"
    # Another reason a model cannot take a request now, whatever its words say.
    busy = ServiceUnavailable("model 'x' is switching versions; the queue waits")
    assert rejection_reason(busy) == "unavailable"
    assert q.pop() is i1  # interactive first …
    threading.Event().wait(0.06)
    assert q.pop() is batch  # … until the batch job has waited aging_s
    assert q.pop() is i2
    i2.cancelled.set()
    q.put(i2)
    assert q.pop() is None  # a cancelled job is dropped, not run


def test_a_chat_returns_to_the_sequence_holding_its_history(scheduler: ModelScheduler) -> None:
    other, out_other = _job(scheduler, "The three primary colours are", max_tokens=8)
    chat, out_chat = _job(scheduler, "Once upon a time, a fox", max_tokens=8)
    scheduler.submit(other)
    scheduler.submit(chat)
    out_other.result()
    first = out_chat.result()
    held = {i: list(s.tokens) for i, s in enumerate(scheduler.slots) if s.tokens}
    home = next(i for i, t in held.items() if t[: len(chat.prompt)] == chat.prompt)
    away = next(i for i, t in held.items() if t[: len(other.prompt)] == other.prompt)
    # The next turn repeats the history and adds to it.
    turn = first.context + tuple(scheduler.model.tokenize(" and then", add_special=False,
                                                          parse_special=False))
    nxt, out_next = _job(scheduler, "x", max_tokens=4)
    nxt.prompt = list(turn)
    scheduler.submit(nxt)
    r = out_next.result()
    assert r.usage.cached_tokens >= len(first.context) - 1
    assert scheduler.slots[home].tokens[: len(turn)] == list(turn)  # it went home …
    assert scheduler.slots[away].tokens == held[away]  # … and left the other cache alone


def test_a_burst_of_short_prompts_gets_first_tokens_one_prompt_per_step(
        scheduler: ModelScheduler) -> None:
    firsts: dict[int, int] = {}
    texts = ["Hi", "Hello there", "Good morning to you", "Please tell me a long story now"]
    jobs = []
    for i, text in enumerate(texts):
        job, out = _job(scheduler, text, max_tokens=6)

        def emit(event: Event, i: int = i, out: _Collector = out) -> None:
            if isinstance(event, TokenEvent):
                firsts.setdefault(i, scheduler.stats.steps)
            out.emit(event)

        job.emit = emit
        jobs.append((job, out))
    assert not scheduler.running
    for job, _ in jobs:
        scheduler.submit(job)
    for _, out in jobs:
        out.result()
    # Not all after one shared prefill: each prompt's first token in its own step,
    # shortest first.
    assert len(set(firsts.values())) == 4
    assert firsts[0] < firsts[3]


def test_a_long_prompt_is_prefilled_in_chunks_while_others_keep_streaming(
        make_scheduler: Callable[..., ModelScheduler]) -> None:
    """Without a stall bound the prompt would go in whole, in one or two steps, and the
    running streams would wait for all of it."""
    sched = make_scheduler(prefill_chunk=0, max_step_stall=3.0)
    runners = [_job(sched, text, max_tokens=400) for text in PROMPTS[:3]]
    for job, _ in runners:
        sched.submit(job)
    while sched.stats.running < 3 or any(s.next_token is None for s in sched.slots if s.job):
        threading.Event().wait(0.01)
    counts = [0, 0, 0]
    arrived = threading.Event()
    for i, (job, out) in enumerate(runners):
        def emit(event: Event, i: int = i, out: _Collector = out) -> None:
            if isinstance(event, TokenEvent) and arrived.is_set():
                counts[i] += 1
            out.emit(event)
        job.emit = emit
    text = " ".join(f"Item {i} costs {i * 3} euros." for i in range(50))
    long_job, long_out = _job(sched, text, max_tokens=1)
    assert len(long_job.prompt) > 300
    steps: list[int] = []

    def first(event: Event) -> None:
        if isinstance(event, TokenEvent) and not steps:
            steps.append(sched.stats.steps)
        long_out.emit(event)

    long_job.emit = first
    start = sched.stats.steps
    arrived.set()
    sched.submit(long_job)
    long_out.result()
    took = steps[0] - start
    assert took >= 5  # split over several steps …
    assert min(counts) >= took - 2  # … each of which also gave every stream a token


def test_a_long_prompt_finishes_where_its_first_row_still_fits(
        scheduler: ModelScheduler) -> None:
    """The step that completes a long prompt makes the next rows pass one deep row longer
    (~two prompt tokens' cost); when that does not fit the step's budget, the prompt stops
    one token short and finishes in the next step."""
    for depth in (0.0, 2000.0):
        scheduler._prefill_cost.observe(16, depth, 16 * 0.005)  # 5 ms a token, any depth
    slot = scheduler.slots[0]
    saved = slot.tokens
    try:
        slot.tokens = [1] * 1000
        assert scheduler._last_chunk(slot, 10, 12) == 10  # 10 + ~2 for the new row fit
        assert scheduler._last_chunk(slot, 10, 11) == 9
        assert scheduler._last_chunk(slot, 1, 1) == 1  # never stalls a prompt outright
    finally:
        slot.tokens = saved


def test_generation_threads_run_nicer_than_the_rest(
        make_scheduler: Callable[..., ModelScheduler]) -> None:
    """The worker and the llama.cpp threads it starts give way to the event loop."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    sched = make_scheduler(nice=3)
    job, out = _job(sched, PROMPTS[0], max_tokens=4)
    sched.submit(job)
    out.result()
    assert os.getpriority(os.PRIO_PROCESS, sched.native_id) == min(19, base + 3)
    niced = [t for t in os.listdir("/proc/self/task")
             if os.getpriority(os.PRIO_PROCESS, int(t)) == min(19, base + 3)]
    assert len(niced) >= 2  # the worker and at least one of llama.cpp's threads
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the caller's thread is untouched


ORDER = {"type": "object", "properties": {
    "order_id": {"type": "string", "maxLength": 12},
    "customer": {"type": "string", "maxLength": 30},
    "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
    "express": {"type": "boolean"}},
    "required": ["order_id", "customer", "quantity", "express"]}


def test_a_schema_is_parsed_once_and_answers_the_same_with_or_without_the_forest(
        scheduler: ModelScheduler) -> None:
    """The first grammar job starts the vocabulary's prefix forest in the background and
    filters the whole vocabulary on refusals until it is there; later jobs use it. Greedy,
    the answers are the same, valid, and the grammar was parsed once."""
    grammar = schema_to_grammar(ORDER, param="format")
    texts = []
    for _ in range(3):
        job, out = _job(scheduler, "Give me an order record as JSON.", max_tokens=120)
        job.grammar = grammar
        scheduler.submit(job)
        done = out.result()
        assert done.reason == "stop"  # the grammar ended it, end-of-generation biased away
        texts.append(done.text)
        deadline = time.monotonic() + 60
        while scheduler.prefixes is None and time.monotonic() < deadline:
            time.sleep(0.05)
    assert scheduler.prefixes is not None
    assert scheduler.grammars.parses == 1
    assert len(set(texts)) == 1
    jsonschema.validate(json.loads(texts[0]), ORDER)


def test_the_yielding_lane_waits_behind_both_classes_and_a_put_back_job_goes_first() -> None:
    q: AdmissionQueue[GenerationJob, object] = AdmissionQueue(max_size=2, aging_s=10.0)
    mk = lambda **kw: GenerationJob(prompt=[1], params=SamplingParams(), grammar=None,  # noqa: E731
                                    max_tokens=1, stops=[], emit=lambda e: None, **kw)
    lines = [mk(yields=True, priority="batch") for _ in range(2)]
    for job in lines:
        q.put(job)
    with pytest.raises(QueueFull):
        q.put(mk(yields=True, priority="batch"))  # the lane has its own bound …
    assert len(q) == 0 and q.yielding == 2  # … and counts in neither class's
    chat = mk()
    q.put(chat)
    assert q.interactive_waiting
    assert q.pop(yielding=True) is chat  # the classes first, whatever the scheduler allows
    assert q.pop() is None  # the lane only when the scheduler opens it
    first = q.pop(yielding=True)
    assert first is lines[0]
    q.put_back(first)
    assert q.pop(yielding=True) is first  # put back: first in its lane again


def _events(out: _Collector, timeout: float = 120) -> list[Event]:
    """Every event of a job, to its end."""
    seen: list[Event] = []
    while not seen or not isinstance(seen[-1], DoneEvent | ErrorEvent):
        seen.append(out.events.get(timeout=timeout))
    return seen


def _on_first(job: GenerationJob, kind: type, then: Callable[[], object]) -> None:
    """`then()` on the worker's thread as the job's first event of `kind` is delivered:
    what it does happens while the job runs (its first text) or just after it ended,
    however slow this test's own thread is."""
    emit, done = job.emit, threading.Event()

    def wrapped(event: Event) -> None:
        emit(event)
        if isinstance(event, kind) and not done.is_set():
            done.set()
            then()

    job.emit = wrapped


def test_a_yielding_job_starts_in_a_pause_and_gives_its_sequence_back_when_work_arrives(
        make_scheduler: Callable[..., ModelScheduler]) -> None:
    """With a pause to wait for (`yield_idle_s`): a batch line's job waits while another
    job runs and for the pause after it; when a chat arrives while it runs it is put back
    at once (a RestartEvent), the chat runs alone, and the line runs again to its end."""
    sched = make_scheduler(parallel=2, yield_idle_s=1.0, yield_reserve=0)
    seen: list[tuple[str, float]] = []
    chat, chat_out = _job(sched, PROMPTS[0], max_tokens=24)
    _on_first(chat, DoneEvent, lambda: seen.append(("chat", time.monotonic())))
    sched.submit(chat)
    line, line_out = _job(sched, PROMPTS[1], max_tokens=120, stream=False, yields=True,
                          priority="batch")
    other, other_out = _job(sched, PROMPTS[2], max_tokens=8)

    def line_started() -> None:
        seen.append(("line", time.monotonic()))
        sched.submit(other)

    _on_first(line, TokenEvent, line_started)
    sched.submit(line)
    chat_out.result()
    other_out.result()
    events = _events(line_out)
    (first, chat_at), (second, line_at) = seen
    assert (first, second) == ("chat", "line")  # held while the chat ran …
    assert line_at - chat_at >= 0.5  # … and for the pause after it (less a step)
    assert sched.stats.put_back == 1 and line.put_backs == 1
    assert sum(isinstance(e, RestartEvent) for e in events) == 1
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.usage.completion_tokens == 120


def test_without_a_pause_a_waiting_chat_takes_the_newest_lines_sequence(
        make_scheduler: Callable[..., ModelScheduler]) -> None:
    """`yield_idle_s` 0: lines run beside other work, and only a chat waiting with every
    sequence taken puts one back, the newest; the other line never restarts."""
    sched = make_scheduler(parallel=2, yield_idle_s=0.0, yield_reserve=0)
    old, old_out = _job(sched, PROMPTS[1], max_tokens=150, stream=False, yields=True)
    new, new_out = _job(sched, PROMPTS[2], max_tokens=150, stream=False, yields=True)
    chat, chat_out = _job(sched, PROMPTS[0], max_tokens=8)
    _on_first(old, TokenEvent, lambda: sched.submit(new))
    _on_first(new, TokenEvent, lambda: sched.submit(chat))
    sched.submit(old)
    chat_out.result()
    new_events, old_events = _events(new_out), _events(old_out)
    assert (old.put_backs, new.put_backs) == (0, 1)
    assert not any(isinstance(e, RestartEvent) for e in old_events)
    assert sum(isinstance(e, RestartEvent) for e in new_events) == 1
    for events in (old_events, new_events):
        assert isinstance(events[-1], DoneEvent) and events[-1].usage.completion_tokens == 150


def test_a_job_put_back_often_enough_runs_to_its_end_and_a_stream_is_never_put_back(
        make_scheduler: Callable[..., ModelScheduler]) -> None:
    """Bounded: a line put back MAX_PUT_BACKS times keeps its sequence, and the chat waits
    for it; a yielding job whose text streams is never put back (sent text stays sent)."""
    sched = make_scheduler(parallel=1, yield_idle_s=0.0)
    for kw in ({"stream": False, "put_backs": MAX_PUT_BACKS}, {"stream": True}):
        line, line_out = _job(sched, PROMPTS[1], max_tokens=60, yields=True, **kw)
        chat, chat_out = _job(sched, PROMPTS[0], max_tokens=4)
        _on_first(line, TokenEvent, lambda chat=chat: sched.submit(chat))
        sched.submit(line)
        chat_out.result()
        events = _events(line_out, timeout=1)  # it ended before the chat could start
        assert not any(isinstance(e, RestartEvent) for e in events)
        assert isinstance(events[-1], DoneEvent) and events[-1].usage.completion_tokens == 60
    assert sched.stats.put_back == 0
