"""The box's rollout state machine: a release received, fetched, staged, switched to,
gated, and kept or rolled back.

Owns: the runner and the `rollout.*` commands it takes (`runner`), the persisted
rollouts and their transitions (`store`), the rules it applies (`rules`), activation
(`activation`, and its two implementations: `model_release`, and `capacity_release` over
`capacity`'s helpers), the health gate a release must pass (`health_gate`), how a fetch
can end (`outcomes`), download progress (`progress`), the one-change-per-name claim
(`name_claim`), and `model.verify`, whether a release's version is still here and sound
(`model_verify`).

Never: publish except through the link's outbox, or act on a transition before it is
committed. Next: `protocol.rollout_states` for the graph; `release/` for the fetch.
"""
