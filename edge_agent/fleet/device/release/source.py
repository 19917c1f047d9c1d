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
at construction).

Locking: `tuf/` is not safe for concurrent writers, but a lookup must not hold it across
the network, or one stalled repository holds every other lookup (another name, the next
rollout after a cancel) for as long as it stalls. So `tuf/.lock` is held only for local
copies: a lookup copies what the box has seen into a private `tuf/.lookup-*` directory
(locked), runs python-tuf there (unlocked: every check is made against that copy), then
stores back what it verified (locked), never replacing newer metadata another lookup
stored meanwhile (`_store_seen`). Two lookups at once are each checked against the state
at their start, as if they had run one after the other.

Slow retrieval (TUF's threat of a repository, or a man in the middle, that sends its
bytes as slowly as it likes): a read timeout alone never fires at 1 byte a second, so
every fetch is held to a floor (`Pace`): after `fleet.transfer_grace_s`, at least
`fleet.min_transfer_bytes_per_s` on average, so N bytes have grace + N / rate seconds;
and one lookup's metadata has `fleet.metadata_deadline_s` in all. Falling behind is
ReleaseFailed (`too_slow`), naming the rate.

Every failure is one of two classes, so a rollout knows what to do without reading text:

    ReleaseRejected  not retried: bad signature, replay or rollback, unknown release,
                     a manifest this agent cannot honour (too old, unsupported
                     architecture), a signed target no file can be (a sha256 that is not
                     64 lowercase hex digits, an empty file), not enough disk, a file
                     that is not a model
    ReleaseFailed    retried up to a limit: expired metadata (the controller's cron, or a
                     freeze), repository unreachable or 404, too slow, hash mismatch
                     after download

`.reason` is a short code (the constants below) and `.details` the figures behind it.
This module never downloads a model file (`transfer` does), never activates anything,
and never imports the scheduler, the runtime or the registry: models are reached through
`ModelOps` only.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Collection, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import urllib3
from tuf.api import exceptions as tuf_errors
from tuf.api.metadata import TargetFile
from tuf.ngclient import FetcherInterface, Updater, UpdaterConfig

from edge_agent import __version__
from edge_agent.config import FleetSettings
from edge_agent.errors import ModelFileError
from edge_agent.files import atomic_write, locked
from edge_agent.fleet.device.release.cutoff import Cutoff
from edge_agent.fleet.device.rollout.outcomes import ReleaseError, ReleaseFailed, ReleaseRejected
from edge_agent.fleet.protocol.agent_release import (
    AGENT_NAME,
    AgentManifest,
    AgentManifestError,
    agent_target_path,
    is_agent,
)
from edge_agent.fleet.protocol.manifest import (
    ManifestError,
    ReleaseManifest,
    agent_too_old,
    parse,
    target_path,
)
from edge_agent.names import ModelName

if TYPE_CHECKING:
    from edge_agent.engine.modelops import ModelOps
    from edge_agent.engine.models.entries import InstalledModel

# Rejected (never retried)
NOT_CONFIGURED = "not_configured"
BAD_SIGNATURE = "bad_signature"
ROLLBACK = "rollback"
UNTRUSTED = "untrusted_metadata"
UNKNOWN_RELEASE = "unknown_release"
BAD_MANIFEST = "bad_manifest"
AGENT_TOO_OLD = "agent_too_old"
UNSUPPORTED_ARCHITECTURE = "unsupported_architecture"
BAD_TARGET = "bad_target"
NO_SPACE = "no_space"
INVALID_MODEL = "invalid_model"
NOT_FOR_THIS_BOX = "not_for_this_box"  # an agent release built for another platform
# Failed (retried)
EXPIRED = "expired"
UNREACHABLE = "unreachable"
TOO_SLOW = "too_slow"
NOT_FOUND = "not_found"
HASH_MISMATCH = "hash_mismatch"
LOCAL_IO = "local_io"
INSTALL_FAILED = "install_failed"
ERROR = "error"  # anything else python-tuf or the transport raised

TUF_DIR = "tuf"
_LOOKUP_PREFIX = ".lookup-"
_ROOT_HISTORY = "root_history"  # python-tuf's: every root version walked, N.root.json
_SHA256 = re.compile(r"[0-9a-f]{64}")
_READ = 1 << 16


