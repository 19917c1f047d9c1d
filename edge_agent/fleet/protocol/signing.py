"""Command signatures: ed25519 (`cryptography`) over the canonical bytes of a command
without its `sig` field.

    canonical(obj) = json.dumps(obj without "sig", sort_keys=True, separators=(",", ":"),
                                ensure_ascii=False).encode("utf-8")

The controller holds the private key (PEM, PKCS8, unencrypted, file mode 0600); devices
hold the public key (PEM, SubjectPublicKeyInfo), `fleet.command_public_key_file`. This module
owns the key files' format and the signature check; it never decides whether a verified
command may run (expiry, replay, device: `commands`), and never logs key material.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from edge_agent.files import atomic_write
from edge_agent.fleet.protocol.refusals import BAD_SIGNATURE, CommandRefused

SIG = "sig"
SIGNATURE_BYTES = 64


def canonical(obj: Mapping[str, Any]) -> bytes:
    """The bytes that are signed: `obj` without `sig`, keys sorted, compact, UTF-8.
    ValueError for what has no canonical form (NaN, a lone surrogate)."""
    unsigned = {k: v for k, v in obj.items() if k != SIG}
    return json.dumps(unsigned, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def generate_keypair(private_path: Path, public_path: Path, *,
                     overwrite: bool = False) -> Ed25519PublicKey:
    """A new key pair: the private key written 0600 (created so, never widened after), the
    public key 0644. Refuses to replace existing files unless `overwrite` — a replaced
    private key orphans every device that trusts the old public key."""
    if not overwrite:
        for path in (private_path, public_path):
            if path.exists():
                raise FileExistsError(f"{path} exists; not replacing a signing key")
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(serialization.Encoding.PEM,
                                    serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
    public_pem = key.public_key().public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)
    atomic_write(private_path, private_pem, 0o600)  # never readable by others
    atomic_write(public_path, public_pem, 0o644)
    return key.public_key()


def load_private(path: Path) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} holds a {type(key).__name__}, not an ed25519 private key")
    return key


def load_public(path: Path) -> Ed25519PublicKey:
    key = serialization.load_pem_public_key(path.read_bytes())
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"{path} holds a {type(key).__name__}, not an ed25519 public key")
    return key


def sign(obj: Mapping[str, Any], private: Ed25519PrivateKey) -> dict[str, Any]:
    """A copy of `obj` with `sig` (standard base64) over its canonical bytes."""
    signature = private.sign(canonical(obj))
    return {**{k: v for k, v in obj.items() if k != SIG},
            SIG: base64.b64encode(signature).decode("ascii")}


def verify(obj: Mapping[str, Any], public: Ed25519PublicKey | None) -> dict[str, Any]:
    """`obj` as a dict if its `sig` is the public key's signature of its canonical bytes;
    else CommandRefused("bad_signature") — also for a missing, non-text or non-base64
    `sig`, and when there is no key to check against."""
    if public is None:
        raise CommandRefused(BAD_SIGNATURE, "no command key configured")
    sig = obj.get(SIG)
    if not isinstance(sig, str):
        raise CommandRefused(BAD_SIGNATURE, "no signature")
    try:
        signature = base64.b64decode(sig.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise CommandRefused(BAD_SIGNATURE, "signature is not base64") from None
    if len(signature) != SIGNATURE_BYTES:
        raise CommandRefused(BAD_SIGNATURE, "signature is not 64 bytes")
    try:
        public.verify(signature, canonical(obj))
    except InvalidSignature:
        raise CommandRefused(BAD_SIGNATURE, "signature does not match") from None
    except ValueError:  # no canonical form: nothing the controller can have signed
        raise CommandRefused(BAD_SIGNATURE, "command has no canonical form") from None
    return dict(obj)
