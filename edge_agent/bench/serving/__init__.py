"""The serving half of `edge-agent bench`: this box's API and engine against their peers
(see `edge_agent.bench`)."""
