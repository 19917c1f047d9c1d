"""The peers a benchmark drives: edge-agent and llama-cpp-python's server as subprocesses
on free loopback ports (spoken to over OpenAI SSE), and llama-cpp-python in process."""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from edge_agent.engine.runtime.llama import resolve_extra_buffers


@dataclass
class Sample:
    """One streamed request: when it started, and when each piece of text arrived."""

    start: float
    arrivals: list[float] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cut: bool = False

    @property
    def tokens(self) -> int:
        return len(self.arrivals)

    @property
    def ttft_s(self) -> float:
        return self.arrivals[0] - self.start if self.arrivals else float("nan")

    @property
    def tpot_s(self) -> float:
        if len(self.arrivals) < 2:
            return float("nan")
        return (self.arrivals[-1] - self.arrivals[0]) / (len(self.arrivals) - 1)


@dataclass
class Completion:
    """One request answered whole: its wall time and what the server counted."""

    seconds: float
    tokens: int  # usage.completion_tokens
    message: dict[str, Any]
    finish_reason: str

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank `q` quantile (the median for 0.5) of the values that are numbers;
    nan where there are none."""
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return float("nan")
    if q == 0.5:
        return statistics.median(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sse_chunks(client: httpx.Client, body: dict[str, Any], headers: dict[str, str]
               ) -> Iterator[dict[str, Any]]:
    """A streamed chat completion's chunks, as they arrive."""
    with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


class HttpPeer:
    """A server process speaking the OpenAI dialect."""

    name = "server"

    def __init__(self, argv: list[str], env: dict[str, str], ready_path: str,
                 model: str) -> None:
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.TemporaryFile()
        argv = [a.replace("{port}", str(self.port)) for a in argv]
        self.proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        self.client = httpx.Client(base_url=self.url, timeout=600)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{argv[:4]} did not start:\n{self.output()}")
            try:
                if self.ready(self.client.get(ready_path)):
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    def ready(self, response: httpx.Response) -> bool:
        return response.status_code == 200

    def output(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-4000:]

    def chat(self, messages: list[dict[str, str]], max_tokens: int,
             extra: dict[str, Any] | None = None) -> Sample:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0, "stream": True, **(extra or {})}
        headers = body.pop("headers", None) or {}
        sample = Sample(start=time.perf_counter())
        try:
            self._read(body, sample, headers)
        except httpx.RemoteProtocolError:
            sample.cut = True  # the server dropped the stream (llama_cpp.server interrupts)
        return sample

    def complete(self, messages: list[dict[str, Any]], max_tokens: int,
                 extra: dict[str, Any] | None = None) -> Completion:
        """One chat completion, not streamed: the whole request as the client waits for it."""
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0, "stream": False, **(extra or {})}
        start = time.perf_counter()
        r = self.client.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        seconds = time.perf_counter() - start
        data = r.json()
        choice = data["choices"][0]
        return Completion(seconds=seconds, tokens=data["usage"]["completion_tokens"],
                          message=choice["message"], finish_reason=choice["finish_reason"])

    def _read(self, body: dict[str, Any], sample: Sample, headers: dict[str, str]) -> None:
        for chunk in sse_chunks(self.client, body, headers):
            if chunk.get("usage"):
                details = chunk["usage"].get("prompt_tokens_details") or {}
                sample.cached_tokens = details.get("cached_tokens") or 0
                sample.prompt_tokens = chunk["usage"].get("prompt_tokens") or 0
            choices = chunk.get("choices") or []
            content = choices[0].get("delta", {}).get("content") if choices else None
            if content:
                sample.arrivals.append(time.perf_counter())
                sample.text += content

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