@dataclass(frozen=True)
class Release:
    """A release as the device verified it: what to download, from where, and what it
    must be (length and sha256 from the signed targets metadata)."""

    name: ModelName
    version: str
    target_path: str
    length: int
    sha256: str
    url: str
    manifest: ReleaseManifest | AgentManifest  # an agent release's: its wheelhouse

    def __post_init__(self) -> None:
        # However it was built (a lookup, a stored row): the download names its files
        # after the sha256, so no Release exists whose hash is not a plain hex name.
        check_target(self.ref, self.length, self.sha256)

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
        manifest = data["manifest"]
        return cls(ModelName(str(data["name"])), str(data["version"]), str(data["target"]),
                   int(data["length"]), str(data["sha256"]), str(data["url"]),
                   AgentManifest.from_custom(manifest) if is_agent(manifest)
                   else parse(manifest))


def check_target(ref: str, length: object, sha256: object) -> None:
    """ReleaseRejected (`bad_target`) unless the signed target can be a model file here:
    a sha256 of exactly 64 lowercase hex digits (what hashlib writes, and what python-tuf
    compares against) and a length of at least one byte. Signed is not enough: the
    repository's online key signs whatever it is given, and the hash becomes file names
    on this box (`<sha256>.part`), so a hash such as `../../x…` must never get that far;
    an empty file is no model, and downloading one would fail as a local error, retried
    forever instead of refused."""
    if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
        shown = repr(sha256)[:80] if sha256 is not None else "none"
        raise ReleaseRejected(BAD_TARGET, f"{ref}: invalid release: the signed target's "
                              f"sha256 ({shown}) is not 64 lowercase hex digits",
                              sha256=str(sha256)[:80])
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise ReleaseRejected(BAD_TARGET, f"{ref}: invalid release: the signed target is "
                              f"{length!r:.40} bytes long; a model file is never empty",
                              length=length if isinstance(length, int) else None)


@dataclass(frozen=True)
class Pace:
    """How slowly a release's bytes may arrive before the fetch is given up (the module's
    doc): after `grace_s`, at least `min_bytes_per_s` on average since the fetch began;
    a lookup's metadata fetches have `metadata_deadline_s` in all. And, for both kinds of
    fetch, the CA file the release server's HTTPS certificate is checked against
    (`fleet.artifacts_ca_file`; None: the system's CAs)."""

    min_bytes_per_s: int
    grace_s: float
    metadata_deadline_s: float
    ca_file: str | None = None

    @classmethod
    def of(cls, fleet: FleetSettings | None = None) -> Pace:
        """`fleet`'s floors and CA (None: the settings' defaults)."""
        f = fleet if fleet is not None else FleetSettings.model_validate({})
        return cls(f.min_transfer_bytes_per_s, f.transfer_grace_s, f.metadata_deadline_s,
                   None if f.artifacts_ca_file is None else str(f.artifacts_ca_file))

    def tls(self) -> dict[str, Any]:
        """The pool manager's TLS arguments: the release server's CA, where one is set."""
        return {} if self.ca_file is None else {"ca_certs": self.ca_file}

    def deadline_s(self, length: int) -> float:
        """Seconds `length` bytes may take in all: the grace, then the floor."""
        return self.grace_s + length / self.min_bytes_per_s

    def behind(self, got: int, elapsed_s: float) -> str | None:
        """Why `got` bytes after `elapsed_s` seconds is below the floor, or None."""
        if elapsed_s <= self.grace_s or got >= (elapsed_s - self.grace_s) * self.min_bytes_per_s:
            return None
        return (f"{got} bytes in {elapsed_s:.1f} s ({got / elapsed_s:.0f} B/s on average), "
                f"below the floor of {self.min_bytes_per_s} B/s after {self.grace_s:g} s "
                "(fleet.min_transfer_bytes_per_s, fleet.transfer_grace_s)")


class TooSlow(tuf_errors.SlowRetrievalError):
    """Metadata that fell behind the `Pace` (python-tuf's own class, so python-tuf lets it
    through unwrapped; only ours: a connect that fails is no slowness)."""


