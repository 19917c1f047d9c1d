"""The device's view of signed releases: The Update Framework's client (python-tuf's
`Updater`, for metadata only) and the errors a rollout acts on.

    source = ReleaseSource(settings.fleet, settings.state_dir)
    release = source.lookup("gemma3:270m", "2")        # verified: length, sha256, manifest
    path = transfer.download(release, transfer.downloads_dir(state_dir), ...)
    model = install(release, path, modelops, by="rollout:<id>")   # installed, not active

Trust: only `fleet.tuf_root_file`, the root metadata provisioned with the box, passed to
every Updater as its bootstrap; `<state>/tuf/` keeps what the box has seen (the newest
root, timestamp, snapshot and targets), which is what makes a replayed or rolled-back
repository detectable. Wiping that directory resets the protection: it is state, not a
cache. One Updater per lookup (python-tuf refreshes once per Updater and fixes its clock
at construction), and one lookup at a time per state dir (`tuf/.lock`: the metadata
directory is not safe for concurrent writers).

Every failure is one of two classes, so a rollout knows what to do without reading text:

    ReleaseRejected  not retried: bad signature, replay or rollback, unknown release,
                     a manifest this agent cannot honour (too old, unsupported
                     architecture), not enough disk, a file that is not a model
    ReleaseFailed    retried up to a limit: expired metadata (the controller's cron, or a
                     freeze), repository unreachable or 404, hash mismatch after download

`.reason` is a short code (the constants below) and `.details` the figures behind it.
This module never downloads a model file (`transfer` does), never activates anything,
and never imports the scheduler, the runtime or the registry: models are reached through
`ModelOps` only.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import quote

from tuf.api import exceptions as tuf_errors
from tuf.ngclient import FetcherInterface, Updater, UpdaterConfig

from edge_agent import __version__
from edge_agent.config import FleetSettings
from edge_agent.errors import EdgeAgentError, ModelFileError
from edge_agent.fleet import outcomes
from edge_agent.fleet.files import locked
from edge_agent.fleet.manifest import (
    ManifestError,
    ReleaseManifest,
    agent_too_old,
    parse,
    target_path,
)

if TYPE_CHECKING:
    from edge_agent.engine.modelops import ModelOps
    from edge_agent.engine.records import InstalledModel

# Rejected (never retried)
NOT_CONFIGURED = "not_configured"
BAD_SIGNATURE = "bad_signature"
ROLLBACK = "rollback"
UNTRUSTED = "untrusted_metadata"
UNKNOWN_RELEASE = "unknown_release"
BAD_MANIFEST = "bad_manifest"
AGENT_TOO_OLD = "agent_too_old"
UNSUPPORTED_ARCHITECTURE = "unsupported_architecture"
NO_SPACE = "no_space"
INVALID_MODEL = "invalid_model"
# Failed (retried)
EXPIRED = "expired"
UNREACHABLE = "unreachable"
NOT_FOUND = "not_found"
HASH_MISMATCH = "hash_mismatch"
LOCAL_IO = "local_io"
INSTALL_FAILED = "install_failed"
ERROR = "error"  # anything else python-tuf or the transport raised

TUF_DIR = "tuf"


class ReleaseError(EdgeAgentError):
    """A release that cannot (yet) be installed. `reason`: one of the codes above;
    `details`: the figures (bytes needed and free, versions, the URL …)."""

    retry: ClassVar[bool] = True

    def __init__(self, reason: str, message: str, **details: Any) -> None:
        super().__init__(message)
        self.reason = reason
        self.details = details

    def body(self) -> dict[str, Any]:
        """For an audit message or a rollout's state row."""
        return {"reason": self.reason, "message": self.message, "retry": self.retry,
                **self.details}


class ReleaseRejected(ReleaseError, outcomes.ReleaseRejected):
    """This release will not be installed here; trying again changes nothing."""

    retry = False


class ReleaseFailed(ReleaseError, outcomes.ReleaseFailed):
    """It did not work this time (network, clock, the controller's re-signing); retry."""

    retry = True


