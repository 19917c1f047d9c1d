"""The fleet half of `edge-agent bench`: what the link costs a box and what a fleet costs
the controller (see `edge_agent.bench`)."""
