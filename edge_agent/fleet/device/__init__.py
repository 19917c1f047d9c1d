"""The box's side of the fleet.

Owns: the link to the broker (`link/`: session, owner thread, outbox, command gate,
`fleet.db`, birth, handlers), what the box tells the fleet (`reporting/`), its rollouts
(`rollout/`: runner, store, rules, activation, health gate) and signed releases
(`release/`: The Update Framework's client, transfer, `models pull`). `durable` opens
its SQLite files.

Never: the scheduler or the runtime (models only through `engine.modelops`), the
controller's modules, or a wait that serving would feel. Next: `link.link.Link` is what
the server starts; `rollout.runner` is the rollout state machine's driver.
"""
