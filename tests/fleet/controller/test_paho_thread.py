"""Ending a client that runs paho's own thread (`fleet.controller.paho_thread`): paho's
`loop_stop()` fails when the thread ends between its check and its `join()` (the thread clears
`client._thread` on its way out, as it does right after a clean DISCONNECT); ours does not.
The race is made certain here: the stand-in thread ends exactly at loop_stop's comparison."""

from __future__ import annotations

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from edge_agent.fleet.controller.paho_thread import disconnect_and_stop


def _ending_thread(client: mqtt.Client) -> object:
    class Ending:  # paho's thread, finishing right after loop_stop checked it
        def __ne__(self, other: object) -> bool:
            client._thread = None  # what paho's _thread_main does in its finally
            return True

    return Ending()


def test_paho_loop_stop_loses_the_race_and_disconnect_and_stop_does_not() -> None:
    client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    client._thread = _ending_thread(client)
    with pytest.raises(AttributeError):
        client.loop_stop()  # paho as it is: the failure `fleet send` met at exit
    client._thread = _ending_thread(client)
    disconnect_and_stop(client)
    assert client._thread is None
