"""`parallel = "auto"`: sequences sized by the model's share of memory, capped by the
hardware; and the box shows what it chose."""

from __future__ import annotations

import httpx
import pytest

from edge_agent.config import ConfigError, load_settings
from edge_agent.engine.runtime.llama import default_threads
from edge_agent.engine.runtime.parallel_plan import auto_parallel, hardware_cap
from tests.conftest import DEFAULT_MODEL, LiveServer

MiB = 2**20
# smollm2:135m: ~23 KB of KV a token (30 layers x 3 KV heads x 64 x 2 x f16), ~94 MB weights.
SMOLLM2 = {"kv_bytes_per_token": 23_040, "weights": 94 * MiB}


def test_a_two_core_box_with_memory_to_spare_gets_eight() -> None:
    """The default box: 8 clients at once, where parallel = 4 queued half of them."""
    n = auto_parallel(**SMOLLM2, context=4096, budget=18 * 1024 * MiB, models=2, threads=2,
                      gpu=False)
    assert n == 8


def test_memory_bounds_the_sequences() -> None:
    # 1 GiB shared by 2 models: 512 MiB - 94 MiB of weights = 418 MiB, 90 MiB a sequence.
    n = auto_parallel(**SMOLLM2, context=4096, budget=1024 * MiB, models=2, threads=2,
                      gpu=False)
    assert n == (512 * MiB - 94 * MiB) // (23_040 * 4096) == 4
    assert auto_parallel(**SMOLLM2, context=4096, budget=64 * MiB, models=2, threads=2,
                         gpu=False) == 1  # never 0: the model still loads, or is refused


def test_the_hardware_caps_the_sequences() -> None:
    assert hardware_cap(threads=1, gpu=False) == 8
    assert hardware_cap(threads=6, gpu=False) == 24
    assert hardware_cap(threads=64, gpu=False) == 64  # the setting's own bound
    assert hardware_cap(threads=2, gpu=True) == 32
    assert auto_parallel(**SMOLLM2, context=2048, budget=64 * 1024 * MiB, models=1,
                         threads=16, gpu=False) == 64


def test_parallel_takes_auto_or_a_count() -> None:
    assert load_settings(None).runtime.parallel == "auto"
    assert load_settings(None, **{"runtime.parallel": "8"}).runtime.parallel == 8
    for bad in ("0", "65", "many"):
        with pytest.raises(ConfigError, match="parallel"):
            load_settings(None, **{"runtime.parallel": bad})


@pytest.mark.integration
def test_the_chosen_parallel_shows_in_ps_and_metrics(live_server: LiveServer) -> None:
    ps = httpx.get(f"{live_server.base_url}/api/ps").json()["models"]
    row = next(m for m in ps if m["name"] == DEFAULT_MODEL)
    model = next(m for m in live_server.app.state.parts.registry.loaded()
                 if m.info.name == DEFAULT_MODEL)
    assert row["parallel"] == model.worker.stats.parallel == len(model.worker.slots)
    if live_server.settings.runtime.parallel == "auto":  # the fixture's default
        assert row["parallel"] == hardware_cap(threads=default_threads(), gpu=False)
    metrics = httpx.get(f"{live_server.base_url}/metrics").text
    assert f'edge_agent_parallel_sequences{{model="{DEFAULT_MODEL}"}} {row["parallel"]}.0' \
        in metrics
