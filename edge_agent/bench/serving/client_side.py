"""Speed as a client measures it: edge-agent on its default settings against llama.cpp's
own server as a box would run it (`llama-server -np 8 -c 16384`, the same threads, file
and weight layouts), asked the way an app asks: the official client's shape of request, a
short order-taking prompt, `max_tokens` 64 (end-of-generation biased away, so both write
64), temperature 0 and 0.7 with a seed per request, streamed and not, at c=1 (plain text
and the order's JSON schema) and c=8 (16 plain requests, 8 at a time), the servers taking
turns case by case.

The figure is what the app gets: completion tokens (`usage`) over each request's wall
time, prompt and HTTP included; a case's ratio is edge-agent's median over
llama-server's, per round, and the bench prints the median of the rounds with their range.
Where each request's time went:

- streamed: before the first token, decoding (first to last token) and after the last
  token (to the end of the response), as the client sees them arrive;
- not streamed: the server's own prompt and decoding time (edge-agent's `Server-Timing`,
  llama-server's `timings`), and the rest of the wall time: queueing, parsing and
  validation, the template and tokenizing, encoding the answer, the wake-ups between the
  event loop and the scheduler, the HTTP exchange.

And where each server's CPU went, per request (Linux's per-thread counters): its engine's
threads (the `threads` busiest: llama.cpp's compute threads, the calling one with the
sampling and the scheduling around each pass) and everything else (HTTP, the event loop,
the ledger), with the cores the process kept busy. Where both keep every core busy, the
engine CPU a request is what bounds the ratio: a server can answer only as much faster
as it spends less CPU on the same tokens, whatever its batching does with them. At c=8
the section also prints the aggregate: completion tokens over each round's wall time.
"""

from __future__ import annotations

import os
import re
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from edge_agent.bench.serving.peers import EdgeAgentPeer, HttpPeer, LlamaServerPeer, sse_chunks
from edge_agent.bench.serving.structured import ORDER_SCHEMA
from edge_agent.bench.targets import report

Echo = Callable[[str], None]
MAX_TOKENS = 64
SLOTS = 8  # llama-server's -np, and the c=8 concurrency
CONTEXT = 2048  # llama-server's context per slot (-c 16384 over 8)
_TIMING = re.compile(r"(\w+);dur=([0-9.]+)")


@dataclass(frozen=True)
class Case:
    kind: str  # "plain" or "schema"
    temperature: float
    stream: bool
    concurrency: int

    @property
    def requests(self) -> int:
        return 3 if self.concurrency == 1 else 2 * self.concurrency

    @property
    def label(self) -> str:
        way = "stream" if self.stream else "whole"
        return f"{self.kind} c={self.concurrency} t={self.temperature:g} {way}"


CASES = tuple(Case(kind, t, stream, 1) for kind in ("plain", "schema")
              for t in (0.0, 0.7) for stream in (False, True)) + \
    tuple(Case("plain", t, stream, SLOTS) for t in (0.0, 0.7) for stream in (False, True))


