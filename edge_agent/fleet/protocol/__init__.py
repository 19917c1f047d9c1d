"""What the box and the controller both put on the wire, and the facts they share.

Owns: topics (`topics`), fleet and device ids (`ids`), the outbox envelope and the
controller's ack (`envelope`), a signed command's shape and its `parse` (`command`), every
command type with its args' schema, role and result (`command_types`), why a command is
refused (`refusals`), ed25519 signatures and key files (`signing`), a release's manifest
(`manifest`) with its stage and materials (`materials`), a rollout's states and graph
(`rollout_states`), the apps' verdicts in a `metrics` message (`feedback`).

Never: sockets, threads, databases, or an import of `device/` or `controller/` — both
sides import this, so it can know neither. Next: the box's command gate is
`device.link.command_gate`; the controller's sender is `controller.commands`.
"""
