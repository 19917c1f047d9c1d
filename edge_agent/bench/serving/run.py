"""The benchmark scenarios. Every figure is a median or percentile over several requests,
and every target is a ratio between peers measured in this same run on this machine; the
targets themselves are in `targets.py`."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from edge_agent.bench.serving.client_side import bench_client_side
from edge_agent.bench.serving.llama_server import bench_llama_server
from edge_agent.bench.serving.lookup import bench_lookup
from edge_agent.bench.serving.observability import (
    bench_governance,
    bench_ledger,
    bench_observability,
)
from edge_agent.bench.serving.peers import (
    EdgeAgentPeer,
    InProcessPeer,
    LlamaCppServerPeer,
    Sample,
    percentile,
)
from edge_agent.bench.serving.repeats import bench_repeats_and_contention
from edge_agent.bench.serving.schema_coverage import bench_schema_coverage
from edge_agent.bench.serving.structured import bench_structured
from edge_agent.bench.targets import report, target
from edge_agent.engine.models.catalog import ModelStore
from edge_agent.engine.runtime.llama import BatchContext, LlamaModel, resolve_flash_attn
from edge_agent.names import ModelName

Echo = Callable[[str], None]
# The worst step a long prompt's chunks may make, in normal steps: the chunked-prefill
# target, from which the least chunked TTFT follows (ChunkCost.floor).
STEP_STALL = target("chunked_prefill.worst_step_ratio").bound
TOPICS = ["a lighthouse keeper", "a bakery at dawn", "a lost umbrella", "the night train",
          "a garden robot", "a chess club", "a mountain village", "an old radio"]


class Peer(Protocol):
    name: str

    def chat(self, messages: list[dict[str, str]], max_tokens: int,
             extra: dict[str, Any] | None = None) -> Sample: ...

    def close(self) -> None: ...


def _ask(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a story about {TOPICS[i % len(TOPICS)]} "
                                        f"(request {i})."}]


@dataclass
class Load:
    peer: str
    concurrency: int
    samples: list[Sample]
    wall_s: float

    @property
    def tokens_per_s(self) -> float:
        return sum(s.tokens for s in self.samples) / self.wall_s

    @property
    def ttft_p50(self) -> float:
        return percentile([s.ttft_s for s in self.samples], 0.5)

    @property
    def ttft_p95(self) -> float:
        return percentile([s.ttft_s for s in self.samples], 0.95)

    @property
    def tpot_p50(self) -> float:
        return percentile([s.tpot_s for s in self.samples], 0.5)

    @property
    def delivered(self) -> str:
        return f"{sum(s.tokens for s in self.samples)}"

    def row(self) -> str:
        return (f"{self.peer:<34} c={self.concurrency:<2} {self.tokens_per_s:>8.1f} "
                f"{self.ttft_p50 * 1000:>9.0f} {self.ttft_p95 * 1000:>9.0f} "
                f"{self.tpot_p50 * 1000:>8.1f} {self.delivered:>8}")


def run_load(peer: Peer, concurrency: int, max_tokens: int, rounds: int,
             extra: dict[str, Any]) -> Load:
    """`rounds` bursts of `concurrency` simultaneous requests (at least 8 requests in all)."""
    return run_levels(peer, [concurrency], max_tokens, rounds, extra)[concurrency]


def _numbered(level: int, burst: int, i: int) -> int:
    """Request numbers apart per level: no level finds another's whole prompt cached."""
    return 1000 * level + burst * level + i


def run_levels(peer: Peer, levels: list[int], max_tokens: int, rounds: int,
               extra: dict[str, Any]) -> dict[int, Load]:
    """Bursts of each concurrency level, the levels taking turns (c=1, c=4, c=8, c=1, …),
    so that a machine that speeds up or slows down during the run (a shared host) moves
    every level alike and their ratios hold; at least `rounds` bursts and 8 requests per
    level."""
    need = {c: max(rounds, math.ceil(8 / c)) for c in levels}
    samples: dict[int, list[Sample]] = {c: [] for c in levels}
    wall = dict.fromkeys(levels, 0.0)
    with ThreadPoolExecutor(max_workers=max(levels)) as pool:
        for r in range(max(need.values())):
            for c in levels:
                if r >= need[c]:
                    continue
                start = time.perf_counter()
                futures = [pool.submit(peer.chat, _ask(_numbered(c, r, i)), max_tokens,
                                       extra) for i in range(c)]
                batch = [f.result() for f in futures]
                wall[c] += time.perf_counter() - start
                samples[c] += batch
    return {c: Load(peer.name, c, samples[c], wall[c]) for c in levels}


