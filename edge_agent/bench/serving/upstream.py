"""`edge-agent bench upstream`: what handing work to an upstream buys a saturated box, and
what the box costs a request it passes through.

Three servers, children of the bench: the pool (edge-agent with `pool_parallel`
sequences, standing in for the central team's GPU pool on loopback), and the box twice,
with `parallel` sequences: once with a deep queue and no upstream (local only), once with
a short queue and the pool as its upstream (a request that finds the queue full spills
there, `[routing] saturated`). Each phase: `clients` concurrent clients, each streaming
`requests` chats of `max_tokens` tokens, every prompt new. The figures: aggregate tokens/s
and TTFT p95, with spill over local only; then, one request at a time, alternating, the
same chat to the pool directly and through the box (`X-Edge-Route: upstream`): the time to
the first token the box adds (p50, the target), and whether the stream arrives token by
token (chunks through the box over chunks direct: 1.0 is unbuffered).

On one machine the pool shares the CPU with the box: in the spill phase the two split the
cores the box has alone in the local phase, so the phase measures the gateway's behaviour
(nothing refused, where the work went, what waiting it saves), not the speed of a GPU
pool; on a real site the pool's tokens/s are its own.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from edge_agent.bench.serving.peers import (
    EdgeAgentPeer,
    HttpPeer,
    LlamaServerPeer,
    Sample,
    percentile,
)
from edge_agent.bench.serving.run import TOPICS, _ask
from edge_agent.bench.targets import report
from edge_agent.engine.models.catalog import ModelStore
from edge_agent.names import ModelName

Echo = Callable[[str], None]
POOL_DIR = "bench-upstream-pool"
VIA_LLAMA_SERVER = "via-llama-server:1"  # the name the box maps to a llama-server upstream


def _phase(peer: EdgeAgentPeer, clients: int, requests: int, max_tokens: int, start: int
           ) -> tuple[list[Sample], float, int]:
    """(samples, wall seconds, refused) of `clients` clients × `requests` chats each."""
    refused = 0

    def client(c: int) -> list[Sample]:
        nonlocal refused
        out = []
        for r in range(requests):
            try:
                out.append(peer.chat(_ask(start + c * requests + r), max_tokens))
            except Exception:  # a refusal (503) or a broken stream: counted, not hidden
                refused += 1
        return out

    began = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        samples = [s for part in pool.map(client, range(clients)) for s in part]
    return samples, time.perf_counter() - began, refused


def _tokens_per_s(samples: list[Sample], seconds: float) -> float:
    return sum(s.tokens for s in samples) / seconds


def run_upstream_bench(state_dir: Path, model: str, *, threads: int, context: int,
                       clients: int = 16, requests: int = 2, parallel: int = 2,
                       pool_parallel: int = 4, max_tokens: int = 32, passes: int = 20,
                       pool_dir: Path | None = None, llama_server: Path | None = None,
                       echo: Echo) -> dict[str, Any]:
    """`pool_dir`: the pool's state dir (default STATE_DIR/bench-upstream-pool), given the
    model if it lacks it; `llama_server`: llama.cpp's server binary, measured as an
    upstream too (the pass-through figures, on the same file)."""
    pool_dir = pool_dir or state_dir / POOL_DIR
    store = ModelStore(pool_dir)
    try:
        if not store.is_installed(ModelName.parse(model)):
            store.pull(ModelName.parse(model))
        model_path = store.get(ModelName.parse(model)).blob_path(pool_dir)
    finally:
        store.close()
    # One machine: the pool and the spilling box split its cores, as the box alone has
    # them all in the local phase (two processes each spinning on every core would
    # measure llama.cpp's thread contention, not the gateway).
    pool_threads = max(1, threads // 2)
    box_threads = max(1, threads - pool_threads)
    pool = EdgeAgentPeer(pool_dir, model, threads=pool_threads, context=context,
                         parallel=pool_parallel)
    config = state_dir / "bench-upstream.toml"
    other = None if llama_server is None else LlamaServerPeer(
        llama_server, model_path, model, threads=pool_threads, context=context,
        parallel=pool_parallel)
    config.write_text(f'[upstreams.pool]\nbase_url = "{pool.url}/v1"\n'
                      f'models = {{ "{model}" = "{model}" }}\nmax_concurrency = 64\n'
                      '[tenants.local]\negress = "allowed"\n'  # the box has no keys
                      + ("" if other is None else
                         f'[upstreams.llama-server]\nbase_url = "{other.url}/v1"\n'
                         f'models = {{ "{VIA_LLAMA_SERVER}" = "{model}" }}\n'))
    try:
        echo(f"upstream: {clients} clients x {requests} streamed chats ({max_tokens} tokens), "
             f"a box with {parallel} sequences ({threads} threads alone, {box_threads} beside "
             f"the pool), a loopback pool with {pool_parallel} ({pool_threads} threads)")
        local = EdgeAgentPeer(state_dir, model, threads=threads, context=context,
                              parallel=parallel)
        try:
            local.chat(_ask(-1), 4)
            alone, alone_s, alone_refused = _phase(local, clients, requests, max_tokens, 9000)
        finally:
            local.close()
        box = EdgeAgentPeer(state_dir, model, threads=box_threads, context=context,
                            parallel=parallel, config=config,
                            env={"EDGE_AGENT_RUNTIME__MAX_QUEUE": str(parallel)})
        try:
            box.chat(_ask(-2), 4)
            spill, spill_s, spill_refused = _phase(box, clients, requests, max_tokens, 9500)
            added, direct_chunks, through_chunks = _pass_through(pool, box, passes,
                                                                 max_tokens, model)
            peer_added: list[float] = []
            if other is not None:
                peer_added, _, _ = _pass_through(other, box, passes, max_tokens,
                                                 VIA_LLAMA_SERVER)
        finally:
            box.close()
    finally:
        pool.close()
        if other is not None:
            other.close()
    return _figures(echo, alone, alone_s, alone_refused, spill, spill_s, spill_refused,
                    added, direct_chunks, through_chunks, peer_added)


def _pass_through(pool: HttpPeer, box: EdgeAgentPeer, passes: int, max_tokens: int,
                  name: str) -> tuple[list[float], list[int], list[int]]:
    """(added TTFT ms, chunks direct, chunks through) of `passes` pairs of requests: one to
    `pool` directly and one through the box under `name`, the name the box maps to it
    (`X-Edge-Route: upstream`). Two new prompts of one shape each pass (the same topic,
    numbers of the same length), neither in the pool's cache; which goes first alternates."""
    added: list[float] = []
    direct_chunks: list[int] = []
    through_chunks: list[int] = []
    for i in range(passes):
        first = 20000 + i * len(TOPICS) * 2
        asks = (_ask(first), _ask(first + len(TOPICS)))
        samples: dict[int, Sample] = {}
        for turn in ((0, 1) if i % 2 == 0 else (1, 0)):
            if turn == 0:
                samples[0] = pool.chat(asks[0], max_tokens)
            else:
                samples[1] = box.chat(asks[1], max_tokens, {
                    "model": name, "headers": {"X-Edge-Route": "upstream"}})
        added.append((samples[1].ttft_s - samples[0].ttft_s) * 1000)
        direct_chunks.append(samples[0].tokens)
        through_chunks.append(samples[1].tokens)
    return added, direct_chunks, through_chunks


