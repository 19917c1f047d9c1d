"""edge-agent against llama.cpp's own C++ server (`edge-agent bench --llama-server PATH`):
plain text and the 5-field JSON schema of `structured`, at c=1 and c=4, the two servers
taking turns burst by burst (edge-agent, llama-server, edge-agent, …) on the same file with
the same threads, slots and context.

Per kind and level: a stream's decode tokens/s (1 / TPOT) and TTFT p50 of each server,
edge-agent / llama-server, and each server's own schema / plain. Then a burst of 8 clients
against each server as a box runs it: edge-agent with its default configuration
(`parallel = "auto"`), llama-server with `-np 8`; its aggregate tokens/s and its TTFT p50
against the same server's at c=1. The ratios are judged against `targets` (plain at c=1,
schema at c=1 and c=4, the burst); each figure is the median of the per-round ratios, and
the range of those is printed as the noise. Both servers answer `max_tokens` (32) tokens
of either kind, end-of-generation biased away, so the lengths match. llama-server
is built from the sdist's vendored llama.cpp: `cmake -S vendor/llama.cpp -B build -G Ninja
-DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF && ninja -C build llama-server` (6-7 min on 2
cores).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from edge_agent.bench.peers import EdgeAgentPeer, HttpPeer, LlamaServerPeer, Sample
from edge_agent.bench.structured import ask_order, schema_body
from edge_agent.bench.targets import report

Echo = Callable[[str], None]
KINDS = ("plain", "schema")


def bench_llama_server(state_dir: Path, path: Path, model: str, binary: Path, *,
                       threads: int, context: int, extra: dict[str, Any], echo: Echo,
                       levels: tuple[int, ...] = (1, 4), rounds: int = 5,
                       max_tokens: int = 32) -> dict[str, Any]:
    parallel = max(levels)
    peers: dict[str, HttpPeer] = {}
    # figures[peer][kind][level] = per-burst (tokens/s, TTFT)
    figures: dict[str, dict[str, dict[int, list[tuple[float, float]]]]] = {}
    try:
        peers["edge-agent"] = EdgeAgentPeer(state_dir, model, threads=threads,
                                            context=context, parallel=parallel)
        peers["llama-server"] = LlamaServerPeer(binary, path, model, threads=threads,
                                                context=context, parallel=parallel)
        figures = {p: {k: {c: [] for c in levels} for k in KINDS} for p in peers}
        bodies = {"plain": extra, "schema": schema_body(extra)}
        for peer in peers.values():  # warm-up: the grammar's first check and parse
            for kind in KINDS:
                peer.chat(ask_order(-1), 8, bodies[kind])
        with ThreadPoolExecutor(max_workers=parallel) as pool:
            for r in range(rounds):
                for c in levels:
                    for k, kind in enumerate(KINDS):
                        base = 5000 + 1000 * c + 20 * r + 10 * k  # no whole prompt cached
                        for name, peer in peers.items():
                            futures = [pool.submit(peer.chat, ask_order(base + i), max_tokens,
                                                   bodies[kind]) for i in range(c)]
                            samples: list[Sample] = [f.result() for f in futures]
                            figures[name][kind][c].append(
                                (statistics.median(1 / s.tpot_s for s in samples),
                                 statistics.median(s.ttft_s for s in samples)))
    finally:
        for peer in peers.values():
            peer.close()
    echo(f"vs llama.cpp's llama-server ({binary.name}, {rounds} alternating rounds, "
         f"{max_tokens} tokens; tok/s: a stream's decode rate; medians)")
    echo(f"  {'':14} {'edge tok/s':>10} {'llama tok/s':>11} {'ratio':>6} {'edge TTFT':>10} "
         f"{'llama TTFT':>10} {'ratio':>6}")
    out: dict[str, Any] = {}
    for kind in KINDS:
        for c in levels:
            e, ls = figures["edge-agent"][kind][c], figures["llama-server"][kind][c]
            tps = statistics.median(a[0] / b[0] for a, b in zip(e, ls, strict=True))
            ttft = statistics.median(a[1] / b[1] for a, b in zip(e, ls, strict=True))
            med = [statistics.median(x[i] for x in series) for series in (e, ls)
                   for i in (0, 1)]
            echo(f"  {kind + f' c={c}':<14} {med[0]:>10.1f} {med[2]:>11.1f} {tps:>5.2f}x "
                 f"{med[1] * 1000:>8.0f}ms {med[3] * 1000:>8.0f}ms {ttft:>5.2f}x")
            out[f"{kind}_c{c}"] = {"tokens_per_s_ratio": tps, "ttft_ratio": ttft,
                                   "edge_tokens_per_s": med[0], "llama_tokens_per_s": med[2]}
    for kind in KINDS:
        for c in levels:
            e, ls = figures["edge-agent"][kind][c], figures["llama-server"][kind][c]
            tps_rounds = [a[0] / b[0] for a, b in zip(e, ls, strict=True)]
            noise = f"    (rounds: {min(tps_rounds):.2f}-{max(tps_rounds):.2f})"
            if kind == "schema":
                report(echo, "llama_server.schema_tokens_per_s", out[f"schema_c{c}"][
                    "tokens_per_s_ratio"], c=c)
                echo(noise)
            elif c == 1:
                report(echo, "llama_server.plain_tokens_per_s", out["plain_c1"][
                    "tokens_per_s_ratio"])
                echo(noise)
                report(echo, "llama_server.plain_ttft", out["plain_c1"]["ttft_ratio"])
    for name in figures:
        for c in levels:
            own = statistics.median(
                s[0] / p[0] for s, p in zip(figures[name]["schema"][c],
                                            figures[name]["plain"][c], strict=True))
            echo(f"  {name} c={c}: schema / plain tokens/s {own:.2f}x")
            out[f"{name}_schema_over_plain_c{c}"] = own
    out["burst"] = _burst(state_dir, path, model, binary, threads=threads, context=context,
                          extra=extra, echo=echo, rounds=rounds, max_tokens=max_tokens)
    return out


def _burst(state_dir: Path, path: Path, model: str, binary: Path, *, threads: int,
           context: int, extra: dict[str, Any], echo: Echo, rounds: int, max_tokens: int,
           clients: int = 8) -> dict[str, Any]:
    """`clients` at once against each server as it is deployed: edge-agent's default
    `parallel`, llama-server's `-np clients`; per round, a lone request then the burst."""
    peers: dict[str, HttpPeer] = {}
    # per peer, per round: (aggregate tokens/s of the burst, its TTFT p50, c=1's TTFT)
    rows: dict[str, list[tuple[float, float, float]]] = {}
    try:
        peers["edge-agent"] = EdgeAgentPeer(state_dir, model, threads=threads,
                                            context=context, parallel="auto")
        peers["llama-server"] = LlamaServerPeer(binary, path, model, threads=threads,
                                                context=context, parallel=clients)
        rows = {name: [] for name in peers}
        for peer in peers.values():
            peer.chat(ask_order(-3), 8, extra)  # warm-up
        with ThreadPoolExecutor(max_workers=clients) as pool:
            for r in range(rounds):
                for name, peer in peers.items():
                    base = 9000 + 100 * r
                    alone = peer.chat(ask_order(base), max_tokens, extra)
                    start = time.perf_counter()
                    futures = [pool.submit(peer.chat, ask_order(base + 1 + i), max_tokens,
                                           extra) for i in range(clients)]
                    samples = [f.result() for f in futures]
                    wall = time.perf_counter() - start
                    rows[name].append((sum(s.tokens for s in samples) / wall,
                                       statistics.median(s.ttft_s for s in samples),
                                       alone.ttft_s))
    finally:
        for peer in peers.values():
            peer.close()
    edge, llama = rows["edge-agent"], rows["llama-server"]
    aggregate = [a[0] / b[0] for a, b in zip(edge, llama, strict=True)]
    growth = [a[1] / a[2] for a in edge]
    med = {name: [statistics.median(x[i] for x in series) for i in range(3)]
           for name, series in rows.items()}
    echo(f"  burst of {clients} (edge-agent's default parallel vs llama-server -np {clients}): "
         f"aggregate {med['edge-agent'][0]:.1f} vs {med['llama-server'][0]:.1f} tok/s, "
         f"TTFT p50 {med['edge-agent'][1] * 1000:.0f} vs {med['llama-server'][1] * 1000:.0f} ms"
         f" (alone: {med['edge-agent'][2] * 1000:.0f} vs {med['llama-server'][2] * 1000:.0f} ms)")
    ratio, ttft = statistics.median(aggregate), statistics.median(growth)
    report(echo, "llama_server.burst_aggregate", ratio, c=clients)
    echo(f"    (rounds: {min(aggregate):.2f}-{max(aggregate):.2f})")
    report(echo, "llama_server.burst_ttft_growth", ttft, c=clients)
    echo(f"    (rounds: {min(growth):.2f}-{max(growth):.2f})")
    return {"aggregate_ratio": ratio, "ttft_growth": ttft, "aggregate_ratios": aggregate,
            "ttft_growths": growth, "edge": med["edge-agent"], "llama": med["llama-server"]}
