"""edge-agent against llama.cpp's own C++ server (`edge-agent bench --llama-server PATH`):
plain text and the 5-field JSON schema of `structured`, at c=1 and c=4, the two servers
taking turns burst by burst (edge-agent, llama-server, edge-agent, …) on the same file with
the same threads, slots and context.

Printed, not judged (the C++ server is the reference, not a target of ours): per kind and
level, a stream's decode tokens/s (1 / TPOT) and TTFT p50 of each server, edge-agent /
llama-server, and each server's own schema / plain. Both servers answer `max_tokens` (32)
tokens of either kind, end-of-generation biased away, so the lengths match. llama-server
is built from the sdist's vendored llama.cpp: `cmake -S vendor/llama.cpp -B build -G Ninja
-DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF && ninja -C build llama-server` (6-7 min on 2
cores).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from edge_agent.bench.peers import EdgeAgentPeer, HttpPeer, LlamaServerPeer, Sample
from edge_agent.bench.structured import ask_order, schema_body

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
    for name in figures:
        for c in levels:
            own = statistics.median(
                s[0] / p[0] for s, p in zip(figures[name]["schema"][c],
                                            figures[name]["plain"][c], strict=True))
            echo(f"  {name} c={c}: schema / plain tokens/s {own:.2f}x")
            out[f"{name}_schema_over_plain_c{c}"] = own
    return out