def _no_eos(path: Path) -> dict[str, Any]:
    """logit_bias that keeps a model from ending early, so every peer emits max_tokens."""
    model = LlamaModel(path, n_gpu_layers=0)
    try:
        eog = {t for t in range(model.n_vocab) if model.is_eog(t)}
    finally:
        model.close()
    return {"logit_bias": {str(t): -100 for t in sorted(eog)}}


def bench_single(state_dir: Path, path: Path, model: str, *, threads: int, context: int,
                 requests: int, max_tokens: int, extra: dict[str, Any], echo: Echo
                 ) -> dict[str, Any]:
    """Single stream through HTTP vs in-process, alternating requests."""
    edge = EdgeAgentPeer(state_dir, model, threads=threads, context=context, parallel=1)
    local = InProcessPeer(path, threads, context)
    served, inproc = [], []
    try:
        edge.chat(_ask(0), 8)
        local.chat(_ask(0), 8)
        for i in range(requests):
            served.append(edge.chat(_ask(i), max_tokens, extra))
            inproc.append(local.chat(_ask(i), max_tokens, extra))
    finally:
        edge.close()
        local.close()
    a = Load("edge-agent (HTTP, streamed)", 1, served, sum(s.arrivals[-1] - s.start
                                                          for s in served))
    b = Load("llama-cpp-python in-process", 1, inproc, sum(s.arrivals[-1] - s.start
                                                          for s in inproc))
    tps = [1 / s.tpot_s for s in served], [1 / s.tpot_s for s in inproc]
    ratio_tps = statistics.median(tps[0]) / statistics.median(tps[1])
    ratio_ttft = a.ttft_p50 / b.ttft_p50
    echo(f"single stream (median of {requests} requests, {max_tokens} tokens)")
    echo(f"  {'peer':<32} {'decode tok/s':>12} {'TTFT ms':>8} {'TPOT ms':>8}")
    for load, t in ((a, tps[0]), (b, tps[1])):
        echo(f"  {load.peer:<32} {statistics.median(t):>12.1f} {load.ttft_p50 * 1000:>8.1f} "
             f"{load.tpot_p50 * 1000:>8.2f}")
    report(echo, "single.tokens_per_s_ratio", ratio_tps)
    report(echo, "single.ttft_ratio", ratio_ttft)
    return {"tokens_per_s_ratio": ratio_tps, "ttft_ratio": ratio_ttft,
            "edge_tokens_per_s": statistics.median(tps[0]),
            "in_process_tokens_per_s": statistics.median(tps[1])}


@contextmanager
def _engine(path: Path, threads: int, flash_attn: str, *, n_seq: int, n_ctx_seq: int
            ) -> Iterator[tuple[LlamaModel, BatchContext]]:
    """The model and a batch context, for figures of llama.cpp alone."""
    model = LlamaModel(path, n_gpu_layers=0)
    try:
        ctx = BatchContext(model, n_seq=n_seq, n_ctx_seq=n_ctx_seq, n_batch=512,
                           n_threads=threads, flash_attn=resolve_flash_attn(flash_attn))
        try:
            yield model, ctx
        finally:
            ctx.close()
    finally:
        model.close()


def _fill(ctx: BatchContext, seqs: Iterable[int], tokens: list[int], start: int) -> None:
    """Prefill `tokens` at `start` into each of `seqs`, one pass each."""
    for seq in seqs:
        ctx.batch.clear()
        ctx.batch.add_span(tokens, start, seq, last_logits=True)
        ctx.decode()


def _step(ctx: BatchContext, seqs: Iterable[int], token: int, pos: int) -> None:
    """One decode step: `token` at `pos` for every one of `seqs`, in one pass."""
    ctx.batch.clear()
    for seq in seqs:
        ctx.batch.add(token, pos, seq, True)
    ctx.decode()


