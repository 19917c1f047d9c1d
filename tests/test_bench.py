"""The benchmark's load driver, with a stand-in peer (the peers themselves are real
servers, exercised by `make bench`); its targets, one table; and what it ships."""

from __future__ import annotations

import ast
import math
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

import edge_agent
import edge_agent.bench
from edge_agent.bench.serving.llama_server import TOOLS, _valid_call, ask_manual
from edge_agent.bench.serving.observability import REDACTION_SAMPLES, redaction_samples
from edge_agent.bench.serving.peers import Completion, HttpPeer, Sample
from edge_agent.bench.serving.run import deep_decode_cost, request_scaling, run_levels
from edge_agent.bench.serving.structured import ask_order
from edge_agent.bench.targets import BY_KEY, TARGETS, report
from edge_agent.engine.models.catalog import ModelStore
from tests.conftest import DEFAULT_MODEL, NO_EOS, LiveServer


class _Recorder:
    name = "recorder"

    def __init__(self) -> None:
        self.calls: list[float] = []
        self.active = 0
        self.peak: list[int] = []
        self._lock = threading.Lock()

    def chat(self, messages: list[dict[str, str]], max_tokens: int,
             extra: dict[str, Any] | None = None) -> Sample:
        with self._lock:
            self.active += 1
            self.peak.append(self.active)
        sample = Sample(start=time.perf_counter())
        time.sleep(0.01)
        sample.arrivals = [time.perf_counter() + i * 1e-4 for i in range(max_tokens)]
        with self._lock:
            self.active -= 1
        return sample

    def close(self) -> None:
        pass


def test_levels_take_turns_and_each_gets_eight_requests() -> None:
    peer = _Recorder()
    loads = run_levels(peer, [1, 4, 8], 3, 2, {})
    assert {c: len(load.samples) for c, load in loads.items()} == {1: 8, 4: 8, 8: 16}
    # Bursts alternate: the first c=1 burst ran before the first c=8 burst, and the last
    # c=1 burst after it.
    ones = sorted(s.start for s in loads[1].samples)
    eights = sorted(s.start for s in loads[8].samples)
    assert ones[0] < eights[0] < ones[-1]
    assert max(peer.peak) == 8
    assert all(load.tokens_per_s > 0 for load in loads.values())


def test_request_shaped_ceiling_runs_the_real_engine(model_cache: Path) -> None:
    path = ModelStore(model_cache).get(DEFAULT_MODEL).blob_path(model_cache)
    for cached in (0, 6):
        ratio = request_scaling(path, threads=2, rows=3, tokens=4, prefill=5, cached=cached,
                                rounds=1)
        # A figure came out of the real engine; how large it is, is the bench's to judge
        # (one round on a shared machine says nothing about speed).
        assert math.isfinite(ratio) and ratio > 0


# -- targets: one table, judged in one place ------------------------------------------------
BENCH = Path(edge_agent.bench.__file__).parent
PACKAGE = Path(edge_agent.__file__).parent


def _target_keys(tree: ast.AST) -> list[ast.expr]:
    """The key argument of every `report(echo, key, …)` and `target(key)` call."""
    keys = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "report":
                keys.append(node.args[1])
            elif node.func.id == "target":
                keys.append(node.args[0])
    return keys


def test_deep_decode_steps_run_the_real_engine_at_each_depth(model_cache: Path) -> None:
    """Each depth's step is timed with its sequences filled that deep (past one 512-token
    pass), and the step's own cell is dropped again, so every step is as deep."""
    path = ModelStore(model_cache).get(DEFAULT_MODEL).blob_path(model_cache)
    costs = deep_decode_cost(path, threads=2, flash_attn="off", rows=2, depths=(8, 600),
                             steps=3)
    # llama.cpp refuses a step whose position does not follow the sequence's last cell:
    # a figure for 600 means 600 cells were there, and only they.
    assert list(costs) == [8, 600]
    assert all(math.isfinite(c) and c > 0 for c in costs.values())


