"""Where clients repeat themselves, as a store's assistant does: the client-side section's
cases that the rest of it avoids on purpose (there every prompt is new).

- **Recurring prompts**: the same RECURRING orders over and over (more of them than either
  server has sequences or slots), answered whole, `max_tokens` 64, at c=1 (plain and the
  order's JSON schema) and c=8: completion tokens over each request's wall time,
  edge-agent's median over llama-server's per round, as the rest of the section.
- **Conversations**: CONVERSATIONS chats of TURNS turns each over one ~500-token system
  prompt (the store's instructions, menu and offers), AT_ONCE requests at a time, the turns
  taken round-robin over the conversations (so each conversation comes back after the
  others displaced it), every turn resending the whole conversation, streamed, `max_tokens`
  ANSWER: TTFT p50 and p95 and the aggregate tokens/s, edge-agent's over llama-server's per
  round. Each round's customers are new; the system prompt is the same in every round, as
  in a store.
- **After a restart** (edge-agent alone; llama-server keeps nothing across one): the first
  request's TTFT after a restart that found the system prompt kept on disk, over the first
  request's TTFT after a start without it, per round.

llama-server runs on its defaults for its prompt cache (`--cache-ram` 8 GiB, idle slots
saved to it), as a box would run it.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from edge_agent.bench.serving import contention
from edge_agent.bench.serving.client_side import (
    CONTEXT,
    SLOTS,
    Case,
    Round,
    Timed,
    _body,
    ask,
)
from edge_agent.bench.serving.peers import (
    EdgeAgentPeer,
    HttpPeer,
    LlamaServerPeer,
    percentile,
    sse_chunks,
)
from edge_agent.bench.targets import report

Echo = Callable[[str], None]
RECURRING = 12  # distinct orders an app sends again and again (more than 8 sequences)
RECURRING_CASES = (Case("plain", 0.0, False, 1), Case("schema", 0.0, False, 1),
                   Case("plain", 0.0, False, SLOTS))
CONVERSATIONS, TURNS, AT_ONCE, ANSWER = 24, 6, 8, 32
_AUTH = {"Authorization": "Bearer bench"}


def store_instructions() -> str:
    """A store assistant's system prompt of ~500 tokens: policies, the menu, the offers."""
    menu = ["rye loaf", "spelt loaf", "sourdough", "croissant", "pain au chocolat",
            "cinnamon roll", "apple pie", "cheesecake", "baguette", "seeded roll",
            "carrot cake", "lemon tart"]
    lines = [f"- {item}: {2 + k % 5}.{k * 7 % 10}0 euros, baked at {5 + k % 4} every morning, "
             f"{'contains nuts' if k % 3 == 0 else 'no nuts'}, "
             f"{'vegan' if k % 4 == 1 else 'contains milk and eggs'}."
             for k, item in enumerate(menu)]
    return ("You are the ordering assistant of the Main Street bakery. Answer in one or two "
            "short sentences, never invent prices, and always confirm the order back to the "
            "customer. Opening hours: 6 to 19 on weekdays, 7 to 13 on Saturdays, closed on "
            "Sundays. Orders above 50 euros need a day's notice; cakes need two. Allergens "
            "must be named whenever a customer asks about an item.\nToday's menu:\n"
            + "\n".join(lines) + "\nToday's offers: two croissants and a coffee for 4 "
            "euros until 10; every sixth loaf free with the loyalty card.")


def _recurring_round(peer: HttpPeer, case: Case, extra: dict[str, Any],
                     pool: ThreadPoolExecutor) -> Round:
    n = RECURRING if case.concurrency == 1 else 2 * RECURRING
    bodies = [_body(peer, case, 40_000 + k % RECURRING, extra) for k in range(n)]
    start = time.perf_counter()
    if case.concurrency == 1:
        timed = [ask(peer.client, b) for b in bodies]
    else:
        timed = list(pool.map(lambda b: ask(peer.client, b), bodies))
    return Round(timed, time.perf_counter() - start)


