"""The controller's key directory: the command-signing pair and the release (TUF) role keys.

    KEYS/command.pem        ed25519, signs commands (`fleet send`); 0600
    KEYS/command.pub.pem    -> every device's `fleet.command_public_key_file`
    KEYS/targets.pem        online release keys: adding a release needs these three
    KEYS/snapshot.pem
    KEYS/timestamp.pem      (the cron job's `fleet release timestamp` needs only this one,
                             and snapshot/targets when those near their expiry)
    KEYS/root/root1.pem …   the root keys: needed by `fleet release init` (and a root
    KEYS/root/threshold.json  re-sign); move the directory offline after init

Every key is ed25519 in PEM (private: PKCS8, unencrypted, created 0600 and never widened;
public: SubjectPublicKeyInfo), written by `fleet.protocol.signing.generate_keypair`, the one writer
of key files. A TUF key id is a hash of the public key, so it is the same every time the
PEM is read. This module never prints or logs key material, and never replaces a key: a
replaced root or command key orphans every device that trusts the old one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from securesystemslib.signer import CryptoSigner, Signer, SSlibKey

from edge_agent.config import ConfigError
from edge_agent.fleet.protocol import signing

ONLINE_ROLES = ("targets", "snapshot", "timestamp")
COMMAND_KEY = "command"
ROOT_DIR = "root"
THRESHOLD_FILE = "threshold.json"


@dataclass(frozen=True)
class KeyDir:
    """A directory of keys laid out as above; loads what a step needs, when it needs it."""

    path: Path

    @property
    def root_dir(self) -> Path:
        return self.path / ROOT_DIR

    def private(self, name: str) -> Path:
        return self.path / f"{name}.pem"

    def public_file(self, name: str) -> Path:
        return self.path / f"{name}.pub.pem"

    def public(self, role: str) -> SSlibKey:
        return load_public(self.public_file(role))

    def signer(self, role: str) -> Signer:
        """The signer of an online role; ConfigError naming the file when it is absent."""
        return load_signer(self.private(role), self.public_file(role))


def keygen(out: Path, *, root_keys: int = 1, root_threshold: int = 1) -> dict[str, str]:
    """Every key the controller needs, in `out` (refused if any already exists). Returns
    {key name: TUF key id or 'ed25519' for the command key}, for the operator to note."""
    if not 1 <= root_threshold <= root_keys:
        raise ConfigError(f"--root-threshold {root_threshold} must be 1..{root_keys} "
                          f"(the number of root keys)")
    keys = KeyDir(out)
    names = [COMMAND_KEY, *ONLINE_ROLES]
    roots = [f"root{i}" for i in range(1, root_keys + 1)]
    planned = [keys.private(n) for n in names] + [keys.root_dir / f"{r}.pem" for r in roots]
    planned += [keys.root_dir / THRESHOLD_FILE]
    existing = [str(p) for p in planned if p.exists()]
    if existing:
        raise ConfigError(f"{', '.join(existing)} exist(s); keygen never replaces a key "
                          "(a replaced key orphans every device that trusts it)")
    made: dict[str, str] = {}
    for name in names:
        signing.generate_keypair(keys.private(name), keys.public_file(name))
        made[name] = "ed25519" if name == COMMAND_KEY else keys.public(name).keyid
    for name in roots:
        priv, pub = keys.root_dir / f"{name}.pem", keys.root_dir / f"{name}.pub.pem"
        signing.generate_keypair(priv, pub)
        made[f"root/{name}"] = load_public(pub).keyid
    (keys.root_dir / THRESHOLD_FILE).write_text(
        json.dumps({"threshold": root_threshold}) + "\n")
    return made


@dataclass(frozen=True)
class RootKeys:
    """The root role's public keys and threshold, and the signers found beside them."""

    publics: list[SSlibKey]
    signers: list[Signer]
    threshold: int


def root_keys(root_dir: Path, threshold: int | None = None) -> RootKeys:
    """Root keys from `root_dir` (rootN.pub.pem, rootN.pem when present); the threshold
    from the argument, else the directory's threshold.json, else 1."""
    pubs = sorted(root_dir.glob("root*.pub.pem"))
    if not pubs:
        raise ConfigError(f"no root public keys (root*.pub.pem) in {root_dir}")
    if threshold is None:
        file = root_dir / THRESHOLD_FILE
        threshold = int(json.loads(file.read_text())["threshold"]) if file.exists() else 1
    if not 1 <= threshold <= len(pubs):
        raise ConfigError(f"root threshold {threshold} must be 1..{len(pubs)} "
                          f"(root keys in {root_dir})")
    publics, signers = [], []
    for pub in pubs:
        publics.append(load_public(pub))
        priv = pub.with_name(pub.name.removesuffix(".pub.pem") + ".pem")
        if priv.exists():
            signers.append(load_signer(priv, pub))
    return RootKeys(publics, signers, threshold)


def root_signers(root_dir: Path) -> list[Signer]:
    """Every root key pair in `root_dir` (one holder's offline copy may hold one)."""
    if not root_dir.is_dir():
        raise ConfigError(f"{root_dir} is not a directory of root keys")
    signers = []
    for priv in sorted(root_dir.glob("root*.pem")):
        if not priv.name.endswith(".pub.pem"):
            signers.append(load_signer(priv, priv.with_name(priv.stem + ".pub.pem")))
    return signers


def load_public(path: Path) -> SSlibKey:
    try:
        return SSlibKey.from_crypto(signing.load_public(path))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such key file (edge-agent fleet keygen makes it)"
                          ) from None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def load_signer(private: Path, public: Path) -> Signer:
    try:
        key = load_pem_private_key(private.read_bytes(), password=None)
    except FileNotFoundError:
        raise ConfigError(f"{private}: no such key file (this step needs it; keygen "
                          "makes it)") from None
    except ValueError as exc:
        raise ConfigError(f"{private}: not a PEM private key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"{private} holds a {type(key).__name__}, not an ed25519 key")
    pub = load_public(public)
    signer = CryptoSigner(key, pub)
    if signer.public_key.keyval != SSlibKey.from_crypto(key.public_key()).keyval:
        raise ConfigError(f"{private} and {public} are not one key pair")
    return signer