def test_every_target_the_bench_prints_comes_from_the_table() -> None:
    """The scenarios name targets by key only; every key is in the table, and every entry
    of the table is used."""
    used: set[str] = set()
    for path in sorted(BENCH.rglob("*.py")):
        if path.name == "targets.py":
            continue
        source = path.read_text()
        tree = ast.parse(source)
        for key in _target_keys(tree):
            assert isinstance(key, ast.Constant) and key.value in BY_KEY, (
                path.name, ast.unparse(key))
            used.add(key.value)
        # Nothing else judges: no ok/MISSED of its own, no figure compared with a number.
        assert "MISSED" not in source, path.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(
                    isinstance(op, ast.Lt | ast.LtE | ast.Gt | ast.GtE) for op in node.ops):
                sides = [node.left, *node.comparators]
                number = any(isinstance(c, ast.Constant) and isinstance(c.value, int | float)
                             for c in sides)
                counted = any(isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
                              and c.func.id == "len" for c in sides)
                assert not number or counted, (path.name, ast.unparse(node))
    assert used == set(BY_KEY)
    assert len(BY_KEY) == len(TARGETS)  # no key twice


def test_a_figure_is_judged_and_printed_against_its_target() -> None:
    lines: list[str] = []
    assert report(lines.append, "single.tokens_per_s_ratio", 0.95)
    assert not report(lines.append, "single.tokens_per_s_ratio", 0.94)
    assert report(lines.append, "concurrency.ttft_growth", 5.0, top=8, one=1)
    assert not report(lines.append, "concurrency.ttft_growth", 5.01, top=8, one=1)
    assert report(lines.append, "ledger.rows_per_s", 12345.6, rows=20000)
    assert lines[0].split() == ["tokens/s,", "edge-agent", "/", "in-process", "0.95x", ">=",
                                "0.95", "ok"]
    assert lines[1].endswith("MISSED")
    assert "TTFT p50, c=8 / c=1" in lines[2] and lines[3].endswith("MISSED")
    assert "ledger writer, 20000 rows" in lines[4] and "12,346/s" in lines[4]
    assert lines[4].split()[-3:] == [">=", "5,000/s", "ok"]
    shown = {t.key: t.shown for t in TARGETS}
    assert shown["telemetry.sampling_core_percent"] == "<= 1%"
    assert shown["telemetry.scrape_ms"] == "<= 20 ms"
    assert shown["governance.redaction_mb_s"] == ">= 5 MB/s"
    assert shown["prefix.ratio"] == "<= 0.1"


def test_a_figure_whose_rounds_straddle_its_bound_widely_is_too_noisy_to_judge() -> None:
    lines: list[str] = []
    # Rounds 0.84-1.17 around a bound of 1.05: the median's verdict would not hold.
    assert not report(lines.append, "llama_server.burst_aggregate", 0.91, c=8,
                      rounds=[0.84, 0.88, 0.91, 1.02, 1.17])
    assert "MISSED (too noisy to judge)  rounds 0.84-1.17" in lines[-1]
    # Wide, but every round on one side: the verdict stands.
    assert report(lines.append, "llama_server.burst_aggregate", 1.4, c=8,
                  rounds=[1.1, 1.4, 1.9])
    assert lines[-1].endswith("ok  rounds 1.10-1.90")
    # Straddling, but narrow: a close call, judged by the median.
    assert not report(lines.append, "llama_server.plain_tokens_per_s", 0.97,
                      rounds=[0.93, 0.97, 1.01])
    assert lines[-1].endswith("MISSED  rounds 0.93-1.01")
    # One round says nothing about noise.
    assert report(lines.append, "llama_server.plain_tokens_per_s", 1.2, rounds=[1.2])
    assert lines[-1].endswith("ok  rounds 1.20-1.20")


