"""Bench lines for telemetry: what sampling and scraping cost, and whether observing
requests moves TTFT; for the ledger writer; and for governance (redaction quality on the
labelled samples in `redaction.jsonl` beside this module, its speed, and what it adds to a
request). Targets: `targets.py`."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from edge_agent.bench.serving.peers import EdgeAgentPeer
from edge_agent.bench.targets import report, target, verdict
from edge_agent.engine.request import DoneEvent, Timings, Usage
from edge_agent.telemetry.hardware import HardwareSampler, PsutilReader, Reading
from edge_agent.telemetry.metrics import Metrics

Echo = Callable[[str], None]
# Labelled samples for the redaction detectors, one JSON object a line: {"text": ...,
# "entities": [{"type": ..., "value": ...}]}. Shipped with the package, so an installed
# bench scores them; tests/fixtures/redaction.jsonl links here, and
# tests/fixtures/make_redaction_fixture.py regenerates it.
REDACTION_SAMPLES = "redaction.jsonl"


def redaction_samples() -> list[dict[str, Any]]:
    """The labelled redaction samples shipped with the bench."""
    text = resources.files("edge_agent.bench.serving").joinpath(REDACTION_SAMPLES).read_text(
        encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


_PROSE = ["The customer asked where the gluten-free bread is kept.",
          "Aisle seven has the seasonal offers this week.",
          "Please remind staff that the cold room door must stay closed.",
          "Our loyalty programme gives double points on Tuesdays.",
          "The delivery van arrives after lunch on most days."]


def _fake_model(i: int) -> Any:
    stats = SimpleNamespace(running=1, kv_used=1000, kv_total=16384, last_step_tokens=4,
                            drafted=0, draft_accepted=0, put_back=0)
    worker = SimpleNamespace(stats=stats, queued=2, threads_now=2)
    return SimpleNamespace(info=SimpleNamespace(name=f"model-{i}:q4"), worker=worker,
                           memory=500_000_000, parallel=4)


def _gpu_readings() -> list[Reading]:
    out = []
    for g in range(2):
        labels = (("gpu", str(g)), ("name", "NVIDIA RTX A2000"))
        for name in ("gpu_utilization_ratio", "gpu_memory_used_bytes", "gpu_memory_total_bytes",
                     "gpu_temperature_celsius", "gpu_power_watts", "gpu_sm_clock_hertz",
                     "gpu_throttle_reasons"):
            out.append(Reading(name, 1.0, labels, name))
    return out


def bench_observability(state_dir: Path, model: str, *, threads: int, context: int,
                        echo: Echo) -> dict[str, Any]:
    echo("telemetry")
    sampler = HardwareSampler([PsutilReader(state_dir)], interval_s=5.0)
    for _ in range(50):
        sampler.sample()
    share = sampler.cpu_seconds / sampler.samples / sampler.interval_s * 100
    report(echo, "telemetry.sampling_core_percent", share)

    sampler.snapshot = sampler.snapshot + _gpu_readings()
    models = [_fake_model(i) for i in range(4)]
    metrics = Metrics(lambda: models, sampler)  # type: ignore[arg-type,return-value]
    done = DoneEvent("stop", Usage(100, 20, 50), Timings(1_000_000, 0, 50_000_000,
                                                         400_000_000, 460_000_000))
    for m in models:
        for dialect in ("openai", "ollama"):
            metrics.observe_done(m.info.name, dialect, done, 0.05)
    times = []
    for _ in range(30):
        start = time.perf_counter()
        metrics.render()
        times.append(time.perf_counter() - start)
    scrape_ms = statistics.median(times) * 1000
    report(echo, "telemetry.scrape_ms", scrape_ms)

    # Both servers up at once, asked in turns: a shared host's drift then moves both alike
    # (one after the other, a slow minute read as a 1.5x cost of metrics).
    peers = {label: EdgeAgentPeer(state_dir, model, threads=threads, context=context,
                                  parallel=4, env={"EDGE_AGENT_TELEMETRY__METRICS": flag})
             for label, flag in (("on", "true"), ("off", "false"))}
    firsts: dict[str, list[float]] = {label: [] for label in peers}
    try:
        for peer in peers.values():
            peer.chat([{"role": "user", "content": "warm up"}], 4)
        for i in range(15):
            for label, peer in peers.items():
                sample = peer.chat([{"role": "user", "content": f"Question {i} about stock?"}],
                                   8)
                firsts[label].append(sample.ttft_s)
    finally:
        for peer in peers.values():
            peer.close()
    ttft = {label: statistics.median(v) for label, v in firsts.items()}
    ratio = ttft["on"] / ttft["off"]
    echo(f"  TTFT p50 with metrics on {ttft['on'] * 1000:.1f} ms, off {ttft['off'] * 1000:.1f} ms")
    report(echo, "telemetry.ttft_ratio", ratio)
    return {"sampling_core_percent": share, "scrape_ms": scrape_ms, "ttft_ratio": ratio}


def bench_ledger(echo: Echo, rows: int = 20_000) -> dict[str, Any]:
    import tempfile

    from edge_agent.ledger.writer import LedgerWriter

    echo("ledger")
    with tempfile.TemporaryDirectory() as tmp:
        writer = LedgerWriter(Path(tmp) / "ledger.db")
        now = time.time()
        start = time.perf_counter()
        for i in range(rows):
            writer.record({"id": f"bench-{i}", "trace_id": f"t-{i}", "ts": now, "status": 200,
                           "tenant": "local", "model": "smollm2:135m", "dialect": "openai",
                           "endpoint": "/v1/chat/completions", "prompt_tokens": 100,
                           "completion_tokens": 50, "ttft_ms": 40.0, "total_ms": 400.0})
        writer.flush(timeout=120)
        elapsed = time.perf_counter() - start
        writer.close()
    rate = rows / elapsed
    report(echo, "ledger.rows_per_s", rate, rows=rows)
    return {"rows_per_s": rate}


def _governance_path_ms(cfg: Path, state: Path, redactor: Any) -> float:
    """The work governance adds before a request reaches the scheduler, timed in process
    (the end-to-end difference between two servers is buried in their noise)."""
    from edge_agent.config import load_settings
    from edge_agent.governance.keys import KeyStore
    from edge_agent.governance.tenants import Governor
    from edge_agent.ledger.writer import LedgerWriter

    settings = load_settings(cfg, state_dir=state)
    keys = KeyStore(state)
    key, _ = keys.create("app")
    governor = Governor(settings, keys)
    writer = LedgerWriter(state / "ledger.db")
    prompt = "Question 3: please call me at jane.doe@example.com about aisle 4 restocking."
    times = []
    for i in range(2000):
        start = time.perf_counter()
        ctx = governor.authenticate(f"Bearer {key}")
        ctx.check_model("smollm2:135m")
        governor.admit(ctx)
        text, spans = redactor.redact(prompt)
        for span in spans:
            writer.record({"request_id": str(i), "entity_type": span.entity}, "redactions")
        writer.record({"request_id": str(i), "text": text, "ts": time.time()}, "contents")
        writer.record({"id": f"g{i}", "trace_id": str(i), "ts": time.time(), "status": 200})
        times.append(time.perf_counter() - start)
    writer.close()
    return statistics.median(times) * 1000


def bench_governance(state_dir: Path, model: str, *, threads: int, context: int,
                     echo: Echo) -> dict[str, Any]:
    """Redaction speed and quality, and what auth + limits + redaction add to TTFT."""
    import tempfile

    from edge_agent.governance.keys import KeyStore
    from edge_agent.governance.redaction import Detectors, Redactor, evaluate

    echo("governance")
    detectors = Detectors(["US", "GB", "DE", "FR"], ["us", "es", "it"])
    corpus = redaction_samples()
    scores: dict[str, Any] = evaluate(detectors, corpus)
    recall, precision = target("governance.recall"), target("governance.precision")
    for entity, s in scores.items():
        ok = recall.met(s["recall"]) and precision.met(s["precision"])
        echo(f"  {entity:<12} recall {s['recall']:.3f} ({recall.shown})  precision "
             f"{s['precision']:.3f} ({precision.shown})  on {len(corpus)} labelled samples"
             f"  {verdict(ok)}")
    labelled = [s["text"] for s in corpus]
    # Mixed text: store-floor prose with one labelled sample in every five sentences; and
    # the labelled samples alone (an identifier in every sentence) as the worst case.
    mixed = " ".join(s if i % 5 == 0 else _PROSE[i % 5]
                     for i, s in enumerate(labelled * 5))
    redactor = Redactor(detectors, b"k" * 32)
    rates = {}
    for label, base in (("mixed", mixed), ("dense", " ".join(labelled))):
        text = (base + " ") * max(1, 2_000_000 // len(base))
        runs = []
        for _ in range(3):
            start = time.process_time()
            redactor.redact(text)
            runs.append(time.process_time() - start)
        rates[label] = len(text.encode()) / statistics.median(runs) / 1e6
    report(echo, "governance.redaction_mb_s", rates["mixed"])
    echo(f"  redaction, identifier in every sentence (worst case): {rates['dense']:.2f} MB/s")
    rate = rates["mixed"]

    ttft = {}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "config.toml"
        cfg.write_text('[tenants.app]\nmax_output_tokens = 64\nrequests_per_minute = 100000\n'
                       'tokens_per_minute = 100000000\nredact_prompt = true\n'
                       '[retention]\ncontent_hours = 1\n')
        for label in ("off", "on"):
            env = {"EDGE_AGENT_TELEMETRY__HARDWARE": "false"}
            extra: dict[str, Any] = {}
            gov_state = Path(tmp) / label
            if label == "on":
                import shutil

                shutil.copytree(state_dir / "manifests", gov_state / "manifests")
                (gov_state / "blobs").mkdir()
                for blob in (state_dir / "blobs").glob("sha256-*"):
                    (gov_state / "blobs" / blob.name).symlink_to(blob.resolve())
                key, _ = KeyStore(gov_state).create("app")
                extra = {"headers": {"Authorization": f"Bearer {key}"}}
            peer = EdgeAgentPeer(gov_state if label == "on" else state_dir, model,
                                 threads=threads, context=context, parallel=4, env=env,
                                 config=cfg if label == "on" else None)
            try:
                peer.chat([{"role": "user", "content": "warm up"}], 4, extra)
                # Same prompts both ways (no personal data, so redaction scans but changes
                # nothing and prefix reuse is alike).
                samples = [peer.chat([{"role": "user", "content":
                                       f"Question {i}: when does aisle {i} get restocked?"}],
                                     8, extra) for i in range(9)]
            finally:
                peer.close()
            ttft[label] = statistics.median(s.ttft_s for s in samples)
        added_ms = _governance_path_ms(cfg, Path(tmp) / "path", redactor)
    echo(f"  end to end (two servers, noisy): TTFT p50 governance on {ttft['on'] * 1000:.1f} ms,"
         f" off {ttft['off'] * 1000:.1f} ms")
    report(echo, "governance.added_ttft_ms", added_ms)
    return {"redaction_mb_s": rate, "added_ttft_ms": added_ms,
            "scores": {k: {"recall": v["recall"], "precision": v["precision"]}
                       for k, v in scores.items()}}
