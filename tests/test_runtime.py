"""Runtime choices that do not need a model loaded."""

from __future__ import annotations

import pytest

from edge_agent.config import ConfigError, load_settings
from edge_agent.engine.runtime import resolve_flash_attn


def test_flash_attention_maps_to_llamas_switch() -> None:
    assert resolve_flash_attn("auto") == -1
    assert resolve_flash_attn("on") == 1
    assert resolve_flash_attn("off") == 0


def test_flash_attention_setting_takes_three_words() -> None:
    assert load_settings(None, **{"runtime.flash_attn": "on"}).runtime.flash_attn == "on"
    with pytest.raises(ConfigError, match="flash_attn"):
        load_settings(None, **{"runtime.flash_attn": "yes"})
