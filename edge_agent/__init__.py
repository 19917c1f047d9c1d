"""edge-agent: a governed local LLM appliance on llama.cpp."""

from __future__ import annotations

__version__ = "0.1.0"