def bench_recurring(peers: dict[str, HttpPeer], extra: dict[str, Any], echo: Echo,
                    rounds: int) -> dict[str, Any]:
    """The recurring orders: per case, edge-agent's tokens/s (median of a round's
    requests) over llama-server's, per round."""
    out: dict[str, Any] = {}
    series: dict[Case, dict[str, list[Round]]] = {c: {n: [] for n in peers}
                                                  for c in RECURRING_CASES}
    with ThreadPoolExecutor(max_workers=SLOTS) as pool:
        for peer in peers.values():  # the first pass fills every cache: not measured
            for case in RECURRING_CASES:
                _recurring_round(peer, case, extra, pool)
        for r in range(rounds):
            for n, case in enumerate(RECURRING_CASES):
                names = list(peers) if (r + n) % 2 == 0 else list(peers)[::-1]
                for name in names:
                    series[case][name].append(_recurring_round(peers[name], case, extra,
                                                               pool))
    echo(f"recurring prompts: the same {RECURRING} orders again and again, answered whole "
         f"({rounds} rounds; tokens / wall time per request, medians)")
    for case in RECURRING_CASES:
        edge, llama = series[case]["edge-agent"], series[case]["llama-server"]
        ratios = [_rate(e.timed) / _rate(s.timed) for e, s in zip(edge, llama, strict=True)]
        label = f"recurring {case.kind} c={case.concurrency}"
        echo(f"  {label:<26} edge {statistics.median(_rate(e.timed) for e in edge):6.1f} "
             f"llama {statistics.median(_rate(s.timed) for s in llama):6.1f} tok/s")
        if case.concurrency == 1:
            report(echo, "recurring.c1", statistics.median(ratios), case=label, rounds=ratios)
        else:
            report(echo, "recurring.c8", statistics.median(ratios), case=label, rounds=ratios)
        out[label] = {"tokens_per_s_ratio": statistics.median(ratios), "rounds": ratios}
    return out


def _rate(timed: list[Timed]) -> float:
    return statistics.median(t.tokens_per_s for t in timed)


# -- conversations ---------------------------------------------------------------------------
@dataclass
class Turn:
    ttft_s: float
    tokens: int
    prompt: int = 0  # prompt tokens, and of them those the server reused
    cached: int = 0


def _stream(client: httpx.Client, body: dict[str, Any]) -> tuple[Turn, str]:
    start = time.perf_counter()
    first = 0.0
    text: list[str] = []
    tokens = 0
    prompt = cached = 0
    for chunk in sse_chunks(client, body, _AUTH):
        if chunk.get("usage"):
            usage = chunk["usage"]
            tokens = usage.get("completion_tokens") or tokens
            prompt = usage.get("prompt_tokens") or prompt
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or cached
        if chunk.get("timings"):  # llama-server's own count of the cells it reused
            cached = chunk["timings"].get("cache_n") or cached
        choices = chunk.get("choices") or []
        piece = choices[0].get("delta", {}).get("content") if choices else None
        if piece:
            first = first or time.perf_counter()
            text.append(piece)
    end = time.perf_counter()
    return Turn((first or end) - start, tokens or len(text), prompt, cached), "".join(text)


def _conversation_round(peer: HttpPeer, system: str, r: int, extra: dict[str, Any]
                        ) -> tuple[list[Turn], float]:
    """One round: every conversation's every turn, AT_ONCE at a time, round-robin; each
    turn waits for its conversation's previous one (long done, 16 requests earlier)."""
    chats = [[{"role": "system", "content": system}] for _ in range(CONVERSATIONS)]
    done = [[threading.Event() for _ in range(TURNS)] for _ in range(CONVERSATIONS)]
    turns: list[Turn] = []
    lock = threading.Lock()

    def one(c: int, t: int) -> None:
        if t:
            done[c][t - 1].wait()
        chats[c].append({"role": "user", "content": f"Customer {r}-{c}, turn {t + 1}: "
                         f"{_QUESTIONS[(c + t) % len(_QUESTIONS)]}"})
        body = {"model": peer.model, "messages": list(chats[c]), "max_tokens": ANSWER,
                "temperature": 0.7, "seed": 1000 * r + 10 * c + t, "stream": True,
                "stream_options": {"include_usage": True}, **extra}
        try:
            turn, text = _stream(peer.client, body)
        except httpx.RemoteProtocolError:  # a kept-alive connection the server closed
            turn, text = _stream(peer.client, body)
        chats[c].append({"role": "assistant", "content": text})
        with lock:
            turns.append(turn)
        done[c][t].set()

    order = [(c, t) for t in range(TURNS) for c in range(CONVERSATIONS)]
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=AT_ONCE) as pool:
        list(pool.map(lambda ct: one(*ct), order))
    return turns, time.perf_counter() - start


