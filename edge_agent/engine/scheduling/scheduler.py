"""Continuous batching: one worker thread per loaded model owns its llama context.

Each step decodes the next token of every running sequence in one `llama_decode`, then
a bounded chunk of prompt tokens for sequences still being prefilled in a second, then a
bounded chunk of embedding input in a context of its own; new jobs take free sequences
between steps and finished ones leave. Each sequence keeps its KV cells after its job, so a
later prompt that starts the same way (a system prompt, a growing chat) reuses them — from
its own sequence, or copied from another. Only this thread calls llama.cpp for this model;
the event loop only reads the counters in `stats`. What goes into a step (which rows, how
many prompt and embedding tokens) is decided by the pure rules of `steppolicy`, from the
costs this thread measures.

A failure inside a step ends only the request(s) it can be traced to, with an error event,
and frees their sequences; the thread and every other request go on.

Jobs that yield (a batch's lines: `GenerationSpec.yields`) run in the capacity the others
leave, and this thread, which holds the sequences, is what makes them yield: one starts
only once no other job has run or waited for `yield_idle_s`, and while more than
`yield_reserve` sequences stay free after it. When other work arrives while they run,
each is put back (its sequence freed at once, the job first in its lane again, its caller
told by a RestartEvent, to run again from its start): with `yield_idle_s` set, every one
running; else, when an interactive job waits with every sequence taken, the newest. A job
put back MAX_PUT_BACKS times runs to its end, so a line always ends however busy the box.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from edge_agent.config import MAX_DRAFT
from edge_agent.engine.constrained.closing import ClosingTokens
from edge_agent.engine.constrained.grammar_cache import ParsedGrammars
from edge_agent.engine.constrained.sampler import Candidates, Sampler
from edge_agent.engine.constrained.token_prefixes import TokenPrefixes
from edge_agent.engine.request import (
    DoneEvent,
    DoneReason,
    EmbeddingResult,
    ErrorEvent,
    Event,
    RestartEvent,
    SamplingParams,
    Timings,
    TokenEvent,
    Usage,
)
from edge_agent.engine.runtime.free_cores import FreeCores
from edge_agent.engine.runtime.llama import (
    BatchContext,
    EmbeddingContext,
    LlamaModel,
    normalised_mean,
)
from edge_agent.engine.scheduling.admission import AdmissionQueue, Priority
from edge_agent.engine.scheduling.draftmodel import DraftModel
from edge_agent.engine.scheduling.prompt_cache import CachedPrompt, CacheShape, PromptCache
from edge_agent.engine.scheduling.prompt_lookup import PromptLookup
from edge_agent.engine.scheduling.stepcost import PrefillCost
from edge_agent.engine.scheduling.steppolicy import (
    DETERMINISTIC_MAX_ROWS,
    MIN_COPY_TOKENS,
    MIN_PREFILL_CHUNK,
    Prompt,
    StepPolicy,
    common_prefix,
    copy_source,
    last_chunk,
    prefill_spans,
    shortest_short,
)
from edge_agent.engine.text.textstream import TextStream
from edge_agent.errors import EdgeAgentError, QueueFull, ServiceUnavailable
from edge_agent.priority import lower_thread_priority

log = logging.getLogger(__name__)

MAX_PUT_BACKS = 3  # then a yielding job runs to its end whatever arrives
# A cached prompt state is restored, and a sequence's cells kept before they are dropped,
# only for at least this many tokens (a block of the cache's index): a restore copies every
# cell it keeps (about 0.3 ms per 100 cells of the default model), where a prompt pass
# reads every weight once more (8-10 ms on a 2-core box).
MIN_RESTORE_TOKENS = 16


@dataclass
class GenerationJob:
    prompt: list[int]
    params: SamplingParams
    grammar: str | None
    max_tokens: int
    stops: list[str]
    emit: Callable[[Event], None]
    priority: Priority = "interactive"
    load_ns: int = 0
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted_ns: int = field(default_factory=time.perf_counter_ns)
    enqueued_at: float = 0.0
    cache_key: str | None = None  # the client's prompt-cache hint (OpenAI prompt_cache_key)
    draft: int | None = None  # most prompt-lookup draft tokens a step (None: the model's)
    stream: bool = True  # False: only the first text as a TokenEvent (GenerationSpec.stream)
    yields: bool = False  # runs in the pauses of other work (GenerationSpec.yields)
    put_backs: int = 0  # times it gave its sequence back
    system_tokens: int = 0  # the prompt's system part (GenerationSpec.system_tokens)

    @property
    def preemptible(self) -> bool:
        """Whether it may still be put back: a yielding job whose caller reads its answer
        whole (a stream's text, once sent, cannot be taken back), not yet put back
        MAX_PUT_BACKS times."""
        return self.yields and not self.stream and self.put_backs < MAX_PUT_BACKS


@dataclass
class EmbeddingJob:
    inputs: list[list[int]]
    done: Callable[[EmbeddingResult | Exception], None]  # called once, from the worker
    truncated_tokens: int = 0
    submitted_ns: int = field(default_factory=time.perf_counter_ns)
    cancelled: threading.Event = field(default_factory=threading.Event)


class _EmbeddingRun:
    """An embedding job under way: the input being fed, how far, and the sum so far."""

    def __init__(self, job: EmbeddingJob) -> None:
        self.job = job
        self.index = 0
        self.pos = 0
        self.total: np.ndarray | None = None
        self.vectors: list[list[float]] = []
        self.started_ns = time.perf_counter_ns()


@dataclass
class SchedulerStats:
    """Plain counters written by the worker and read by anyone, without locks."""

    parallel: int
    kv_total: int
    running: int = 0
    kv_used: int = 0
    steps: int = 0
    last_step_tokens: int = 0
    last_step_s: float = 0.0
    failures: int = 0  # requests ended by an error inside a step
    embedding_jobs: int = 0  # embedding requests waiting or under way
    embedded_inputs: int = 0  # inputs embedded since the model was loaded
    embedded_tokens: int = 0
    drafted: int = 0  # draft tokens decoded (an earlier answer's, prompt lookup's, a draft model's)
    draft_accepted: int = 0  # of them, those the sampler confirmed
    yielding: int = 0  # sequences held by yielding jobs now (a batch's lines)
    put_back: int = 0  # yielding jobs put back for other work, since the load
    prompt_passes: int = 0  # llama_decode calls that carried prompt tokens


class _Slot:
    """One llama sequence and the job currently using it."""

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.tokens: list[int] = []  # the cells this sequence holds, position by position
        self.job: GenerationJob | None = None
        self.pending: list[int] = []  # prompt tokens still to prefill
        self.prefill_total = 0  # how many the job had to prefill when it started
        self.next_token: int | None = None  # sampled, decoded in the next step
        self.row = -1
        self.span = 0
        self.sampler: Sampler | None = None
        self.stream = TextStream([])
        self.completion: list[int] = []
        self.parts: list[str] = []
        self.cached = 0
        self.t_start = 0
        self.t_prompt = 0
        self.last_token_at = 0.0  # perf_counter of its latest token, for the stall bound
        self.cache_key: str | None = None  # the hint of the job that last used it
        self.lookup: PromptLookup | None = None  # the job's tokens, when it speculates
        self.draft_max = 0  # the job's bound on draft tokens a step
        self.draft_len = 0  # this step's bound, adapted to how many were confirmed before
        self.draft: list[int] = []  # the guesses decoded after next_token in this step
        # Earlier answers to the same prompt (`_earlier_answers`): token i of each is a guess
        # for the job's completion token i, for as long as every one before it came true.
        self.answers: list[list[int]] = []


def _prompt(slot: _Slot) -> Prompt:
    """What the step policy sees of a sequence being prefilled."""
    return Prompt(seq=slot.seq, pending=len(slot.pending), total=slot.prefill_total,
                  cells=len(slot.tokens))


class ModelScheduler:
    def __init__(
        self,
        model: LlamaModel,
        *,
        parallel: int,
        n_ctx_seq: int,
        n_batch: int,
        n_threads: int,
        embed_ctx: int,
        max_queue: int,
        prefill_chunk: int,
        aging_s: float,
        max_step_stall: float = 3.0,
        deterministic: bool = False,
        flash_attn: int = -1,
        kv_type: str = "f16",
        nice: int = 0,
        prompt_lookup: int = 0,
        answer_drafts: int = 0,
        draft_model: LlamaModel | None = None,
        close_tokens: int = 0,
        yield_idle_s: float = 0.0,
        yield_reserve: int = 0,
        prompt_cache: PromptCache | None = None,
        cache_shape: CacheShape | None = None,
        threads_follow_load: bool = False,
    ) -> None:
        self.model = model
        # Fewer threads while other processes keep cores busy (`free_cores`).
        self.free_cores = FreeCores(n_threads) if threads_follow_load and n_threads > 1 \
            else None
        self.threads_now = n_threads
        # The prompt cache beyond the sequences (`prompt_cache`), shared by every model;
        # entries found for this model's shape only.
        self.cache = prompt_cache if prompt_cache is not None and prompt_cache.enabled \
            and cache_shape is not None and not deterministic else None
        self.shape = cache_shape
        # Yielding jobs (see the module's docstring): the pause of other work they wait
        # for, and the sequences they leave free (one model sequence is lent while idle,
        # else they would never run there).
        self.yield_idle_s = yield_idle_s
        self.yield_reserve = min(yield_reserve, parallel - 1)
        self._others_at = 0.0  # when a job that does not yield last ran or waited
        # A JSON answer's last tokens of max_tokens, at most, spent closing it
        # (`constrained.closing`; `_close_reserve`). 0: never.
        self.close_tokens = close_tokens
        self.prompt_lookup = prompt_lookup  # draft tokens a step, for jobs that set none
        self.answer_drafts = answer_drafts  # draft tokens a step from an earlier answer
        # Sequences a pass may hold for their drafts to be decoded. On a CPU every row
        # costs ~0.4 of a one-row pass (smollm2, 2 cores): beside other rows, guesses
        # confirmed 2 times in 3 still lower the aggregate, so only a lone stream drafts.
        # A GPU's rows are almost free until the batch is large.
        self.draft_rows = 1 if model.n_gpu_layers == 0 else 4
        self.ctx = BatchContext(model, n_seq=parallel, n_ctx_seq=n_ctx_seq, n_batch=n_batch,
                                n_threads=n_threads, flash_attn=flash_attn, kv_type=kv_type)
        self.slots = [_Slot(i) for i in range(parallel)]
        if self.cache is not None and self.shape is not None:
            self.cache.load(self.shape)  # the disk tier's prefixes for this model
        # Guesses from a draft model, where one is given (its vocabulary checked by the
        # caller), rather than from the prompt; this scheduler owns and closes it.
        self.drafter: DraftModel | None = None
        if draft_model is not None:
            try:
                self.drafter = DraftModel(draft_model, n_seq=parallel,
                                          n_ctx_seq=self.ctx.n_ctx_seq, n_batch=n_batch,
                                          n_threads=n_threads, flash_attn=flash_attn)
            except BaseException:
                draft_model.close()
                self.ctx.close()
                raise
        # Shared by the sequences, which sample one at a time on this thread.
        self._candidates = Candidates(model.n_vocab)
        self.grammars = ParsedGrammars(model.vocab)
        self.prefixes: TokenPrefixes | None = None  # built on the first grammar job
        self.closing_tokens: ClosingTokens | None = None  # built with it
        self._prefix_builder: threading.Thread | None = None
        self._closing = threading.Event()
        self.queue: AdmissionQueue[GenerationJob, EmbeddingJob] = AdmissionQueue(
            max_queue, aging_s)
        self.policy = StepPolicy(max_step_stall=max_step_stall, prefill_chunk=prefill_chunk,
                                 n_batch=self.ctx.n_batch, parallel=parallel)
        # Measured costs, for the prefill budget: a rows pass by row count in steps that
        # follow no prompt pass (the step a stream sees when nobody prefills), and one
        # prompt token of prefill.
        self._decode_s: dict[int, float] = {}
        self._prefill_cost = PrefillCost()
        self._prefilled_last_step = False
        self.deterministic = deterministic
        self.stats = SchedulerStats(parallel=parallel, kv_total=self.ctx.n_ctx_seq * parallel)
        self._embed_ctx_size = min(embed_ctx, self.ctx.n_ctx_seq)
        self._n_threads = n_threads
        self._embedder: EmbeddingContext | None = None
        self._embeddings: deque[_EmbeddingRun] = deque()  # taking turns, input by input
        # Measured in passes beside running streams only: small chunks cost far more a
        # token than the big ones of an idle pass (a decode's fixed cost).
        self._embed_cost = PrefillCost()
        self._embed_cost_seen = False
        # Flash attention off for embeddings on a CPU: below 64 query rows its kernel reads
        # the whole KV once per row (an 8-token chunk 1,000 deep: 3x the cost), and its
        # results move with the chunk size, where the plain path gives the same vector,
        # bit for bit, however an input is chunked.
        self._embed_flash_attn = 0 if model.n_gpu_layers == 0 else flash_attn
        self._embed_lock = threading.Lock()  # stats.embedding_jobs: both threads write it
        self._max_queue = max_queue
        self._step_s = 0.05  # running estimate, for Retry-After
        # Events of the current step, delivered together at its end (see ThreadEmitter).
        self._outbox: list[tuple[GenerationJob, Event]] = []
        self._rows_s = 0.0  # this step's rows pass and prompt pass, for the embedding budget
        self._prompt_s = 0.0
        self._nice = nice
        self.native_id = 0  # the worker thread's id, once it runs
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self._thread.start()

    # -- the event loop's side -------------------------------------------------------------
    @property
    def n_ctx(self) -> int:
        """The context window one request gets."""
        return self.ctx.n_ctx_seq

    @property
    def embed_ctx(self) -> int:
        return self._embed_ctx_size

    @property
    def running(self) -> int:
        return self.stats.running

    @property
    def queued(self) -> int:
        return len(self.queue)

    def submit(self, job: GenerationJob | EmbeddingJob) -> None:
        if isinstance(job, EmbeddingJob):
            with self._embed_lock:
                if self.stats.embedding_jobs >= max(1, self._max_queue):
                    raise QueueFull(
                        f"the embedding queue for this model is full "
                        f"({self.stats.embedding_jobs} requests); retry later",
                        retry_after=self._embed_wait())
                self.stats.embedding_jobs += 1
            self.queue.put_side(job)
            return
        waves = (len(self.queue) + 1) / len(self.slots)
        self.queue.put(job, retry_after=max(1.0, waves * 128 * self._step_s))

    def expected_wait_s(self) -> float:
        """A rough wait before a job submitted now starts, where jobs already wait for a
        sequence: those ahead, each ~128 tokens, `parallel` at a time (the figure a full
        queue's Retry-After gives). With nobody waiting it is 0: the next sequence to free
        may be a moment away (an answer ending, a stream cancelled), and a guess at the
        running ones' remaining tokens would turn away requests that would have run."""
        waiting = len(self.queue)
        return waiting / len(self.slots) * 128 * self._step_s if waiting else 0.0

    def _embed_wait(self) -> float:
        """A rough Retry-After for embeddings: the tokens under way, at the measured cost."""
        try:
            pending = sum(len(t) for run in list(self._embeddings) for t in run.job.inputs)
        except RuntimeError:  # changed by the worker meanwhile: a guess is as good
            pending = 0
        return max(1.0, pending * self._embed_cost.per_token(0))

    @property
    def alive(self) -> bool:
        """Whether the worker thread still runs (it only ends at close)."""
        return self._thread.is_alive()

    def close(self) -> None:
        self.queue.close()
        self._closing.set()
        self._thread.join()
        if self._prefix_builder is not None:
            self._prefix_builder.join()  # it reads the vocabulary: before the model goes
        if self._embedder is not None:
            self._embedder.close()
        self.grammars.close()
        if self.drafter is not None:
            self.drafter.close()
        self.ctx.close()
        self.model.close()

    # -- the worker thread -----------------------------------------------------------------
    def _loop(self) -> None:
        self.native_id = threading.get_native_id()
        _lower_priority(self.native_id, self._nice)
        while not self.queue.closed:
            try:
                self._take_side_work()
                self._yield_to_others()
                self._admit()
                if any(s.job for s in self.slots):
                    self._step()
                elif self._embeddings:
                    self._embed_pass(self._embed_chunk(), None)
                else:
                    self._flush()
                    held = self._yielding_held_for()
                    self.queue.wait(held, yielding_held=held is not None)
            except Exception as exc:
                # Nothing narrower could be blamed: end the jobs this step was running, so
                # that the next step cannot fail the same way again.
                self._survive(self._fail, [s for s in self.slots if s.job is not None], exc,
                              "a step")
            finally:
                self._survive(self._flush)
        for slot in self.slots:
            if slot.job is not None:
                try:
                    self._finish(slot, "cancelled")
                except Exception:
                    log.exception("releasing a sequence at close failed")
        self._flush()
        self._take_side_work()
        while self._embeddings:
            self._end_embedding(self._embeddings[0],
                                ServiceUnavailable("the model was unloaded", retry_after=1.0))

    @staticmethod
    def _survive(func: Callable[..., None], *args: object) -> None:
        """Runs a clean-up of the loop itself: whatever it raises is logged, never lets the
        thread end (a model whose worker is gone would take requests and answer none)."""
        try:
            func(*args)
        except Exception:
            log.exception("the scheduler's own clean-up failed")

    def _emit(self, job: GenerationJob, event: Event) -> None:
        self._outbox.append((job, event))

    def _flush(self) -> None:
        if not self._outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Event], Event]]] = {}
        for job, event in self._outbox:
            emit = job.emit
            if isinstance(emit, ThreadEmitter):
                by_loop.setdefault(emit.loop, []).append((emit.queue, event))
            else:
                try:
                    emit(event)
                except Exception:  # that job cannot be told anything more: end it
                    if not job.cancelled.is_set():
                        log.exception("delivering an event failed; the request is cancelled")
                    job.cancelled.set()
        self._outbox.clear()
        for loop, items in by_loop.items():
            _post(loop, items)

    def _fail(self, slots: list[_Slot], exc: BaseException, where: str) -> None:
        """End the jobs of `slots` with an error event and free their sequences; the other
        sequences go on. Logged once per failure, however many jobs it ends."""
        failed = [s for s in slots if s.job is not None]
        if not failed:
            return
        log.error("%s failed; ending %d request(s)", where, len(failed), exc_info=exc)
        error = _as_error(exc)
        for slot in failed:
            assert slot.job is not None
            self._emit(slot.job, ErrorEvent(error))
            self._release(slot, keep_cells=False)
        self.stats.failures += len(failed)

    def _admit(self) -> None:
        while True:
            free = [s for s in self.slots if s.job is None]
            if not free:
                return
            job = self.queue.pop(yielding=self._yielding_may_start(len(free)))
            if job is None:
                return
            slot = self._pick_slot(free, job)
            try:
                self._start(slot, job)
            except Exception as exc:
                slot.job = job
                self._fail([slot], exc, "starting a request")

    # -- yielding jobs: in the pauses of the others ------------------------------------------
    def _others_seen(self) -> bool:
        """Whether a job that does not yield runs or waits now; notes when, for
        `yield_idle_s`."""
        if len(self.queue) or any(s.job is not None and not s.job.yields for s in self.slots):
            self._others_at = time.monotonic()
            return True
        return False

    def _yielding_may_start(self, free: int) -> bool:
        """Whether a yielding job may take one of the `free` sequences now: no other job
        waiting, the others paused for `yield_idle_s` (with 0, it runs beside them), and
        `yield_reserve` sequences left free after it."""
        if not self.queue.yielding:
            return False
        self._others_seen()
        return not len(self.queue) and free - 1 >= self.yield_reserve \
            and time.monotonic() - self._others_at >= self.yield_idle_s

    def _yielding_held_for(self) -> float | None:
        """With nothing running: how long the yielding lane's jobs are held back still (the
        rest of the pause they wait for), or None when they are not."""
        if not self.queue.yielding:
            return None
        left = self._others_at + self.yield_idle_s - time.monotonic()
        return left if left > 0 else None

    def _yield_to_others(self) -> None:
        """Puts back the yielding jobs that other work needs the sequences of (see the
        module's docstring)."""
        mine = [s for s in self.slots if s.job is not None and s.job.preemptible]
        if not mine:
            return
        if self.yield_idle_s > 0:
            if self._others_seen():
                for slot in mine:
                    self._put_back(slot)
        elif self.queue.interactive_waiting and all(s.job is not None for s in self.slots):
            self._put_back(max(mine, key=lambda s: s.t_start))

    def _put_back(self, slot: _Slot) -> None:
        job = slot.job
        assert job is not None
        log.info("a yielding job gave its sequence back to other work")
        job.put_backs += 1
        self.stats.put_back += 1
        self._emit(job, RestartEvent())
        self._release(slot, keep_cells=True)  # its prompt's cells, for when it runs again
        self.queue.put_back(job)

    def _pick_slot(self, free: list[_Slot], job: GenerationJob) -> _Slot:
        """The free sequence whose cells share the longest prefix with the prompt, so a
        chat's next turn lands where its history already is; on a tie, the one its cache
        key used last (a client's own cache is replaced before another's), then the one
        holding the fewest cells, keeping caches that other clients may come back to.

        A prefix of MIN_COPY_TOKENS or fewer counts as none: it is a template's opening
        (`<|im_start|>user\nRecord order`), cheaper to compute again than the cache it
        would cost. Counted, a plain chat sharing 3 such tokens with a tool call's
        sequence took it over an empty one and threw away the 240 cells of tools that the
        next call would have reused (each call then prefilled its prompt whole: 1.0 s
        where 30 new tokens take 0.1)."""
        prompt, key = job.prompt, job.cache_key
        limit = len(prompt) - 1

        def rank(s: _Slot) -> tuple[int, bool, int]:
            shared = common_prefix(s.tokens, prompt, limit)
            return (shared if shared > MIN_COPY_TOKENS else 0,
                    key is not None and s.cache_key == key, -len(s.tokens))

        return max(free, key=rank)

    def _start(self, slot: _Slot, job: GenerationJob) -> None:
        slot.t_start = time.perf_counter_ns()
        prompt = job.prompt
        limit = len(prompt) - 1  # the last prompt token is always evaluated, for its logits
        reused = 0
        if not self.deterministic:  # exact repeatability needs identical prefill chunking
            own = common_prefix(slot.tokens, prompt, limit)
            i, best = copy_source(own, [common_prefix(other.tokens, prompt, limit)
                                        for other in self.slots])
            src = slot if i is None else self.slots[i]
            hit, cached = self._cached_prefix(prompt, limit, best)
            slot.answers = self._earlier_answers(job, hit)
            # What this sequence held and the new job does not keep goes to the cache
            # first (the conversation it held may come back).
            self._keep_leaving(slot, own if hit is None and src is slot else 0)
            if hit is not None:
                reused = self._restore(slot, hit, cached, prompt)
            elif src is not slot:
                if self.ctx.copy_prefix(src.seq, slot.seq, best):
                    slot.tokens = prompt[:best]
                    reused = best
            elif self.ctx.keep_prefix(slot.seq, own):
                reused = own
            self._system_used(job, reused)
        if reused == 0:
            self.ctx.clear(slot.seq)
        del slot.tokens[reused:]
        try:
            slot.sampler = Sampler.build(
                self.model, job.params, job.grammar, candidates=self._candidates,
                grammars=self.grammars,
                prefixes=None if job.grammar is None else self._grammar_prefixes())
        except EdgeAgentError as exc:
            self._emit(job, ErrorEvent(exc))
            return
        slot.job = job
        slot.cache_key = job.cache_key
        slot.pending = prompt[reused:]
        slot.prefill_total = len(slot.pending)
        slot.cached = reused
        slot.next_token = None
        slot.stream = TextStream(job.stops)
        slot.completion, slot.parts = [], []
        # Speculation changes how many rows of a sequence a pass holds: not in the
        # batch-invariant mode, whose output must not depend on the batch's shape.
        slot.draft_max = 0 if self.deterministic else min(
            MAX_DRAFT, self.prompt_lookup if job.draft is None else job.draft)
        slot.lookup = PromptLookup(prompt) \
            if slot.draft_max > 0 and self.drafter is None else None
        if slot.answers:  # a request's own bound (0: none) holds here too
            slot.draft_max = max(slot.draft_max, self.answer_drafts if job.draft is None
                                 else min(job.draft, self.answer_drafts))
        slot.draft_len = min(slot.draft_max, 4)
        slot.draft = []
        slot.t_prompt = 0
        if len(slot.pending) == 1 and reused:
            # All but the last token cached (the same prompt again, restored or held): the
            # last goes in as a row of the next rows pass, not in a prompt pass of its own,
            # which would read every weight once more for one token.
            slot.next_token = slot.pending.pop()
            slot.last_token_at = time.perf_counter()
        self._count()

    def _earlier_answers(self, job: GenerationJob, hit: CachedPrompt | None
                         ) -> list[list[int]]:
        """The tokens that followed `job`'s whole prompt in the sequences' cells and in the
        cache entry about to be restored: answers given to the same prompt before, one of
        which a greedy job (a store's app sending the same order again) is likely to give
        again. They are guesses like prompt lookup's: decoded as draft rows once the first
        token confirmed one of them, kept only where the sampler confirms them, so the
        answer is the job's own. Only greedy jobs use them: a sampled answer follows an
        earlier one for a few tokens at most, and on a CPU every guess costs ~0.4 of a
        pass."""
        if self.answer_drafts <= 0 or self.deterministic or job.params.temperature > 0 \
                or job.draft == 0:
            return []
        prompt = job.prompt
        n = len(prompt)
        sources = [s.tokens for s in self.slots]
        if hit is not None:
            sources.append(hit.tokens)
        answers: list[list[int]] = []
        for tokens in sources:
            if len(tokens) > n + 1 and tokens[:n] == prompt:
                answer = tokens[n:]
                if answer not in answers:
                    answers.append(answer)
        return answers

    # -- the prompt cache beyond the sequences ---------------------------------------------
    def _cached_prefix(self, prompt: list[int], limit: int, best: int
                       ) -> tuple[CachedPrompt | None, int]:
        """The cache's entry to restore for `prompt`, and how many of its cells: one that
        covers at least MIN_RESTORE_TOKENS more than the `best` a sequence holds (a restore
        copies every cell it keeps; a few tokens are cheaper to compute again)."""
        if self.cache is None or self.shape is None:
            return None, 0
        hit, n = self.cache.find(self.shape, prompt, limit)
        if hit is None or n < best + MIN_RESTORE_TOKENS:
            return None, 0
        return hit, n

    def _keep_leaving(self, slot: _Slot, kept: int) -> None:
        """Hands the cells `slot` holds to the cache before all but its first `kept` are
        dropped, where that drops enough to be worth keeping and no entry holds them yet."""
        if self.cache is None or self.shape is None \
                or len(slot.tokens) - kept < MIN_RESTORE_TOKENS \
                or not self.cache.worth_keeping(self.shape, slot.tokens):
            return
        state = self.ctx.seq_state(slot.seq)
        if state is not None:
            self.cache.keep(self.shape, slot.tokens, state)

    def _restore(self, slot: _Slot, hit: CachedPrompt, n: int, prompt: list[int]) -> int:
        """Puts `hit`'s first n cells into `slot`'s sequence; the cells reused (0 where
        llama.cpp refused them: the prompt is then computed whole)."""
        assert self.cache is not None
        started = time.perf_counter()
        if not self.ctx.restore(slot.seq, hit.state, n):
            log.warning("a cached prompt state could not be restored; computing it")
            slot.tokens = []
            return 0
        self.cache.restored(hit, n, time.perf_counter() - started)
        slot.tokens = prompt[:n]
        return n

    def _system_used(self, job: GenerationJob, reused: int) -> None:
        """A start whose system part came from cells computed before: that system prompt
        served a second request, and is kept across restarts from now on."""
        n = job.system_tokens
        if self.cache is not None and self.shape is not None and n and reused >= n:
            self.cache.shared_used(self.shape, job.prompt[:n])

    def _system_boundary(self, slot: _Slot) -> int | None:
        """Where `slot`'s prefill must stop for its system part's cells to be kept alone
        (`_keep_system`): the system part's end, while the cache has no entry of it."""
        job = slot.job
        if self.cache is None or self.shape is None or job is None \
                or job.system_tokens <= len(slot.tokens):
            return None
        if self.cache.has_shared(self.shape, job.prompt[: job.system_tokens]):
            return None
        return job.system_tokens

    def _keep_system(self, slot: _Slot) -> None:
        """Right after a prefill that ended at the job's system part: its cells, alone."""
        job = slot.job
        if self.cache is None or self.shape is None or job is None \
                or len(slot.tokens) != job.system_tokens:
            return
        state = self.ctx.seq_state(slot.seq)
        if state is not None:
            self.cache.keep_shared(self.shape, slot.tokens, state)

    def _count(self) -> None:
        """The sequences held now, by all jobs and by yielding ones, and the cells held."""
        st = self.stats
        st.running = sum(1 for s in self.slots if s.job is not None)
        st.yielding = sum(1 for s in self.slots if s.job is not None and s.job.yields)
        st.kv_used = sum(len(s.tokens) for s in self.slots)

    def _grammar_prefixes(self) -> TokenPrefixes | None:
        """The vocabulary's prefix forest (`token_prefixes`), once built. The first grammar
        job starts its build in a thread of its own (0.2-0.5 s of Python for the default
        model's vocabulary), so no stream waits for it; the samplers made before it is
        ready filter the whole vocabulary when the grammar refuses a token."""
        if self.prefixes is None and self._prefix_builder is None:
            self._prefix_builder = threading.Thread(target=self._build_prefixes,
                                                    name="token-prefixes", daemon=True)
            self._prefix_builder.start()
        return self.prefixes

    def _build_prefixes(self) -> None:
        model, n = self.model, self.model.n_vocab
        pieces: list[bytes] = []
        eog: list[bool] = []
        try:
            for token in range(n):
                if token % 4096 == 0 and self._closing.is_set():
                    return
                pieces.append(model.grammar_piece(token))
                eog.append(model.is_eog(token))
            self.closing_tokens = ClosingTokens(pieces, eog)
            self.prefixes = TokenPrefixes(pieces, eog)
        except Exception:  # the samplers go on filtering the whole vocabulary
            log.exception("building the vocabulary's prefix forest failed")

    def _step(self) -> None:
        for slot in self.slots:
            if slot.job is not None and slot.job.cancelled.is_set():
                try:
                    self._finish(slot, "cancelled")
                except Exception as exc:
                    self._fail([slot], exc, "cancelling a request")
        active = [s for s in self.slots if s.job is not None]
        if not active:
            return
        if self.free_cores is not None:
            threads = self.free_cores.threads()
            if threads != self.threads_now:
                log.info("decoding with %d thread(s): other processes keep %.1f core(s) busy",
                         threads, self.free_cores.others)
                self.ctx.set_threads(threads)
                self.threads_now = threads
        started = time.perf_counter()
        decoding = [s for s in active if s.next_token is not None]
        prefilling = [s for s in active if s.next_token is None]
        self._rows_s = self._prompt_s = 0.0
        rows = len(decoding)
        if self.deterministic:
            for i in range(0, len(decoding), DETERMINISTIC_MAX_ROWS):
                self._decode(decoding[i : i + DETERMINISTIC_MAX_ROWS], [], 0)
            if prefilling:
                self._decode([], prefilling[:1], self.ctx.n_batch)
        else:
            shortest = shortest_short(_prompt(s) for s in prefilling)
            if shortest and decoding and self._rows_may_wait(decoding, shortest):
                self._decode([], prefilling, shortest)
                rows = -1  # the rows sat this step out for the prompt: no embedding either
            else:
                self._decode(decoding, prefilling, None, shortest)
        if self._embeddings and rows >= 0:
            self._embed_pass(*self._embed_budget(rows))
        elapsed = time.perf_counter() - started
        st = self.stats
        st.steps += 1
        st.last_step_s = elapsed
        self._count()
        self._step_s = 0.9 * self._step_s + 0.1 * elapsed

    def _rows_may_wait(self, decoding: list[_Slot], prompt_tokens: int) -> bool:
        """Whether running rows can sit out one step while a short prompt goes in alone
        (StepPolicy.rows_may_wait, with the time since the oldest row's last token)."""
        waited = time.perf_counter() - min(s.last_token_at for s in decoding)
        return self.policy.rows_may_wait(waited_s=waited, prompt_tokens=prompt_tokens,
                                         decode_s=self._decode_s,
                                         per_token=self._prefill_cost.per_token)

    def _prefill_budget(self, rows: int, shortest: int, rows_s: float, depth: int) -> int:
        """Prompt tokens this step may carry after a rows pass of `rows` sequences that
        took `rows_s` (StepPolicy.prefill_budget, at the measured costs)."""
        return self.policy.prefill_budget(rows=rows, shortest=shortest, rows_s=rows_s,
                                          depth=depth, decode_s=self._decode_s,
                                          per_token=self._prefill_cost.per_token)

    def _decode(self, decoding: list[_Slot], prefilling: list[_Slot], budget: int | None,
                shortest: int = 0) -> None:
        """The next token of every row of `decoding`, then up to `budget` prompt tokens
        (None: as many as `_prefill_budget` allows once the rows pass is timed).

        Two llama_decode calls, not one: with a KV stream per sequence llama.cpp splits a
        mixed batch into equal-length micro-batches anyway, and the two plain passes cost
        ~10% less than that split (7 rows + 16 prompt tokens 1,000 deep: 190 vs 213 ms)."""
        self.stats.last_step_tokens = 0
        rows_s = 0.0
        if decoding:
            rows_s = self._decode_rows(decoding)
            self._flush()  # their tokens go out now, not after the prefill pass
        if not prefilling:  # no budget to work out (a step of a stream decoding alone)
            self._prefilled_last_step = False
            return
        prompts = [_prompt(s) for s in prefilling]
        if budget is None:
            # The cells of the prompt that goes first: the shortest (the first of them).
            depth = min(prompts, key=lambda p: p.pending).cells if prompts else 0
            budget = self._prefill_budget(len(decoding), shortest, rows_s, depth)
        spans = prefill_spans(prompts, budget, rows=bool(decoding),
                              per_token=self._prefill_cost.per_token)
        self._prefilled_last_step = bool(spans)
        if spans:
            self._prefill([s for s in prefilling if s.seq in spans], spans)

    def _last_chunk(self, slot: _Slot, take: int, budget: int) -> int:
        """How much of `slot`'s remaining `take` prompt tokens to prefill in a step whose
        budget is `budget`, rows running (steppolicy.last_chunk, at the measured cost)."""
        return last_chunk(take, budget, len(slot.tokens), self._prefill_cost.per_token)

    def _decode_rows(self, decoding: list[_Slot]) -> float:
        """Decode and sample the rows; the seconds it took, sampling included. A sequence
        that speculates has its draft tokens in the same pass, right after its row."""
        batch = self.ctx.batch
        batch.clear()
        # Rows in ascending sequence order: llama.cpp then runs the batch as one pass.
        rows = []
        ordered = sorted(decoding, key=lambda s: s.seq)
        drafts = len(ordered) <= self.draft_rows
        for i, slot in enumerate(ordered):
            start = batch.n
            try:
                assert slot.next_token is not None
                pos = len(slot.tokens)
                draft = self._draft(slot, room=batch.room - (len(ordered) - i)) \
                    if drafts else []
                slot.row = batch.add(slot.next_token, pos, slot.seq, True)
                for k, token in enumerate(draft):
                    batch.add(token, pos + 1 + k, slot.seq, True)
                slot.draft = draft
            except Exception as exc:  # a row is stored only once every field fits
                batch.n = start  # nor its draft
                slot.draft = []
                self._fail([slot], exc, "adding a row")
            else:
                rows.append(slot)
        if not rows:
            return 0.0
        drafted = batch.n - len(rows)
        started = time.perf_counter()
        try:
            self.ctx.decode()
        except Exception as exc:  # the whole pass: every row in it ends
            for slot in rows:
                slot.draft = []
            self._fail(rows, exc, "a decode pass")
            return 0.0
        self.stats.last_step_tokens += batch.n
        self.stats.drafted += drafted
        for slot in rows:
            try:
                self._accept(slot)
            except Exception as exc:
                self._fail([slot], exc, "sampling")
        elapsed = time.perf_counter() - started
        if not self._prefilled_last_step and not drafted:
            old = self._decode_s.get(len(rows), elapsed)
            self._decode_s[len(rows)] = 0.8 * old + 0.2 * elapsed
        self._rows_s += elapsed
        return elapsed

    def _draft(self, slot: _Slot, room: int) -> list[int]:
        """The guesses to decode after `slot`'s next token this step (an earlier answer's
        while it comes true, else prompt lookup's or the draft model's), within
        `room` batch rows (those of the sequences after it are kept free), its context and
        what is left of its max_tokens."""
        job = slot.job
        if slot.draft_len <= 0 or job is None or (
                slot.lookup is None and self.drafter is None and not slot.answers):
            return []
        limit = min(slot.draft_len, room,
                    self.ctx.n_ctx_seq - len(slot.tokens) - 1,
                    job.max_tokens - len(slot.completion) - 1)
        if limit <= 0:
            return []
        if slot.answers:
            # Guesses only once the answer's first token came true: the same prompt answered
            # under another schema, bias or penalty starts otherwise, and a pass of wrong
            # guesses costs more than the one step without any.
            done = len(slot.completion)  # next_token is its last: the guesses follow it
            if done == 0:
                return []
            guess = slot.answers[0][done : done + limit]
            if guess:
                return guess
            slot.answers = []  # all of it came true: the answer goes on past it
        if slot.lookup is not None:
            return slot.lookup.draft(limit)
        if self.drafter is None:
            return []
        assert slot.next_token is not None
        try:
            return self.drafter.draft(slot.seq, [*slot.tokens, slot.next_token], limit)
        except Exception:  # no guess this step; the stream goes on as without a draft
            log.exception("the draft model failed to guess; the stream goes on without")
            self.drafter.forget(slot.seq)
            return []

    def _accept(self, slot: _Slot) -> None:
        """Samples `slot`'s row, then each of its draft rows for as long as the token
        sampled is the guess that row was decoded with: every token is sampled from the
        logits of the token before it, exactly as without a draft, so the answer is the
        same (greedy token for token; sampled, from the same distribution). The cells of
        the guesses after the first wrong one are dropped."""
        draft, slot.draft = slot.draft, []
        assert slot.next_token is not None
        written = len(slot.tokens) + 1 + len(draft)
        slot.tokens.append(slot.next_token)
        slot.next_token = None
        if not slot.t_prompt:  # its prompt's last token was this row (see `_start`)
            slot.t_prompt = time.perf_counter_ns()
        self._sampled(slot)
        confirmed = 0
        for guess in draft:
            if slot.job is None or slot.next_token != guess:
                break
            slot.tokens.append(guess)
            slot.next_token = None
            slot.row += 1
            confirmed += 1
            self._sampled(slot)
        if draft:
            self.stats.draft_accepted += confirmed
            # Longer guesses while they are confirmed, shorter once they are not.
            slot.draft_len = min(slot.draft_max, 2 * slot.draft_len) \
                if confirmed == len(draft) else max(1, confirmed + 1)
        if written > len(slot.tokens) and slot.tokens:
            # Cells the sequence keeps (running, or finished for prefix reuse) end with
            # its last confirmed token.
            if not self.ctx.keep_prefix(slot.seq, len(slot.tokens)):
                raise EdgeAgentError("llama.cpp could not drop a sequence's draft cells")

    def _prefill(self, slots: list[_Slot], spans: dict[int, int]) -> None:
        batch = self.ctx.batch
        batch.clear()
        added = []
        for slot in sorted(slots, key=lambda s: s.seq):
            take = spans[slot.seq]
            boundary = self._system_boundary(slot)
            if boundary is not None and len(slot.tokens) + take > boundary:
                take = spans[slot.seq] = boundary - len(slot.tokens)
            slot.span = take
            try:
                slot.row = batch.add_span(slot.pending[:take], len(slot.tokens), slot.seq,
                                          last_logits=take == len(slot.pending))
            except Exception as exc:  # a token that does not fit: the span is not counted
                self._fail([slot], exc, "adding a prompt")
            else:
                added.append(slot)
        if not added:
            return
        depth = sum(spans[s.seq] * (len(s.tokens) + spans[s.seq] / 2) for s in added)
        started = time.perf_counter()
        try:
            self.ctx.decode()
        except Exception as exc:  # the whole pass: every prompt in it ends
            self._fail(added, exc, "a prompt pass")
            return
        elapsed = time.perf_counter() - started
        self.stats.prompt_passes += 1
        self._prompt_s += elapsed
        if batch.n >= MIN_PREFILL_CHUNK:
            self._prefill_cost.observe(batch.n, depth / batch.n, elapsed)
        self.stats.last_step_tokens += batch.n
        for slot in added:
            try:
                slot.tokens.extend(slot.pending[: slot.span])
                del slot.pending[: slot.span]
                self._keep_system(slot)
                if not slot.pending:
                    slot.t_prompt = time.perf_counter_ns()
                    self._sampled(slot)
            except Exception as exc:
                self._fail([slot], exc, "sampling")

    def _sampled(self, slot: _Slot) -> None:
        job, sampler = slot.job, slot.sampler
        assert job is not None and sampler is not None
        if sampler.grammar is not None and not sampler.closing \
                and self.closing_tokens is not None \
                and job.max_tokens - len(slot.completion) <= self._close_reserve(job.max_tokens):
            sampler.start_closing(self.closing_tokens, slot.completion)
        token = sampler.sample(self.ctx, slot.row)
        slot.last_token_at = time.perf_counter()
        if self.model.is_eog(token):
            self._finish(slot, "stop")
            return
        if slot.answers:  # those that went another way give no more guesses
            done = len(slot.completion)
            slot.answers = [a for a in slot.answers if len(a) > done and a[done] == token]
        slot.completion.append(token)
        if slot.lookup is not None:
            slot.lookup.append(token)
        text = slot.stream.feed(self.model.piece(token))
        if text:
            self._text(slot, job, text)
        if slot.stream.stopped:
            self._finish(slot, "stop")
        elif len(slot.completion) >= job.max_tokens:
            self._finish(slot, "length")
        else:
            slot.next_token = token

    def _text(self, slot: _Slot, job: GenerationJob, text: str) -> None:
        """Text of the answer: kept for the DoneEvent, and sent as a TokenEvent when the
        job streams or it is the first (GenerationSpec.stream)."""
        slot.parts.append(text)
        if job.stream or len(slot.parts) == 1:
            self._emit(job, TokenEvent(text))

    def _close_reserve(self, max_tokens: int) -> int:
        """The last tokens of a JSON answer's budget spent closing it: the setting, at most
        a quarter of the budget, but 8 (or half of a smaller budget) whatever the quarter
        is, enough for a quote, a bracket or two and the end."""
        if self.close_tokens <= 0:
            return 0
        return max(min(self.close_tokens, max_tokens // 4), min(8, max_tokens // 2))

    def _finish(self, slot: _Slot, reason: DoneReason) -> None:
        job = slot.job
        assert job is not None
        if reason != "cancelled":
            tail = slot.stream.finish()
            if tail:
                self._text(slot, job, tail)
            end = time.perf_counter_ns()
            prompt_done = slot.t_prompt or end
            self._emit(job, DoneEvent(
                reason=reason,
                usage=Usage(len(job.prompt), slot.cached, len(slot.completion)),
                timings=Timings(queue_ns=slot.t_start - job.submitted_ns, load_ns=job.load_ns,
                                prompt_ns=prompt_done - slot.t_start,
                                eval_ns=end - prompt_done,
                                total_ns=end - job.submitted_ns + job.load_ns),
                text="".join(slot.parts),
                context=tuple(job.prompt + slot.completion),
                closed=reason == "stop" and slot.sampler is not None
                and slot.sampler.closed_tokens > 0))
        # A cancelled job's cells are freed; a finished one's stay for prefix reuse.
        self._release(slot, keep_cells=reason != "cancelled")

    def _release(self, slot: _Slot, *, keep_cells: bool) -> None:
        # The slot is free first, whatever llama.cpp says below: a release that raised
        # must not leave a job behind to fail again in the next step.
        sampler, slot.sampler = slot.sampler, None
        drop = not keep_cells or bool(slot.pending)
        slot.job = None
        slot.pending = []
        slot.next_token = None
        slot.lookup, slot.draft, slot.answers = None, [], []
        if drop:
            slot.tokens = []
        self._count()
        try:
            if sampler is not None:
                sampler.close()
        finally:
            if drop:
                self.ctx.clear(slot.seq)

    # -- embeddings: chunks between steps, in a context of their own ------------------------
    def _take_side_work(self) -> None:
        while (job := self.queue.pop_side()) is not None:
            self._embeddings.append(_EmbeddingRun(job))
        for run in [r for r in self._embeddings if r.job.cancelled.is_set()]:
            self._end_embedding(run, EdgeAgentError("the embedding request was cancelled"))

    def _embed_chunk(self) -> int:
        """Embedding tokens per pass while no generation runs (StepPolicy.embed_chunk)."""
        return self.policy.embed_chunk

    def _embed_budget(self, rows: int) -> tuple[int, float | None]:
        """Embedding tokens, and seconds, this step may spend after its rows pass (`rows`
        sequences) and its prompt pass (StepPolicy.embed_budget), priced by the cost of
        embedding chunks beside running streams once one was measured, else of prompt
        tokens."""
        cost = self._embed_cost if self._embed_cost_seen else self._prefill_cost
        return self.policy.embed_budget(rows=rows, rows_s=self._rows_s,
                                        prompt_s=self._prompt_s,
                                        depth=self._embeddings[0].pos,
                                        decode_s=self._decode_s, per_token=cost.per_token)

    def _embed_pass(self, budget: int, seconds: float | None) -> None:
        """Up to `budget` tokens of embedding input, one chunk of one input per decode, and
        no further decode once `seconds` are spent (many short inputs cost a decode each).
        The jobs take turns input by input (an input's cells are the context's only
        sequence), and a cancelled job stops at its next chunk."""
        started = time.perf_counter()
        fed = 0
        while budget > 0 and self._embeddings:
            if fed and seconds is not None and time.perf_counter() - started >= seconds:
                break
            run = self._embeddings[0]
            if run.job.cancelled.is_set():
                self._end_embedding(run, EdgeAgentError("the embedding request was cancelled"))
                continue
            try:
                take = self._embed_some(run, budget, observe=seconds is not None)
            except Exception as exc:
                log.error("an embedding pass failed; ending that request", exc_info=exc)
                self._end_embedding(run, exc)
                continue
            budget -= take
            fed += take
        if fed:
            self._prefilled_last_step = True  # its weights and cells are in the cache now

    def _embed_some(self, run: _EmbeddingRun, budget: int, *, observe: bool) -> int:
        """Feeds the next chunk of `run`'s current input; the tokens it took."""
        embedder = self._embedder
        if embedder is None:
            embedder = self._embedder = EmbeddingContext(
                self.model, n_ctx=self._embed_ctx_size, n_threads=self._n_threads,
                n_batch=min(self.ctx.n_batch, self._embed_ctx_size),
                flash_attn=self._embed_flash_attn)
        tokens = run.job.inputs[run.index]
        if not tokens:
            raise EdgeAgentError(f"input {run.index} is empty")
        left = len(tokens) - run.pos
        take = min(budget, left, embedder.n_batch) if embedder.causal else left
        if run.pos == 0:
            embedder.reset()
        started = time.perf_counter()
        chunk = embedder.feed(tokens[run.pos : run.pos + take], run.pos)
        if observe:
            self._embed_cost.observe(take, run.pos + take / 2, time.perf_counter() - started)
            self._embed_cost_seen = True
        run.total = chunk if run.total is None else run.total + chunk
        run.pos += take
        self.stats.embedded_tokens += take
        if run.pos == len(tokens):
            run.vectors.append(normalised_mean(run.total, len(tokens)))
            self.stats.embedded_inputs += 1
            run.index, run.pos, run.total = run.index + 1, 0, None
            if run.index == len(run.job.inputs):
                self._end_embedding(run, None)
            else:
                self._embeddings.rotate(-1)  # the next job's turn
        return take

    def _end_embedding(self, run: _EmbeddingRun, error: BaseException | None) -> None:
        """Hands `run`'s result (or `error`) to its caller and drops it; the next run starts
        its input afresh (at position 0 the context is reset)."""
        self._embeddings.remove(run)
        with self._embed_lock:
            self.stats.embedding_jobs -= 1
        job = run.job
        result: EmbeddingResult | Exception
        if error is None:
            end = time.perf_counter_ns()
            result = EmbeddingResult(
                vectors=run.vectors, prompt_tokens=sum(len(t) for t in job.inputs),
                truncated_tokens=job.truncated_tokens,
                timings=Timings(queue_ns=run.started_ns - job.submitted_ns,
                                prompt_ns=end - run.started_ns,
                                total_ns=end - job.submitted_ns))
        else:
            result = _as_error(error)
        try:
            job.done(result)
        except Exception:
            log.exception("delivering an embedding result failed")


def _as_error(exc: BaseException) -> EdgeAgentError:
    """What a request is told when its step failed: the error itself when it is one of
    ours (it says what was wrong with the request), else a 500 that keeps the cause."""
    if isinstance(exc, EdgeAgentError):
        return exc
    error = EdgeAgentError("internal error while running the request; it was ended")
    error.__cause__ = exc
    return error


def _lower_priority(tid: int, nice: int) -> None:
    """Make this thread, and the llama.cpp (OpenMP) threads it starts, which inherit it,
    `nice` steps nicer. With every core computing, a thread that wakes for a moment (the
    event loop with a token to send, a client) would otherwise wait for a time slice."""
    if nice > 0 and lower_thread_priority(nice, tid) is None:
        # not permitted here (a sandbox): run at the usual priority
        log.warning("could not lower the generation threads' priority")


class ThreadEmitter:
    """An `emit` for jobs that hands events from the worker thread to an asyncio queue.

    The scheduler delivers one step's events for all jobs of a loop in a single
    `call_soon_threadsafe` (one wake-up of the event loop per step, not one per token)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, q: asyncio.Queue[Event]) -> None:
        self.loop = loop
        self.queue = q

    def __call__(self, event: Event) -> None:
        _post(self.loop, [(self.queue, event)])


def _post(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue[Event], Event]]
          ) -> None:
    try:
        loop.call_soon_threadsafe(_deliver, items)
    except RuntimeError:  # the loop is gone (shutdown): nobody is listening
        pass


def _deliver(items: list[tuple[asyncio.Queue[Event], Event]]) -> None:
    for q, event in items:
        q.put_nowait(event)