@dataclass(frozen=True)
class Release:
    """A release as the device verified it: what to download, from where, and what it
    must be (length and sha256 from the signed targets metadata)."""

    name: str
    version: str
    target_path: str
    length: int
    sha256: str
    url: str
    manifest: ReleaseManifest

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "target": self.target_path,
                "length": self.length, "sha256": self.sha256, "url": self.url,
                "manifest": self.manifest.model_dump()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Release:
        """A release as `to_json` stored it (a rollout's row), to resume its download
        after a restart without a new lookup. Only what this box verified may be stored:
        the row is as trusted as the state dir it lives in."""
        return cls(str(data["name"]), str(data["version"]), str(data["target"]),
                   int(data["length"]), str(data["sha256"]), str(data["url"]),
                   parse(data["manifest"]))


class ReleaseSource:
    """Looks releases up in the repository at `fleet.artifacts_url`, trusting only
    `fleet.tuf_root_file`. `supported_architectures`: GGUF architectures this build of
    llama.cpp loads (None: not checked here; the precheck after download still reads the
    file). `fetcher`: python-tuf's fetcher (None: its urllib3 one)."""

    def __init__(self, fleet: FleetSettings, state_dir: Path, *,
                 agent_version: str = __version__,
                 supported_architectures: Collection[str] | None = None,
                 fetcher: FetcherInterface | None = None) -> None:
        self.root_file = fleet.tuf_root_file
        self.artifacts_url = fleet.artifacts_url
        self.metadata_dir = state_dir / TUF_DIR
        self.agent_version = agent_version
        self.supported_architectures = (frozenset(supported_architectures)
                                        if supported_architectures is not None else None)
        self.fetcher = fetcher

    def lookup(self, name: str, version: str) -> Release:
        """The verified release `name@version`, compatible with this agent; raises
        ReleaseRejected or ReleaseFailed (see the module's doc) and nothing else."""
        ref = f"{name}@{version}"
        try:
            path = target_path(name, version)
        except ManifestError as exc:
            raise ReleaseRejected(UNKNOWN_RELEASE, f"{ref}: {exc}") from None
        base = self._base_url(ref)
        root = self._trusted_root(ref)
        try:
            with self._locked():
                updater = Updater(
                    metadata_dir=str(self.metadata_dir), metadata_base_url=base + "metadata/",
                    fetcher=self.fetcher,
                    config=UpdaterConfig(app_user_agent=f"edge-agent/{self.agent_version}"),
                    bootstrap=root)
                updater.refresh()  # root -> timestamp -> snapshot -> targets, all verified
                info = updater.get_targetinfo(path)
        except Exception as exc:  # every python-tuf and transport error has its class
            raise classify(exc, ref) from exc
        if info is None:
            raise ReleaseRejected(UNKNOWN_RELEASE, f"{ref}: not in the signed release list "
                                  f"(no target {path})", target=path)
        try:
            manifest = ReleaseManifest.from_custom(info.custom)
        except ManifestError as exc:
            raise ReleaseRejected(BAD_MANIFEST, f"{ref}: {exc}") from None
        if (manifest.name, manifest.version) != (name_of(path), version):
            raise ReleaseRejected(BAD_MANIFEST, f"{ref}: the signed manifest names "
                                  f"{manifest.ref}")
        sha = info.hashes.get("sha256")
        if not isinstance(sha, str) or len(sha) != 64:
            raise ReleaseRejected(BAD_MANIFEST, f"{ref}: the signed target has no sha256")
        self.check_compatible(manifest)
        url = base + "targets/" + quote(info.get_prefixed_paths()[0])
        return Release(manifest.name, version, path, info.length, sha.lower(), url, manifest)

    def check_compatible(self, manifest: ReleaseManifest) -> None:
        """ReleaseRejected when this agent cannot run the release as signed."""
        if agent_too_old(manifest.min_agent_version, self.agent_version):
            raise ReleaseRejected(
                AGENT_TOO_OLD, f"{manifest.ref} needs agent {manifest.min_agent_version} or "
                f"later; this is {self.agent_version}",
                min_agent_version=manifest.min_agent_version, agent_version=self.agent_version)
        supported = self.supported_architectures
        if supported is not None and manifest.architecture not in supported:
            raise ReleaseRejected(
                UNSUPPORTED_ARCHITECTURE, f"{manifest.ref} is a {manifest.architecture} model;"
                f" this agent runs {', '.join(sorted(supported))}",
                architecture=manifest.architecture)

    def _base_url(self, ref: str) -> str:
        if not self.artifacts_url:
            raise ReleaseRejected(NOT_CONFIGURED, f"{ref}: fleet.artifacts_url is not set")
        return self.artifacts_url if self.artifacts_url.endswith("/") else \
            self.artifacts_url + "/"

    def _trusted_root(self, ref: str) -> bytes:
        if self.root_file is None:
            raise ReleaseRejected(NOT_CONFIGURED, f"{ref}: fleet.tuf_root_file is not set; "
                                  "releases are refused without a trusted root")
        try:
            return self.root_file.read_bytes()
        except OSError as exc:
            raise ReleaseRejected(NOT_CONFIGURED, f"{ref}: fleet.tuf_root_file "
                                  f"{self.root_file}: {exc.strerror}") from None

    def _locked(self) -> AbstractContextManager[None]:
        self.metadata_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        return locked(self.metadata_dir / ".lock")