class _PacedFetcher(FetcherInterface):
    """python-tuf's fetcher with the slow-retrieval defence its own lacks (its reads wait
    for a whole chunk, with a timeout per socket read only): reads take what has arrived
    (`read1`), so each one checks the floor; no read waits longer than the grace; a clock
    (`cutoff`) cuts the connection the instant a fetch falls behind, even where no read
    returns (headers sent a byte a second); and every fetch of one lookup ends by
    `metadata_deadline_s` after the fetcher was made. Falling behind raises TooSlow
    (`classify`: `too_slow`)."""

    def __init__(self, pace: Pace, user_agent: str, timeout_s: float = 30.0) -> None:
        self.pace = pace
        self.timeout_s = min(timeout_s, pace.grace_s)
        self.deadline = time.monotonic() + pace.metadata_deadline_s
        self.started, self.got = time.monotonic(), 0  # the fetch under way
        self.cutoff = Cutoff(self._due_s, name="release metadata")
        # One connect retry (a pooled connection the server closed); redirects followed,
        # as object stores use them: the bytes are checked against the signatures.
        self.http = self.cutoff.pool_manager(
            retries=urllib3.Retry(total=None, connect=1, read=0, status=0, other=0,
                                  redirect=5),
            headers={"User-Agent": user_agent}, **pace.tls())

    def _due_s(self) -> float:
        """Seconds until the fetch under way falls behind (the floor or the lookup's
        deadline), negative once it has."""
        pace = self.pace
        return min(self.deadline, self.started + pace.grace_s + self.got / pace.min_bytes_per_s
                   ) - time.monotonic()

    def _fetch(self, url: str) -> Iterator[bytes]:
        self.started, self.got = time.monotonic(), 0
        timeout = max(0.05, min(self.timeout_s, self.deadline - self.started))
        self.cutoff.arm()  # disarmed when the body ends (`_body`) or here on failure
        try:
            resp = self.http.request("GET", url, preload_content=False,
                                     timeout=urllib3.Timeout(connect=timeout, read=timeout))
        except urllib3.exceptions.MaxRetryError as exc:
            self.cutoff.disarm()
            self._check(url, cut=self.cutoff.tripped)
            # connected, then no answer: slow; refused or no route (urllib3 counts a
            # failed connect as a timeout too): unreachable, as python-tuf's own says
            if isinstance(exc.reason, urllib3.exceptions.ReadTimeoutError):
                raise TooSlow(f"{_file(url)}: no answer within {timeout:.1f} s") from exc
            raise
        except BaseException:
            self.cutoff.disarm()
            self._check(url, cut=self.cutoff.tripped)
            raise
        if resp.status >= 400:
            self.cutoff.disarm()
            resp.close()
            raise tuf_errors.DownloadHTTPError(
                f"{_file(url)}: HTTP error occurred with status {resp.status}", resp.status)
        return self._body(url, resp)

    def _body(self, url: str, resp: urllib3.BaseHTTPResponse) -> Iterator[bytes]:
        ended = False
        try:
            while True:
                try:
                    block = resp.read1(_READ)
                except urllib3.exceptions.TimeoutError as exc:
                    raise TooSlow(
                        f"{_file(url)}: no byte for {self.timeout_s:.1f} s after {self.got} "
                        "bytes") from exc
                except urllib3.exceptions.HTTPError as exc:  # cut short, reset
                    self._check(url, cut=self.cutoff.tripped)
                    raise tuf_errors.DownloadError(f"{_file(url)}: {exc}") from exc
                if not block:
                    self._check(url, cut=self.cutoff.tripped)
                    ended = True
                    return
                self.got += len(block)
                self._check(url)
                yield block
        finally:
            self.cutoff.disarm()
            if ended:
                resp.release_conn()
            else:  # given up on (too slow, too long): never reuse the connection
                resp.close()

    def _check(self, url: str, *, cut: bool = False) -> None:
        """TooSlow where the fetch under way is behind, or was `cut` for it."""
        now = time.monotonic()
        if now > self.deadline:
            raise TooSlow(
                f"{_file(url)}: the release metadata took more than "
                f"{self.pace.metadata_deadline_s:g} s in all (fleet.metadata_deadline_s)")
        why = self.pace.behind(self.got, now - self.started)
        if why is None and cut:  # the clock cuts only once strictly behind: not reached
            why = f"{self.got} bytes in {now - self.started:.1f} s, cut at the floor"
        if why is not None:
            raise TooSlow(f"{_file(url)}: {why}")

    def close(self) -> None:
        self.cutoff.close()
        self.http.clear()


def _file(url: str) -> str:
    return url.rpartition("/")[2] or url