class EdgeAgentPeer(HttpPeer):
    def __init__(self, state_dir: Path, model: str, *, threads: int, context: int,
                 parallel: int | str, env: dict[str, str] | None = None, config: Path | None = None,
                 **runtime: object) -> None:
        self.name = "edge-agent"
        extra_env = env
        env = {"EDGE_AGENT_RUNTIME__THREADS": str(threads),
               "EDGE_AGENT_RUNTIME__CONTEXT_LENGTH": str(context),
               "EDGE_AGENT_RUNTIME__PARALLEL": str(parallel),
               "EDGE_AGENT_RUNTIME__MAX_QUEUE": "256",
               "EDGE_AGENT_DEFAULT_MODEL": model}
        env.update({f"EDGE_AGENT_RUNTIME__{k.upper()}": str(v).lower() if isinstance(v, bool)
                    else str(v) for k, v in runtime.items()})
        env.update(extra_env or {})
        argv = [sys.executable, "-m", "edge_agent", "serve", "--state-dir", str(state_dir),
                "--port", "{port}", "--log-level", "warning"]
        if config is not None:
            argv += ["--config", str(config)]
        super().__init__(argv, env, "/ready", model)

    def chat(self, messages: list[dict[str, str]], max_tokens: int,
             extra: dict[str, Any] | None = None) -> Sample:
        extra = {"stream_options": {"include_usage": True}, "repeat_penalty": 1.0,
                 **(extra or {})}
        return super().chat(messages, max_tokens, extra)


class LlamaCppServerPeer(HttpPeer):
    """`python -m llama_cpp.server` with its defaults (or interrupts off)."""

    def __init__(self, model_path: Path, model: str, *, threads: int, context: int,
                 interrupt: bool) -> None:
        self.name = "llama_cpp.server" + ("" if interrupt else " (interrupt off)")
        super().__init__([sys.executable, "-m", "llama_cpp.server", "--model", str(model_path),
                          "--model_alias", model, "--host", "127.0.0.1", "--port", "{port}",
                          "--n_ctx", str(context), "--n_threads", str(threads),
                          "--n_threads_batch", str(threads),
                          "--interrupt_requests", str(interrupt)], {}, "/v1/models", model)


class LlamaServerPeer(HttpPeer):
    """llama.cpp's own C++ server (`llama-server`, built from the llama.cpp that
    llama-cpp-python vendors) on the same file: `parallel` slots of `context` tokens each,
    the same threads as edge-agent, and its weight layouts: no repacking where edge-agent
    turns llama.cpp's extra CPU buffers off (a CPU with AMX, where its kernels crash)."""

    def __init__(self, binary: Path, model_path: Path, model: str, *, threads: int,
                 context: int, parallel: int, extra_args: tuple[str, ...] = ()) -> None:
        self.name = "llama-server"
        super().__init__([str(binary), "-m", str(model_path), "--alias", model,
                          "--host", "127.0.0.1", "--port", "{port}", "-t", str(threads),
                          "-tb", str(threads), "-c", str(context * parallel),
                          "-np", str(parallel), "--no-webui",
                          *([] if resolve_extra_buffers("auto") else ["--no-repack"]),
                          *extra_args], {}, "/health", model)


class InProcessPeer:
    """llama-cpp-python's own high-level API, in this process, on the same file."""

    name = "llama-cpp-python in-process"

    def __init__(self, path: Path, threads: int, context: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(path), n_ctx=context, n_threads=threads,
                         n_threads_batch=threads, n_batch=512, verbose=False)

    def chat(self, messages: list[dict[str, str]], max_tokens: int,
             extra: dict[str, Any] | None = None) -> Sample:
        sample = Sample(start=time.perf_counter())
        stream: Iterator[Any] = self.llm.create_chat_completion(  # type: ignore[assignment]
            messages=messages,  # type: ignore[arg-type]
            max_tokens=max_tokens, temperature=0, repeat_penalty=1.0, stream=True,
            logit_bias=(extra or {}).get("logit_bias"))
        for chunk in stream:
            content = chunk["choices"][0]["delta"].get("content")
            if content:
                sample.arrivals.append(time.perf_counter())
                sample.text += content
        return sample

    def close(self) -> None:
        self.llm.close()