@dataclass(frozen=True)
class Timed:
    """One request as its client saw it: wall time, completion tokens, and the three parts
    of the wall time (ms) described in the module's docstring."""

    wall_s: float
    tokens: int
    before_ms: float
    decode_ms: float
    after_ms: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of process `pid`, from Linux's scheduler statistics
    (nanoseconds on a CPU; `stat`'s clock ticks where there are none); {} where there is
    no /proc (not Linux, or the process is gone)."""
    out: dict[int, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            out[int(tid)] = _ran_s(f"/proc/{pid}/task/{tid}")
        except OSError:  # the thread ended meanwhile
            continue
    return out


def _ran_s(task: str) -> float:
    try:
        with open(f"{task}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except FileNotFoundError:  # a kernel without schedstats
        with open(f"{task}/stat") as f:
            stat = f.read()
        fields = stat[stat.rindex(")") + 2 :].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class CpuUse:
    """A server's CPU over some runs of a case: wall seconds, CPU seconds of its engine's
    threads and of the rest, and the requests they served."""

    wall_s: float = 0.0
    engine_s: float = 0.0
    other_s: float = 0.0
    requests: int = 0

    def add(self, before: dict[int, float], after: dict[int, float], wall_s: float,
            requests: int, engine_threads: int) -> None:
        used = sorted((after[t] - before.get(t, 0.0) for t in after), reverse=True)
        self.engine_s += sum(used[:engine_threads])
        self.other_s += sum(used[engine_threads:])
        self.wall_s += wall_s
        self.requests += requests

    @property
    def cores(self) -> float:
        """The cores the process kept busy, on average."""
        return (self.engine_s + self.other_s) / self.wall_s if self.wall_s else 0.0

    def per_request_ms(self) -> tuple[float, float]:
        """(engine, other) CPU milliseconds a request."""
        n = max(1, self.requests)
        return 1000 * self.engine_s / n, 1000 * self.other_s / n


def order(i: int) -> list[dict[str, str]]:
    """A short order-taking exchange (about 40 prompt tokens), different per request."""
    return [{"role": "system", "content": "You take orders at a bakery counter. Answer "
                                          "briefly."},
            {"role": "user", "content": f"Order {i}: two croissants, {i % 5 + 1} rolls and "
                                        "a coffee to go, please."}]


def _body(peer: HttpPeer, case: Case, i: int, extra: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": peer.model, "messages": order(i),
                            "max_tokens": MAX_TOKENS, "temperature": case.temperature,
                            "seed": i, "stream": case.stream, **extra}
    if case.stream:
        body["stream_options"] = {"include_usage": True}
    if case.kind == "schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "order", "schema": ORDER_SCHEMA}}
    return body


def ask(client: httpx.Client, body: dict[str, Any]) -> Timed:
    """One request, timed as the client sees it. A connection the server closed after a
    stream (llama-server does) and the pool handed out again fails before anything is
    sent back: the request is sent once more, on a new one, as a client library does."""
    try:
        return _ask(client, body)
    except httpx.RemoteProtocolError:
        return _ask(client, body)


def _ask(client: httpx.Client, body: dict[str, Any]) -> Timed:
    start = time.perf_counter()
    if not body["stream"]:
        r = client.post("/v1/chat/completions", json=body,
                        headers={"Authorization": "Bearer bench"})
        r.raise_for_status()
        wall = time.perf_counter() - start
        data = r.json()
        prompt_ms, decode_ms = _server_times(r.headers, data)
        return Timed(wall, data["usage"]["completion_tokens"], prompt_ms, decode_ms,
                     wall * 1000 - prompt_ms - decode_ms)
    first = last = 0.0
    tokens = chunks = 0
    for chunk in sse_chunks(client, body, {"Authorization": "Bearer bench"}):
        if chunk.get("usage"):
            tokens = chunk["usage"].get("completion_tokens") or tokens
        choices = chunk.get("choices") or []
        if choices and choices[0].get("delta", {}).get("content"):
            last = time.perf_counter()
            first = first or last
            chunks += 1
    end = time.perf_counter()
    first, last = first or end, last or end
    return Timed(end - start, tokens or chunks, (first - start) * 1000,
                 (last - first) * 1000, (end - last) * 1000)


def _server_times(headers: httpx.Headers, data: dict[str, Any]) -> tuple[float, float]:
    """(prompt ms, decoding ms) as the server reports them: edge-agent's Server-Timing
    header, llama-server's `timings`."""
    timing = dict(_TIMING.findall(headers.get("server-timing", "")))
    if timing:
        return float(timing.get("prompt", 0)), float(timing.get("decode", 0))
    t = data.get("timings") or {}
    return float(t.get("prompt_ms", 0)), float(t.get("predicted_ms", 0))


def _run(peer: HttpPeer, case: Case, base: int, extra: dict[str, Any],
         pool: ThreadPoolExecutor) -> list[Timed]:
    bodies = [_body(peer, case, base + i, extra) for i in range(case.requests)]
    if case.concurrency == 1:
        return [ask(peer.client, b) for b in bodies]
    return list(pool.map(lambda b: ask(peer.client, b), bodies))


@dataclass
class Round:
    """One peer's requests of one case in one round, and the round's wall time."""

    timed: list[Timed]
    wall_s: float

    @property
    def aggregate(self) -> float:
        """Completion tokens over the round's wall time."""
        return sum(t.tokens for t in self.timed) / self.wall_s


def _measured(peer: HttpPeer, case: Case, base: int, extra: dict[str, Any],
              pool: ThreadPoolExecutor, cpu: CpuUse, threads: int) -> Round:
    """`_run`, with the round's wall time and the server's CPU over it."""
    pid = peer.proc.pid
    before = thread_cpu(pid)
    start = time.perf_counter()
    timed = _run(peer, case, base, extra, pool)
    wall = time.perf_counter() - start
    cpu.add(before, thread_cpu(pid), wall, len(timed), threads)
    return Round(timed, wall)


def bench_client_side(state_dir: Path, path: Path, model: str, binary: Path, *,
                      threads: int, extra: dict[str, Any], echo: Echo, rounds: int = 5
                      ) -> dict[str, Any]:
    peers: dict[str, HttpPeer] = {}
    # per case, per peer, per round: that round's requests
    timed: dict[Case, dict[str, list[Round]]] = {}
    cpu: dict[Case, dict[str, CpuUse]] = {}
    try:
        peers["edge-agent"] = EdgeAgentPeer(state_dir, model, threads=threads,
                                            context=4096, parallel="auto")
        # Its weight layouts as edge-agent's: --no-repack where edge-agent turns llama.cpp's
        # extra CPU buffers off (a CPU with AMX), as on the box the figures came from.
        peers["llama-server"] = LlamaServerPeer(binary, path, model, threads=threads,
                                                context=CONTEXT, parallel=SLOTS)
        timed = {case: {name: [] for name in peers} for case in CASES}
        cpu = {case: {name: CpuUse() for name in peers} for case in CASES}
        with ThreadPoolExecutor(max_workers=SLOTS) as pool:
            for peer in peers.values():  # warm-up: each case's first parse and grammar
                for case in CASES:
                    ask(peer.client, _body(peer, case, -1, extra))
            for r in range(rounds):
                for n, case in enumerate(CASES):
                    base = 20_000 + 1000 * r + 50 * n
                    names = list(peers) if (r + n) % 2 == 0 else list(peers)[::-1]
                    for name in names:  # who goes first alternates
                        timed[case][name].append(_measured(
                            peers[name], case, base, extra, pool, cpu[case][name], threads))
    finally:
        for peer in peers.values():
            peer.close()
    out = _summary({case: {name: [r.timed for r in series] for name, series in by.items()}
                    for case, by in timed.items()}, rounds, echo)
    _aggregates(timed, out, echo)
    _cpu_summary(cpu, out, echo)
    return out



def _aggregates(timed: dict[Case, dict[str, list[Round]]], out: dict[str, Any], echo: Echo
                ) -> None:
    """At c=8: completion tokens over each round's wall time, edge-agent's over
    llama-server's, per round (median and range)."""
    for case, by_peer in timed.items():
        if case.concurrency == 1:
            continue
        ratios = [e.aggregate / s.aggregate
                  for e, s in zip(by_peer["edge-agent"], by_peer["llama-server"], strict=True)]
        rate = {name: statistics.median(r.aggregate for r in series)
                for name, series in by_peer.items()}
        echo(f"  {case.label:<26} aggregate {rate['edge-agent']:.1f} vs "
             f"{rate['llama-server']:.1f} tok/s: {statistics.median(ratios):.2f}x "
             f"({min(ratios):.2f}-{max(ratios):.2f})")
        out[case.label].update(aggregate_ratio=statistics.median(ratios),
                               aggregate_rounds=ratios, edge_aggregate=rate["edge-agent"],
                               llama_aggregate=rate["llama-server"])


def _cpu_summary(cpu: dict[Case, dict[str, CpuUse]], out: dict[str, Any], echo: Echo
                 ) -> None:
    """Per case: each server's engine and other CPU a request, the cores it kept busy, and
    llama-server's engine CPU a request over edge-agent's (the ratio's bound where both
    keep every core busy)."""
    echo("  CPU a request, ms: engine threads + the rest (cores busy); llama-server's engine "
         "CPU / edge-agent's")
    for case, by_peer in cpu.items():
        edge, llama = by_peer["edge-agent"], by_peer["llama-server"]
        if not edge.requests or not llama.requests or not edge.engine_s:
            continue
        (ee, eo), (le, lo) = edge.per_request_ms(), llama.per_request_ms()
        bound = le / ee
        echo(f"  {case.label:<26} edge {ee:6.0f} + {eo:4.1f} ({edge.cores:.2f})  "
             f"llama {le:6.0f} + {lo:4.1f} ({llama.cores:.2f})  {bound:.2f}x")
        out[case.label]["cpu"] = {
            "edge_engine_ms": ee, "edge_other_ms": eo, "edge_cores": edge.cores,
            "llama_engine_ms": le, "llama_other_ms": lo, "llama_cores": llama.cores,
            "engine_cpu_ratio": bound}


def _summary(timed: dict[Case, dict[str, list[list[Timed]]]], rounds: int, echo: Echo
             ) -> dict[str, Any]:
    echo(f"as a client sees it: edge-agent default vs llama-server -np {SLOTS} -c "
         f"{SLOTS * CONTEXT} ({rounds} rounds, {MAX_TOKENS} tokens, tokens / wall time per "
         f"request; ms: before the first token or prompt | decoding | after the last token "
         f"or the rest, medians)")
    echo(f"  {'':26} {'edge tok/s':>10} {'llama tok/s':>11} {'ratio':>6} {'range':>11}  "
         f"{'edge ms':>17}  {'llama ms':>17}")
    out: dict[str, Any] = {}
    for case, by_peer in timed.items():
        edge, llama = by_peer["edge-agent"], by_peer["llama-server"]
        ratios = [statistics.median(t.tokens_per_s for t in e)
                  / statistics.median(t.tokens_per_s for t in s)
                  for e, s in zip(edge, llama, strict=True)]
        ratio = statistics.median(ratios)
        parts = {name: _parts([t for batch in series for t in batch])
                 for name, series in by_peer.items()}
        rate = {name: statistics.median(t.tokens_per_s for batch in series for t in batch)
                for name, series in by_peer.items()}
        shown = {name: "/".join(f"{v:.0f}" for v in parts[name]) for name in parts}
        echo(f"  {case.label:<26} {rate['edge-agent']:>10.1f} {rate['llama-server']:>11.1f} "
             f"{ratio:>5.2f}x {min(ratios):>5.2f}-{max(ratios):<5.2f}  "
             f"{shown['edge-agent']:>17}  {shown['llama-server']:>17}")
        out[case.label] = {"tokens_per_s_ratio": ratio, "rounds": ratios,
                           "edge_tokens_per_s": rate["edge-agent"],
                           "llama_tokens_per_s": rate["llama-server"],
                           "edge_ms": parts["edge-agent"], "llama_ms": parts["llama-server"]}
    for case in timed:
        figure = out[case.label]
        if case.concurrency == 1:
            report(echo, "client_side.c1", figure["tokens_per_s_ratio"], case=case.label,
                   rounds=figure["rounds"])
        else:
            report(echo, "client_side.c8", figure["tokens_per_s_ratio"], case=case.label,
                   rounds=figure["rounds"])
    return out


def _parts(items: list[Timed]) -> tuple[float, float, float]:
    return (statistics.median(t.before_ms for t in items),
            statistics.median(t.decode_ms for t in items),
            statistics.median(t.after_ms for t in items))
