"""The central team's side of the link (`edge-agent fleet …`): ingest every box's messages
into a store, acknowledge what is stored, track who is online, sign and send commands, run
rollouts in waves, and publish signed releases.

Owns: the store and every table it keeps (`schema` lists them; `store`, `sql`,
`rollout_sql`, `retention`, `operators`, `audit` read and write them, each through
`transaction.Exec`), the ingest session
(`ingest`), signed commands (`commands`), the rollout engine and its wave policy
(`rollouts`, `waves`, `rollout_ops`, `rollout_records`), the release repository, its keys
and the artifact server (`releases/`), the broker's provisioning (`broker`), its HTTP API,
who may call it, what they did, and its metrics (`api`, `rollout_api`, `access`,
`operators`, `audit`, `metrics`), its settings (`settings`) and `fleet serve` put together
(`service`).

Never: an import of the box's modules (`fleet.device`): what both sides must agree on is
in `fleet.protocol`, and import-linter holds the line. Next: `service.serve`.
"""
