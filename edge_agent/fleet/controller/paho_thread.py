"""Ending a paho client that runs paho's own network thread (`loop_start`): the
controller's ingest and command publisher, the bench's plain publisher. (A box's link runs
no paho thread: its owner drives the socket.)

paho 2.x clears `client._thread` in that thread's own `finally` as it exits — which it does
by itself right after a clean DISCONNECT — and `loop_stop()` reads the attribute twice,
between its check and its `join()`. A thread ending in between makes `loop_stop()` raise
AttributeError on None: a `fleet send` whose command the broker had acknowledged then
failed at exit. Once the attribute is None the thread has finished, so there is nothing
left to wait for.
"""

from __future__ import annotations

import contextlib

import paho.mqtt.client as mqtt


def disconnect_and_stop(client: mqtt.Client) -> None:
    """DISCONNECT (queued to the thread), then wait for paho's thread to end."""
    client.disconnect()
    with contextlib.suppress(AttributeError):  # the thread ended first (see above)
        client.loop_stop()
