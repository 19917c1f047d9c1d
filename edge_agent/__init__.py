"""edge-agent: a governed local LLM appliance on llama.cpp.

The layers, top to bottom (import-linter holds them; `pyproject.toml` lists the
contracts): `cli` → `app`, `server`, `doctor`, `bench` (the wiring) → `api` (the HTTP
dialects) and `fleet` (the link to a controller, and the controller) → `gateway` (the
request path's policy) → `engine`, `governance`, `ledger`, `telemetry` → `config`,
`logs` → `names`, `errors` and the other one-module leaves. Each package's docstring says
what it owns, what it must never do and where to look next; `docs/development.md` says
how the whole is built and tested.
"""

from __future__ import annotations

__version__ = "0.1.0"
