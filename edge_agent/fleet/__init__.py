"""The fleet link: the box's side of its connection to a central controller over MQTT.

Serving never waits on the link: it runs beside the server, everything it sends is first
committed to a local outbox, and it reaches models only through `engine.modelops`, never
the scheduler or the runtime. `fleet.controller` is the central team's side.
"""