class ReleaseSource:
    """Looks releases up in the repository at `fleet.artifacts_url`, trusting only
    `fleet.tuf_root_file`. `supported_architectures`: GGUF architectures this build of
    llama.cpp loads (None: not checked here; the precheck after download still reads the
    file). `fetcher`: python-tuf's fetcher (None: urllib3, held to the fleet's `Pace`)."""

    def __init__(self, fleet: FleetSettings, state_dir: Path, *,
                 agent_version: str = __version__,
                 supported_architectures: Collection[str] | None = None,
                 fetcher: FetcherInterface | None = None) -> None:
        self.root_file = fleet.tuf_root_file
        self.artifacts_url = fleet.artifacts_url
        self.metadata_dir = state_dir / TUF_DIR
        self.pace = Pace.of(fleet)
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
        base, info = self._verified(ref, path)
        sha = info.hashes.get("sha256")
        try:
            manifest = ReleaseManifest.from_custom(info.custom)
        except ManifestError as exc:
            raise ReleaseRejected(BAD_MANIFEST, f"{ref}: {exc}") from None
        if (manifest.name, manifest.version) != (name_of(path), version):
            raise ReleaseRejected(BAD_MANIFEST, f"{ref}: the signed manifest names "
                                  f"{manifest.ref}")
        self.check_compatible(manifest)
        url = base + "targets/" + quote(info.get_prefixed_paths()[0])
        return Release(manifest.name, version, path, info.length, str(sha), url, manifest)

    def lookup_agent(self, version: str) -> Release:
        """The verified agent release `version` (`protocol.agent_release`); whether it is
        built for this box is the caller's to decide (before downloading)."""
        ref = f"{AGENT_NAME.given}@{version}"
        try:
            path = agent_target_path(version)
        except AgentManifestError as exc:
            raise ReleaseRejected(UNKNOWN_RELEASE, f"{ref}: {exc}") from None
        base, info = self._verified(ref, path)
        sha = info.hashes.get("sha256")
        try:
            manifest = AgentManifest.from_custom(info.custom)
        except AgentManifestError as exc:
            raise ReleaseRejected(BAD_MANIFEST, f"{ref}: {exc}") from None
        if manifest.version != version:
            raise ReleaseRejected(BAD_MANIFEST, f"{ref}: the signed manifest names "
                                  f"{manifest.ref}")
        url = base + "targets/" + quote(info.get_prefixed_paths()[0])
        return Release(AGENT_NAME, version, path, info.length, str(sha), url, manifest)

    def _verified(self, ref: str, path: str) -> tuple[str, TargetFile]:
        """The repository's base URL and the verified target at `path`, its hash and
        length checked (`check_target`); ReleaseRejected or ReleaseFailed otherwise."""
        base = self._base_url(ref)
        root = self._trusted_root(ref)
        try:
            info = self._targetinfo(base, root, path)
        except Exception as exc:  # every python-tuf and transport error has its class
            raise classify(exc, ref) from exc
        if info is None:
            raise ReleaseRejected(UNKNOWN_RELEASE, f"{ref}: not in the signed release list "
                                  f"(no target {path})", target=path)
        check_target(ref, info.length, info.hashes.get("sha256"))
        return base, info

    def _targetinfo(self, base: str, root: bytes, path: str) -> TargetFile | None:
        """python-tuf's refresh and target lookup in a private copy of what the box has
        seen, stored back afterwards (the module's doc: the lock is never held across
        the network). What verified is stored even when a later step failed, as
        python-tuf itself stores each file once it verifies."""
        work = self._private_copy()
        fetcher = self.fetcher or _PacedFetcher(self.pace, f"edge-agent/{self.agent_version}")
        try:
            updater = Updater(
                metadata_dir=str(work), metadata_base_url=base + "metadata/", fetcher=fetcher,
                config=UpdaterConfig(app_user_agent=f"edge-agent/{self.agent_version}"),
                bootstrap=root)
            updater.refresh()  # root -> timestamp -> snapshot -> targets, all verified
            info = updater.get_targetinfo(path)
        except BaseException:
            with contextlib.suppress(OSError), self._locked():  # the lookup's error wins
                _store_seen(work, self.metadata_dir)
            raise
        else:
            with self._locked():
                _store_seen(work, self.metadata_dir)
            return info
        finally:
            if isinstance(fetcher, _PacedFetcher):
                fetcher.close()
            shutil.rmtree(work, ignore_errors=True)

    def _private_copy(self) -> Path:
        """A new `tuf/.lookup-*` holding what the box has seen (copied under the lock, so
        never half of one store); copies a killed process left are removed here."""
        with self._locked():
            stale = time.time() - 2 * self.pace.metadata_deadline_s - 3600
            for old in self.metadata_dir.glob(_LOOKUP_PREFIX + "*"):
                with contextlib.suppress(OSError):
                    if old.stat().st_mtime < stale:
                        shutil.rmtree(old)
            work = Path(tempfile.mkdtemp(prefix=_LOOKUP_PREFIX, dir=self.metadata_dir))
            for rel in _seen_files(self.metadata_dir):
                (work / rel).parent.mkdir(exist_ok=True, mode=0o700)
                shutil.copyfile(self.metadata_dir / rel, work / rel)
        return work

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


