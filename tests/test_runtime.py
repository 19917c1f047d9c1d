"""Runtime choices that do not need a model loaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.config import ConfigError, load_settings
from edge_agent.engine.runtime.llama import cpu_has_amx, resolve_extra_buffers, resolve_flash_attn


def test_flash_attention_maps_to_llamas_switch() -> None:
    assert resolve_flash_attn("auto") == -1
    assert resolve_flash_attn("on") == 1
    assert resolve_flash_attn("off") == 0


def test_flash_attention_setting_takes_three_words() -> None:
    assert load_settings(None, **{"runtime.flash_attn": "on"}).runtime.flash_attn == "on"
    with pytest.raises(ConfigError, match="flash_attn"):
        load_settings(None, **{"runtime.flash_attn": "yes"})


def test_extra_buffers_are_off_by_default_only_where_the_cpu_has_amx() -> None:
    assert resolve_extra_buffers("auto", has_amx=True) is False
    assert resolve_extra_buffers("auto", has_amx=False) is True
    assert resolve_extra_buffers("on", has_amx=True) is True
    assert resolve_extra_buffers("off", has_amx=False) is False


def test_amx_is_read_from_the_cpu_flags(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_tile amx_int8 amx_bf16\n")
    assert cpu_has_amx(info)
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f\n")
    assert not cpu_has_amx(info)
    assert not cpu_has_amx(tmp_path / "missing")
