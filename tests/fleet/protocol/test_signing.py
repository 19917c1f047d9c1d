"""ed25519 command signatures: round trip, tampering, the wrong key, missing or garbage
signatures, key files."""

from __future__ import annotations

import base64
import stat
import time
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edge_agent.fleet.protocol.refusals import CommandRefused
from edge_agent.fleet.protocol.signing import (
    canonical,
    generate_keypair,
    load_private,
    load_public,
    sign,
    verify,
)


def _command(**change: Any) -> dict[str, Any]:
    return {"v": 1, "id": "a" * 32, "fleet": "f1", "device": "store-042", "type": "ping",
            "seq": 12, "issued_at": 1764520000.0, "expires_at": 1764520300.0,
            "args": {"note": "café ☕", "n": [1, 2.5]}, **change}


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path]:
    private, public = tmp_path / "cmd.key", tmp_path / "cmd.pub"
    generate_keypair(private, public)
    return private, public


def test_key_files(keys: tuple[Path, Path]) -> None:
    private, public = keys
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert private.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert public.read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")
    assert load_private(private).public_key().public_bytes_raw() == (
        load_public(public).public_bytes_raw())
    assert not list(private.parent.glob(".*tmp*"))
    with pytest.raises(FileExistsError):
        generate_keypair(private, public)


def test_the_private_key_is_0600_whatever_the_umask(tmp_path: Path) -> None:
    import os
    old = os.umask(0)
    try:
        generate_keypair(tmp_path / "k", tmp_path / "p")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "k").stat().st_mode) == 0o600


def test_other_key_types_are_refused(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives.asymmetric import ec
    key = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "ec.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    with pytest.raises(ValueError, match="not an ed25519"):
        load_private(tmp_path / "ec.key")


def test_canonical_bytes_leave_out_sig_and_sort_keys() -> None:
    assert canonical({"b": 1, "a": "é", "sig": "x"}) == '{"a":"é","b":1}'.encode()


def test_sign_verify_round_trip(keys: tuple[Path, Path]) -> None:
    private, public = load_private(keys[0]), load_public(keys[1])
    signed = sign(_command(), private)
    assert set(signed) == set(_command()) | {"sig"}
    assert len(base64.b64decode(signed["sig"])) == 64
    assert verify(signed, public) == signed
    # Through JSON and back (what the wire does), key order shuffled: still valid.
    import json
    wire = json.loads(json.dumps(dict(reversed(list(signed.items())))))
    assert verify(wire, public) == wire


@pytest.mark.parametrize(("key", "value"), [
    ("device", "all"), ("seq", 13), ("expires_at", 1764529999.0), ("type", "rebirth"),
    ("args", {"note": "café ☕", "n": [1, 2.5], "x": 1}), ("v", 2),
])
def test_a_tampered_field_is_refused(keys: tuple[Path, Path], key: str, value: Any) -> None:
    signed = sign(_command(), load_private(keys[0]))
    signed[key] = value
    with pytest.raises(CommandRefused) as info:
        verify(signed, load_public(keys[1]))
    assert info.value.reason == "bad_signature"


def test_an_added_field_is_refused(keys: tuple[Path, Path]) -> None:
    signed = sign(_command(), load_private(keys[0]))
    signed["extra"] = 1
    with pytest.raises(CommandRefused, match="bad_signature"):
        verify(signed, load_public(keys[1]))


def test_another_key_is_refused(keys: tuple[Path, Path]) -> None:
    signed = sign(_command(), Ed25519PrivateKey.generate())
    with pytest.raises(CommandRefused) as info:
        verify(signed, load_public(keys[1]))
    assert info.value.reason == "bad_signature"


@pytest.mark.parametrize("sig", [None, "", "not base64!", 12, base64.b64encode(b"x" * 63).decode(),
                                 base64.b64encode(b"\0" * 64).decode(), "é"])
def test_missing_or_garbage_signatures_are_refused(keys: tuple[Path, Path], sig: Any) -> None:
    obj = _command()
    if sig is not None:
        obj["sig"] = sig
    with pytest.raises(CommandRefused) as info:
        verify(obj, load_public(keys[1]))
    assert info.value.reason == "bad_signature"


def test_no_key_configured_refuses_everything(keys: tuple[Path, Path]) -> None:
    signed = sign(_command(), load_private(keys[0]))
    with pytest.raises(CommandRefused, match="bad_signature"):
        verify(signed, None)


def test_sign_verify_figures(keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """Benchmark-style, not asserted: µs per sign and per verify of a ~1 KB command."""
    private, public = load_private(keys[0]), load_public(keys[1])
    obj = _command(args={"pad": "x" * 800})
    n = 2000
    start = time.perf_counter()
    for _ in range(n):
        signed = sign(obj, private)
    signing = (time.perf_counter() - start) / n
    start = time.perf_counter()
    for _ in range(n):
        verify(signed, public)
    verifying = (time.perf_counter() - start) / n
    with capsys.disabled():
        print(f"\nsigning: sign {signing * 1e6:.0f} µs, verify {verifying * 1e6:.0f} µs "
              f"({len(canonical(signed))}-byte command, canonical JSON included)")
