"""The central team's side of the link (`edge-agent fleet …`): ingest every box's messages
into a store, acknowledge what is stored, track who is online, sign and send commands, run
rollouts in waves, and publish signed releases.

Owns: the store and every table it keeps (`schema` lists them; `store`, `sql`,
`rollout_queries`, `retention`, `operators`, `audit` read and write them, `feedback`
reads the apps' verdicts out of the boxes' metrics messages, each through
`transaction.Exec`), the ingest session and what it takes and acknowledges (`ingest`,
`inbound`), signed commands (`commands`), rollouts in waves (the wave policy, `waves`, and
the rollouts' records, `rollout_records`, below the store; the fleets each release stage
may go to, `rings`; the operator's actions and the engine that drives them above it,
`rollouts/`), the release repository, its signing
keys and the artifact server (`releases/`), the broker's provisioning (`broker`), its HTTP
API, who may call it, what they did, and its metrics (`api`, `rollouts.api`, `access`,
`operators`, `audit`, `metrics`), and `fleet serve` put together (`service`). Its settings
are `config.controller`, beside the box's.

Never: an import of the box's modules (`fleet.device`): what both sides must agree on is
in `fleet.protocol`, and import-linter holds the line. Next: `service.serve`.
"""
