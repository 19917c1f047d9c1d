"""Prompt lookup on and off on the same server, at c=1: answers that quote their prompt (a
returns policy, a product list: a store assistant's most common shape) and free text.

On and off take turns request by request (`X-Edge-Prompt-Lookup: 8` vs `0`), each pair on
a prompt of its own asked once each way after its cells were computed by a one-token
request, so a shared host's drift moves both alike; the figure is the median over the
rounds of the per-pair ratio of a stream's decode rate (1 / TPOT), with the range of those
ratios as the noise. Both ways run greedy to
`max_tokens`, so their texts are compared too: the pair's answers must be the same.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edge_agent.bench.serving.peers import EdgeAgentPeer
from edge_agent.bench.targets import report

Echo = Callable[[str], None]

POLICIES = [
    "Returns policy: Unopened items can be returned within {n} days with the receipt for a "
    "full refund. Opened electronics can be returned within 14 days and a restocking fee of "
    "10 percent applies. Fresh food, gift cards and personalised items cannot be returned. "
    "Refunds are paid to the original payment method within 5 business days.",
    "Click and collect: Orders placed before {n} o'clock are ready the same day at the "
    "service desk. Bring the order number and a photo ID. Orders not collected within 7 "
    "days are cancelled and refunded. Large items are handed over at the loading bay.",
]
PRODUCTS = ["Organic whole milk 1 L", "Sourdough bread 500 g", "Free-range eggs, 10 pack",
            "Basmati rice 1 kg", "Extra virgin olive oil 750 ml", "Greek yoghurt 500 g"]


def quote_prompt(i: int) -> list[dict[str, str]]:
    """Request `i`: a text to quote back, with a number of its own (no two prompts alike)."""
    if i % 2:
        items = "\n".join(f"- SKU {1000 + 7 * i + k}: {name}, aisle {k + 2}"
                          for k, name in enumerate(PRODUCTS))
        return [{"role": "user", "content": f"Product list:\n{items}\n\nCopy the product "
                                            f"list above exactly, one line per product."}]
    policy = POLICIES[i // 2 % len(POLICIES)].format(n=10 + i)
    return [{"role": "user", "content": f"{policy}\n\nQuote the text above word for word."}]


def free_prompt(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a short story about fox number {i} in a "
                                        f"forest."}]


def bench_lookup(state_dir: Path, model: str, *, threads: int, context: int, rounds: int = 6,
                 max_tokens: int = 96, draft: int = 8, extra: dict[str, Any],
                 echo: Echo) -> dict[str, Any]:
    # Prompt lookup alone: the second of each pair would otherwise also guess from the
    # first's answer to the same prompt (`answer_drafts`).
    peer = EdgeAgentPeer(state_dir, model, threads=threads, context=context, parallel=1,
                         answer_drafts=0)
    kinds: dict[str, Callable[[int], list[dict[str, str]]]] = {
        "quoting": quote_prompt, "free": free_prompt}
    ratios: dict[str, list[float]] = {k: [] for k in kinds}
    rates: dict[str, dict[str, list[float]]] = {k: {"on": [], "off": []} for k in kinds}
    same: dict[str, int] = dict.fromkeys(kinds, 0)
    try:
        peer.chat(free_prompt(-1), 8, extra)  # warm-up, off the figures
        for r in range(rounds):
            for kind, prompt in kinds.items():
                got: dict[str, tuple[float, str]] = {}
                # The prompt's cells first, so that both ways start from the same cache
                # (a prompt computed cold and one computed on cached cells may differ in
                # their last bits, and greedy answers with them).
                peer.chat(prompt(r), 1, extra)
                # On first in even rounds, off first in odd ones.
                for way in (("on", "off") if r % 2 == 0 else ("off", "on")):
                    header = {"X-Edge-Prompt-Lookup": str(draft if way == "on" else 0)}
                    sample = peer.chat(prompt(r), max_tokens, {**extra, "headers": header})
                    got[way] = (1 / sample.tpot_s, sample.text)
                    rates[kind][way].append(got[way][0])
                ratios[kind].append(got["on"][0] / got["off"][0])
                same[kind] += got["on"][1] == got["off"][1]
    finally:
        peer.close()
    echo(f"prompt lookup (X-Edge-Prompt-Lookup: {draft} vs 0, c=1, {rounds} alternating "
         f"pairs of {max_tokens} greedy tokens; a stream's decode tok/s, medians, and the "
         f"range of the per-pair ratios)")
    out: dict[str, Any] = {}
    for kind in kinds:
        on, off = (statistics.median(rates[kind][w]) for w in ("on", "off"))
        ratio = statistics.median(ratios[kind])
        echo(f"  {kind:<8} on {on:6.1f} tok/s, off {off:6.1f} tok/s; the same text in "
             f"{same[kind]} of {rounds} pairs")
        if kind == "quoting":
            report(echo, "lookup.quoting_ratio", ratio, rounds=ratios[kind])
        else:
            report(echo, "lookup.free_ratio", ratio, rounds=ratios[kind])
        out[kind] = {"ratio": ratio, "ratios": ratios[kind], "on_tps": on, "off_tps": off,
                     "same_text": same[kind], "pairs": rounds}
    return out
