from __future__ import annotations

from edge_agent.cli import main

main()
