"""`edge-agent bench batches`: what a batch costs the interactive requests beside it, and
how fast it goes.

One server (a child process, the default settings): bursts of `streams` simultaneous
interactive chats, `gap_s` apart (a store's traffic has pauses, and a batch runs in them:
`batches.idle_ms`), with no batch, then the same bursts while a `lines`-line chat batch
runs, then again with none (the two batch-free phases together are the baseline, so a
machine that drifts during the run moves both sides alike). Each burst of the second
phase arrives while the batch's lines run. The figures: the interactive TTFT p50 with the
batch over without it (`batches.ttft_ratio`), and the batch's lines a second beside that
traffic and alone.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edge_agent.bench.serving.peers import EdgeAgentPeer, Sample, percentile
from edge_agent.bench.serving.run import _ask
from edge_agent.bench.targets import report

Echo = Callable[[str], None]
ENDED = ("completed", "failed", "expired", "cancelled")


def _lines(model: str, n: int, max_tokens: int, tag: str) -> bytes:
    """`n` short chat requests, each asking something of its own (no two share a prompt)."""
    out = []
    for i in range(n):
        body = {"model": model, "max_tokens": max_tokens, "messages": [
            {"role": "user", "content": f"Rewrite the description of product {tag}-{i} in "
                                        "one sentence."}]}
        out.append(json.dumps({"custom_id": f"{tag}-{i}", "method": "POST",
                               "url": "/v1/chat/completions", "body": body}))
    return ("\n".join(out) + "\n").encode()


def _submit(peer: EdgeAgentPeer, data: bytes) -> str:
    uploaded = peer.client.post("/v1/files", files={"file": ("lines.jsonl", data)},
                                data={"purpose": "batch"})
    uploaded.raise_for_status()
    batch = peer.client.post("/v1/batches", json={
        "input_file_id": uploaded.json()["id"], "endpoint": "/v1/chat/completions",
        "completion_window": "24h"})
    batch.raise_for_status()
    return str(batch.json()["id"])


def _status(peer: EdgeAgentPeer, batch_id: str) -> dict[str, Any]:
    r = peer.client.get(f"/v1/batches/{batch_id}")
    r.raise_for_status()
    body: dict[str, Any] = r.json()
    return body


def _wait(peer: EdgeAgentPeer, batch_id: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        status = _status(peer, batch_id)
        if status["status"] in ENDED or time.monotonic() > deadline:
            return status
        time.sleep(0.2)


def _burst(peer: EdgeAgentPeer, streams: int, max_tokens: int, start: int,
           gap_s: float) -> list[Sample]:
    from concurrent.futures import ThreadPoolExecutor

    time.sleep(gap_s)
    with ThreadPoolExecutor(max_workers=streams) as pool:
        futures = [pool.submit(peer.chat, _ask(start + i), max_tokens) for i in range(streams)]
        return [f.result() for f in futures]


def run_batch_bench(state_dir: Path, model: str, *, threads: int, context: int,
                    lines: int = 200, streams: int = 4, rounds: int = 6, max_tokens: int = 32,
                    line_tokens: int = 16, gap_s: float = 1.5, echo: Echo) -> dict[str, Any]:
    peer = EdgeAgentPeer(state_dir, model, threads=threads, context=context,
                         parallel="auto")
    try:
        peer.chat(_ask(-1), 4)  # warm-up, on a prompt the runs do not use
        echo(f"batches: {streams} interactive streams ({max_tokens} tokens) in bursts "
             f"{gap_s:g} s apart, with and without a {lines}-line chat batch ({line_tokens} "
             "tokens a line)")
        n = 0
        alone: list[Sample] = []
        for _ in range(rounds):
            alone += _burst(peer, streams, max_tokens, 5000 + n, gap_s)
            n += streams
        batch_id = _submit(peer, _lines(model, lines, line_tokens, "beside"))
        started = time.monotonic()
        beside: list[Sample] = []
        for _ in range(rounds):
            if _status(peer, batch_id)["status"] in ENDED:
                break
            beside += _burst(peer, streams, max_tokens, 5000 + n, gap_s)
            n += streams
        bursts_beside = len(beside) // streams
        before = len(alone)
        done = _wait(peer, batch_id, 3600)
        beside_s = time.monotonic() - started
        for _ in range(rounds):
            alone += _burst(peer, streams, max_tokens, 5000 + n, gap_s)
            n += streams
        after = alone[before:]
        solo_id = _submit(peer, _lines(model, lines, line_tokens, "alone"))
        started = time.monotonic()
        solo = _wait(peer, solo_id, 3600)
        solo_s = time.monotonic() - started
    finally:
        peer.close()
    ttft_without = percentile([s.ttft_s for s in alone], 0.5)
    ttft_with = percentile([s.ttft_s for s in beside], 0.5)
    ratio = ttft_with / ttft_without
    counts, solo_counts = done["request_counts"], solo["request_counts"]
    echo(f"  interactive TTFT p50: {ttft_without * 1000:.0f} ms without a batch "
         f"({len(alone)} requests), {ttft_with * 1000:.0f} ms with one ({len(beside)} "
         f"requests in {bursts_beside} bursts)")
    report(echo, "batches.ttft_ratio", ratio, streams=streams, lines=lines)
    tpot = [percentile([s.tpot_s for s in phase], 0.5) * 1000
            for phase in (alone[:len(alone) - len(after)], beside, after)]
    echo(f"  a stream's TPOT p50 before, beside and after the batch: {tpot[0]:.0f}, "
         f"{tpot[1]:.0f} and {tpot[2]:.0f} ms (far apart: other work loaded the machine "
         "unevenly, and the ratio says little)")
    echo(f"  the batch beside the bursts: {counts['completed']}/{lines} lines in "
         f"{beside_s:.1f} s, {lines / beside_s:.2f} lines/s ({done['status']})")
    echo(f"  the batch alone: {solo_counts['completed']}/{lines} lines in {solo_s:.1f} s, "
         f"{lines / solo_s:.2f} lines/s ({solo['status']})")
    return {"ttft_without_ms": ttft_without * 1000, "ttft_with_ms": ttft_with * 1000,
            "ttft_ratio": ratio, "bursts_beside": bursts_beside, "tpot_p50_ms": tpot,
            "lines_per_s_beside": lines / beside_s, "lines_per_s_alone": lines / solo_s,
            "completed": counts["completed"], "completed_alone": solo_counts["completed"]}
