"""The fleet: a box's link to a central controller over MQTT, and that controller.

Four rooms, one direction of imports (import-linter holds it: `sim` → `controller` |
`device` → `protocol`):

- `protocol/` — what both sides put on the wire and agree on: topics, ids, the envelope
  and its ack, a command's shape and `parse`, refusals, signatures, a release's manifest,
  a rollout's states. No I/O of its own, no threads, nothing of either side.
- `device/` — the box's side: the link (`link/`), what it reports (`reporting/`), its
  rollouts (`rollout/`) and signed releases (`release/`). Serving never waits on it, and
  it reaches models only through `engine.modelops`.
- `controller/` — the central team's side (`edge-agent fleet serve`): ingest, store,
  commands, rollouts in waves, the release repository. It never imports `device/`.
- `sim/` — simulated boxes and a private test fleet for `edge-agent bench fleet|rollout`
  and the tests. The serving path never imports it.
"""
