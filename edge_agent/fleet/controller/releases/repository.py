"""The controller's release repository: The Update Framework's metadata (python-tuf's
Metadata API) and the model files it signs, in `<state>/releases/`.

    releases/metadata/1.root.json 2.root.json …   every root version (devices walk N+1)
    releases/metadata/root.json                   the newest root: provision devices with it
    releases/metadata/N.targets.json N.snapshot.json   versioned (consistent snapshots)
    releases/metadata/timestamp.json              the only unversioned name
    releases/targets/gemma3/270m/2/<sha256>.model.gguf   a release's file, by content
    releases/targets/agent/0.2.0/<sha256>.wheelhouse.tar  an agent release's wheelhouse
    releases/repo.json                            expiry per role, the key dir (not served)

What changes, and what is re-signed, in this order (a device never sees metadata that
names a file or a version not yet written):

    add a release     blob, then targets v+1, snapshot v+1, timestamp v+1 (online keys)
    publish a pushed  targets v+1 signed at a desk (`push`), its files uploaded before into
      release         incoming/ (`Upload`); then snapshot v+1, timestamp v+1 here
    `timestamp` (cron) timestamp v+1; snapshot/targets too when under half their life left
    `root-sign`       root v+1, same keys, new expiry (offline root keys; yearly)

The root keys are needed only by `init` (and a root re-sign): adding releases needs the
targets, snapshot and timestamp keys; publishing one signed elsewhere (`publish_signed`,
the API's `POST /releases`) needs only snapshot and timestamp: the targets key may live at
a desk, never on this host, and the controller still cannot make a release of its own.
Releases are immutable: `name@version` names one file for good, so a device that saw it
can trust that it did not change. A release that lacks what its stage asks is refused
before anything is written (`readiness`).

Every write takes `repo.lock` (a cron re-sign and an `add` must not bump the same version
twice) and goes to a temporary file renamed into place (python-tuf's `to_file` removes,
then creates: a device could get a 404 in between). This module never serves (that is
`artifacts`), never deletes a published file and never reads a private key it does not
need for the step at hand.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tarfile
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from tuf.api.exceptions import UnsignedMetadataError
from tuf.api.metadata import (
    Metadata,
    MetaFile,
    Root,
    Signed,
    Snapshot,
    TargetFile,
    Targets,
    Timestamp,
)
from tuf.api.serialization.json import JSONSerializer

from edge_agent.config import ConfigError
from edge_agent.engine.models.catalog import packaged_catalog_dir, read_catalog
from edge_agent.engine.models.gguf_probe import GGUFInfo, open_regular, precheck_open, probe
from edge_agent.engine.models.staging import Progress, hash_copy
from edge_agent.errors import (
    Conflict,
    EdgeAgentError,
    InvalidRequest,
    ModelFileError,
    ModelNotFound,
    PayloadTooLarge,
    ServiceUnavailable,
)
from edge_agent.files import atomic_write, locked
from edge_agent.fleet.controller.releases.readiness import refusal
from edge_agent.fleet.controller.releases.signing_keys import KeyDir, root_keys, root_signers
from edge_agent.fleet.protocol.agent_release import (
    AgentManifest,
    AgentManifestError,
    agent_target_path,
    is_agent,
    is_agent_name,
)
from edge_agent.fleet.protocol.manifest import (
    ManifestError,
    ReleaseManifest,
    parse,
    target_path,
)
from edge_agent.names import ModelName

RELEASES_DIR = "releases"
INCOMING = "incoming"  # uploaded files waiting for the signed targets that name them
INCOMING_KEEP_S = 86400  # an upload never published is removed after a day
SHA256 = re.compile(r"[0-9a-f]{64}")
DAY = 86400
DEFAULT_EXPIRY_S = {"root": 365 * DAY, "targets": 365 * DAY, "snapshot": 30 * DAY,
                    "timestamp": DAY}
_PRETTY = JSONSerializer(compact=False)


class ReleaseExists(EdgeAgentError):
    """`name@version` is published already; releases never change."""

    status_code = 409


@dataclass(frozen=True)
class ReleaseEntry:
    """One published release as the signed targets metadata lists it."""

    target_path: str
    length: int
    sha256: str
    manifest: ReleaseManifest
    blob: Path

    def to_json(self) -> dict[str, Any]:
        return {"name": self.manifest.name, "version": self.manifest.version,
                "target": self.target_path, "length": self.length, "sha256": self.sha256,
                "blob": str(self.blob), "manifest": self.manifest.model_dump()}


@dataclass(frozen=True)
class AgentEntry:
    """One published agent release (`fleet.protocol.agent_release`)."""

    target_path: str
    length: int
    sha256: str
    manifest: AgentManifest
    blob: Path

    def to_json(self) -> dict[str, Any]:
        return {"kind": "agent", "version": self.manifest.version,
                "target": self.target_path, "length": self.length, "sha256": self.sha256,
                "blob": str(self.blob), "manifest": self.manifest.model_dump()}


def releases_dir(state_dir: Path) -> Path:
    return state_dir / RELEASES_DIR


class ReleaseRepository:
    """The repository in `root` (`<state>/releases`)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.metadata = root / "metadata"
        self.targets = root / "targets"
        self.config_file = root / "repo.json"

    # -- creating ---------------------------------------------------------------------
    @classmethod
    def create(cls, root: Path, keys: KeyDir, *, root_key_dir: Path | None = None,
               root_threshold: int | None = None,
               expiry_s: Mapping[str, int] | None = None) -> ReleaseRepository:
        """Root v1 signed by the root keys (threshold of them at least), and version 1 of
        targets (empty), snapshot and timestamp. Refused where a repository exists."""
        repo = cls(root)
        if (repo.metadata / "root.json").exists():
            raise ConfigError(f"{root} holds a release repository already")
        expiry = {**DEFAULT_EXPIRY_S, **(expiry_s or {})}
        for role, seconds in expiry.items():
            if role not in DEFAULT_EXPIRY_S or seconds <= 0:
                raise ConfigError(f"expiry of {role!r}: a role of {sorted(DEFAULT_EXPIRY_S)}"
                                  " and a positive duration")
        rk = root_keys(root_key_dir or keys.root_dir, root_threshold)
        if len(rk.signers) < rk.threshold:
            raise ConfigError(f"root needs {rk.threshold} signature(s); {len(rk.signers)} "
                              f"root private key(s) found in {root_key_dir or keys.root_dir}")
        online = {role: keys.public(role) for role in ("targets", "snapshot", "timestamp")}
        signers = {role: keys.signer(role) for role in online}  # all present before writing
        repo.metadata.mkdir(parents=True, exist_ok=True)
        repo.targets.mkdir(parents=True, exist_ok=True)
        _write_json(repo.config_file, {"expiry_s": expiry,
                                       "keys": str(keys.path.resolve())})
        with repo._locked():
            root_md = Metadata(Root(expires=_expiry(expiry["root"]), consistent_snapshot=True))
            for pub in rk.publics:
                root_md.signed.add_key(pub, "root")
            root_md.signed.roles["root"].threshold = rk.threshold
            for role, pub in online.items():
                root_md.signed.add_key(pub, role)
            for signer in rk.signers:
                root_md.sign(signer, append=True)  # append: a k-of-n root keeps every sig
            repo._write(root_md, "1.root.json")
            repo._write(root_md, "root.json")
            state = _State(Metadata(Targets()), Metadata(Snapshot()), Metadata(Timestamp()))
            repo._publish_targets(state, signers, expiry, bump=0)
        return repo

    # -- reading ----------------------------------------------------------------------
    def exists(self) -> bool:
        return (self.metadata / "timestamp.json").exists()

    def config(self) -> dict[str, Any]:
        if not self.exists():
            raise ConfigError(f"no release repository in {self.root} (edge-agent fleet "
                              "release init creates it)")
        data: dict[str, Any] = json.loads(self.config_file.read_text())
        return data

    def expiry_s(self) -> dict[str, int]:
        return {**DEFAULT_EXPIRY_S, **self.config().get("expiry_s", {})}

    def default_keys(self) -> KeyDir:
        """The key dir recorded at init (a command's --keys overrides it)."""
        return KeyDir(Path(self.config()["keys"]))

    def releases(self) -> list[ReleaseEntry]:
        """Every release the current signed targets list, by name then version."""
        state = self._load()
        entries = [self._entry(tf) for tf in state.targets.signed.targets.values()
                   if not is_agent(tf.custom)]
        return sorted(entries, key=lambda e: (e.manifest.name, e.manifest.version))

    def agents(self) -> list[AgentEntry]:
        """Every agent release the current signed targets list, by version."""
        state = self._load()
        entries = [self._agent_entry(tf) for tf in state.targets.signed.targets.values()
                   if is_agent(tf.custom)]
        return sorted(entries, key=lambda e: e.manifest.version)

    def agent(self, version: str) -> AgentEntry:
        try:
            path = agent_target_path(version)
        except AgentManifestError as exc:
            raise InvalidRequest(str(exc), param="version") from None
        tf = self._load().targets.signed.targets.get(path)
        if tf is None:
            raise ModelNotFound(f"no agent release {version} in {self.root} (fleet release "
                                "add-agent)")
        return self._agent_entry(tf)

    def get(self, name: str, version: str) -> ReleaseEntry:
        path = target_path(name, version)
        tf = self._load().targets.signed.targets.get(path)
        if tf is None:
            raise ModelNotFound(f"no release {name}@{version} in {self.root}")
        return self._entry(tf)

    def status(self) -> dict[str, dict[str, Any]]:
        """Each role's version and expiry, and the seconds it has left."""
        state = self._load()
        root = Metadata[Root].from_file(str(self.metadata / "root.json"))
        now = datetime.now(timezone.utc)
        out = {}
        for role, md in (("root", root), ("targets", state.targets),
                         ("snapshot", state.snapshot), ("timestamp", state.timestamp)):
            signed: Signed = md.signed
            out[role] = {"version": signed.version, "expires": signed.expires.isoformat(),
                         "expires_in_s": int((signed.expires - now).total_seconds())}
        return out

    # -- writing ----------------------------------------------------------------------
    def add(self, gguf: Path, manifest: ReleaseManifest, keys: KeyDir,
            progress: Progress | None = None) -> ReleaseEntry:
        """Publish `gguf` as `manifest.name@manifest.version`: the file is copied in under
        its hash, then targets, snapshot and timestamp are re-signed."""
        if is_agent_name(manifest.name):
            raise InvalidRequest(f"{manifest.name.given!r} is the name agent releases roll "
                                 "out under; give the model another name", param="name")
        return self._entry(self._publish_file(gguf, manifest, keys, progress))

    def add_agent(self, tar: Path, manifest: AgentManifest, keys: KeyDir,
                  progress: Progress | None = None) -> AgentEntry:
        """Publish the packed wheelhouse `tar` as agent release `manifest.version`, as `add`
        publishes a model."""
        return self._agent_entry(self._publish_file(tar, manifest, keys, progress))

    def _publish_file(self, file: Path, manifest: ReleaseManifest | AgentManifest,
                      keys: KeyDir, progress: Progress | None) -> TargetFile:
        """`file` in under its hash as `manifest`'s release (a model's is checked to be a
        GGUF), then targets, snapshot and timestamp re-signed; ReleaseExists if it is
        published already."""
        signers = {role: keys.signer(role) for role in ("targets", "snapshot", "timestamp")}
        expiry = self.expiry_s()
        path = manifest.target_path
        with self._locked():
            state = self._load()
            old = state.targets.signed.targets.get(path)
            if old is not None:
                raise ReleaseExists(f"release {manifest.ref} exists (sha256 "
                                    f"{old.hashes.get('sha256', '?')[:12]}); a release never "
                                    "changes: publish a new version")
            if isinstance(manifest, ReleaseManifest):
                unready = refusal(manifest, state.targets.signed.targets)
                if unready is not None:
                    raise InvalidRequest(unready, param="stage")
            length, digest = self._store_blob(
                file, path, progress, check_gguf=isinstance(manifest, ReleaseManifest))
            tf = release_target(manifest, length, digest)
            state.targets.signed.targets[path] = tf
            self._publish_targets(state, signers, expiry)
        return tf

    def publish_signed(self, md: Metadata[Targets], keys: KeyDir
                       ) -> list[ReleaseEntry | AgentEntry]:
        """Publish targets metadata signed elsewhere (a desk's `fleet release push`): it
        must be the next version, signed by the targets key(s) root trusts, keep every
        release as it was, and name only files uploaded already (`Upload`). Its new files
        move in under their content names, then snapshot and timestamp are re-signed here.
        Returns the releases it added."""
        signers = self._signers(keys, ("snapshot", "timestamp"))
        expiry = self.expiry_s()
        with self._locked():
            state = self._load()
            root = Metadata[Root].from_file(str(self.metadata / "root.json"))
            added = self._check_signed(root, state.targets, md)
            blobs = {tf.path: self.incoming / tf.hashes["sha256"] for tf in added}
            for tf in added:
                dest = self.targets / tf.get_prefixed_paths()[0]
                dest.parent.mkdir(parents=True, exist_ok=True)
                if not dest.exists():
                    os.link(blobs[tf.path], dest)
            for blob in set(blobs.values()):
                blob.unlink(missing_ok=True)
            state.targets = md
            self._write(md, f"{md.signed.version}.targets.json")
            state.snapshot.signed.meta["targets.json"] = MetaFile(version=md.signed.version)
            self._publish_snapshot(state, signers, expiry)
        return [self._agent_entry(tf) if is_agent(tf.custom) else self._entry(tf)
                for tf in added]

    def _check_signed(self, root: Metadata[Root], old: Metadata[Targets],
                      md: Metadata[Targets]) -> list[TargetFile]:
        """The releases `md` adds to `old`; the refusal, naming what is wrong, otherwise."""
        if not isinstance(md.signed, Targets):
            raise InvalidRequest(f"the metadata is {md.signed.type}, not targets")
        try:
            root.signed.verify_delegate(Targets.type, md.signed_bytes, md.signatures)
        except UnsignedMetadataError as exc:
            raise InvalidRequest(f"the targets are not signed by the targets key(s) of root "
                                 f"v{root.signed.version}: {exc}") from None
        want = old.signed.version + 1
        if md.signed.version != want:
            raise Conflict(f"the targets are version {md.signed.version}; the repository's "
                           f"next is {want}: fetch them again and sign anew")
        if md.signed.is_expired():
            raise InvalidRequest("the targets expired already "
                                 f"({md.signed.expires.isoformat()})")
        if md.signed.delegations is not None:
            raise InvalidRequest("delegated targets roles are not published here")
        for path, tf in old.signed.targets.items():
            if md.signed.targets.get(path) != tf:
                raise ReleaseExists(f"the targets change or drop the release {path}: a "
                                    "release never changes: publish a new version")
        added = [tf for path, tf in sorted(md.signed.targets.items())
                 if path not in old.signed.targets]
        if not added:
            raise InvalidRequest("the targets add no release")
        for tf in added:
            manifest: ReleaseManifest | AgentManifest
            try:
                manifest = AgentManifest.from_custom(tf.custom) if is_agent(tf.custom) \
                    else ReleaseManifest.from_custom(tf.custom)
            except (ManifestError, AgentManifestError) as exc:
                raise InvalidRequest(f"{tf.path}: {exc}") from None
            if isinstance(manifest, ReleaseManifest) and is_agent_name(manifest.name):
                raise InvalidRequest(f"{tf.path}: {manifest.name.given!r} is the name agent "
                                     "releases roll out under")
            if manifest.target_path != tf.path:
                raise InvalidRequest(f"{tf.path}: its manifest names {manifest.ref} "
                                     f"({manifest.target_path})")
            if isinstance(manifest, ReleaseManifest):
                unready = refusal(manifest, md.signed.targets)
                if unready is not None:
                    raise InvalidRequest(unready, param="stage")
            digest = tf.hashes.get("sha256", "")
            blob = self.incoming / digest
            if not SHA256.fullmatch(digest) or not blob.is_file():
                raise InvalidRequest(f"{manifest.ref}: its file (sha256 {digest[:12] or '-'}) "
                                     "was not uploaded: PUT /release-files/<sha256> first")
            if blob.stat().st_size != tf.length:
                raise InvalidRequest(f"{manifest.ref}: the targets say {tf.length} bytes; "
                                     f"the upload has {blob.stat().st_size}")
            agent = isinstance(manifest, AgentManifest)
            if (not agent and not _is_gguf(blob)) or (agent and not tarfile.is_tarfile(blob)):
                raise InvalidRequest(f"{manifest.ref}: its upload is not "
                                     f"{'a wheelhouse tar' if agent else 'a GGUF'}")
        return added

    def refresh(self, keys: KeyDir, *, timestamp_expires_s: int | None = None,
                force: tuple[str, ...] = ()) -> list[str]:
        """The cron job: a new timestamp; also snapshot and targets when less than half
        their life is left (or named in `force`). Returns the roles re-signed.
        `timestamp_expires_s` overrides the timestamp's expiry once (tests: negative)."""
        expiry = self.expiry_s()
        with self._locked():
            state = self._load()
            now = datetime.now(timezone.utc)

            def due(role: str, md: Metadata[Any]) -> bool:
                left = (md.signed.expires - now).total_seconds()
                return role in force or left < expiry[role] / 2

            if due("targets", state.targets):
                signers = {r: keys.signer(r) for r in ("targets", "snapshot", "timestamp")}
                self._publish_targets(state, signers, expiry, ts_s=timestamp_expires_s)
                return ["targets", "snapshot", "timestamp"]
            if due("snapshot", state.snapshot):
                signers = {r: keys.signer(r) for r in ("snapshot", "timestamp")}
                self._publish_snapshot(state, signers, expiry, ts_s=timestamp_expires_s)
                return ["snapshot", "timestamp"]
            self._publish_timestamp(state, {"timestamp": keys.signer("timestamp")}, expiry,
                                    ts_s=timestamp_expires_s)
            return ["timestamp"]

    def resign_root(self, root_key_dirs: list[Path]) -> int:
        """Root v+1 with the same keys and a new expiry (the yearly re-sign), signed by
        every root private key found in `root_key_dirs` (each holder's offline copy);
        refused below the threshold. Devices fetch it as N+1.root.json. Returns N+1."""
        signers = [s for d in root_key_dirs for s in root_signers(d)]
        expiry = self.expiry_s()
        with self._locked():
            self._load()
            md = Metadata[Root].from_file(str(self.metadata / "root.json"))
            trusted = set(md.signed.roles["root"].keyids)
            usable = {s.public_key.keyid: s for s in signers
                      if s.public_key.keyid in trusted}
            threshold = md.signed.roles["root"].threshold
            if len(usable) < threshold:
                raise ConfigError(f"the root needs {threshold} signature(s) of its keys; "
                                  f"{len(usable)} of them found in "
                                  f"{', '.join(map(str, root_key_dirs))}")
            md.signed.version += 1
            md.signed.expires = _expiry(expiry["root"])
            md.signatures.clear()
            for signer in usable.values():
                md.sign(signer, append=True)
            self._write(md, f"{md.signed.version}.root.json")
            self._write(md, "root.json")
            return md.signed.version

    # -- internals --------------------------------------------------------------------
    @property
    def incoming(self) -> Path:
        return self.root / INCOMING

    @staticmethod
    def _signers(keys: KeyDir, roles: tuple[str, ...]) -> dict[str, Any]:
        try:
            return {role: keys.signer(role) for role in roles}
        except ConfigError as exc:
            raise ServiceUnavailable(f"this controller cannot re-sign {' and '.join(roles)}: "
                                     f"{exc}") from None

    def _publish_targets(self, state: _State, signers: Mapping[str, Any],
                         expiry: Mapping[str, int], *, bump: int = 1,
                         ts_s: int | None = None) -> None:
        t = state.targets
        t.signed.version += bump
        t.signed.expires = _expiry(expiry["targets"])
        t.sign(signers["targets"])
        self._write(t, f"{t.signed.version}.targets.json")
        state.snapshot.signed.meta["targets.json"] = MetaFile(version=t.signed.version)
        self._publish_snapshot(state, signers, expiry, bump=bump, ts_s=ts_s)

    def _publish_snapshot(self, state: _State, signers: Mapping[str, Any],
                          expiry: Mapping[str, int], *, bump: int = 1,
                          ts_s: int | None = None) -> None:
        s = state.snapshot
        s.signed.version += bump
        s.signed.expires = _expiry(expiry["snapshot"])
        s.sign(signers["snapshot"])
        self._write(s, f"{s.signed.version}.snapshot.json")
        state.timestamp.signed.snapshot_meta = MetaFile(version=s.signed.version)
        self._publish_timestamp(state, signers, expiry, bump=bump, ts_s=ts_s)

    def _publish_timestamp(self, state: _State, signers: Mapping[str, Any],
                           expiry: Mapping[str, int], *, bump: int = 1,
                           ts_s: int | None = None) -> None:
        ts = state.timestamp
        ts.signed.version += bump
        ts.signed.expires = _expiry(expiry["timestamp"] if ts_s is None else ts_s)
        ts.sign(signers["timestamp"])
        self._write(ts, "timestamp.json")  # last: it makes everything before it visible

    def _store_blob(self, gguf: Path, path: str, progress: Progress | None, *,
                    check_gguf: bool = True) -> tuple[int, str]:
        """Copy `gguf` into targets/ under its content name, hashing on the way (one read).
        Its header is walked first (bounded, `precheck_open`; `manifest_for` read it in the
        child already), so a file that is not a GGUF never reaches the repository
        (`check_gguf` False: an agent's wheelhouse, which has none)."""
        directory, base = (self.targets / path).parent, Path(path).name
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".incoming-{os.getpid()}-{time.monotonic_ns()}"
        try:
            with os.fdopen(open_regular(gguf), "rb") as src, tmp.open("wb") as dest:
                if check_gguf:
                    precheck_open(src, gguf)
                    src.seek(0)
                digest = hash_copy(src, dest, progress)
                dest.flush()
                os.fsync(dest.fileno())
                length = dest.tell()
            tmp.chmod(0o644)
            os.replace(tmp, directory / f"{digest}.{base}")
        finally:
            tmp.unlink(missing_ok=True)
        return length, digest

    def _agent_entry(self, tf: TargetFile) -> AgentEntry:
        return AgentEntry(tf.path, tf.length, tf.hashes["sha256"],
                          AgentManifest.from_custom(tf.custom),
                          self.targets / tf.get_prefixed_paths()[0])

    def _entry(self, tf: TargetFile) -> ReleaseEntry:
        manifest = ReleaseManifest.from_custom(tf.custom)
        return ReleaseEntry(tf.path, tf.length, tf.hashes["sha256"], manifest,
                            self.targets / tf.get_prefixed_paths()[0])

    def _load(self) -> _State:
        """The newest timestamp, and the snapshot and targets versions it chains to."""
        self.config()  # a clear error where there is no repository
        ts = Metadata[Timestamp].from_file(str(self.metadata / "timestamp.json"))
        sv = ts.signed.snapshot_meta.version
        snap = Metadata[Snapshot].from_file(str(self.metadata / f"{sv}.snapshot.json"))
        tv = snap.signed.meta["targets.json"].version
        targets = Metadata[Targets].from_file(str(self.metadata / f"{tv}.targets.json"))
        return _State(targets, snap, ts)

    def _write(self, md: Metadata[Any], name: str) -> None:
        # 0644: metadata is public (it is served), its integrity is the signatures'
        atomic_write(self.metadata / name, md.to_bytes(_PRETTY), 0o644)

    def _locked(self) -> AbstractContextManager[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        return locked(self.root / "repo.lock")


class Upload:
    """One release file arriving over HTTP (`PUT /release-files/<sha256>`): written under
    incoming/ and hashed as it comes, kept under its digest only when the digest is the one
    announced, the length the one announced and the file a GGUF or a tar (an agent's
    wheelhouse; which of the two its targets entry may name is checked at publish, where its
    kind is known). Where a file of that digest
    is waiting already it is kept and this one dropped. Uploads older than a day that no
    targets named are removed when a new one starts."""

    def __init__(self, repo: ReleaseRepository, sha256: str, length: int) -> None:
        if not SHA256.fullmatch(sha256):
            raise InvalidRequest(f"{sha256[:80]!r} is not a sha256 (64 lowercase hex digits)")
        repo.config()  # a clear error where there is no repository
        self.dest = repo.incoming / sha256
        self.sha256, self.length = sha256, length
        repo.incoming.mkdir(exist_ok=True)
        _sweep(repo.incoming, time.time() - INCOMING_KEEP_S)
        free = shutil.disk_usage(repo.incoming).free
        if length > free - (1 << 30):
            raise PayloadTooLarge(f"{length} bytes do not fit: {free} free on the "
                                  "controller's release store, with a GiB to spare")
        self.tmp = repo.incoming / f".upload-{os.getpid()}-{time.monotonic_ns()}"
        self._out = self.tmp.open("wb")
        self._hash = hashlib.sha256()
        self.got = 0

    def write(self, chunk: bytes) -> None:
        self.got += len(chunk)
        if self.got > self.length:
            raise InvalidRequest(f"the body is longer than its Content-Length {self.length}")
        self._hash.update(chunk)
        self._out.write(chunk)

    def finish(self) -> bool:
        """Keep the file; False where one of that digest was there already."""
        try:
            self._out.flush()
            os.fsync(self._out.fileno())
            self._out.close()
            if self.got != self.length:
                raise InvalidRequest(f"the body ended after {self.got} of {self.length} "
                                     "bytes")
            if self._hash.hexdigest() != self.sha256:
                raise InvalidRequest(f"the body's sha256 is {self._hash.hexdigest()}, not "
                                     f"{self.sha256}")
            if not _is_gguf(self.tmp) and not tarfile.is_tarfile(self.tmp):
                with os.fdopen(open_regular(self.tmp), "rb") as src:
                    try:
                        precheck_open(src, self.tmp)
                    except ModelFileError as exc:
                        raise InvalidRequest(f"not a release file (a GGUF or an agent's "
                                             f"wheelhouse tar): {exc.message}") from None
            if self.dest.exists():
                return False
            self.tmp.chmod(0o644)
            os.replace(self.tmp, self.dest)
            return True
        finally:
            self.discard()

    def discard(self) -> None:
        if not self._out.closed:
            self._out.close()
        self.tmp.unlink(missing_ok=True)


def _is_gguf(path: Path) -> bool:
    """A GGUF whose header walks (`precheck_open`), False otherwise."""
    try:
        with os.fdopen(open_regular(path), "rb") as src:
            precheck_open(src, path)
    except (ModelFileError, OSError):
        return False
    return True


def _sweep(directory: Path, before: float) -> None:
    for leftover in directory.iterdir():
        try:
            if leftover.stat().st_mtime < before:
                leftover.unlink()
        except OSError:
            continue  # gone meanwhile, or another upload's: the next sweep decides


def release_target(manifest: ReleaseManifest | AgentManifest, length: int, digest: str
                   ) -> TargetFile:
    """The targets entry of a release: its file's length and sha256, and its manifest in
    `custom` (inside `signed`: signed with them)."""
    tf = TargetFile(length, {"sha256": digest}, manifest.target_path)
    tf.unrecognized_fields["custom"] = manifest.to_custom()
    return tf


@dataclass
class _State:
    targets: Metadata[Targets]
    snapshot: Metadata[Snapshot]
    timestamp: Metadata[Timestamp]


def manifest_for(gguf: Path, *, name: str, version: str, notes: list[str] | None = None,
                 **fields: Any) -> ReleaseManifest:
    """The manifest of `gguf` as `name@version`: architecture, quantization, context
    length and parameter size from its header (read in the bounded child process), the
    rest from `fields` (license, tier, chat_template, parameters, min_agent_version, gate,
    stage, materials).
    What the publisher should know before the boxes find out goes into `notes`: a model
    with no chat template anywhere answers no chat, and a box whose previous version did
    rolls it back (its `chat_template` check)."""
    info = probe(gguf)
    manifest = parse({"name": name, "version": version, "architecture": info.architecture,
                      "quantization": info.quantization,
                      "context_length": info.context_length,
                      "parameter_size": info.parameter_size, "created_at": int(time.time()),
                      **{k: v for k, v in fields.items() if v is not None}})
    if notes is not None:
        notes += _missing(manifest.name, version, info, fields)
    return manifest


def _missing(name: str, version: str, info: GGUFInfo, fields: dict[str, Any]) -> list[str]:
    """What a release leaves out that its boxes will miss: a chat template where the
    GGUF has none, the catalog's default parameters for a catalog name."""
    entry = read_catalog(packaged_catalog_dir()).get(ModelName.parse(name))
    out = []
    if not info.chat_template and not fields.get("chat_template"):
        out.append(f"{name}@{version}: the GGUF has no chat template and none was given "
                   "(--template): boxes serve it for /api/generate and /v1/completions "
                   "only, and a box whose current version answers chats rolls it back "
                   "(gate check chat_template)" + (
                       f"; `edge-agent models show {name} --template` prints the catalog's"
                       if entry is not None and entry.chat_template else ""))
    if entry is not None and entry.parameters and not fields.get("parameters"):
        out.append(f"{name}@{version}: the catalog gives {name} default parameters "
                   f"({', '.join(sorted(entry.parameters))}) and none were given "
                   "(--parameters): the release goes out without them; `edge-agent models "
                   f"show {name} --parameters` prints the catalog's")
    return out


def _expiry(seconds: int) -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0) + timedelta(seconds=seconds)


def _write_json(path: Path, data: Any) -> None:
    atomic_write(path, (json.dumps(data, indent=2) + "\n").encode(), 0o644)
