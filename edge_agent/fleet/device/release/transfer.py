"""A release's model file onto this box: resumable, rate-capped, verified as it arrives.

    path = download(release, downloads_dir(state_dir), progress=cb,
                    max_bytes_per_s=fleet.max_download_bytes_per_s,
                    headroom=fleet.download_headroom_bytes, pace=Pace.of(fleet))

In order:
1. free disk first: what is left to fetch, plus the model store's copy of the file where
   it needs one (`install_copy`: `ModelOps.install_verified` takes a download on the
   blobs' filesystem by rename, `store_copy_needed`), plus `headroom`; refused
   (ReleaseRejected, `no_space`) with the three numbers and the directory;
2. the bytes go to `<dest>/<sha256>.part`; a part left by a dropped link, a stopped agent
   or a `kill -9` is continued with `Range: bytes=N-` (its bytes are hashed once first);
   a server that ignores Range (200) is read from the start again. Every file name here
   goes through `files.inside` (a name that would leave `dest`, a link planted there:
   ReleaseRejected, `bad_target`), behind `Release`'s own check of the hash;
3. transient errors (connection refused or reset, timeouts, 5xx, a body cut short) are
   retried with exponential backoff and jitter; the count restarts whenever bytes arrived,
   so a flaky but moving link is not given up on; `retry.attempts` failures in a row give
   ReleaseFailed (`unreachable`); a 404 gives ReleaseFailed (`not_found`) at once;
4. optional rate cap (`max_bytes_per_s`, a token bucket), and a floor (`pace`, TUF's
   slow-retrieval defence): from the first request, after `pace.grace_s`, the bytes of
   this call must keep up with `pace.min_bytes_per_s` on average (at most half the cap
   under one), checked at each read and before each retry, and by a clock (`cutoff`)
   that cuts the connection the moment the bytes so far fall below it, whatever the
   server sends (headers or a chunk's size line a byte a second: reads that never
   return), so what is left of the file has grace + left / rate seconds in all; no read
   waits longer than the grace. Falling
   behind is ReleaseFailed (`too_slow`, the figures named) at once, never retried here:
   a trickle that sends a byte now and then would otherwise reset the count of failures
   for ever. The part is kept. Until a first byte came, the count of failures alone
   decides (a server that is down is `unreachable`, as before);
5. sha256 computed as the bytes arrive; nothing past the signed length is written; length
   and sha256 must match the signed target, else the part is deleted and ReleaseFailed
   (`hash_mismatch`): the next attempt starts from zero;
6. renamed to `<dest>/<sha256>.gguf`, then the GGUF precheck in the bounded child process
   (`engine.gguf_probe.probe`): a file that is not a model is ReleaseRejected
   (`invalid_model`) and deleted.

`progress(done, total, rate_bytes_s, eta_s)` is called at most every 0.25 s and once at
the end (eta None until a rate is known). The disk is read through `free_space(path) ->
bytes` (default: `shutil.disk_usage(path).free`), a seam for tests and for a state dir
with a quota of its own. One download per file at a time (`<sha256>.lock`). Uses urllib3
(python-tuf's own HTTP client). Fetches only the URL built from the signed target
(redirects are followed, as object stores use them: the bytes are checked against the
signed sha256 whoever sends them). Never installs or activates anything
(`release.install` does the former).
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

import urllib3

from edge_agent import __version__
from edge_agent.engine.models.gguf_probe import probe
from edge_agent.errors import ModelFileError
from edge_agent.files import EscapesDirectory, inside, locked
from edge_agent.fleet.device.release.cutoff import Cutoff
from edge_agent.fleet.device.release.source import (
    BAD_MANIFEST,
    BAD_TARGET,
    HASH_MISMATCH,
    INVALID_MODEL,
    LOCAL_IO,
    NO_SPACE,
    NOT_FOUND,
    TOO_SLOW,
    UNREACHABLE,
    Pace,
    Release,
    ReleaseFailed,
    ReleaseRejected,
)
from edge_agent.fleet.protocol.manifest import ReleaseManifest

DOWNLOADS_DIR = "downloads"
CHUNK = 1 << 20
PROGRESS_EVERY_S = 0.25
FreeSpace = Callable[[Path], int]
Progress = Callable[[int, int, float, "float | None"], None]
_TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class Retry:
    """Backoff between attempts: base * 2^(n-1), at most max_s, times a jitter in
    [0.5, 1); `attempts` failures in a row (no byte received) end the download."""

    attempts: int = 6
    base_s: float = 0.5
    max_s: float = 30.0

    def delay(self, failures: int) -> float:
        return min(self.max_s, self.base_s * 2 ** (failures - 1)) * random.uniform(0.5, 1.0)


def downloads_dir(state_dir: Path) -> Path:
    return state_dir / DOWNLOADS_DIR


def disk_free(path: Path) -> int:
    return shutil.disk_usage(path).free


def paths(release: Release, dest_dir: Path) -> tuple[Path, Path]:
    """(the finished file, its part) for `release` in `dest_dir`."""
    return _named(release, dest_dir, "gguf"), _named(release, dest_dir, "part")


def _named(release: Release, dest_dir: Path, suffix: str) -> Path:
    try:
        return inside(dest_dir, f"{release.sha256}.{suffix}")
    except EscapesDirectory as exc:
        raise ReleaseRejected(BAD_TARGET, f"{release.ref}: invalid release: its file "
                              f"would not stay in {dest_dir} ({exc})", where=str(dest_dir)
                              ) from None


def store_copy_needed(dest_dir: Path, blobs_dir: Path) -> bool:
    """Whether the model store must copy a download from `dest_dir` into `blobs_dir`
    (two filesystems) rather than rename it: what the free-disk check counts."""
    return _device(dest_dir) != _device(blobs_dir)


def _device(path: Path) -> int:
    """The filesystem of `path`, or of its nearest folder that exists."""
    for p in (path, *path.parents):
        try:
            return os.stat(p).st_dev
        except FileNotFoundError:
            continue
    return -1


def discard(release: Release, dest_dir: Path) -> None:
    """Remove what a download of `release` left (a rollout given up on)."""
    final, part = paths(release, dest_dir)
    for p in (final, part, _named(release, dest_dir, "lock")):
        p.unlink(missing_ok=True)


def download(release: Release, dest_dir: Path, *, progress: Progress | None = None,
             max_bytes_per_s: int | None = None, headroom: int = 0,
             install_copy: bool = True, free_space: FreeSpace = disk_free,
             retry: Retry | None = None, timeout_s: float = 30.0,
             pace: Pace | None = None) -> Path:
    """The verified file of `release` in `dest_dir` (see the module's doc). `pace`: the
    floor (None: the fleet settings' defaults)."""
    try:
        return _download(release, dest_dir, progress, max_bytes_per_s, headroom,
                         install_copy, free_space, retry or Retry(), timeout_s,
                         pace or Pace.of())
    except OSError as exc:  # this box's disk (the link's errors are retried inside)
        raise ReleaseFailed(LOCAL_IO, f"{release.ref}: {dest_dir}: {exc}",
                            where=str(dest_dir)) from exc


def _download(release: Release, dest_dir: Path, progress: Progress | None,
              max_bytes_per_s: int | None, headroom: int, install_copy: bool,
              free_space: FreeSpace, retry: Retry, timeout_s: float, pace: Pace) -> Path:
    final, part = paths(release, dest_dir)  # refused before anything is created
    lock = _named(release, dest_dir, "lock")
    dest_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    with locked(lock):
        if final.exists():  # finished before a stop, not yet installed: check it again
            try:
                return verify(release, final)
            except ReleaseFailed:
                pass  # deleted: fetched again below
        have = part.stat().st_size if part.exists() else 0
        if have > release.length:
            part.unlink()
            have = 0
        _check_space(release, dest_dir, have, headroom, install_copy, free_space)
        digest = _hash_prefix(part) if have else hashlib.sha256()
        fetch = _Fetch(release, part, digest, have, progress, max_bytes_per_s, timeout_s,
                       pace)
        fetch.run(retry)
        if fetch.have != release.length or fetch.digest.hexdigest() != release.sha256:
            part.unlink(missing_ok=True)
            raise ReleaseFailed(
                HASH_MISMATCH, f"{release.ref}: downloaded {fetch.have} bytes with sha256 "
                f"{fetch.digest.hexdigest()[:16]}…; signed {release.length} bytes, "
                f"{release.sha256[:16]}… (deleted; the next attempt starts over)",
                url=release.url, got_bytes=fetch.have, got_sha256=fetch.digest.hexdigest())
        os.replace(part, final)
        return _prechecked(final, release)


class _Fetch:
    """One download's attempts: the open part, the running hash, the rate cap, the
    floor."""

    def __init__(self, release: Release, part: Path, digest: hashlib._Hash, have: int,
                 progress: Progress | None, max_bytes_per_s: int | None,
                 timeout_s: float, pace: Pace) -> None:
        self.release, self.part, self.digest, self.have = release, part, digest, have
        self.restarts, self.max_restarts = 0, 0
        self.meter = _Meter(release.length, progress, have)
        self.bucket = _TokenBucket(max_bytes_per_s) if max_bytes_per_s else None
        if max_bytes_per_s:  # the cap's own pace never trips the floor
            pace = replace(pace, min_bytes_per_s=max(1, min(pace.min_bytes_per_s,
                                                            max_bytes_per_s // 2)))
        self.pace = pace
        self.got, self.started = 0, time.monotonic()  # this call's bytes, from its start
        self.left = release.length - have  # what this call set out to fetch
        timeout_s = min(timeout_s, pace.grace_s)
        # Under a cap, smaller reads keep the pace even (about 8 reads a second).
        self.chunk = min(CHUNK, max(16384, max_bytes_per_s // 8)) if max_bytes_per_s \
            else CHUNK
        self.cutoff = Cutoff(self._due_s, name=release.ref)
        self.http = self.cutoff.pool_manager(
            retries=urllib3.Retry(total=None, connect=0, read=0, status=0, other=0,
                                  redirect=5, raise_on_status=False),
            timeout=urllib3.Timeout(connect=timeout_s, read=timeout_s),
            headers={"User-Agent": f"edge-agent/{__version__}"}, **pace.tls())

    def run(self, retry: Retry) -> None:
        self.max_restarts = retry.attempts
        self.started = time.monotonic()
        failures, last_error = 0, ""
        try:
            while self.have < self.release.length:
                before = self.have
                try:
                    with self.cutoff.armed():
                        self._attempt()
                    continue
                except _Transient as exc:
                    last_error = str(exc)
                except (urllib3.exceptions.HTTPError, OSError) as exc:  # the link's
                    last_error = f"{type(exc).__name__}: {exc}"
                if self.cutoff.tripped:  # connected, and fell behind: cut by the clock
                    self._check_pace(last_error, cut=True)
                if self.got:  # nothing at all yet: the count of failures decides
                    self._check_pace(last_error)
                failures = 1 if self.have > before else failures + 1
                if failures > retry.attempts:
                    raise ReleaseFailed(
                        UNREACHABLE, f"{self.release.ref}: download stopped at {self.have} of "
                        f"{self.release.length} bytes after {retry.attempts} failed attempts "
                        f"in a row ({last_error}); the part is kept and resumed next time",
                        url=self.release.url, done=self.have, error=last_error)
                delay = retry.delay(failures)
                if self.got:
                    time.sleep(min(delay, self._left_s()))
                    self._check_pace(last_error)
                else:
                    time.sleep(delay)
        finally:
            self.cutoff.close()
            self.meter.done(self.have)
            self.http.clear()

    def _attempt(self) -> None:
        # identity: Range offsets and the signed hash are of the bytes as stored
        headers = {"Accept-Encoding": "identity"}
        if self.have:
            headers["Range"] = f"bytes={self.have}-"
        resp = self.http.request("GET", self.release.url, headers=headers,
                                 preload_content=False, decode_content=False)
        try:
            status = resp.status
            if status == 404:
                raise ReleaseFailed(NOT_FOUND, f"{self.release.ref}: {self.release.url} "
                                    "answered 404", url=self.release.url, status=404)
            if status in _TRANSIENT_STATUS:
                raise _Transient(f"HTTP {status}")
            if status == 416:  # our part is past the server's end
                size = resp.headers.get("Content-Range", "").rpartition("/")[2]
                if size.isdigit() and int(size) < self.release.length:
                    self._fail_short(int(size))
                self._restart()
                raise _Transient(f"HTTP 416 at {self.have}")
            if status == 200:
                size = resp.headers.get("Content-Length", "")
                if size.isdigit() and int(size) < self.release.length:
                    self._fail_short(int(size))
                if self.have:  # Range ignored: the whole file comes again
                    self._restart()
            elif status == 206:
                self._check_range(resp.headers.get("Content-Range", ""))
            elif status != 200:
                raise ReleaseFailed(UNREACHABLE, f"{self.release.ref}: {self.release.url} "
                                    f"answered HTTP {status}", url=self.release.url,
                                    status=status)
            fd = os.open(self.part, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                         0o600)  # owner-only whatever the umask, as the blob it becomes
            with os.fdopen(fd, "ab") as out:
                self._copy(resp, out)
        finally:
            if resp.length_remaining == 0:
                resp.release_conn()
            else:  # cut short, or more than signed: never read on, drop the connection
                resp.close()

    def _copy(self, resp: urllib3.BaseHTTPResponse, out: BinaryIO) -> None:
        want = self.release.length
        while self.have < want:
            # read1: what has arrived (up to a chunk), so a cut link loses nothing read
            block = resp.read1(min(self.chunk, want - self.have), decode_content=False)
            if not block:
                raise _Transient(f"body ended at {self.have} of {want} bytes")
            block = block[:want - self.have]  # never past the signed length
            try:
                out.write(block)
            except OSError as exc:  # this box's disk, not the link: not retried here
                raise ReleaseFailed(
                    LOCAL_IO, f"{self.release.ref}: writing {self.part}: {exc.strerror}",
                    where=str(self.part)) from exc
            self.digest.update(block)
            self.have += len(block)
            self.got += len(block)
            self.meter.update(self.have)
            self._check_pace()
            if self.bucket is not None:
                self.bucket.take(len(block))

    def _left_s(self) -> float:
        """Seconds until the floor, at the bytes received so far, is crossed."""
        return max(0.0, self._due_s())

    def _due_s(self) -> float:
        """`_left_s`, negative once behind (the cutoff's clock)."""
        pace = self.pace
        return self.started + pace.grace_s + self.got / pace.min_bytes_per_s - time.monotonic()

    def _check_pace(self, last_error: str = "", *, cut: bool = False) -> None:
        """ReleaseFailed (`too_slow`) where the call is behind its floor, or was `cut`
        for it (by `cutoff`, at the instant it fell behind)."""
        elapsed = time.monotonic() - self.started
        why = self.pace.behind(self.got, elapsed)
        if why is None and cut:  # the clock cuts only once strictly behind: not reached
            why = f"{self.got} bytes in {elapsed:.1f} s, cut at the floor"
        if why is None:
            return
        raise ReleaseFailed(
            TOO_SLOW, f"{self.release.ref}: the download is too slow: {why}; the "
            f"{self.left} bytes left were due within "
            f"{self.pace.deadline_s(self.left):.0f} s; stopped at {self.have} of "
            f"{self.release.length} bytes, the part is kept and resumed next time"
            + (f" (last error: {last_error})" if last_error else ""),
            url=self.release.url, done=self.have, bytes_per_s=round(self.got / elapsed),
            min_bytes_per_s=self.pace.min_bytes_per_s, error=last_error or None)

    def _check_range(self, content_range: str) -> None:
        # "bytes 1000-4999/5000": the answer must start where the part ends
        unit, _, spec = content_range.partition(" ")
        first, _, rest = spec.partition("-")
        total = rest.partition("/")[2]
        if unit != "bytes" or first != str(self.have):
            raise _Transient(f"Content-Range {content_range[:60]!r} does not start at "
                             f"{self.have}")
        if total.isdigit() and int(total) < self.release.length:
            self._fail_short(int(total))

    def _restart(self) -> None:
        # Bounded: a server that ignores Range and cuts every transfer short would
        # otherwise make "progress" from zero forever.
        self.restarts += 1
        if self.restarts > self.max_restarts:
            raise ReleaseFailed(UNREACHABLE, f"{self.release.ref}: {self.release.url} "
                                f"made the download start over {self.max_restarts} times "
                                "(Range ignored or a file of another length)",
                                url=self.release.url)
        self.part.unlink(missing_ok=True)
        self.digest, self.have = hashlib.sha256(), 0

    def _fail_short(self, served: int) -> None:
        self.part.unlink(missing_ok=True)
        raise ReleaseFailed(HASH_MISMATCH, f"{self.release.ref}: the server's file is "
                            f"{served} bytes; the signed length is {self.release.length}",
                            url=self.release.url, served_bytes=served)


class _Transient(Exception):
    """A failed attempt worth another one."""


class _TokenBucket:
    """`rate` bytes a second; starts empty so the first second is capped too."""

    def __init__(self, rate: int) -> None:
        self.rate = float(rate)
        self.tokens = 0.0
        self.last = time.monotonic()

    def take(self, n: int) -> None:
        now = time.monotonic()
        self.tokens = min(self.rate, self.tokens + (now - self.last) * self.rate) - n
        self.last = now
        if self.tokens < 0:  # in debt: wait until it is paid
            time.sleep(-self.tokens / self.rate)


class _Meter:
    """Rate over the last few seconds, ETA, and the throttled progress callback."""

    def __init__(self, total: int, progress: Progress | None, start: int) -> None:
        self.total, self.progress = total, progress
        self.samples: deque[tuple[float, int]] = deque([(time.monotonic(), start)])
        self.last_call = 0.0
        self.reported = -1

    def update(self, done: int, *, force: bool = False) -> None:
        now = time.monotonic()
        self.samples.append((now, done))
        while len(self.samples) > 2 and now - self.samples[0][0] > 3.0:
            self.samples.popleft()
        if self.progress is None or (not force and now - self.last_call < PROGRESS_EVERY_S
                                     and done < self.total):
            return
        self.last_call, self.reported = now, done
        t0, d0 = self.samples[0]
        rate = (done - d0) / (now - t0) if now > t0 else 0.0
        eta = (self.total - done) / rate if rate > 0 else None
        self.progress(done, self.total, rate, eta)

    def done(self, done: int) -> None:
        """The last call, whatever ended the attempts (unless it showed `done` already)."""
        if done != self.reported:
            self.update(done, force=True)


def _check_space(release: Release, dest_dir: Path, have: int, headroom: int,
                 install_copy: bool, free_space: FreeSpace) -> None:
    left = release.length - have
    copy = release.length if install_copy else 0
    needed = left + copy + headroom
    free = free_space(dest_dir)
    if free < needed:
        raise ReleaseRejected(
            NO_SPACE, f"{release.ref}: not enough disk in {dest_dir}: {needed} bytes needed "
            f"({left} to download + {copy} for the model store's copy + {headroom} "
            f"headroom), {free} free",
            needed=needed, free=free, where=str(dest_dir), download=left, store_copy=copy,
            headroom=headroom)


def _hash_prefix(part: Path) -> hashlib._Hash:
    digest = hashlib.sha256()
    with part.open("rb") as fh:
        while block := fh.read(CHUNK):
            digest.update(block)
    return digest


def verify(release: Release, path: Path) -> Path:
    """A finished file checked again from disk (after a restart in VERIFYING): length,
    sha256, then the GGUF precheck. ReleaseFailed (`hash_mismatch`, file deleted) or
    ReleaseRejected (`invalid_model`); `download` calls it for a file it finds done."""
    size = path.stat().st_size
    digest = _hash_prefix(path).hexdigest()
    if size != release.length or digest != release.sha256:
        path.unlink(missing_ok=True)
        raise ReleaseFailed(HASH_MISMATCH, f"{release.ref}: {path} is {size} bytes with "
                            f"sha256 {digest[:16]}…; signed {release.length} bytes, "
                            f"{release.sha256[:16]}… (deleted)", got_bytes=size,
                            got_sha256=digest)
    return _prechecked(path, release)


def _prechecked(path: Path, release: Release) -> Path:
    if not isinstance(release.manifest, ReleaseManifest):
        return path  # an agent's wheelhouse: its install checks it (`device.agent.slots`)
    try:
        info = probe(path, label=Path(release.target_path))
    except ModelFileError as exc:
        path.unlink(missing_ok=True)
        raise ReleaseRejected(INVALID_MODEL, f"{release.ref}: {exc.message}") from None
    if info.architecture != release.manifest.architecture:
        path.unlink(missing_ok=True)
        raise ReleaseRejected(BAD_MANIFEST, f"{release.ref}: the file is a "
                              f"{info.architecture} model; its manifest says "
                              f"{release.manifest.architecture}")
    return path
