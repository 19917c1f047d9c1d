"""Beside other work, and against the engine's own limit: the client-side section's last
two parts.

- **Beside a hog**: a store's PC runs other software. One process keeps one core busy
  (a loop pinned to the first core, as a till's or a backup's burst would), and a stream
  at c=1 (plain text, `max_tokens` 64, end-of-generation biased away) is timed from its
  first token to its last, for each server, quiet and beside the hog, the servers taking
  turns. Printed: each server's decode tokens/s both ways, edge-agent's beside the hog
  over its quiet speed, and edge-agent's over llama-server's beside the same hog.
- **The ceiling**: llama.cpp's `llama-bench` (built beside `llama-server` from the same
  sources) on the same GGUF and threads, `tg64` and `pp512`: what the engine itself does
  with no server around it. Each server's quiet stream is printed against it, so every
  ratio can be read against what is possible at all.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from edge_agent.bench.serving.client_side import MAX_TOKENS, order
from edge_agent.bench.serving.peers import HttpPeer, Sample
from edge_agent.bench.targets import report

Echo = Callable[[str], None]
STREAMS = 4  # streams per server per condition per round


@contextmanager
def hog() -> Iterator[None]:
    """One process keeping the first core busy for as long as the block runs."""
    proc = subprocess.Popen([sys.executable, "-c", "import os\nos.sched_setaffinity(0, {0})"
                             "\nwhile True:\n    pass\n"])
    try:
        time.sleep(2.0)  # long enough for a server's next sample of the load to see it
        yield
    finally:
        proc.kill()
        proc.wait()


def _decode_rate(peer: HttpPeer, extra: dict[str, Any], i: int) -> float:
    sample: Sample = peer.chat(order(50_000 + i), MAX_TOKENS, {"seed": i, **extra})
    if sample.cut:  # a kept-alive connection the server had closed: once more, on a new one
        sample = peer.chat(order(50_000 + i), MAX_TOKENS, {"seed": i, **extra})
    return 1 / sample.tpot_s  # the tokens after the first, over the time they took


def bench_contention(peers: dict[str, HttpPeer], extra: dict[str, Any], echo: Echo,
                     rounds: int) -> dict[str, Any]:
    rates: dict[str, dict[str, list[float]]] = {n: {"quiet": [], "hog": []} for n in peers}
    for r in range(rounds):
        for condition in ("quiet", "hog") if r % 2 == 0 else ("hog", "quiet"):
            with hog() if condition == "hog" else nullcontext():
                names = list(peers) if r % 2 == 0 else list(peers)[::-1]
                for name in names:
                    # Prompts of their own per condition: the second would otherwise be
                    # answered from the first's answer (`answer_drafts`), not decoded.
                    got = [_decode_rate(peers[name], extra,
                                        100 * r + k + (50 if condition == "hog" else 0))
                           for k in range(STREAMS)]
                    rates[name][condition].append(statistics.median(got))
    edge, llama = rates["edge-agent"], rates["llama-server"]
    echo(f"beside a hog (a busy loop on one core): a stream's decode tokens/s at c=1 "
         f"({rounds} rounds of {STREAMS} streams, medians)")
    for name, by in rates.items():
        echo(f"  {name:<13} quiet {statistics.median(by['quiet']):6.1f}  beside the hog "
             f"{statistics.median(by['hog']):6.1f}")
    kept = [h / q for h, q in zip(edge["hog"], edge["quiet"], strict=True)]
    versus = [e / s for e, s in zip(edge["hog"], llama["hog"], strict=True)]
    report(echo, "contention.kept", statistics.median(kept), rounds=kept)
    report(echo, "contention.vs_llama", statistics.median(versus), rounds=versus)
    return {"kept": statistics.median(kept), "kept_rounds": kept,
            "vs_llama": statistics.median(versus), "vs_llama_rounds": versus,
            "quiet": {n: statistics.median(by["quiet"]) for n, by in rates.items()},
            "hog": {n: statistics.median(by["hog"]) for n, by in rates.items()}}


def llama_bench(binary: Path, model_path: Path, threads: int) -> dict[str, float] | None:
    """llama-bench's tg64 and pp512 tokens/s (`binary`: llama-server's path; llama-bench
    is built beside it), or None where there is none."""
    bench = binary.with_name("llama-bench")
    if not bench.exists():
        return None
    out = subprocess.run([str(bench), "-m", str(model_path), "-t", str(threads), "-p", "512",
                          "-n", "64", "-r", "3", "-o", "json"], capture_output=True,
                         text=True, timeout=600, env={**os.environ}, check=False)
    if out.returncode != 0:
        return None
    figures: dict[str, float] = {}
    for row in json.loads(out.stdout):
        kind = "pp512" if row.get("n_prompt") else "tg64"
        figures[kind] = float(row["avg_ts"])
    return figures


def bench_ceiling(binary: Path, model_path: Path, threads: int, quiet: dict[str, float],
                  echo: Echo) -> dict[str, Any]:
    """The engine's own limit beside each server's quiet stream (`quiet`: decode tokens/s
    by server, from `bench_contention`)."""
    figures = llama_bench(binary, model_path, threads)
    if figures is None:
        echo("the ceiling: no llama-bench beside llama-server (build its target too)")
        return {}
    tg = figures.get("tg64", 0.0)
    echo(f"the ceiling: llama-bench on the same build, GGUF and {threads} threads: tg64 "
         f"{tg:.1f} tok/s, pp512 {figures.get('pp512', 0.0):.1f} tok/s")
    for name, rate in quiet.items():
        echo(f"  {name:<13} a stream at c=1 decodes at {rate:6.1f} tok/s: "
             f"{rate / tg if tg else 0:.2f} of tg64")
    return {**figures, "of_tg64": {n: r / tg for n, r in quiet.items()} if tg else {}}
