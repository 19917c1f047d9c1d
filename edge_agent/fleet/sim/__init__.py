"""Simulated boxes and a private fleet on one machine, for `edge-agent bench fleet|rollout`
and the tests.

Owns: one simulated device running the box's own link code (`device`), the selector loop
that drives many (`loop`), scripted rollouts (`rollout`), the simulator (`fleet`) and a
private broker and controller process (`testbed`).

Never: imported by the serving path (app, server, doctor — import-linter holds it).
"""
