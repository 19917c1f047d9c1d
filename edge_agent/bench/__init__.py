"""`edge-agent bench`: measures this box against peers in one run and prints ratios
(`run`, `targets` for the bounds), against llama-server (`llama_server`), with schemas
and tool calls (`structured`), real-world schemas' coverage (`schema_coverage`, on the
JSONSchemaBench sample in `jsonschemabench/`), prompt lookup (`lookup`), redaction and
metrics overhead (`observability`), and the fleet (`fleet`, `fleet_sim`, `rollout`,
`rollout_waves`, on the simulator and test fleet of `fleet.sim`).

Never: a timed assertion in a test (figures are printed, judged against the bounds, and
left to a person), or anything the server imports. Next: `docs/bench.md`.
"""
