"""Every target the bench judges a figure against, in one table.

A target's key is where its figure sits in the bench's result (`edge-agent bench --json`),
section and name; the scenarios print and judge through `report`, so a bound changes here
and nowhere else. Ratios are between peers measured in the same run on the same machine;
the few absolute figures (a share of a core, milliseconds, rows or megabytes a second)
are costs of edge-agent's own code.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

# A figure measured in rounds is too noisy to judge when its rounds lie on both sides of
# the bound and spread over more than this share of their median: the verdict would
# flip with the next run. (On this 2-core box a quiet run's rounds span 5-20%; a run
# beside a compile or another bench spans 40% and more.)
NOISY_SPREAD = 0.3


@dataclass(frozen=True)
class Target:
    key: str  # "<section>.<figure>", as in the bench's result
    description: str  # the printed label; may name {fields} that `report` fills in
    op: Literal[">=", "<="]
    bound: float
    unit: str = "x"  # "x": a ratio

    def met(self, value: float) -> bool:
        return value >= self.bound if self.op == ">=" else value <= self.bound

    @property
    def shown(self) -> str:
        """The target as printed: ">= 0.95", "<= 20 ms", ">= 5,000/s", "<= 1%"."""
        if self.unit == "x":
            return f"{self.op} {self.bound:,g}"
        space = " " if self.unit[:1].isalpha() else ""
        return f"{self.op} {self.bound:,g}{space}{self.unit}"


TARGETS: tuple[Target, ...] = (
    Target("single.tokens_per_s_ratio", "tokens/s, edge-agent / in-process", ">=", 0.95),
    Target("single.ttft_ratio", "TTFT, edge-agent / in-process", "<=", 1.2),
    Target("concurrency.scale", "aggregate tokens/s, c={top} / c={one}", ">=", 1.8),
    Target("concurrency.ttft_growth", "TTFT p50, c={top} / c={one}", "<=", 5),
    Target("concurrency.vs_peer",
           "aggregate tokens/s at c={top}, edge-agent / peer (interrupt off)", ">=", 2.5),
    Target("prefix.ratio", "TTFT, shared prefix / cold", "<=", 0.1),
    Target("structured.tokens_per_s_ratio",
           "a stream's tokens/s at c={c}, JSON schema / plain", ">=", 0.9),
    Target("structured.ttft_ratio", "TTFT at c={c}, JSON schema / plain", "<=", 1.2),
    Target("lookup.quoting_ratio",
           "a stream's tokens/s quoting its prompt, prompt lookup on / off", ">=", 1.5),
    Target("lookup.free_ratio", "a stream's tokens/s in free text, prompt lookup on / off",
           ">=", 0.95),
    # `edge-agent bench --llama-server PATH`: llama.cpp's own server on the same file.
    Target("llama_server.plain_tokens_per_s",
           "plain text, a stream's tokens/s at c=1, edge-agent / llama-server", ">=", 1.0),
    Target("llama_server.plain_ttft", "plain text, TTFT p50 at c=1, edge-agent / llama-server",
           "<=", 1.2),
    Target("llama_server.schema_tokens_per_s",
           "JSON schema, a stream's tokens/s at c={c}, edge-agent / llama-server", ">=", 1.0),
    Target("llama_server.tools_tokens_per_s",
           "tool calls, tokens/s end to end at c=1, edge-agent / llama-server", ">=", 1.0),
    Target("llama_server.tools_over_plain",
           "edge-agent tool calls / plain text, tokens/s end to end at c=1", ">=", 0.9),
    Target("llama_server.lookup_tokens_per_s",
           "prompt lookup on, quoting, tokens/s at c=1, edge-agent / llama-server ngram",
           ">=", 1.0),
    Target("llama_server.prefix_ttft",
           "long shared prefix, TTFT p50 at c=1, edge-agent / llama-server", "<=", 1.2),
    Target("llama_server.burst_aggregate",
           "c={c} aggregate tokens/s, edge-agent default / llama-server -np {c}", ">=", 1.05),
    Target("llama_server.burst_ttft_growth", "edge-agent default, TTFT p50 at c={c} / c=1",
           "<=", 3),
    # `edge-agent bench client-side PATH` (and the llama-server section): as an app sees it.
    Target("client_side.c1", "{case}: tokens / wall time, edge-agent / llama-server",
           ">=", 1.0),
    Target("client_side.c8", "{case}: tokens / wall time, edge-agent default / llama-server",
           ">=", 1.05),
    # The same section, where clients repeat themselves (repeats) and beside other work
    # (contention).
    Target("recurring.c1", "{case}: tokens / wall time, edge-agent / llama-server", ">=", 1.0),
    Target("recurring.c8", "{case}: tokens / wall time, edge-agent default / llama-server",
           ">=", 1.0),
    Target("conversations.ttft_p50", "conversations, TTFT p50, edge-agent / llama-server",
           "<=", 0.8),
    Target("conversations.ttft_p95", "conversations, TTFT p95, edge-agent / llama-server",
           "<=", 0.8),
    Target("conversations.aggregate",
           "conversations, aggregate tokens/s, edge-agent / llama-server", ">=", 1.0),
    Target("restart.ttft_ratio",
           "first request after a restart, system prompt kept on disk / not", "<=", 0.3),
    Target("contention.kept", "a stream's decode at c=1 beside a hog / quiet, edge-agent",
           ">=", 0.4),
    Target("contention.vs_llama",
           "a stream's decode at c=1 beside a hog, edge-agent / llama-server", ">=", 1.0),
    # `edge-agent bench structured-coverage`: the JSONSchemaBench sample (schema_coverage).
    Target("structured_coverage.edge_invalid",
           "edge-agent answers that finished and do not fit their schema, of {n}", "<=", 0,
           ""),
    Target("structured_coverage.declared_coverage",
           "edge-agent declared coverage, schemas accepted / sent", ">=", 0.85, ""),
    Target("structured_coverage.empirical_coverage",
           "edge-agent empirical coverage, valid answers / schemas sent", ">=", 0.70, ""),
    Target("structured_coverage.categories_below_llama_server",
           "categories of {categories} where edge-agent's empirical coverage < llama-server's",
           "<=", 0, ""),
    Target("chunked_prefill.worst_step_ratio",
           "worst step / normal step (flash_attn = {flash_attn})", "<=", 4),
    Target("chunked_prefill.ttft_ratio",
           "long prompt TTFT, chunked / unchunked (flash_attn = {flash_attn})", "<=", 2),
    Target("telemetry.sampling_core_percent",
           "hardware sampling, share of one core at the 5 s default", "<=", 1, "%"),
    Target("telemetry.scrape_ms", "/metrics render, 4 models + 2 GPUs of series (median)",
           "<=", 20, "ms"),
    Target("telemetry.ttft_ratio", "TTFT, metrics on / off", "<=", 1.1),
    # `edge-agent bench batches`: interactive bursts beside a batch (bench/batches.py).
    Target("batches.ttft_ratio",
           "interactive TTFT p50, {streams} streams, a {lines}-line batch running / none",
           "<=", 1.2),
    # `edge-agent bench upstream`: a request passed to an upstream (bench/upstream.py).
    Target("upstream.added_ttft_ms",
           "TTFT the box adds to a request it passes to an upstream (p50)", "<=", 5, "ms"),
    Target("upstream.chunks_ratio",
           "streamed chunks through the box / straight from the upstream (1: unbuffered)",
           ">=", 0.9),
    Target("ledger.rows_per_s", "ledger writer, {rows} rows through the batching thread",
           ">=", 5000, "/s"),
    # Per entity type, on the labelled samples (redaction.jsonl beside this module).
    Target("governance.recall", "redaction recall, each entity type", ">=", 0.95, ""),
    Target("governance.precision", "redaction precision, each entity type", ">=", 0.90, ""),
    Target("governance.redaction_mb_s",
           "redaction, mixed text (1 identifier per 5 sentences), one core", ">=", 5, "MB/s"),
    Target("governance.added_ttft_ms",
           "added per request: auth + scope + quota + redaction + ledger rows (median)",
           "<=", 1, "ms"),
    # `edge-agent bench fleet`: the link and the controller on loopback, one machine.
    Target("fleet.outbox_msgs_per_s",
           "outbox to controller ack, {messages} msgs (median of {runs})", ">=", 5000, "/s"),
    Target("fleet.ttft_ratio", "TTFT, link on / off (syncing every {sync_s:g} s)", "<=", 1.02),
    Target("fleet.idle_core_percent", "idle link, share of one core over {seconds:g} s",
           "<=", 0.5, "%"),
    Target("fleet.lost", "{devices:,} devices: messages lost (broker restart: {restart})",
           "<=", 0, ""),
    Target("fleet.scale_lost", "{devices:,} devices, {regions} regions, the leading "
           "controller killed: messages lost", "<=", 0, ""),
    Target("fleet.scale_duplicated", "{devices:,} devices, {regions} regions, the leading "
           "controller killed: messages stored twice", "<=", 0, ""),
    Target("fleet.failover_s", "the other controller leads, after the leader's SIGKILL",
           "<=", 5, " s"),
    # `edge-agent bench rollout`: one box, its controller and broker on loopback.
    Target("rollout.download_vs_curl",
           "release download to the last byte, edge-agent / curl (median of {runs})", ">=", 0.9),
    Target("rollout.to_active_s", "rollout start to ACTIVE, one box (median)", "<=", 60, "s"),
    Target("rollout.longest_gap_ms", "longest interval without a token, during the switch",
           "<=", 1000, "ms"),
    Target("rollout.ttft_p99_ratio", "TTFT p99 of short requests, during switch / before",
           "<=", 3),
    Target("rollout.waves_cpu_ms_per_box",
           "controller CPU per box, a rollout in waves over {devices:,} simulated boxes",
           "<=", 10, "ms"),
    Target("agent_rollout.view_right",
           "the controller's view of agent versions matches {devices:,} simulated boxes "
           "after every agent rollout (1 = yes)", ">=", 1, ""),
)

BY_KEY: dict[str, Target] = {t.key: t for t in TARGETS}


def target(key: str) -> Target:
    return BY_KEY[key]


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def too_noisy(t: Target, rounds: Sequence[float]) -> bool:
    """Whether `rounds` (the per-round values whose median is judged) straddle `t`'s bound
    over a spread wider than NOISY_SPREAD of their median."""
    if len(rounds) < 2:
        return False
    low, high = min(rounds), max(rounds)
    middle = statistics.median(rounds)
    straddle = low < t.bound < high
    return straddle and middle > 0 and (high - low) / middle > NOISY_SPREAD


def report(echo: Callable[[str], None], key: str, value: float, *,
           rounds: Sequence[float] = (), **fields: object) -> bool:
    """Prints `value` against its target, ok or MISSED, and says whether it was met.
    `fields` fill the description's {placeholders}. With the `rounds` whose median `value`
    is, their range is printed after the verdict, and a verdict they cannot support is
    flagged: "MISSED (too noisy to judge)" or "ok (too noisy to judge)"."""
    t = BY_KEY[key]
    if t.unit == "x":
        shown = f"{value:.2f}"
    else:
        shown = f"{value:,.0f}" if value >= 1000 else f"{value:.3g}"
    ok = t.met(value)
    label = t.description.format(**fields)
    said = verdict(ok)
    if rounds:
        if too_noisy(t, rounds):
            said += " (too noisy to judge)"
        said += f"  rounds {min(rounds):.2f}-{max(rounds):.2f}"
    echo(f"  {label:<78} {shown:>7}{t.unit:<2} {t.shown:<10} {said}")
    return ok