def test_the_package_reads_nothing_from_tests() -> None:
    """A wheel has no tests/: no module of edge_agent imports from it or names a path in
    it (docstrings and comments may mention it)."""
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)
                      and isinstance(n.value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] == "tests" for a in node.names), path
            elif isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] != "tests", path
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and id(node) not in docstrings):
                text = node.value.replace("\\", "/")
                assert text != "tests" and "tests/" not in text, (path, text[:80])


def test_the_labelled_redaction_samples_ship_with_the_bench() -> None:
    samples = redaction_samples()
    assert len(samples) >= 200
    assert all(isinstance(s["text"], str) and isinstance(s["entities"], list)
               for s in samples)
    assert {e["type"] for s in samples for e in s["entities"]} >= {"EMAIL", "CARD"}
    # The tests' fixture is the same file.
    fixture = Path(__file__).parent / "fixtures" / "redaction.jsonl"
    assert fixture.resolve() == (BENCH / "serving" / REDACTION_SAMPLES).resolve()


def _call(arguments: str, name: str = "record_order") -> Completion:
    return Completion(seconds=1.0, tokens=10, finish_reason="tool_calls", message={
        "tool_calls": [{"function": {"name": name, "arguments": arguments}}]})


def test_a_tool_call_counts_as_valid_only_when_its_arguments_fit_the_schema() -> None:
    good = ('{"order_id": "A1", "customer": "Bo Chen", "quantity": 3, "price": 2.5, '
            '"express": true}')
    assert _valid_call(_call(good))
    assert not _valid_call(_call(good, name="other"))
    assert not _valid_call(_call(good.replace("3", "300")))  # maximum 100
    assert not _valid_call(_call(good[:-1]))  # cut short
    assert not _valid_call(Completion(1.0, 10, {"content": good}, "stop"))


@pytest.mark.integration
def test_the_tool_call_round_is_answered_with_a_valid_call(live_server: LiveServer) -> None:
    """The bench's tool-call request, as `_tools` sends it, on edge-agent: one valid call,
    counted in completion tokens (a server that answered otherwise would be measured on
    something else)."""
    peer = HttpPeer.__new__(HttpPeer)  # the server is already running: no process
    peer.model = DEFAULT_MODEL
    with httpx.Client(base_url=live_server.base_url, timeout=120) as peer.client:
        done = peer.complete(ask_order(7000), 96, {"tools": TOOLS, "tool_choice": "required"})
    assert done.finish_reason == "tool_calls" and _valid_call(done)
    assert done.tokens > 10 and done.tokens_per_s > 0


def test_the_long_prefix_is_long_and_shared() -> None:
    a, b = ask_manual(1), ask_manual(2)
    assert a[0] == b[0] and a[1] != b[1]
    assert len(a[0]["content"]) > 4000  # ~1,200 tokens of English


@pytest.mark.integration
def test_the_client_side_requests_are_timed_in_three_parts(live_server: LiveServer) -> None:
    """Each case of the client-side section against edge-agent: 64 tokens counted from
    `usage`, and the wall time split into parts that add up to it (not streamed: the
    server's own prompt and decoding times, from its Server-Timing header)."""
    from edge_agent.bench.serving.client_side import CASES, MAX_TOKENS, _body, ask

    peer = HttpPeer.__new__(HttpPeer)
    peer.model = DEFAULT_MODEL
    with httpx.Client(base_url=live_server.base_url, timeout=120) as client:
        for case in CASES[:4] + CASES[-1:]:  # c=1 whole and streamed, both temperatures
            timed = ask(client, _body(peer, case, 3, {"logit_bias": NO_EOS}))
            assert timed.tokens == MAX_TOKENS, case
            parts = timed.before_ms + timed.decode_ms + timed.after_ms
            assert abs(parts - timed.wall_s * 1000) < 1, case
            assert timed.before_ms > 0 and timed.decode_ms > 0 and timed.after_ms > 0, case
        r = client.post("/v1/chat/completions", json=_body(peer, CASES[0], 4, {}))
    timing = r.headers["server-timing"]
    assert timing.startswith("queue;dur=") and "prompt;dur=" in timing and "decode;dur=" in timing


