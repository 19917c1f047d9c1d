"""`edge-agent bench`: measures this box against peers in one run and prints ratios, every
figure judged against one table of bounds (`targets`). Two rooms:

- `serving`: the box's API and engine against their peers — the scenarios (`run`), the
  peers it drives (`peers`), llama.cpp's own server (`llama_server`, `client_side`),
  schemas and tool calls (`structured`), real-world schemas' coverage (`schema_coverage`,
  on the JSONSchemaBench sample in `serving/jsonschemabench/`), prompt lookup (`lookup`),
  redaction and metrics overhead (`observability`), batches beside interactive work
  (`batches`);
- `fleet`: the fleet link and the controller (`fleet.run`), a simulated fleet
  (`fleet.sim`) and one past a single broker (`fleet.scale`), a rollout on a real box and
  in waves over simulated ones (`fleet.rollout`, `fleet.rollout_waves`), on the simulator
  of `edge_agent.fleet.sim`. It drives a box through `serving.peers`; nothing in
  `serving` imports it.

Never: a timed assertion in a test (figures are printed, judged against the bounds, and
left to a person), or anything the server imports. Next: `docs/bench.md`.
"""
