"""The controller's rollouts: a release taken to a selection of boxes in waves, watched,
and stopped or rolled back by itself.

Owns the operator's side: start, pause, resume, abort, roll back and the status report
(`operations`), their HTTP routes (`api`), and the engine inside `fleet serve` that signs
and publishes each wave's commands at every tick (`driver`). It sits above the store: what
it reads and writes lives below it, beside the store's other query objects — the wave
policy, pure functions of the boxes' states and the clock (`controller.waves`), what a
rollout is as data and the store interface for it (`controller.rollout_records`), and its
SQL, shared by SQLite and PostgreSQL (`controller.rollout_queries`).

Never: the box's modules (`fleet.device`), or a signing key for releases (those stay at a
desk: `releases/`). Next: `operations.start` for what `fleet rollout start` writes,
`driver.RolloutEngine.tick` for what happens next.
"""