def engine_scaling(path: Path, *, threads: int, rows: int, steps: int = 48) -> float:
    """Decode tokens/s of llama.cpp alone with `rows` sequences per step over one: the
    ceiling for what batching can add on this machine, whatever the server does. The two
    take turns in blocks of 8 steps, as the load levels do."""
    # Sequences 0..rows-1 decode together; sequence `rows` decodes alone.
    groups = {1: [rows], rows: list(range(rows))}
    spent = dict.fromkeys(groups, 0.0)
    with _engine(path, threads, "auto", n_seq=rows + 1, n_ctx_seq=256) as (model, ctx):
        prompt = model.tokenize(" ".join(TOPICS), add_special=True, parse_special=False)
        _fill(ctx, range(rows + 1), prompt, 0)
        for block in range(0, steps, 8):
            for n, seqs in groups.items():
                start = time.perf_counter()
                for step in range(block, min(block + 8, steps)):
                    _step(ctx, seqs, prompt[step % len(prompt)], len(prompt) + step)
                spent[n] += time.perf_counter() - start
    return (rows * steps / spent[rows]) / (steps / spent[1])


def request_scaling(path: Path, *, threads: int, rows: int, tokens: int, prefill: int,
                    cached: int, rounds: int = 3) -> float:
    """Aggregate tokens/s of llama.cpp alone serving `rows` requests at once over serving
    one, for requests shaped like the load levels': `prefill` new prompt tokens after
    `cached` reused ones, then `tokens` - 1 decode steps. The prompts go in one per pass,
    as the server puts a burst's prompts in. No HTTP, no sampling, no ramp. Batching speeds
    up the decode steps only; a prompt costs as much at c=8 as at c=1, which holds this
    below the decode-only ratio. (A server's own per-request costs weigh more at c=1, so
    its ratio may land a little above this one.)"""
    spent = {1: 0.0, rows: 0.0}
    cells = 256 * math.ceil((cached + prefill + tokens) / 256)
    with _engine(path, threads, "auto", n_seq=rows + 1, n_ctx_seq=cells) as (model, ctx):
        text = " ".join(TOPICS * (1 + (cached + prefill) // 8))
        base = model.tokenize(text, add_special=True, parse_special=False)[: cached + prefill]
        if cached:
            _fill(ctx, range(rows + 1), base[:cached], 0)
        groups = {1: [rows], rows: list(range(rows))}
        for _ in range(rounds):
            for n, seqs in groups.items():
                start = time.perf_counter()
                for seq in seqs:
                    ctx.keep_prefix(seq, cached)
                _fill(ctx, seqs, base[cached:], cached)
                for step in range(tokens - 1):
                    _step(ctx, seqs, base[step % len(base)], cached + prefill + step)
                spent[n] += time.perf_counter() - start
    return (rows / spent[rows]) / (1 / spent[1])


@dataclass
class ChunkCost:
    """What chunked prefill costs in llama.cpp alone, beside running streams."""

    cost: float  # the prompt in small chunks over the prompt in 512-token passes
    slowdown: float  # a rows pass right after a chunk over one after another rows pass

    def floor(self, stall: float | None = None) -> float:
        """The least chunked / unchunked TTFT that steps held to `stall` x a normal step
        (by default the worst-step target) allow: each step keeps one rows pass (slowed by
        the chunk before it), so the prompt gets at most (stall - slowdown) / stall of the
        time, at `cost` a token."""
        stall = STEP_STALL if stall is None else stall
        return self.cost * stall / (stall - self.slowdown)


def chunk_cost(path: Path, text: str, *, threads: int, flash_attn: str, chunk: int,
               rows: int = 7, repeats: int = 2) -> ChunkCost:
    """Prefill `text` in 512-token passes, then in `chunk`-token pieces each followed by a
    pass of `rows` decoding sequences, as the scheduler interleaves them; then the same
    rows passes back to back."""
    spent = {512: 0.0, chunk: 0.0}
    plain: list[float] = []
    after: list[float] = []
    with _engine(path, threads, flash_attn, n_seq=rows + 1, n_ctx_seq=2048) as (model, ctx):
        tokens = model.tokenize(text, add_special=True, parse_special=False)
        short = model.tokenize(" ".join(TOPICS), add_special=True, parse_special=False)
        _fill(ctx, range(1, rows + 1), short, 0)
        pos = len(short)

        def rows_pass() -> float:
            nonlocal pos
            began = time.perf_counter()
            _step(ctx, range(1, rows + 1), short[pos % len(short)], pos)
            pos += 1
            return time.perf_counter() - began

        for _ in range(repeats):
            for size in spent:
                ctx.clear(0)
                for i in range(0, len(tokens), size):
                    ctx.batch.clear()
                    ctx.batch.add_span(tokens[i : i + size], i, 0,
                                       last_logits=i + size >= len(tokens))
                    began = time.perf_counter()
                    ctx.decode()
                    spent[size] += time.perf_counter() - began
                    if size == chunk:
                        after.append(rows_pass())
            rows_pass()
            plain += [rows_pass() for _ in range(16)]
    return ChunkCost(spent[chunk] / spent[512],
                     statistics.median(after) / statistics.median(plain))


DEEP_DEPTHS = (64, 1000, 1800)
DEEP_ROWS = {1: "1 row", 8: "8 rows"}


def deep_decode_cost(path: Path, *, threads: int, flash_attn: str, rows: int,
                     depths: tuple[int, ...] = DEEP_DEPTHS, steps: int = 8
                     ) -> dict[int, float]:
    """Seconds a decode step of `rows` sequences takes with each sequence `depth` cells
    deep, for each of `depths` (median of `steps` steps), in llama.cpp alone: where a long
    chat's tokens go on a CPU, whose flash-attention kernel reads every cell once per row."""
    cells = 256 * math.ceil((max(depths) + steps) / 256)
    out: dict[int, float] = {}
    with _engine(path, threads, flash_attn, n_seq=rows, n_ctx_seq=cells) as (model, ctx):
        text = model.tokenize(" ".join(TOPICS), add_special=False, parse_special=False)
        tokens = (text * (1 + max(depths) // len(text)))[: max(depths)]
        filled = 0
        for depth in sorted(depths):
            for start in range(filled, depth, 512):
                _fill(ctx, range(rows), tokens[start : min(depth, start + 512)], start)
            filled = depth
            spent = []
            for step in range(steps):
                began = time.perf_counter()
                _step(ctx, range(rows), tokens[step], depth)
                spent.append(time.perf_counter() - began)
                for seq in range(rows):  # the step's cell goes: the next is as deep
                    ctx.keep_prefix(seq, depth)
            out[depth] = statistics.median(spent)
    return out


def bench_concurrency(state_dir: Path, path: Path, model: str, *, threads: int, context: int,
                      levels: list[int], max_tokens: int, rounds: int, peers: bool,
                      extra: dict[str, Any], echo: Echo) -> dict[str, Any]:
    results: dict[str, dict[int, Load]] = {}
    makers: list[tuple[str, Callable[[], Any]]] = [
        ("edge-agent", lambda: EdgeAgentPeer(state_dir, model, threads=threads,
                                             context=context, parallel=max(levels)))]
    if peers:
        makers += [
            ("peer-no-interrupt", lambda: LlamaCppServerPeer(
                path, model, threads=threads, context=context * max(levels), interrupt=False)),
            ("peer-default", lambda: LlamaCppServerPeer(
                path, model, threads=threads, context=context * max(levels), interrupt=True)),
        ]
    echo(f"concurrency (bursts of c requests, >= {rounds} bursts and >= 8 requests per "
         f"level, {max_tokens} tokens each)")
    echo(f"  {'peer':<34} {'':4} {'agg tok/s':>8} {'TTFT p50':>9} {'TTFT p95':>9} "
         f"{'TPOT p50':>8} {'tokens':>8}")
    for key, make in makers:
        peer = make()
        try:
            peer.chat(_ask(-1), 4)  # warm-up, on a prompt the runs do not use
            results[key] = run_levels(peer, levels, max_tokens, rounds, extra)
        finally:
            peer.close()
        for c in levels:
            echo("  " + results[key][c].row())
    edge = results["edge-agent"]
    top, one = max(levels), min(levels)
    out: dict[str, Any] = {"edge_agent": {c: {"tokens_per_s": r.tokens_per_s,
                                              "ttft_p50_ms": r.ttft_p50 * 1000,
                                              "ttft_p95_ms": r.ttft_p95 * 1000,
                                              "tpot_p50_ms": r.tpot_p50 * 1000}
                                          for c, r in edge.items()}}
    scale = edge[top].tokens_per_s / edge[one].tokens_per_s
    report(echo, "concurrency.scale", scale, top=top, one=one)
    ceiling = engine_scaling(path, threads=threads, rows=top)
    echo(f"  {'  the same ratio for llama.cpp alone, decode steps only':<62} "
         f"{ceiling:>7.2f}x")
    prefill = round(statistics.median(s.prompt_tokens - s.cached_tokens
                                      for s in edge[top].samples))
    cached = round(statistics.median(s.cached_tokens for s in edge[top].samples))
    shaped = request_scaling(path, threads=threads, rows=top, tokens=max_tokens,
                             prefill=max(1, prefill), cached=cached)
    echo(f"  {f'  llama.cpp alone on these requests ({prefill} new prompt tokens)':<62} "
         f"{shaped:>7.2f}x  no HTTP, no sampling")
    ttft = edge[top].ttft_p50 / edge[one].ttft_p50
    report(echo, "concurrency.ttft_growth", ttft, top=top, one=one)
    out.update(scale=scale, engine_scale=ceiling, request_scale=shaped,
               ttft_growth=ttft)
    if peers:
        vs = edge[top].tokens_per_s / results["peer-no-interrupt"][top].tokens_per_s
        report(echo, "concurrency.vs_peer", vs, top=top)
        cut = results["peer-default"][top]
        asked = len(cut.samples) * max_tokens
        echo(f"  peer with defaults at c={top}: {cut.delivered} of {asked} tokens delivered "
             "(it interrupts running streams)")
        out["vs_peer"] = vs
    return out


def bench_prefix(state_dir: Path, model: str, *, threads: int, context: int, echo: Echo
                 ) -> dict[str, Any]:
    system = {"role": "system", "content": " ".join(
        f"Rule {i}: be kind to customers in aisle {i} and mention offer {i * 7}."
        for i in range(60))}
    peer = EdgeAgentPeer(state_dir, model, threads=threads, context=context, parallel=4)
    try:
        cold = peer.chat([system, {"role": "user", "content": "Where is the milk?"}], 4)
        warm = [peer.chat([system, {"role": "user", "content": f"Question {i}?"}], 4)
                for i in range(5)]
    finally:
        peer.close()
    ratio = statistics.median(s.ttft_s for s in warm) / cold.ttft_s
    echo(f"prefix reuse (system prompt of ~{warm[0].cached_tokens} cached tokens)")
    echo(f"  cold TTFT {cold.ttft_s * 1000:.0f} ms, warm TTFT p50 "
         f"{statistics.median(s.ttft_s for s in warm) * 1000:.0f} ms")
    report(echo, "prefix.ratio", ratio)
    return {"ratio": ratio, "cached_tokens": warm[0].cached_tokens}


def _prefill_under_load(peer: EdgeAgentPeer, extra: dict[str, Any], long_prompt: str
                        ) -> tuple[float, float, float]:
    """7 streams decoding; a long prompt arrives. (normal step, worst step, its TTFT)."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        runners = [pool.submit(peer.chat, _ask(i), 220, extra) for i in range(7)]
        time.sleep(1.5)
        arrived = time.perf_counter()
        newcomer = pool.submit(peer.chat, [{"role": "user", "content": long_prompt}], 4)
        probe = newcomer.result()
        streams = [f.result() for f in runners]
    first = probe.arrivals[0] if probe.arrivals else time.perf_counter()
    gaps_before, gaps_during = [], []
    for s in streams:
        for a, b in zip(s.arrivals, s.arrivals[1:], strict=False):
            if b < arrived:
                gaps_before.append(b - a)
            elif a <= first:
                gaps_during.append(b - a)
    return statistics.median(gaps_before), max(gaps_during or [0.0]), probe.ttft_s


def bench_chunked_prefill(state_dir: Path, path: Path, model: str, *, threads: int,
                          context: int, extra: dict[str, Any], echo: Echo) -> dict[str, Any]:
    long_prompt = " ".join(f"Item {i} costs {i * 3} euros and sits on shelf {i % 9}."
                           for i in range(80)) + " Which item is cheapest?"
    echo("chunked prefill (7 streams decoding, a ~1,000-token prompt arrives)")
    out: dict[str, Any] = {}
    deeps: dict[str, dict[int, dict[int, float]]] = {}  # flash_attn -> rows -> depth -> s
    # The default, then flash attention off: on a CPU that makes prompt chunks deep in
    # a context much cheaper (see RuntimeSettings.flash_attn).
    for flash_attn in ("auto", "off"):
        figures = {}
        for label, unchunked in (("chunked", False), ("unchunked", True)):
            kwargs: dict[str, Any] = {"flash_attn": flash_attn}
            if unchunked:
                kwargs.update(prefill_chunk=0, max_step_stall=0)
            peer = EdgeAgentPeer(state_dir, model, threads=threads, context=context,
                                 parallel=8, **kwargs)
            try:
                peer.chat(_ask(-1), 4)
                figures[label] = _prefill_under_load(peer, extra, long_prompt)
            finally:
                peer.close()
        normal, worst, ttft = figures["chunked"]
        echo(f"  flash_attn = {flash_attn}: normal step {normal * 1000:.0f} ms; worst step "
             f"while it prefills {worst * 1000:.0f} ms chunked, "
             f"{figures['unchunked'][1] * 1000:.0f} ms unchunked; its TTFT "
             f"{ttft * 1000:.0f} ms chunked, {figures['unchunked'][2] * 1000:.0f} ms unchunked")
        stall = worst / normal
        slow = ttft / figures["unchunked"][2]
        report(echo, "chunked_prefill.worst_step_ratio", stall, flash_attn=flash_attn)
        report(echo, "chunked_prefill.ttft_ratio", slow, flash_attn=flash_attn)
        cost = chunk_cost(path, long_prompt, threads=threads, flash_attn=flash_attn, chunk=16)
        echo(f"    llama.cpp alone: the prompt in 16-token chunks costs {cost.cost:.2f}x its "
             f"cost in 512-token passes; 7 rows run {cost.slowdown:.2f}x slower after a chunk")
        echo(f"    so with every step at exactly {STEP_STALL:g}x, the TTFT could be no less "
             f"than {cost.floor():.2f}x")
        deep = deeps[flash_attn] = {
            rows: deep_decode_cost(path, threads=threads, flash_attn=flash_attn, rows=rows)
            for rows in DEEP_ROWS}
        for rows, by_depth in deep.items():
            echo(f"    a decode step of {DEEP_ROWS[rows]}, cells deep: "
                 + ", ".join(f"{depth:,} {cost * 1000:.1f} ms"
                             for depth, cost in by_depth.items()))
        out[flash_attn] = {"worst_step_ratio": stall, "ttft_ratio": slow,
                           "chunk_cost_ratio": cost.cost, "rows_slowdown": cost.slowdown,
                           "ttft_floor": cost.floor(),
                           "deep_decode_s": {str(r): d for r, d in deep.items()}}
    for rows, label in DEEP_ROWS.items():
        on, off = deeps["auto"][rows], deeps["off"][rows]
        echo(f"  flash_attn off / auto, a decode step of {label}: "
             + ", ".join(f"{depth:,} deep {off[depth] / on[depth]:.2f}x" for depth in on))
    return out


def bench_correctness(state_dir: Path, model: str, *, threads: int, context: int,
                      echo: Echo) -> dict[str, Any]:
    echo("batched vs solo at temperature 0 (8 requests, 48 tokens)")
    out = {}
    for deterministic in (False, True):
        # Without guesses from the solo answers (`answer_drafts`): the burst's own text.
        peer = EdgeAgentPeer(state_dir, model, threads=threads, context=context, parallel=8,
                             deterministic=deterministic, answer_drafts=0)
        try:
            # The same 8 prompts as the burst below, one at a time first.
            solo = [peer.chat(_ask(_numbered(8, 0, i)), 48).text for i in range(8)]
            load = run_load(peer, 8, 48, 1, {})
        finally:
            peer.close()
        batched = [s.text for s in load.samples]
        matches = sum(a == b for a, b in zip(solo, batched, strict=True))
        label = "deterministic = true" if deterministic else "default"
        echo(f"  {label:<22} {matches}/8 identical; c=8 aggregate {load.tokens_per_s:.1f} "
             "tok/s")
        out[label] = {"matches": matches, "tokens_per_s": load.tokens_per_s}
    cost = out["deterministic = true"]["tokens_per_s"] / out["default"]["tokens_per_s"]
    echo(f"  deterministic mode throughput: {cost:.2f}x of default")
    return out


def run_llama_server_bench(state_dir: Path, model: ModelName, binary: Path, *, threads: int,
                           context: int, rounds: int, echo: Echo,
                           client_side_only: bool = False, repeats_only: bool = False
                           ) -> dict[str, Any]:
    """The llama-server comparison alone (`edge-agent bench llama-server BINARY`), or only
    its client-side section (`--client-side`), or only that section's cases where clients
    repeat themselves and beside other work (`--repeats`)."""
    store = ModelStore(state_dir)
    if not store.is_installed(model):
        store.pull(model)
    info = store.get(model)
    path = info.blob_path(state_dir)
    echo(f"edge-agent bench llama-server: {info.name} ({info.quantization}, "
         f"sha256:{info.digest[:12]}), {threads} threads")
    if repeats_only:
        return {"model": info.name, "threads": threads, "llama_server": {"client_side": {
            "repeats": bench_repeats_and_contention(state_dir, path, info.name, binary,
                                                    threads=threads, extra=_no_eos(path),
                                                    echo=echo, rounds=rounds)}}}
    if client_side_only:
        side = bench_client_side(state_dir, path, info.name, binary, threads=threads,
                                 extra=_no_eos(path), echo=echo, rounds=rounds)
        side["repeats"] = bench_repeats_and_contention(
            state_dir, path, info.name, binary, threads=threads, extra=_no_eos(path),
            echo=echo, rounds=rounds)
        return {"model": info.name, "threads": threads,
                "llama_server": {"client_side": side}}
    return {"model": info.name, "threads": threads, "llama_server": bench_llama_server(
        state_dir, path, info.name, binary, threads=threads, context=context,
        extra=_no_eos(path), echo=echo, rounds=rounds)}


def run_schema_coverage_bench(state_dir: Path, model: ModelName, *, threads: int,
                              context: int, echo: Echo, llama_server: Path | None = None,
                              per_category: int | None = None,
                              categories: tuple[str, ...] = (), parallel: int = 4
                              ) -> dict[str, Any]:
    """The structured-coverage section alone (`edge-agent bench structured-coverage`)."""
    store = ModelStore(state_dir)
    if not store.is_installed(model):
        store.pull(model)
    info = store.get(model)
    echo(f"edge-agent bench structured-coverage: {info.name} ({info.quantization}, "
         f"sha256:{info.digest[:12]}), {threads} threads")
    return {"model": info.name, "threads": threads,
            "structured_coverage": bench_schema_coverage(
                state_dir, info.name, threads=threads, context=context, echo=echo,
                model_path=info.blob_path(state_dir), llama_server=llama_server,
                per_category=per_category, categories=categories, parallel=parallel)}


def run_bench(state_dir: Path, model: ModelName, *, levels: list[int], requests: int,
              max_tokens: int, threads: int, context: int, peers: bool, echo: Echo,
              llama_server: Path | None = None) -> dict[str, Any]:
    store = ModelStore(state_dir)
    if not store.is_installed(model):
        store.pull(model)
    info = store.get(model)
    path = info.blob_path(state_dir)
    extra = _no_eos(path)
    echo(f"edge-agent bench: {info.name} ({info.quantization}, sha256:{info.digest[:12]}), "
         f"{threads} threads")
    result: dict[str, Any] = {"model": info.name, "threads": threads}
    result["single"] = bench_single(state_dir, path, info.name, threads=threads,
                                    context=context, requests=requests,
                                    max_tokens=max_tokens, extra=extra, echo=echo)
    result["concurrency"] = bench_concurrency(
        state_dir, path, info.name, threads=threads, context=context, levels=levels,
        max_tokens=64, rounds=3, peers=peers, extra=extra, echo=echo)
    result["prefix"] = bench_prefix(state_dir, info.name, threads=threads, context=context,
                                    echo=echo)
    result["structured"] = bench_structured(state_dir, info.name, threads=threads,
                                            context=context, extra=extra, echo=echo)
    result["lookup"] = bench_lookup(state_dir, info.name, threads=threads, context=context,
                                   extra=extra, echo=echo)
    result["structured_coverage"] = bench_schema_coverage(
        state_dir, info.name, threads=threads, context=context, echo=echo, model_path=path,
        llama_server=llama_server)
    if llama_server is not None:
        result["llama_server"] = bench_llama_server(state_dir, path, info.name, llama_server,
                                                    threads=threads, context=context,
                                                    extra=extra, echo=echo)
    result["chunked_prefill"] = bench_chunked_prefill(state_dir, path, info.name,
                                                      threads=threads,
                                                      context=context, extra=extra, echo=echo)
    result["correctness"] = bench_correctness(state_dir, info.name, threads=threads,
                                              context=context, echo=echo)
    result["telemetry"] = bench_observability(state_dir, info.name, threads=threads,
                                              context=context, echo=echo)
    result["ledger"] = bench_ledger(echo)
    result["governance"] = bench_governance(state_dir, info.name, threads=threads,
                                            context=context, echo=echo)
    return result
