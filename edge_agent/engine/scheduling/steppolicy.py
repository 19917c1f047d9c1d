"""Who runs in a scheduler step, and how much of each prompt: the arithmetic of the step
policy, apart from the worker loop that acts on it.

Each step the scheduler decides whether running rows may sit out one step while a short
prompt goes in alone, how many prompt tokens the step may carry after its rows pass
without a running stream waiting more than `max_step_stall` times a normal step, how that
budget is shared among the prompts being prefilled (shortest first, whole short prompts,
a long prompt's last chunk held back one token when the row it adds would overshoot), how
much embedding input fits after that, and, when a job starts, whether to copy another
sequence's cells rather than reuse its own.

Everything here is pure: plain numbers in (row counts, prompt lengths, depths in cells,
measured seconds), decisions out, and the measured cost of a prompt token enters as a
function of depth (`PrefillCost.per_token` in the scheduler). No llama.cpp, no threads,
no clock, so every rule can be checked with numbers alone (tests/test_steppolicy.py) and
the scheduler keeps only the loop, the contexts and the measuring.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

# Copying another sequence's cells costs about a millisecond per few hundred cells;
# below this many shared tokens, recomputing is as cheap.
MIN_COPY_TOKENS = 8
# However tight the stall budget, a prompt advances at least this much per step, and a
# prompt this short goes in whole: a burst of short chats then gets first tokens one
# prompt per step instead of a few tokens each per step.
MIN_PREFILL_CHUNK = 8
SHORT_PROMPT = 48
# On this class of CPU, llama.cpp's matmuls take one path for 1–7 rows and another from
# 8 on; deterministic mode keeps every decode under that, and never mixes in prefill.
DETERMINISTIC_MAX_ROWS = 7
# A sequence that has just finished a long prompt costs the next rows pass about this many
# prompt tokens at its depth (see `last_chunk`).
JOIN_COST_TOKENS = 2.0
# Embedding tokens a step carries however little room the stall bound leaves: embeddings
# always advance, and nobody waits for their first token, so a single token will do (a
# decode's fixed cost makes a token of a tiny chunk dear; the measured cost includes it).
MIN_EMBED_CHUNK = 1

# Seconds one prompt token costs with its middle `depth` cells deep.
PerToken = Callable[[float], float]


@dataclass(frozen=True)
class Prompt:
    """A sequence still being prefilled, as the policy sees it."""

    seq: int
    pending: int  # prompt tokens still to go in
    total: int  # prompt tokens it had to prefill when its job started
    cells: int  # cells the sequence already holds

    @property
    def short(self) -> bool:
        return self.total <= SHORT_PROMPT


def shortest_short(prompts: Iterable[Prompt]) -> int:
    """The fewest pending tokens of a short prompt (one of at most SHORT_PROMPT tokens to
    prefill); 0 when none is short."""
    return min((p.pending for p in prompts if p.short), default=0)


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """How many leading tokens `a` and `b` share, at most `limit`. Where the shorter is a
    prefix of the other (a sequence that holds what it is asked for: the common case), a
    list comparison answers at C speed; a difference is found by bisection, each step a
    comparison at C speed too (a 2,000-token prompt against a cached one: 11 of them)."""
    n = max(0, min(len(a), len(b), limit))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def copy_source(own: int, shared: Sequence[int]) -> tuple[int | None, int]:
    """Where a starting job takes its cached prefix from: `own` tokens its sequence already
    shares with the prompt, `shared[i]` what sequence i shares. (i, n) to copy n cells from
    sequence i, which must share more than MIN_COPY_TOKENS beyond the best before it; (None,
    own) to keep its own."""
    src: int | None = None
    best = own
    for i, n in enumerate(shared):
        if n > best + MIN_COPY_TOKENS:
            src, best = i, n
    return src, best


def last_chunk(take: int, budget: int, cells: int, per_token: PerToken) -> int:
    """How much of a long prompt's remaining `take` tokens to prefill in a step whose budget
    is `budget` tokens, running rows being there; the sequence holds `cells` cells.

    The step that completes a long prompt also makes the next rows pass one row longer,
    and that row sits deep: with 7 rows of ~35 ms, a prompt finishing 1,300 cells deep
    made the next pass 55 ms, so the gap the running streams saw overshot the stall
    bound by half a normal step. That row costs about two prompt tokens at its depth;
    when they do not fit beside the rest, the prompt stops one token short and
    finishes in the next step, whose remainder leaves room for the new row."""
    depth = cells + take
    join = JOIN_COST_TOKENS * per_token(depth)
    per = per_token(cells + take / 2)
    if take + join / per <= budget or take <= 1:
        return take
    return take - 1


def prefill_spans(prompts: Sequence[Prompt], budget: int, *, rows: bool,
                  per_token: PerToken) -> dict[int, int]:
    """How many tokens of each prompt go in this step, by sequence: shortest first, up to
    `budget` in all. A short prompt that does not fit whole waits, once another prompt is
    in (a fragment of it earns nobody a token sooner); a long prompt's last chunk, beside
    running `rows`, may stop one token short (`last_chunk`)."""
    spans: dict[int, int] = {}
    for p in sorted(prompts, key=lambda p: p.pending):  # stable: ties keep their order
        if budget <= 0:
            break
        take = min(budget, p.pending)
        if spans and take < p.pending and p.short:
            continue
        if rows and take == p.pending and not p.short:
            take = last_chunk(take, budget, p.cells, per_token)
        spans[p.seq] = take
        budget -= take
    return spans


@dataclass(frozen=True)
class StepPolicy:
    """The scheduler's knobs, and the decisions that depend on them."""

    max_step_stall: float  # a running stream's gap between tokens, in normal steps (0: off)
    prefill_chunk: int  # prompt tokens per step at most (0: no cap but the batch)
    n_batch: int  # tokens one llama_decode takes
    parallel: int  # sequences

    def rows_may_wait(self, *, waited_s: float, prompt_tokens: int,
                      decode_s: Mapping[int, float], per_token: PerToken) -> bool:
        """Whether running rows can sit out one step while a short prompt of
        `prompt_tokens` tokens goes in alone, the longest-waiting row having waited
        `waited_s` since its last token; `decode_s`: a rows pass's measured seconds by row
        count.

        During a burst of chats this gets each new client its first token a whole rows
        pass sooner, while no running stream waits longer between two tokens than
        `max_step_stall` times a decode step of a full batch (or of the largest measured,
        or 10 ms a row before any)."""
        if self.max_step_stall <= 0:
            return False
        full = decode_s.get(self.parallel) or max(decode_s.values(),
                                                  default=0.01 * self.parallel)
        cost = prompt_tokens * per_token(prompt_tokens / 2)
        return waited_s + cost <= self.max_step_stall * full

    def prefill_budget(self, *, rows: int, shortest: int, rows_s: float, depth: float,
                       decode_s: Mapping[int, float], per_token: PerToken) -> int:
        """Prompt tokens this step may carry after a rows pass of `rows` sequences that
        took `rows_s`: as many as keep the gap between two tokens of a running stream
        (this prompt pass plus the next rows pass) within `max_step_stall` times its gap
        when nobody prefills (`decode_s[rows]`, else `rows_s`), so one client's long
        prompt delays the others by a bounded factor; at least MIN_PREFILL_CHUNK, or the
        whole `shortest` short prompt; capped by `prefill_chunk` and by the batch's room.
        `depth`: the cells the first prompt to advance already holds (deeper tokens cost
        more).

        The bound is taken against the rows pass as measured with no prompt work around
        it: after a prompt pass the same rows run 10–25% slower (the prompt's weights and
        cells have pushed theirs out of cache), and that slowdown counts against the
        budget because this step's own rows pass is subtracted as measured."""
        room = self.n_batch - rows
        if rows == 0:
            # A burst of short chats: one whole prompt per step, shortest first, so each
            # client gets its first token after its own prefill rather than everyone's.
            return shortest if 0 < shortest <= SHORT_PROMPT else room
        budget = room
        if self.max_step_stall > 0:
            plain = decode_s.get(rows, rows_s)
            seconds = self.max_step_stall * plain - rows_s
            allowed = seconds / per_token(depth)
            # Priced again at the middle of the chunk it allows.
            allowed = seconds / per_token(depth + allowed / 2)
            floor = shortest if 0 < shortest <= SHORT_PROMPT else MIN_PREFILL_CHUNK
            budget = max(floor, int(allowed))
        if self.prefill_chunk > 0:
            budget = min(budget, self.prefill_chunk)
        return min(budget, room)

    @property
    def embed_chunk(self) -> int:
        """Embedding tokens per pass while no generation runs: a prompt chunk's worth, so a
        request that arrives waits at most about one prompt chunk for its first step."""
        return self.prefill_chunk or self.n_batch

    def embed_budget(self, *, rows: int, rows_s: float, prompt_s: float, depth: float,
                     decode_s: Mapping[int, float], per_token: PerToken
                     ) -> tuple[int, float | None]:
        """Embedding tokens, and seconds, a step may spend after its rows pass (`rows`
        sequences, `rows_s`) and its prompt pass (`prompt_s`), the input under way being
        `depth` tokens in: as much as keeps the gap between two tokens of a running stream
        within `max_step_stall` times its gap when nobody prefills, as for a prompt; at
        least MIN_EMBED_CHUNK tokens, so that embeddings always advance; at most
        `embed_chunk`. With only prompts in the step, whose clients wait for a first
        token: that least, and no time. No stall bound: a chunk, and no time limit."""
        cap = self.embed_chunk
        if rows == 0:
            return MIN_EMBED_CHUNK, 0.0
        if self.max_step_stall <= 0:
            return cap, None
        plain = decode_s.get(rows, rows_s)
        seconds = self.max_step_stall * plain - rows_s - prompt_s
        allowed = seconds / per_token(depth)
        allowed = seconds / per_token(depth + max(0.0, allowed) / 2)
        return min(cap, max(MIN_EMBED_CHUNK, int(allowed))), max(0.0, seconds)