def _seen_files(directory: Path) -> list[Path]:
    """What python-tuf keeps in `directory`, relative to it: every root version walked,
    and the newest file of each other role (`root.json` is only its link to the newest
    root; lookups' copies, temporaries and the lock are not metadata)."""
    history = directory / _ROOT_HISTORY
    roots = [p.relative_to(directory) for p in history.glob("*.root.json") if p.is_file()]
    roles = [Path(p.name) for p in directory.glob("*.json")
             if p.name != "root.json" and p.is_file() and not p.is_symlink()]
    return roots + roles


def _version(path: Path) -> int:
    """The signed version in a metadata file, -1 where there is none (missing, unreadable):
    only for ordering files python-tuf verified, never for trusting one."""
    try:
        version = json.loads(path.read_bytes())["signed"]["version"]
    except (OSError, ValueError, KeyError, TypeError):
        return -1
    return version if isinstance(version, int) and not isinstance(version, bool) else -1


def _store_seen(work: Path, shared: Path) -> None:
    """Under the lock: what a lookup verified in `work` becomes what the box has seen in
    `shared`, only ever forward. Root versions are added (a chain only grows; `root.json`
    then links to the newest); the other roles are replaced as one set, and only where
    none of them would become older: a lookup that ran beside another which stored newer
    metadata leaves that newer metadata in place."""
    history = shared / _ROOT_HISTORY
    history.mkdir(parents=True, exist_ok=True, mode=0o700)
    for rel in _seen_files(work):
        if rel.parts[0] == _ROOT_HISTORY and not (shared / rel).exists():
            _put(work / rel, shared / rel)
    roots = [(_version(p), p.name) for p in history.glob("*.root.json")]
    if roots:
        link, newest = shared / "root.json", f"{_ROOT_HISTORY}/{max(roots)[1]}"
        if not link.is_symlink() or os.readlink(link) != newest:
            tmp = shared / f".root.json.{os.getpid()}"
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(newest)
            os.replace(tmp, link)
    names = {rel.name for rel in _seen_files(work) if len(rel.parts) == 1}
    names |= {rel.name for rel in _seen_files(shared) if len(rel.parts) == 1}
    if all(_version(work / n) >= _version(shared / n) for n in names):
        for n in sorted(names):
            if (work / n).exists():
                _put(work / n, shared / n)


def _put(src: Path, dest: Path) -> None:
    data = src.read_bytes()
    with contextlib.suppress(OSError):
        if dest.read_bytes() == data:
            return  # most lookups find nothing new: no write
    atomic_write(dest, data, 0o600)


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
    if isinstance(exc, TooSlow):
        return ReleaseFailed(TOO_SLOW, f"{ref}: the release metadata arrived too slowly "
                             f"({detail})", error=kind)
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


def release_origin(name: str, version: str) -> str:
    """The origin the model store records for a version a release installed (`install`),
    by which `model.verify` finds the version a release's number names."""
    return f"release:{name}@{version}"


def install(release: Release, path: Path, modelops: ModelOps, *, by: str) -> InstalledModel:
    """The verified download into the model store as a new version of the release's name,
    NOT active (activation is the rollout's next step). The store takes the file by rename
    where it is on the blobs' filesystem (else copies it) and checks length, sha256 and the
    header once more on what it keeps; the download is gone afterwards. ReleaseFailed when
    the store refuses the file."""
    assert isinstance(release.manifest, ReleaseManifest)  # an agent's: `device.agent.slots`
    try:
        model = modelops.install_verified(
            path, release.name, release.sha256, by=by, expected_size=release.length,
            extras=release.manifest.extras(),
            origin=release_origin(release.name, release.version), activate=False, move=True)
    except ModelFileError as exc:
        raise ReleaseFailed(INSTALL_FAILED, f"{release.ref}: {exc.message}") from exc
    path.unlink(missing_ok=True)  # copied from another filesystem
    return model
