"""Bench lines for telemetry: what sampling and scraping cost, and whether observing
requests moves TTFT."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from edge_agent.bench.peers import EdgeAgentPeer
from edge_agent.engine.request import DoneEvent, Timings, Usage
from edge_agent.telemetry.hardware import HardwareSampler, PsutilReader, Reading
from edge_agent.telemetry.metrics import Metrics

Echo = Callable[[str], None]


def _line(echo: Echo, label: str, value: float, unit: str, target: str, ok: bool) -> None:
    shown = f"{value:,.0f}" if value >= 1000 else f"{value:.3g}"
    echo(f"  {label:<62} {shown:>7}{unit:<2} {target:<10} {'ok' if ok else 'MISSED'}")


def _fake_model(i: int) -> Any:
    stats = SimpleNamespace(running=1, kv_used=1000, kv_total=16384, last_step_tokens=4)
    worker = SimpleNamespace(stats=stats, queued=2)
    return SimpleNamespace(info=SimpleNamespace(name=f"model-{i}:q4"), worker=worker,
                           memory=500_000_000)


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
    _line(echo, "hardware sampling, share of one core at the 5 s default", share, "%",
          "<= 1%", share <= 1)

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
    _line(echo, "/metrics render, 4 models + 2 GPUs of series (median)", scrape_ms, "ms",
          "<= 20 ms", scrape_ms <= 20)

    ttft = {}
    for label, flag in (("on", "true"), ("off", "false")):
        peer = EdgeAgentPeer(state_dir, model, threads=threads, context=context, parallel=4,
                             env={"EDGE_AGENT_TELEMETRY__METRICS": flag})
        try:
            peer.chat([{"role": "user", "content": "warm up"}], 4)
            samples = [peer.chat([{"role": "user", "content": f"Question {i} about stock?"}],
                                 8) for i in range(9)]
        finally:
            peer.close()
        ttft[label] = statistics.median(s.ttft_s for s in samples)
    ratio = ttft["on"] / ttft["off"]
    echo(f"  TTFT p50 with metrics on {ttft['on'] * 1000:.1f} ms, off {ttft['off'] * 1000:.1f} ms")
    _line(echo, "TTFT, metrics on / off", ratio, "x", "~1.0", ratio <= 1.1)
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
    _line(echo, f"ledger writer, {rows} rows through the batching thread", rate, "/s",
          ">= 5,000/s", rate >= 5000)
    return {"rows_per_s": rate}
