"""Constrained output against plain output on the same server: a JSON schema (a 5-field
order record, as a store's app sends with every request) vs free text, at c=1 and c=4.

The two take turns burst by burst (plain, schema, plain, …) so a shared host's drift moves
both alike; each level's figure is the median over its rounds of the per-round ratio, with
the range of those ratios as the noise. The judged figures are a stream's decode tokens/s
(1 / TPOT, the median stream of the burst) and TTFT p50; the bursts' aggregate tokens/s is
printed beside them. Both kinds stop at `max_tokens` (32), fewer than the record takes
(~42): answers of one length, so that the steps slowed by a burst's prompts weigh the same
in both (a shorter answer's TPOT holds more of them). Text chunks are counted as tokens
for both kinds alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from edge_agent.bench.serving.peers import EdgeAgentPeer
from edge_agent.bench.targets import report

Echo = Callable[[str], None]

ORDER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "maxLength": 12},
        "customer": {"type": "string", "maxLength": 40},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
        "price": {"type": "number"},
        "express": {"type": "boolean"},
    },
    "required": ["order_id", "customer", "quantity", "price", "express"],
}
CUSTOMERS = ["Ana Lopez", "Bo Chen", "Chidi Okafor", "Dana Kim", "Emil Berg", "Fatima Noor",
             "Gus Meyer", "Hana Sato"]


def ask_order(i: int) -> list[dict[str, str]]:
    """Request `i`'s question (the llama-server section asks the same ones)."""
    name = CUSTOMERS[i % len(CUSTOMERS)]
    return [{"role": "user", "content": f"Record order {i}: {name} buys {i % 9 + 1} boxes of "
                                        f"screws, express delivery. Answer with the order as "
                                        f"JSON."}]


def schema_body(extra: dict[str, Any]) -> dict[str, Any]:
    """`extra` with the order record as the OpenAI dialect's `response_format`."""
    return {**extra, "response_format": {"type": "json_schema", "json_schema": {
        "name": "order", "schema": ORDER_SCHEMA}}}


def bench_structured(state_dir: Path, model: str, *, threads: int, context: int,
                     levels: tuple[int, ...] = (1, 4), rounds: int = 5, max_tokens: int = 32,
                     extra: dict[str, Any], echo: Echo) -> dict[str, Any]:
    """Plain vs JSON-schema chat on one edge-agent server, `rounds` alternating bursts of
    each level."""
    peer = EdgeAgentPeer(state_dir, model, threads=threads, context=context,
                         parallel=max(levels))
    ratios: dict[int, dict[str, list[float]]] = {c: {"tps": [], "ttft": []} for c in levels}
    figures: dict[int, dict[str, list[float]]] = {
        c: {f"{kind}_{figure}": [] for kind in ("plain", "schema")
            for figure in ("tps", "ttft", "aggregate")} for c in levels}
    try:
        # Warm-up: the grammar's first check (a child process) and parse, off the figures.
        peer.chat(ask_order(-1), 8, extra)
        peer.chat(ask_order(-2), 8, schema_body(extra))
        with ThreadPoolExecutor(max_workers=max(levels)) as pool:
            for r in range(rounds):
                for c in levels:
                    got = {}
                    for k, (kind, body) in enumerate((("plain", extra),
                                                      ("schema", schema_body(extra)))):
                        # Prompts of their own: none finds another's whole prompt cached.
                        base = 1000 * c + 20 * r + 10 * k
                        start = time.perf_counter()
                        futures = [pool.submit(peer.chat, ask_order(base + i), max_tokens, body)
                                   for i in range(c)]
                        samples = [f.result() for f in futures]
                        wall = time.perf_counter() - start
                        got[kind] = (statistics.median(1 / s.tpot_s for s in samples),
                                     statistics.median(s.ttft_s for s in samples))
                        figures[c][f"{kind}_tps"].append(got[kind][0])
                        figures[c][f"{kind}_ttft"].append(got[kind][1])
                        figures[c][f"{kind}_aggregate"].append(
                            sum(s.tokens for s in samples) / wall)
                    ratios[c]["tps"].append(got["schema"][0] / got["plain"][0])
                    ratios[c]["ttft"].append(got["schema"][1] / got["plain"][1])
    finally:
        peer.close()
    echo(f"structured output (a 5-field JSON schema vs plain text, {rounds} alternating "
         f"rounds per level; tok/s: a stream's decode rate; medians, and the range of the "
         f"per-round ratios)")
    echo(f"  {'':6} {'plain tok/s':>11} {'schema tok/s':>12} {'plain TTFT':>10} "
         f"{'schema TTFT':>11} {'aggregate, plain / schema':>26}")
    out: dict[str, Any] = {}
    for c in levels:
        f = figures[c]
        med = {k: statistics.median(v) for k, v in f.items()}
        echo(f"  c={c:<4} {med['plain_tps']:>11.1f} {med['schema_tps']:>12.1f} "
             f"{med['plain_ttft'] * 1000:>8.0f}ms {med['schema_ttft'] * 1000:>9.0f}ms "
             f"{med['plain_aggregate']:>17.1f} / {med['schema_aggregate']:.1f}")
        tps, ttft = statistics.median(ratios[c]["tps"]), statistics.median(ratios[c]["ttft"])
        report(echo, "structured.tokens_per_s_ratio", tps, c=c, rounds=ratios[c]["tps"])
        report(echo, "structured.ttft_ratio", ttft, c=c, rounds=ratios[c]["ttft"])
        out[f"c{c}"] = {"tokens_per_s_ratio": tps, "ttft_ratio": ttft,
                        "tokens_per_s_ratios": ratios[c]["tps"],
                        "ttft_ratios": ratios[c]["ttft"], **med}
    return out
