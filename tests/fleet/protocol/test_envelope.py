"""The envelope and the ack: compact bytes, a size limit, strict decoding."""

from __future__ import annotations

import json
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edge_agent.fleet.protocol import envelope
from edge_agent.fleet.protocol.envelope import (
    AckRefused,
    Envelope,
    build,
    decode,
    decode_ack,
    encode,
    encode_ack,
)

BOOT = "0123456789abcdef0123456789abcdef"


def _good() -> dict[str, Any]:
    return {"v": 1, "device": "store-042", "boot_id": BOOT, "seq": 17, "kind": "metrics",
            "class": "metrics", "ts": 1764520000.123, "body": {"x": [1, 2.5, "é"]}}


def test_round_trip_is_compact_utf8() -> None:
    env = build("store-042", BOOT, 17, "metrics", "metrics", {"x": [1, 2.5, "é"]},
                1764520000.123)
    data = encode(env)
    assert b" " not in data and "é".encode() in data
    assert json.loads(data) == _good()
    assert decode(data) == env


def test_the_size_limit_is_256_kib() -> None:
    pad = envelope.MAX_BYTES - len(encode(build("d", BOOT, 1, "events", "audit", {"p": ""}, 1)))
    assert len(encode(build("d", BOOT, 1, "events", "audit", {"p": "x" * pad}, 1))) == (
        envelope.MAX_BYTES)
    with pytest.raises(ValueError, match="at most"):
        encode(build("d", BOOT, 1, "events", "audit", {"p": "x" * (pad + 1)}, 1))
    with pytest.raises(ValueError, match="at most"):
        decode(b" " * (envelope.MAX_BYTES + 1))


@pytest.mark.parametrize(("change", "why"), [
    ({"v": 2}, "version"), ({"v": True}, "version"), ({"device": "a/b"}, "device id"),
    ({"device": "all"}, "reserved"), ({"boot_id": "ABC"}, "boot_id"), ({"seq": 0}, "seq"),
    ({"seq": True}, "seq"), ({"seq": 1.0}, "seq"), ({"kind": "status"}, "kind"),
    ({"class": "audit"}, "class"), ({"ts": "now"}, "ts"), ({"body": []}, "body"),
    ({"extra": 1}, "unknown"), ({"body": None}, "body"),
])
def test_decode_is_strict(change: dict[str, Any], why: str) -> None:
    obj = {**_good(), **change}
    with pytest.raises(ValueError, match=why):
        decode(json.dumps(obj).encode())


@pytest.mark.parametrize("payload", [
    b"\xff\xfe", b"[]", b"{", b'{"v":1,"v":1}', b"NaN",
    json.dumps(_good()).replace("1764520000.123", "NaN").encode(), "x".encode("utf-16"),
])
def test_not_json_or_not_an_envelope(payload: bytes) -> None:
    with pytest.raises(ValueError):
        decode(payload)


def test_missing_fields_are_named() -> None:
    obj = _good()
    del obj["ts"]
    with pytest.raises(ValueError, match="missing \\['ts'\\]"):
        decode(json.dumps(obj).encode())


def test_ranges() -> None:
    assert envelope.to_ranges([5, 1, 2, 3, 3, 7, 8]) == [[1, 3], [5, 5], [7, 8]]
    assert envelope.to_ranges([]) == []


def test_ack_round_trip_and_strictness() -> None:
    data = encode_ack({BOOT: [[1, 100], [105, 107]]}, device="d1")
    assert data == b'{"v":1,"device":"d1","acks":{"%s":[[1,100],[105,107]]}}' % BOOT.encode()
    assert decode_ack(data, device="d1", public_key=None, signed=False) == {
        BOOT: [(1, 100), (105, 107)]}
    for bad in (b'{"v":1}', b'{"v":1,"acks":{"x":[[1,2]]}}', b'{"v":2,"acks":{}}',
                b'{"v":1,"acks":{"%s":[[3,2]]}}' % BOOT.encode(), b'{"v":1,"acks":[]}',
                b'{"v":1,"acks":{},"extra":1}'):
        with pytest.raises(ValueError):
            decode_ack(bad, device="d1", public_key=None, signed=False)


def test_a_signed_ack_is_taken_only_with_the_controllers_key_and_for_its_device() -> None:
    key, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    acks = {BOOT: [[1, 10]]}
    good = encode_ack(acks, device="d1", key=key)
    assert decode_ack(good, device="d1", public_key=key.public_key()) == {BOOT: [(1, 10)]}
    refused = {
        "unsigned": encode_ack(acks, device="d1"),
        "no device": b'{"v":1,"acks":{"%s":[[1,10]]}}' % BOOT.encode(),
        "another key": encode_ack(acks, device="d1", key=other),
        "another device": encode_ack(acks, device="d2", key=key),
        "ranges changed": good.replace(b"[[1,10]]", b"[[1,1000]]"),
    }
    for why, payload in refused.items():
        with pytest.raises(AckRefused):
            decode_ack(payload, device="d1", public_key=key.public_key())
            pytest.fail(why)
    with pytest.raises(AckRefused, match="unreadable"):  # a key configured, none loaded
        decode_ack(good, device="d1", public_key=None)


def test_envelope_dataclass_is_what_the_controller_reads() -> None:
    env = decode(json.dumps(_good()).encode())
    assert isinstance(env, Envelope)
    assert (env.device, env.boot_id, env.seq, env.cls) == ("store-042", BOOT, 17, "metrics")
