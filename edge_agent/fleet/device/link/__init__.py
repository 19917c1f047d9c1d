"""The link itself: one MQTT session, driven by one owner thread, that publishes the
durable outbox and passes every command through the gate.

Owns: the session (`session`), the owner's loop and its send window (`owner`,
`send_window`), the outbox (`outbox`), the command gate (`command_gate`) and `fleet.db`
(`state`), the birth message (`birth`), the thread-free core (`core`), the link the
server starts (`link`), the box-acting handlers (`handlers`, `overlay`) and their table,
held to the registry of command types (`dispatch`).

Never: block a request, publish a message that is not first in the outbox, or run a
command that has not passed the gate. Next: `protocol.command` for a command's shape.
"""
