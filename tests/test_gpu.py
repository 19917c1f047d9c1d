"""On a GPU (`make device-check`): every layer offloaded and reported as VRAM, and the
same build answering with none offloaded. Skipped where llama.cpp has no GPU backend."""

from __future__ import annotations

from pathlib import Path

import ollama
import pytest

from edge_agent.config import load_settings
from edge_agent.engine.runtime.llama import gpu_offload_supported
from tests.conftest import DEFAULT_MODEL, clone_state, free_port, start_server

pytestmark = [pytest.mark.gpu, pytest.mark.integration,
              pytest.mark.skipif(not gpu_offload_supported(),
                                 reason="llama.cpp was built without a GPU backend")]


@pytest.mark.parametrize("layers", ["auto", 0])
def test_the_model_answers_offloaded_or_on_the_cpu_and_reports_its_vram(
        model_cache: Path, tmp_path: Path, layers: str | int) -> None:
    state = clone_state(model_cache, tmp_path / "state")
    live = start_server(load_settings(None, state_dir=state, **{
        "server.port": free_port(), "runtime.n_gpu_layers": layers}))
    try:
        client = ollama.Client(host=live.ollama_url)
        r = client.generate(model=DEFAULT_MODEL, prompt="The capital of France is",
                            options={"temperature": 0, "num_predict": 8})
        assert r.response and r.eval_count == 8
        [model] = client.ps().models
        if layers == "auto":
            assert model.size_vram == model.size > 0  # every layer on the GPU
        else:
            assert model.size_vram == 0  # the CPU fallback, same build
    finally:
        live.stop()