_QUESTIONS = ["Do you have rye bread today?", "How much is the carrot cake?",
              "Does the cinnamon roll contain nuts?", "I'd like two croissants and a coffee.",
              "Can I order a cheesecake for Saturday?", "Is the lemon tart vegan?",
              "What time do you close today?", "Add a baguette to my order, please."]


def bench_conversations(peers: dict[str, HttpPeer], extra: dict[str, Any], echo: Echo,
                        rounds: int) -> dict[str, Any]:
    system = store_instructions()
    figures: dict[str, dict[str, list[float]]] = {
        n: {"p50": [], "p95": [], "aggregate": [], "reused": []} for n in peers}
    for peer in peers.values():  # warm-up: one short chat with the system prompt
        _stream(peer.client, {"model": peer.model, "max_tokens": 4, "stream": True,
                              "messages": [{"role": "system", "content": system},
                                           {"role": "user", "content": "Hello."}], **extra})
    for r in range(rounds):
        names = list(peers) if r % 2 == 0 else list(peers)[::-1]
        for name in names:
            turns, wall = _conversation_round(peers[name], system, r, extra)
            ttfts = [t.ttft_s * 1000 for t in turns]
            figures[name]["p50"].append(statistics.median(ttfts))
            figures[name]["p95"].append(percentile(ttfts, 0.95))
            figures[name]["aggregate"].append(sum(t.tokens for t in turns) / wall)
            figures[name]["reused"].append(sum(t.cached for t in turns)
                                           / max(1, sum(t.prompt for t in turns)))
    echo(f"conversations: {CONVERSATIONS} chats of {TURNS} turns over a "
         f"~500-token system prompt, {AT_ONCE} at a time, round-robin, streamed, "
         f"{ANSWER} tokens a turn ({rounds} rounds)")
    echo("  prompt tokens reused: edge-agent {:.0%}, llama-server {:.0%} (each server's own "
         "count: usage's cached_tokens, llama-server's timings.cache_n)".format(
             *(statistics.median(figures[n]["reused"]) for n in ("edge-agent", "llama-server"))))
    out: dict[str, Any] = {"rss_mib": {n: resident_mib(p.proc.pid) for n, p in peers.items()}}
    held = _metric(peers["edge-agent"], 'edge_agent_prompt_cache_bytes{tier="ram"}')
    bound = _metric(peers["edge-agent"], 'edge_agent_prompt_cache_limit_bytes{tier="ram"}')
    out["prompt_cache_mib"] = held / 2**20
    echo(f"  memory after them: edge-agent {out['rss_mib']['edge-agent']:.0f} MiB resident "
         f"(its prompt cache's RAM tier {held / 2**20:.0f} of {bound / 2**20:.0f} MiB), "
         f"llama-server {out['rss_mib']['llama-server']:.0f} MiB")
    edge, llama = figures["edge-agent"], figures["llama-server"]
    for key, what in (("p50", "TTFT p50 ms"), ("p95", "TTFT p95 ms"), ("aggregate", "tok/s")):
        ratios = [e / s for e, s in zip(edge[key], llama[key], strict=True)]
        echo(f"  {what:<12} edge {statistics.median(edge[key]):7.1f}  llama "
             f"{statistics.median(llama[key]):7.1f}")
        out[key] = {"ratio": statistics.median(ratios), "rounds": ratios,
                    "edge": statistics.median(edge[key]),
                    "llama": statistics.median(llama[key])}
    report(echo, "conversations.ttft_p50", out["p50"]["ratio"], rounds=out["p50"]["rounds"])
    report(echo, "conversations.ttft_p95", out["p95"]["ratio"], rounds=out["p95"]["rounds"])
    report(echo, "conversations.aggregate", out["aggregate"]["ratio"],
           rounds=out["aggregate"]["rounds"])
    return out


# -- after a restart -------------------------------------------------------------------------
def state_copy(src: Path, dest: Path) -> Path:
    """A state dir of the bench's own with `src`'s installed models: their blobs linked
    (no copies of the weights), the catalog's records copied, nothing else."""
    dest.mkdir(parents=True)
    (dest / "blobs").mkdir()
    for blob in (src / "blobs").iterdir():
        if blob.is_file() and not blob.name.startswith("."):
            try:
                (dest / "blobs" / blob.name).hardlink_to(blob)
            except OSError:  # another filesystem
                shutil.copy2(blob, dest / "blobs" / blob.name)
    shutil.copytree(src / "manifests", dest / "manifests")
    for name in ("models.db", "models.db-wal"):
        if (src / name).exists():
            shutil.copy2(src / name, dest / name)
    return dest