def name_of(path: str) -> str:
    """The normalized name a target path encodes (`target_path`'s inverse, name part)."""
    parts = path.split("/")
    return f"{'/'.join(parts[:-3])}:{parts[-3]}"


def classify(exc: BaseException, ref: str) -> ReleaseError:
    """A python-tuf or transport exception as the rollout's error (subclasses first:
    the order of the checks is the mapping)."""
    if isinstance(exc, ReleaseError):
        return exc
    detail = str(exc) or (repr(exc.__cause__) if exc.__cause__ else type(exc).__name__)
    kind = type(exc).__name__
    if isinstance(exc, tuf_errors.ExpiredMetadataError):
        now = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        return ReleaseFailed(EXPIRED, f"{ref}: release metadata expired ({detail}); this "
                             f"box's clock says {now} UTC. The controller re-signs the "
                             "timestamp from cron (edge-agent fleet release timestamp); "
                             "if it does, this clock is wrong", device_utc=now)
    if isinstance(exc, tuf_errors.LengthOrHashMismatchError):
        return ReleaseFailed(HASH_MISMATCH, f"{ref}: {detail}")
    if isinstance(exc, tuf_errors.UnsignedMetadataError):
        return ReleaseRejected(BAD_SIGNATURE, f"{ref}: release metadata is not signed by the "
                               f"trusted keys ({detail})", error=kind)
    if isinstance(exc, tuf_errors.BadVersionNumberError):
        return ReleaseRejected(ROLLBACK, f"{ref}: release metadata is older than what this "
                               f"box has seen: a replay or a rolled-back repository "
                               f"({detail})", error=kind)
    if isinstance(exc, tuf_errors.RepositoryError):
        return ReleaseRejected(UNTRUSTED, f"{ref}: untrusted release metadata ({kind}: "
                               f"{detail})", error=kind)
    if isinstance(exc, tuf_errors.DownloadHTTPError):
        if exc.status_code == 404:
            return ReleaseFailed(NOT_FOUND, f"{ref}: the repository answered 404 ({detail})",
                                 status=404)
        return ReleaseFailed(UNREACHABLE, f"{ref}: the repository answered HTTP "
                             f"{exc.status_code}", status=exc.status_code)
    if isinstance(exc, tuf_errors.DownloadError):
        return ReleaseFailed(UNREACHABLE, f"{ref}: release repository unreachable "
                             f"({kind}: {detail})", error=kind)
    if isinstance(exc, OSError):
        return ReleaseFailed(LOCAL_IO, f"{ref}: {kind}: {detail}", error=kind)
    return ReleaseFailed(ERROR, f"{ref}: {kind}: {detail}", error=kind)


def install(release: Release, path: Path, modelops: ModelOps, *, by: str) -> InstalledModel:
    """The verified download into the model store as a new version of the release's name,
    NOT active (activation is the rollout's next step). The store takes the file by rename
    where it is on the blobs' filesystem (else copies it) and checks length, sha256 and the
    header once more on what it keeps; the download is gone afterwards. ReleaseFailed when
    the store refuses the file."""
    try:
        model = modelops.install_verified(
            path, release.name, release.sha256, by=by, expected_size=release.length,
            extras=release.manifest.extras(), origin=f"release:{release.ref}",
            activate=False, move=True)
    except ModelFileError as exc:
        raise ReleaseFailed(INSTALL_FAILED, f"{release.ref}: {exc.message}") from exc
    path.unlink(missing_ok=True)  # copied from another filesystem
    return model