def _figures(echo: Echo, alone: list[Sample], alone_s: float, alone_refused: int,
             spill: list[Sample], spill_s: float, spill_refused: int, added: list[float],
             direct_chunks: list[int], through_chunks: list[int], peer_added: list[float]
             ) -> dict[str, Any]:
    tps_alone, tps_spill = _tokens_per_s(alone, alone_s), _tokens_per_s(spill, spill_s)
    p95_alone = percentile([s.ttft_s for s in alone], 0.95)
    p95_spill = percentile([s.ttft_s for s in spill], 0.95)
    echo(f"  local only: {tps_alone:.1f} tokens/s, TTFT p95 {p95_alone * 1000:.0f} ms "
         f"({len(alone)} answered, {alone_refused} refused, {alone_s:.1f} s)")
    echo(f"  with spill: {tps_spill:.1f} tokens/s, TTFT p95 {p95_spill * 1000:.0f} ms "
         f"({len(spill)} answered, {spill_refused} refused, {spill_s:.1f} s)")
    echo(f"  tokens/s with spill / local only: {tps_spill / tps_alone:.2f}; TTFT p95: "
         f"{p95_spill / p95_alone:.2f}")
    added_p50 = statistics.median(added)
    report(echo, "upstream.added_ttft_ms", added_p50, rounds=added)
    unbuffered = sum(through_chunks) / max(1, sum(direct_chunks))
    report(echo, "upstream.chunks_ratio", unbuffered)
    out: dict[str, Any] = {
        "tokens_per_s_local": tps_alone, "tokens_per_s_spill": tps_spill,
        "ttft_p95_local_ms": p95_alone * 1000, "ttft_p95_spill_ms": p95_spill * 1000,
        "refused_local": alone_refused, "refused_spill": spill_refused,
        "added_ttft_ms": added_p50, "added_ttft_ms_passes": added,
        "chunks_ratio": unbuffered}
    if peer_added:
        out["added_ttft_ms_llama_server"] = statistics.median(peer_added)
        echo(f"  with llama-server as the upstream: the box adds "
             f"{out['added_ttft_ms_llama_server']:.1f} ms (p50; passes "
             f"{min(peer_added):.1f} to {max(peer_added):.1f})")
    return out