def _first_ttft(peer: HttpPeer, system: str, question: str, extra: dict[str, Any]) -> float:
    turn, _ = _stream(peer.client, {
        "model": peer.model, "max_tokens": 8, "temperature": 0, "stream": True,
        "messages": [{"role": "system", "content": system},
                     {"role": "user", "content": question}], **extra})
    return turn.ttft_s


def _metric(peer: HttpPeer, sample: str) -> float:
    """One sample of edge-agent's /metrics (0 where it is not there)."""
    for line in peer.client.get("/metrics").text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def resident_mib(pid: int) -> float:
    """A process's resident memory (VmRSS), in MiB; 0 where /proc has none."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _disk_writes(peer: HttpPeer) -> float:
    return _metric(peer, "edge_agent_prompt_cache_disk_writes_total")


def bench_restart(state_dir: Path, model: str, *, threads: int, extra: dict[str, Any],
                  echo: Echo, rounds: int) -> dict[str, Any]:
    """The first request after a start without the system prompt on disk (cold) and after
    a restart with it there (warm), per round; `state_dir` is the bench's own copy."""
    system = store_instructions()
    kept = state_dir / "prompt-cache"
    ratios: list[float] = []
    colds: list[float] = []
    warms: list[float] = []

    def start() -> EdgeAgentPeer:
        return EdgeAgentPeer(state_dir, model, threads=threads, context=4096,
                             parallel="auto")

    for r in range(rounds):
        shutil.rmtree(kept, ignore_errors=True)
        peer = start()
        try:
            cold = _first_ttft(peer, system, f"Round {r}: do you have rye bread?", extra)
            _first_ttft(peer, system, f"Round {r}: is the lemon tart vegan?", extra)
            deadline = time.monotonic() + 60
            while not _disk_writes(peer) and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            peer.close()
        peer = start()
        try:
            warm = _first_ttft(peer, system, f"Round {r}: how much is the carrot cake?", extra)
        finally:
            peer.close()
        colds.append(cold * 1000)
        warms.append(warm * 1000)
        ratios.append(warm / cold)
    echo(f"after a restart: the first request's TTFT with the system prompt kept on disk, "
         f"over without ({rounds} rounds): cold {statistics.median(colds):.0f} ms, warm "
         f"{statistics.median(warms):.0f} ms")
    report(echo, "restart.ttft_ratio", statistics.median(ratios), rounds=ratios)
    return {"ratio": statistics.median(ratios), "rounds": ratios,
            "cold_ms": statistics.median(colds), "warm_ms": statistics.median(warms),
            "files": json.dumps(sorted(p.name for p in kept.glob("*/*.kv")))}


def bench_repeats_and_contention(state_dir: Path, path: Path, model: str, binary: Path, *,
                                 threads: int, extra: dict[str, Any], echo: Echo,
                                 rounds: int = 5) -> dict[str, Any]:
    """The section's cases where clients repeat themselves (`repeats`) and beside other
    work (`contention`), against llama-server on its defaults, and the engine's ceiling;
    then the first request after a restart, on a copy of the state dir."""
    peers: dict[str, HttpPeer] = {}
    out: dict[str, Any] = {}
    try:
        peers["edge-agent"] = EdgeAgentPeer(state_dir, model, threads=threads,
                                            context=4096, parallel="auto")
        peers["llama-server"] = LlamaServerPeer(binary, path, model, threads=threads,
                                                context=CONTEXT, parallel=SLOTS)
        out["recurring"] = bench_recurring(peers, extra, echo, rounds)
        out["conversations"] = bench_conversations(peers, extra, echo, rounds)
        out["contention"] = contention.bench_contention(peers, extra, echo, rounds)
    finally:
        for peer in peers.values():
            peer.close()
    out["ceiling"] = contention.bench_ceiling(binary, path, threads,
                                              out["contention"]["quiet"], echo)
    with tempfile.TemporaryDirectory(prefix="edge-agent-restart-") as scratch:
        copy = state_copy(state_dir, Path(scratch) / "state")
        out["restart"] = bench_restart(copy, model, threads=threads, extra=extra,
                                               echo=echo, rounds=rounds)
    return out
