"""`edge-agent bench`: measures this box, against peers, in one run.

Single stream: TTFT, TPOT and decode tokens/s through edge-agent's HTTP API (a real
`edge-agent serve` subprocess, streamed over loopback) against llama-cpp-python in
process on the same GGUF with the same template, threads and greedy settings. Requests
alternate between the two so that machine noise falls on both alike; the figures are
medians, and the ratios are what to read.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from edge_agent.engine.catalog import ModelStore


@dataclass(frozen=True)
class Sample:
    ttft_s: float
    total_s: float
    tokens: int

    @property
    def tpot_s(self) -> float:
        return (self.total_s - self.ttft_s) / max(1, self.tokens - 1)

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.tpot_s if self.tpot_s > 0 else 0.0


@dataclass(frozen=True)
class Summary:
    name: str
    samples: list[Sample]

    def median(self, field: Callable[[Sample], float]) -> float:
        return statistics.median(field(s) for s in self.samples)

    @property
    def ttft_ms(self) -> float:
        return self.median(lambda s: s.ttft_s) * 1000

    @property
    def tpot_ms(self) -> float:
        return self.median(lambda s: s.tpot_s) * 1000

    @property
    def tokens_per_s(self) -> float:
        return self.median(lambda s: s.tokens_per_s)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _messages(i: int) -> list[dict[str, str]]:
    # A different tail each time: both peers reuse the shared template prefix alike.
    return [{"role": "user",
             "content": f"Request {i}: write a long story about a lighthouse keeper."}]


class ServerPeer:
    """A real `edge-agent serve` in a subprocess, driven over HTTP with SSE streaming."""

    def __init__(self, state_dir: Path, model: str, threads: int, context: int) -> None:
        self.model = model
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "EDGE_AGENT_RUNTIME__THREADS": str(threads),
               "EDGE_AGENT_RUNTIME__CONTEXT_LENGTH": str(context),
               "EDGE_AGENT_DEFAULT_MODEL": model}
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "edge_agent", "serve", "--state-dir", str(state_dir),
             "--port", str(self.port), "--log-level", "warning"],
            env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.client = httpx.Client(base_url=self.url, timeout=300)
        deadline = time.monotonic() + 180
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self._log.seek(0)
                raise RuntimeError("edge-agent did not start:\n" + self._log.read().decode())
            try:
                models = self.client.get("/api/ps").json()["models"]
                if any(m["name"] == model for m in models):
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    def run(self, i: int, max_tokens: int) -> Sample:
        body = {"model": self.model, "messages": _messages(i), "max_tokens": max_tokens,
                "temperature": 0, "repeat_penalty": 1.0, "stream": True,
                "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        first = None
        tokens = 0
        with self.client.stream("POST", "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if first is None and chunk.get("choices") and \
                        chunk["choices"][0]["delta"].get("content"):
                    first = time.perf_counter()
        end = time.perf_counter()
        return Sample((first or end) - start, end - start, tokens)

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


class InProcessPeer:
    """llama-cpp-python's own high-level API, in this process, on the same file."""

    def __init__(self, path: Path, threads: int, context: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(path), n_ctx=context, n_threads=threads,
                         n_threads_batch=threads, n_batch=512, verbose=False)

    def run(self, i: int, max_tokens: int) -> Sample:
        start = time.perf_counter()
        first = None
        tokens = 0
        stream: Iterator[Any] = self.llm.create_chat_completion(  # type: ignore[assignment]
            messages=_messages(i),  # type: ignore[arg-type]
            max_tokens=max_tokens, temperature=0, repeat_penalty=1.0,
            stream=True)
        for chunk in stream:
            if chunk["choices"][0]["delta"].get("content"):
                tokens += 1
                if first is None:
                    first = time.perf_counter()
        end = time.perf_counter()
        return Sample((first or end) - start, end - start, tokens)

    def close(self) -> None:
        self.llm.close()


def run_bench(state_dir: Path, model: str, *, requests: int, max_tokens: int, threads: int,
              context: int, echo: Callable[[str], None]) -> dict[str, Any]:
    store = ModelStore(state_dir)
    if not store.is_installed(model):
        store.pull(model)
    info = store.get(model)
    echo(f"model {info.name} ({info.quantization}, sha256:{info.digest[:12]}), "
         f"{threads} threads, {requests} requests of up to {max_tokens} tokens per peer")
    server = ServerPeer(state_dir, info.name, threads, context)
    inproc = InProcessPeer(info.blob_path(state_dir), threads, context)
    try:
        server.run(-1, 8)
        inproc.run(-1, 8)  # warm-up, not counted
        served, local = [], []
        for i in range(requests):
            served.append(server.run(i, max_tokens))
            local.append(inproc.run(i, max_tokens))
    finally:
        server.close()
        inproc.close()
    a, b = Summary("edge-agent (HTTP, streamed)", served), Summary("llama-cpp-python in-process",
                                                                  local)
    echo(f"{'peer':<32} {'TTFT p50':>10} {'TPOT p50':>10} {'tok/s p50':>10} {'tokens':>7}")
    for s in (a, b):
        echo(f"{s.name:<32} {s.ttft_ms:>8.1f}ms {s.tpot_ms:>8.2f}ms {s.tokens_per_s:>10.1f} "
             f"{statistics.median(x.tokens for x in s.samples):>7.0f}")
    ratios = {"tokens_per_s": a.tokens_per_s / b.tokens_per_s, "ttft": a.ttft_ms / b.ttft_ms}
    echo(f"ratio edge-agent / in-process: tokens/s {ratios['tokens_per_s']:.3f}x "
         f"(target >= 0.95), TTFT {ratios['ttft']:.3f}x (target <= 1.2)")
    return {"model": info.name, "threads": threads, "requests": requests,
            "edge_agent": {"ttft_ms": a.ttft_ms, "tpot_ms": a.tpot_ms,
                           "tokens_per_s": a.tokens_per_s},
            "in_process": {"ttft_ms": b.ttft_ms, "tpot_ms": b.tpot_ms,
                           "tokens_per_s": b.tokens_per_s},
            "ratios": ratios}