def test_a_busy_threads_cpu_is_read_from_proc() -> None:
    """`thread_cpu` finds a thread that has spun for 0.2 s of CPU (by its own clock), and
    a thread that only waited stays near zero."""
    import os

    from edge_agent.bench.serving.client_side import thread_cpu

    ids: dict[str, int] = {}
    spun = threading.Event()
    release = threading.Event()

    def spin() -> None:
        ids["busy"] = threading.get_native_id()
        while time.thread_time() < 0.2:
            pass
        spun.set()
        release.wait()

    def idle() -> None:
        ids["idle"] = threading.get_native_id()
        release.wait()

    threads = [threading.Thread(target=spin), threading.Thread(target=idle)]
    for t in threads:
        t.start()
    try:
        assert spun.wait(30)
        cpu = thread_cpu(os.getpid())
        assert cpu[ids["busy"]] >= 0.19
        assert cpu[ids["idle"]] < 0.05
    finally:
        release.set()
        for t in threads:
            t.join()
    assert thread_cpu(2**22 + 7) == {}  # no such process


def test_the_busiest_threads_count_as_the_engine_and_the_bound_is_their_cpu() -> None:
    """Per request: the `threads` busiest threads' CPU is the engine's, the rest is the
    serving's; the aggregate is tokens over the round's wall time; llama-server's engine
    CPU over edge-agent's is printed as the bound of the ratio."""
    from edge_agent.bench.serving.client_side import (
        CASES,
        CpuUse,
        Round,
        Timed,
        _aggregates,
        _cpu_summary,
    )

    use = CpuUse()
    use.add({1: 1.0, 2: 1.0, 3: 0.0}, {1: 3.0, 2: 2.9, 3: 0.2, 4: 0.1}, 2.0, 4, 2)
    assert use.per_request_ms() == pytest.approx((975.0, 75.0))
    assert use.cores == pytest.approx(2.1)

    c8 = next(c for c in CASES if c.concurrency == 8)
    t = Timed(1.0, 64, 1, 1, 1)
    timed = {c8: {"edge-agent": [Round([t] * 16, 4.0), Round([t] * 16, 5.0)],
                  "llama-server": [Round([t] * 16, 5.0), Round([t] * 16, 5.0)]}}
    out: dict[str, Any] = {c8.label: {}}
    lines: list[str] = []
    _aggregates(timed, out, lines.append)
    assert out[c8.label]["aggregate_rounds"] == pytest.approx([1.25, 1.0])
    assert out[c8.label]["edge_aggregate"] == pytest.approx((256 + 204.8) / 2)
    edge, llama = CpuUse(), CpuUse()
    edge.add({}, {1: 8.0, 2: 8.0, 3: 0.5}, 9.0, 16, 2)
    llama.add({}, {1: 9.0, 2: 9.0, 3: 0.1}, 9.5, 16, 2)
    _cpu_summary({c8: {"edge-agent": edge, "llama-server": llama}}, out, lines.append)
    assert out[c8.label]["cpu"]["engine_cpu_ratio"] == pytest.approx(18 / 16)
    assert any("1.12x" in line and "1000" in line and "1125" in line for line in lines), lines


def test_the_telemetry_sections_stand_in_models_carry_what_the_metrics_read() -> None:
    """The telemetry section times `/metrics` over four stand-in models: each must carry
    every field the live collector reads, or the section ends the bench with an
    AttributeError before its figures."""
    from edge_agent.bench.serving.observability import _fake_model
    from edge_agent.telemetry.metrics import Metrics

    models = [_fake_model(i) for i in range(4)]
    text = Metrics(lambda: models, None).render().decode()  # type: ignore[arg-type,return-value]
    assert 'edge_agent_batch_lines_put_back_total{model="model-3:q4"} 0.0' in text
    assert 'edge_agent_parallel_sequences{model="model-0:q4"} 4.0' in text
