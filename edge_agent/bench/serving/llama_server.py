"""edge-agent against llama.cpp's own C++ server (`edge-agent bench --llama-server PATH`,
or `edge-agent bench llama-server PATH` alone), on the same file with the same threads,
slots and context, the servers taking turns request by request or burst by burst:

- plain text and the 5-field JSON schema of `structured`, at c=1 and c=4: a stream's
  decode tokens/s (1 / TPOT) and TTFT p50 of each, edge-agent / llama-server, and each
  server's own schema / plain. Both answer `max_tokens` (32) tokens of either kind,
  end-of-generation biased away, so the lengths match;
- tool calls (the order record as a function's parameters, `tool_choice: "required"`) at
  c=1, answered whole: completion tokens/s end to end, each server's against the other's
  and edge-agent's against its own plain text of the same length, every call checked
  against the parameters' schema;
- a long shared prefix (a store manual of ~1,200 tokens as the system message, a new
  question each time): TTFT at c=1, each server reusing the manual's cells;
- prompt lookup at c=1 on answers that quote their prompt (`lookup`'s prompts):
  edge-agent with `X-Edge-Prompt-Lookup: 8` against a third server, llama-server
  `--spec-type ngram-simple` (its n-gram lookup with its defaults: a 12-token match, up to
  48 guesses), each also against itself with it off;
- a burst of 8 clients against each server as a box runs it: edge-agent with its default
  configuration (`parallel = "auto"`), llama-server with `-np 8`; its aggregate tokens/s
  and its TTFT p50 against the same server's at c=1.

The ratios are judged against `targets`; each figure is the median of the per-round
ratios, and the range of those is printed as the noise, flagged where it leaves the
verdict to chance. llama-server is built from the sdist's vendored llama.cpp: `cmake -S
vendor/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF && cmake --build
build --target llama-server -j2` (about 10 minutes on 2 cores).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema

from edge_agent.bench.serving.client_side import bench_client_side
from edge_agent.bench.serving.lookup import quote_prompt
from edge_agent.bench.serving.peers import (
    Completion,
    EdgeAgentPeer,
    HttpPeer,
    LlamaServerPeer,
    Sample,
)
from edge_agent.bench.serving.repeats import bench_repeats_and_contention
from edge_agent.bench.serving.structured import ORDER_SCHEMA, ask_order, schema_body
from edge_agent.bench.targets import report
from edge_agent.engine.constrained.tool_calls import tool_call_schema, tool_instructions

Echo = Callable[[str], None]
KINDS = ("plain", "schema")
TOOLS = [{"type": "function", "function": {
    "name": "record_order", "description": "Record a customer's order.",
    "parameters": ORDER_SCHEMA}}]
AISLES = ["dairy", "bakery", "produce", "frozen food", "household", "pet food", "drinks",
          "snacks", "baby care", "canned food", "spices", "cleaning"]


def manual() -> str:
    """A store manual of ~1,200 tokens: the long system prompt a store's assistant sends
    with every question."""
    lines = [f"Aisle {k + 1} holds {name}. It is restocked every {k % 3 + 1} days before "
             f"{7 + k % 4} in the morning; damaged {name} items go to the returns cage at "
             f"the back, and price labels for {name} are printed at the desk in aisle "
             f"{(k + 5) % len(AISLES) + 1}."
             for k, name in enumerate(AISLES * 3)]
    return "Store manual. Answer the staff's questions from it.\n" + "\n".join(lines)


def ask_manual(i: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": manual()},
            {"role": "user", "content": f"Question {i}: where do damaged items of aisle "
                                        f"{i % len(AISLES) + 1} go?"}]


def _valid_call(done: Completion) -> bool:
    """Whether the answer is one call of `record_order` whose arguments fit its schema: in
    `tool_calls`, or written as llama.cpp's generic call in the text (llama-server's
    answer, see `_tools`)."""
    calls = done.message.get("tool_calls") or []
    try:
        if not calls and done.message.get("content"):
            call = json.loads(done.message["content"])["tool_call"]
            calls = [{"function": {"name": call["name"],
                                   "arguments": json.dumps(call["arguments"])}}]
        if len(calls) != 1 or calls[0]["function"]["name"] != "record_order":
            return False
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), ORDER_SCHEMA)
    except (ValueError, KeyError, TypeError, jsonschema.ValidationError):
        return False
    return True


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
        lines: list[str] = []  # printed after the table below
        tools = _tools(peers, extra=extra, rounds=rounds, echo=lines.append)
        prefix = _long_prefix(peers, extra=extra, rounds=rounds, echo=lines.append)
        peers["llama-server ngram"] = LlamaServerPeer(
            binary, path, model, threads=threads, context=context, parallel=parallel,
            extra_args=("--spec-type", "ngram-simple"))
        lookup = _lookup(peers, extra=extra, rounds=rounds, echo=lines.append)
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
            if kind == "schema":
                report(echo, "llama_server.schema_tokens_per_s", out[f"schema_c{c}"][
                    "tokens_per_s_ratio"], c=c, rounds=tps_rounds)
            elif c == 1:
                report(echo, "llama_server.plain_tokens_per_s", out["plain_c1"][
                    "tokens_per_s_ratio"], rounds=tps_rounds)
                report(echo, "llama_server.plain_ttft", out["plain_c1"]["ttft_ratio"],
                       rounds=[a[1] / b[1] for a, b in zip(e, ls, strict=True)])
    for name in figures:
        for c in levels:
            own = statistics.median(
                s[0] / p[0] for s, p in zip(figures[name]["schema"][c],
                                            figures[name]["plain"][c], strict=True))
            echo(f"  {name} c={c}: schema / plain tokens/s {own:.2f}x")
            out[f"{name}_schema_over_plain_c{c}"] = own
    for line in lines:
        echo(line)
    out["tools"], out["long_prefix"], out["lookup"] = tools, prefix, lookup
    out["burst"] = _burst(state_dir, path, model, binary, threads=threads, context=context,
                          extra=extra, echo=echo, rounds=rounds, max_tokens=max_tokens)
    out["client_side"] = bench_client_side(state_dir, path, model, binary, threads=threads,
                                           extra=extra, echo=echo, rounds=rounds)
    out["client_side"]["repeats"] = bench_repeats_and_contention(
        state_dir, path, model, binary, threads=threads, extra=extra, echo=echo,
        rounds=rounds)
    return out


def _tools(peers: dict[str, HttpPeer], *, extra: dict[str, Any], rounds: int, echo: Echo,
           max_tokens: int = 160) -> dict[str, Any]:
    """Tool calls at c=1, answered whole, the servers taking turns; per server and round a
    call, then plain text of the call's length (end-of-generation biased away) on a
    question of its own: completion tokens / the request's wall time, prompt included, as
    the app waits for it.

    edge-agent gets `tools` with `tool_choice: "required"`: the tools in its system prompt
    and llama.cpp's generic call, `{"tool_call": {"name": …, "arguments": …}}`, under a
    grammar from their schema. llama-server leaves a template without tool markup
    (SmolLM2's) unconstrained, answering free text (0 of 3 calls valid), so it gets the
    same: edge-agent's tool instructions as the system message and the call's schema as
    `response_format`."""
    schema = tool_call_schema(TOOLS, "required")
    bodies: dict[str, dict[str, Any]] = {
        name: {"tools": TOOLS, "tool_choice": "required"} for name in peers}
    bodies["llama-server"] = {"response_format": {"type": "json_schema", "json_schema": {
        "name": "tool_call", "schema": schema}}}
    system = {"role": "system", "content": tool_instructions(TOOLS, "required")}

    def ask(name: str, i: int) -> list[dict[str, str]]:
        return ([system] if name == "llama-server" else []) + ask_order(i)

    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in peers}
    valid = dict.fromkeys(peers, 0)
    for name, peer in peers.items():  # warm-up: the grammar's conversion, the tools' cells
        peer.complete(ask(name, -5), max_tokens, bodies[name])
    for r in range(rounds):
        for name, peer in peers.items():
            call = peer.complete(ask(name, 7000 + r), max_tokens, bodies[name])
            valid[name] += _valid_call(call)
            plain = peer.complete(ask_order(7500 + r), max(2, call.tokens), extra)
            rows[name].append((call.tokens_per_s, plain.tokens_per_s))
    edge, llama = rows["edge-agent"], rows["llama-server"]
    vs_llama = [a[0] / b[0] for a, b in zip(edge, llama, strict=True)]
    own = [a[0] / a[1] for a in edge]
    med = {name: [statistics.median(x[i] for x in series) for i in (0, 1)]
           for name, series in rows.items()}
    echo(f"  tool calls c=1, whole answers (completion tokens / wall time): edge-agent "
         f"{med['edge-agent'][0]:.1f} tok/s, llama-server {med['llama-server'][0]:.1f} tok/s; "
         f"valid calls {valid['edge-agent']}/{rounds} and {valid['llama-server']}/{rounds}")
    report(echo, "llama_server.tools_tokens_per_s", statistics.median(vs_llama),
           rounds=vs_llama)
    report(echo, "llama_server.tools_over_plain", statistics.median(own), rounds=own)
    return {"tokens_per_s_ratio": statistics.median(vs_llama),
            "over_plain": statistics.median(own), "valid": valid, "rounds": rounds,
            "edge_tokens_per_s": med["edge-agent"][0],
            "llama_tokens_per_s": med["llama-server"][0]}


def _lookup(peers: dict[str, HttpPeer], *, extra: dict[str, Any], rounds: int, echo: Echo,
            max_tokens: int = 96) -> dict[str, Any]:
    """Prompt lookup at c=1 on answers that quote their prompt: per round one prompt, its
    cells computed first on each server (a 1-token request), then asked with it on and off
    of each (edge-agent's header; llama-server's ngram server and its plain one), in turn:
    a stream's decode rate, and whether on and off wrote the same text."""
    ways = {"edge on": ("edge-agent", "8"), "edge off": ("edge-agent", "0"),
            "llama on": ("llama-server ngram", ""), "llama off": ("llama-server", "")}
    rate: dict[str, list[float]] = {way: [] for way in ways}
    same = {"edge": 0, "llama": 0}
    for name in {server for server, _ in ways.values()}:
        peers[name].chat(quote_prompt(-1), 4, extra)
    for r in range(rounds):
        prompt = quote_prompt(6000 + r)
        for name in {server for server, _ in ways.values()}:
            peers[name].chat(prompt, 1, extra)
        text: dict[str, str] = {}
        for way, (name, header) in ways.items():
            body = {**extra, "headers": {"X-Edge-Prompt-Lookup": header}} if header else extra
            sample = peers[name].chat(prompt, max_tokens, body)
            rate[way].append(1 / sample.tpot_s)
            text[way] = sample.text
        same["edge"] += text["edge on"] == text["edge off"]
        same["llama"] += text["llama on"] == text["llama off"]
    med = {way: statistics.median(v) for way, v in rate.items()}
    vs_llama = [a / b for a, b in zip(rate["edge on"], rate["llama on"], strict=True)]
    own = {side: statistics.median(a / b for a, b in zip(rate[f"{side} on"],
                                                          rate[f"{side} off"], strict=True))
           for side in ("edge", "llama")}
    echo(f"  prompt lookup c=1, quoting ({max_tokens} greedy tokens): edge-agent on "
         f"{med['edge on']:.1f} / off {med['edge off']:.1f} tok/s ({own['edge']:.2f}x, the "
         f"same text in {same['edge']} of {rounds}), llama-server ngram-simple on "
         f"{med['llama on']:.1f} / off {med['llama off']:.1f} tok/s ({own['llama']:.2f}x, "
         f"{same['llama']} of {rounds})")
    report(echo, "llama_server.lookup_tokens_per_s", statistics.median(vs_llama),
           rounds=vs_llama)
    return {"tokens_per_s_ratio": statistics.median(vs_llama), "on_over_off": own,
            "same_text": same, "tokens_per_s": med}


def _long_prefix(peers: dict[str, HttpPeer], *, extra: dict[str, Any], rounds: int,
                 echo: Echo) -> dict[str, Any]:
    """A ~1,200-token system prompt shared by every request, a new question each time, at
    c=1: TTFT p50 of each server, the manual's cells computed once before (each server's
    own prompt cache: llama-server's slot, edge-agent's sequences)."""
    ttft: dict[str, list[float]] = {name: [] for name in peers}
    prompt = dict.fromkeys(peers, 0)
    for peer in peers.values():
        peer.chat(ask_manual(-1), 1, extra)
    for r in range(rounds):
        for name, peer in peers.items():
            sample = peer.chat(ask_manual(r), 8, extra)
            ttft[name].append(sample.ttft_s)
            prompt[name] = sample.prompt_tokens or prompt[name]
    ratios = [a / b for a, b in zip(ttft["edge-agent"], ttft["llama-server"], strict=True)]
    med = {name: statistics.median(v) for name, v in ttft.items()}
    echo(f"  long shared prefix c=1 ({prompt['edge-agent'] or '?'} prompt tokens): TTFT p50 "
         f"edge-agent {med['edge-agent'] * 1000:.0f} ms, llama-server "
         f"{med['llama-server'] * 1000:.0f} ms")
    report(echo, "llama_server.prefix_ttft", statistics.median(ratios), rounds=ratios)
    return {"ttft_ratio": statistics.median(ratios), "ttft_ratios": ratios,
            "edge_ttft_s": med["edge-agent"], "llama_ttft_s": med["llama-server"]}


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
    report(echo, "llama_server.burst_aggregate", ratio, c=clients, rounds=aggregate)
    report(echo, "llama_server.burst_ttft_growth", ttft, c=clients, rounds=growth)
    return {"aggregate_ratio": ratio, "ttft_growth": ttft, "aggregate_ratios": aggregate,
            "ttft_growths": growth, "edge": med["edge-agent"], "llama": med["llama-server"]}
