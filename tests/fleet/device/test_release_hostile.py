"""A hostile release repository, against the box's real TUF client, transfer and pull:
metadata signed with the real online key that names a path for a hash or an empty file,
a link planted where a download writes, and a server that trickles its bytes (TUF's
slow-retrieval threat) — refused or given up on with a clear reason, within a deadline
derived from the settings, without holding any other lookup, and without touching a file
outside the state dir."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
from tuf.api.metadata import TargetFile

from edge_agent.engine.modelops import ModelOps
from edge_agent.engine.models.catalog import ModelStore
from edge_agent.files import EscapesDirectory, inside
from edge_agent.fleet.device.release import source as rel
from edge_agent.fleet.device.release import transfer
from edge_agent.fleet.device.release.pull import pull
from edge_agent.fleet.device.release.signed_releases import SignedReleases
from edge_agent.fleet.device.release.source import (
    Release,
    ReleaseFailed,
    ReleaseRejected,
    ReleaseSource,
)
from edge_agent.fleet.device.rollout.runner import RolloutManager
from edge_agent.fleet.protocol.manifest import parse
from edge_agent.fleet.protocol.rollout_states import CANCELLED, RECEIVED, STAGED
from tests.ggufgen import write_tiny_gguf
from tests.support.releasekit import ArtifactServer, Repo, device_settings, make_repo, mirror

FAST = transfer.Retry(attempts=3, base_s=0.05, max_s=0.2)


def sign_raw_target(repo: Repo, name: str, version: str, *, length: int, sha256: str
                    ) -> None:
    """A target entry as the holder of the online targets key can sign it, past the
    checks `fleet release add` makes: targets, snapshot and timestamp re-signed."""
    r = repo.repo
    manifest = parse({"name": name, "version": version, "architecture": "llama"})
    signers = {role: repo.keys.signer(role) for role in ("targets", "snapshot", "timestamp")}
    with r._locked():
        state = r._load()
        tf = TargetFile(length, {"sha256": sha256}, manifest.target_path)
        tf.unrecognized_fields["custom"] = manifest.to_custom()
        state.targets.signed.targets[manifest.target_path] = tf
        r._publish_targets(state, signers, r.expiry_s())


def _blob_bytes(server: ArtifactServer) -> int:
    return sum(n for p, n in server.counter.by_path.items() if "/targets/" in p)


@pytest.fixture
def ops(tmp_path: Path) -> Iterator[ModelOps]:
    modelops = ModelOps(ModelStore(tmp_path / "box"))
    yield modelops
    modelops.store.close()


# -- hashes and lengths from the wire ------------------------------------------------------


def test_a_signed_hash_that_is_a_path_is_refused_and_nothing_outside_is_touched(
        tmp_path: Path, ops: ModelOps) -> None:
    repo = make_repo(tmp_path / "ctl")
    evil = "../../outside/" + "a" * 50  # 64 characters: what a length check lets through
    assert len(evil) == 64
    gguf = write_tiny_gguf(tmp_path / "t.gguf")
    sign_raw_target(repo, "tiny:1", "3", length=gguf.stat().st_size, sha256=evil)
    server = ArtifactServer(mirror(repo.repo.root, tmp_path / "served")).start()
    state = tmp_path / "box"
    outside = tmp_path / "outside"  # <state>/downloads/../../outside
    outside.mkdir()
    planted = outside / f"{'a' * 50}.gguf"
    planted.write_bytes(b"not the box's to delete")
    try:
        with pytest.raises(ReleaseRejected) as err:
            pull(device_settings(state, repo.root_file, server.url), ops, "tiny:1", "3",
                 by="test")
        assert err.value.reason == rel.BAD_TARGET and not err.value.retry
        assert "invalid release" in err.value.message
        assert "64 lowercase hex digits" in err.value.message
        assert err.value.body()["retry"] is False
        assert planted.read_bytes() == b"not the box's to delete"
        assert sorted(p.name for p in outside.iterdir()) == [planted.name]  # no .lock
        assert _blob_bytes(server) == 0  # refused before any download
        assert not (state / "downloads").exists()
        # The same wall for a release stored in a rollout's row (`from_json`).
        row = {"name": "tiny:1", "version": "3", "target": "tiny/1/3/model.gguf",
               "length": 10, "sha256": evil, "url": "http://x/",
               "manifest": {"name": "tiny:1", "version": "3", "architecture": "llama"}}
        with pytest.raises(ReleaseRejected) as stored:
            Release.from_json(row)
        assert stored.value.reason == rel.BAD_TARGET
        with pytest.raises(ReleaseRejected):  # upper case: not what any hash compares to
            Release.from_json({**row, "sha256": "A" * 64})
    finally:
        server.stop()


def test_an_empty_signed_target_is_refused_not_retried(tmp_path: Path,
                                                       ops: ModelOps) -> None:
    repo = make_repo(tmp_path / "ctl")
    empty = hashlib.sha256(b"").hexdigest()
    sign_raw_target(repo, "tiny:1", "4", length=0, sha256=empty)
    served = mirror(repo.repo.root, tmp_path / "served")
    blob = served / "targets" / "tiny" / "1" / "4" / f"{empty}.model.gguf"
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(b"")  # the server has the (empty) file the metadata signs
    server = ArtifactServer(served).start()
    state = tmp_path / "box"
    try:
        with pytest.raises(ReleaseRejected) as err:
            pull(device_settings(state, repo.root_file, server.url), ops, "tiny:1", "4",
                 by="test")
        assert err.value.reason == rel.BAD_TARGET and not err.value.retry
        assert "0 bytes long" in err.value.message and "never empty" in err.value.message
        assert "Errno" not in err.value.message
        assert not list(transfer.downloads_dir(state).glob("*"))
    finally:
        server.stop()


def test_a_name_that_would_leave_its_directory_is_refused(tmp_path: Path) -> None:
    base = tmp_path / "dl"
    base.mkdir()
    assert inside(base, "a" * 64 + ".part") == base / ("a" * 64 + ".part")
    for bad in ("../x.part", "a/b", "..", ".", "", "x\0y", "..\\x"):
        with pytest.raises(EscapesDirectory):
            inside(base, bad)
    (base / "link.part").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(EscapesDirectory):
        inside(base, "link.part")


def test_a_link_planted_where_a_download_writes_is_refused(tmp_path: Path) -> None:
    """The second wall, behind the hash check: the download's part is a link out of its
    directory; nothing is written through it."""
    data = write_tiny_gguf(tmp_path / "m.gguf").read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    root = tmp_path / "releases"
    blob = root / "targets" / "m" / "1" / f"{sha}.model.gguf"
    blob.parent.mkdir(parents=True)
    blob.write_bytes(data)
    server = ArtifactServer(root).start()
    dest = tmp_path / "dl"
    dest.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"keep")
    (dest / f"{sha}.part").symlink_to(victim)
    manifest = parse({"name": "m:1", "version": "1", "architecture": "llama"})
    release = Release("m:1", "1", "m/latest/1/model.gguf", len(data), sha,
                      f"{server.url}targets/m/1/{sha}.model.gguf", manifest)
    try:
        with pytest.raises(ReleaseRejected) as err:
            transfer.download(release, dest, retry=FAST)
        assert err.value.reason == rel.BAD_TARGET and "would not stay in" in err.value.message
        assert victim.read_bytes() == b"keep"
        assert _blob_bytes(server) == 0
    finally:
        server.stop()


# -- slow retrieval ------------------------------------------------------------------------


class Trickle:
    """A loopback HTTP server over a repository tree at /releases/: paths that `slow`
    picks are sent `rate` bytes a second, the rest at once; every trickle ends when the
    server stops or after `limit_s`. `how` is what trickles: the body after headers sent
    at once ("body", with its length), the whole response from its status line on
    ("whole": no read of the box's returns before the headers end), or a chunked body
    whose framing trickles too ("chunked": each byte a chunk of its own)."""

    def __init__(self, root: Path, slow: Callable[[str], bool], limit_s: float = 60,
                 *, how: str = "body", rate: int = 1) -> None:
        self.root, self.slow, self.limit_s = root.resolve(), slow, limit_s
        self.how, self.rate = how, rate
        self.stopping = threading.Event()
        self.trickling = threading.Event()  # set once a trickle began
        self.active = 0  # trickles under way
        self.finished = 0  # trickles sent to their end
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                outer.answer(self)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_port}/releases/"

    def start(self) -> Trickle:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)

    def answer(self, h: BaseHTTPRequestHandler) -> None:
        path = unquote(urlsplit(h.path).path).removeprefix("/releases/")
        file = (self.root / path).resolve()
        if not file.is_relative_to(self.root) or not file.is_file():
            h.send_error(404)
            return
        body = file.read_bytes()
        h.close_connection = True
        if not self.slow(path):
            h.send_response(200)
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body)
            return
        if self.how == "whole":
            slow = (f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n"
                    "Connection: close\r\n\r\n").encode() + body
        elif self.how == "chunked":
            h.wfile.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
                          b"Connection: close\r\n\r\n")
            slow = b"".join(b"1\r\n" + body[i:i + 1] + b"\r\n" for i in range(len(body)))
            slow += b"0\r\n\r\n"
        else:
            h.send_response(200)
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            slow = body
        h.wfile.flush()
        self.trickling.set()
        self.active += 1
        ends = time.monotonic() + self.limit_s
        step = max(1, self.rate // 10)  # about 10 writes a second
        try:
            for i in range(0, len(slow), step):
                if time.monotonic() > ends:
                    return
                h.wfile.write(slow[i:i + step])
                h.wfile.flush()
                if self.stopping.wait(step / self.rate):
                    return
            self.finished += 1
        except OSError:  # the box gave up and closed the connection
            return
        finally:
            self.active -= 1


def _in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, dict[str, object]]:
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except Exception as exc:  # read by the test
            out["error"] = exc
        out["at"] = time.monotonic()

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    return worker, out


def _pace(grace_s: float, min_bps: int = 1024, deadline_s: float = 30) -> dict[str, Any]:
    return {"fleet.min_transfer_bytes_per_s": min_bps, "fleet.transfer_grace_s": grace_s,
            "fleet.metadata_deadline_s": deadline_s}


def test_a_trickled_model_file_fails_too_slow_within_its_deadline(
        tmp_path: Path, ops: ModelOps) -> None:
    repo = make_repo(tmp_path / "ctl")
    entry = repo.add(write_tiny_gguf(tmp_path / "t.gguf", floats=1024), "tiny:1", "2")
    trickle = Trickle(mirror(repo.repo.root, tmp_path / "served"),
                      slow=lambda p: p.startswith("targets/")).start()
    settings = device_settings(tmp_path / "box", repo.root_file, trickle.url,
                               **_pace(grace_s=2))
    pace = rel.Pace.of(settings.fleet)
    deadline = pace.deadline_s(entry.length)  # 2 s + about 4 kB at 1024 B/s
    assert 4 < deadline < 10
    try:
        started = time.monotonic()
        worker, out = _in_thread(lambda: pull(settings, ops, "tiny:1", "2", by="test",
                                              retry=FAST))
        worker.join(deadline + 15)
        assert not worker.is_alive(), "the pull was still running past its deadline"
        took = float(out["at"]) - started  # type: ignore[arg-type]
        err = out.get("error")
        assert isinstance(err, ReleaseFailed), out
        assert err.reason == rel.TOO_SLOW and err.retry
        assert "too slow" in err.message and "B/s" in err.message
        assert "fleet.min_transfer_bytes_per_s" in err.message
        assert pace.grace_s <= took < deadline, (took, deadline)
        assert trickle.trickling.is_set()
    finally:
        trickle.stop()


CUT_WITHIN_S = 1.5  # the clock cuts at the floor's instant; the rest is the test's threads


@pytest.mark.parametrize("how", ["whole", "chunked"])
def test_a_model_file_trickled_in_any_shape_is_cut_at_its_floor(
        tmp_path: Path, ops: ModelOps, how: str) -> None:
    """Its headers, or a chunked body's framing, sent a byte a second: no read returns
    a block to check, and the clock cuts the connection when the floor is crossed
    (grace + bytes / rate after the start), `too_slow`, never a hang."""
    repo = make_repo(tmp_path / "ctl")
    repo.add(write_tiny_gguf(tmp_path / "t.gguf", floats=1024), "tiny:1", "2")
    trickle = Trickle(mirror(repo.repo.root, tmp_path / "served"),
                      slow=lambda p: p.startswith("targets/"), how=how).start()
    settings = device_settings(tmp_path / "box", repo.root_file, trickle.url,
                               **_pace(grace_s=2))
    try:
        started = time.monotonic()
        worker, out = _in_thread(lambda: pull(settings, ops, "tiny:1", "2", by="test",
                                              retry=FAST))
        worker.join(20)
        assert not worker.is_alive(), "the pull was still running: nothing cut it"
        took = float(out["at"]) - started  # type: ignore[arg-type]
        err = out.get("error")
        assert isinstance(err, ReleaseFailed), out
        assert err.reason == rel.TOO_SLOW and err.retry, err.message
        assert "fleet.min_transfer_bytes_per_s" in err.message
        assert 2 <= took < 2 + CUT_WITHIN_S, took
        assert trickle.trickling.is_set() and trickle.finished == 0
    finally:
        trickle.stop()


def test_a_model_file_just_above_the_floor_completes(tmp_path: Path, ops: ModelOps) -> None:
    """The whole response at 1.25 times the floor: slow, never behind, so it is
    downloaded, verified and installed."""
    repo = make_repo(tmp_path / "ctl")
    entry = repo.add(write_tiny_gguf(tmp_path / "t.gguf", floats=1024), "tiny:1", "2")
    trickle = Trickle(mirror(repo.repo.root, tmp_path / "served"),
                      slow=lambda p: p.startswith("targets/"), how="whole",
                      rate=1280).start()
    settings = device_settings(tmp_path / "box", repo.root_file, trickle.url,
                               **_pace(grace_s=1, min_bps=1024))
    try:
        started = time.monotonic()
        pulled = pull(settings, ops, "tiny:1", "2", by="test", retry=FAST)
        took = time.monotonic() - started
        assert pulled.downloaded and pulled.model.digest.endswith(entry.sha256)
        assert trickle.finished == 1
        assert took >= entry.length / 1280 * 0.9, "the file did not trickle"
    finally:
        trickle.stop()


def test_metadata_whose_headers_trickle_is_cut_at_its_floor(tmp_path: Path) -> None:
    """The timestamp's status line and headers a byte a second: cut at the grace."""
    repo = make_repo(tmp_path / "ctl")
    repo.add(write_tiny_gguf(tmp_path / "a.gguf"), "tiny:1", "2")
    trickle = Trickle(mirror(repo.repo.root, tmp_path / "served"),
                      slow=lambda p: p == "metadata/timestamp.json", how="whole").start()
    state = tmp_path / "box"
    fleet = device_settings(state, repo.root_file, trickle.url, **_pace(grace_s=2)).fleet
    try:
        started = time.monotonic()
        worker, out = _in_thread(lambda: ReleaseSource(fleet, state).lookup("tiny:1", "2"))
        worker.join(20)
        assert not worker.is_alive(), "the lookup was still running: nothing cut it"
        err = out.get("error")
        assert isinstance(err, ReleaseFailed) and err.reason == rel.TOO_SLOW, out
        assert "timestamp.json" in err.message
        assert 2 <= float(out["at"]) - started < 2 + CUT_WITHIN_S  # type: ignore[arg-type]
    finally:
        trickle.stop()


def test_a_stalled_metadata_lookup_holds_no_other_lookup(tmp_path: Path) -> None:
    """The stalled lookup (the trickled timestamp) and one of another name from a healthy
    server share the box's TUF state: the second finishes while the first is stalled,
    and the first fails too slow soon after its grace."""
    repo = make_repo(tmp_path / "ctl")
    repo.add(write_tiny_gguf(tmp_path / "a.gguf"), "tiny:1", "2")
    other = repo.add(write_tiny_gguf(tmp_path / "b.gguf", name="other"), "other:1", "1")
    served = mirror(repo.repo.root, tmp_path / "served")
    trickle = Trickle(served, slow=lambda p: p == "metadata/timestamp.json").start()
    server = ArtifactServer(served).start()
    state = tmp_path / "box"
    pace = _pace(grace_s=4)

    def source(url: str) -> ReleaseSource:
        return ReleaseSource(device_settings(state, repo.root_file, url, **pace).fleet,
                             state)

    try:
        started = time.monotonic()
        stalled, slow_out = _in_thread(lambda: source(trickle.url).lookup("tiny:1", "2"))
        assert trickle.trickling.wait(10), "the stalled lookup never reached the trickle"
        t0 = time.monotonic()
        healthy, fast_out = _in_thread(lambda: source(server.url).lookup("other:1", "1"))
        healthy.join(3)
        assert not healthy.is_alive(), "the second lookup waited behind the stalled one"
        assert stalled.is_alive(), "the stalled lookup ended first: nothing was shown"
        found = fast_out.get("value")
        assert isinstance(found, Release) and found.sha256 == other.sha256, fast_out
        assert float(fast_out["at"]) - t0 < 3  # type: ignore[arg-type]
        stalled.join(15)
        assert not stalled.is_alive(), "the stalled lookup outlived its floor"
        err = slow_out.get("error")
        assert isinstance(err, ReleaseFailed) and err.reason == rel.TOO_SLOW, slow_out
        assert "timestamp.json" in err.message and "B/s" in err.message
        took = float(slow_out["at"]) - started  # type: ignore[arg-type]
        assert 4 <= took < 4 + 5, took
        # Both lookups left the box's TUF state whole: the next one needs no network
        # beyond the timestamp, and no private copy is left behind.
        assert source(server.url).lookup("tiny:1", "2").name == "tiny:1"
        assert not list((state / "tuf").glob(".lookup-*"))
    finally:
        trickle.stop()
        server.stop()


def test_metadata_has_a_deadline_in_all(tmp_path: Path) -> None:
    """Above the floor (1 byte a second against a floor of 1 B/s) but past
    `metadata_deadline_s`: the lookup ends there, naming the setting."""
    repo = make_repo(tmp_path / "ctl")
    repo.add(write_tiny_gguf(tmp_path / "a.gguf"), "tiny:1", "2")
    trickle = Trickle(mirror(repo.repo.root, tmp_path / "served"),
                      slow=lambda p: p == "metadata/timestamp.json").start()
    state = tmp_path / "box"
    fleet = device_settings(state, repo.root_file, trickle.url,
                            **_pace(grace_s=2, min_bps=1, deadline_s=4)).fleet
    try:
        started = time.monotonic()
        worker, out = _in_thread(lambda: ReleaseSource(fleet, state).lookup("tiny:1", "2"))
        worker.join(20)
        assert not worker.is_alive(), "the lookup outlived its deadline"
        err = out.get("error")
        assert isinstance(err, ReleaseFailed) and err.reason == rel.TOO_SLOW, out
        assert "fleet.metadata_deadline_s" in err.message
        assert 4 <= float(out["at"]) - started < 4 + 2.5  # type: ignore[arg-type]
    finally:
        trickle.stop()


def test_after_a_cancelled_stalled_lookup_the_next_rollout_goes_on(tmp_path: Path) -> None:
    """rollout.cancel of a rollout whose lookup is stalled (its thread trickles on): the
    next rollout of the name, against the same server now healthy, leaves RECEIVED at
    once and is staged (held there by a maintenance window, so no gate is needed)."""
    repo = make_repo(tmp_path / "ctl")
    repo.add(write_tiny_gguf(tmp_path / "a.gguf"), "tiny:1", "2")
    trickle: Trickle | None = None

    def first_timestamp(path: str) -> bool:  # only the first lookup's is trickled
        return path == "metadata/timestamp.json" and trickle is not None \
            and not trickle.trickling.is_set()

    trickle = Trickle(mirror(repo.repo.root, tmp_path / "served"), slow=first_timestamp)
    trickle.start()
    state = tmp_path / "box"
    settings = device_settings(state, repo.root_file, trickle.url,
                               **{**_pace(grace_s=4), "fleet.maintenance_window": "02:00-03:00"})

    async def scenario() -> tuple[str, float, int]:
        manager = RolloutManager(settings, ModelOps(ModelStore(state)),
                                 SignedReleases(settings.fleet, state), probe=None,  # type: ignore[arg-type]
                                 local_now=lambda: datetime(2030, 1, 1, 12, 0), poll_s=0.05)
        await manager.start()
        try:
            assert manager.begin("ro-1", "tiny:1", "2")["accepted"]
            assert await asyncio.to_thread(trickle.trickling.wait, 10), "no stalled lookup"
            assert manager.cancel("ro-1")["accepted"]
            t0 = time.monotonic()
            assert manager.begin("ro-2", "tiny:1", "2")["accepted"]
            while manager.store.get("ro-2").state == RECEIVED:  # type: ignore[union-attr]
                assert time.monotonic() - t0 < 5, "the next rollout stayed RECEIVED"
                await asyncio.sleep(0.02)
            left, stalled = time.monotonic() - t0, trickle.active
            while manager.store.get("ro-2").state != STAGED:  # type: ignore[union-attr]
                assert time.monotonic() - t0 < 30, manager.store.get("ro-2")
                await asyncio.sleep(0.05)
            first = manager.store.get("ro-1")
            assert first is not None
            return first.state, left, stalled
        finally:
            trickle.stopping.set()  # whatever happened, the stalled thread ends now
            await manager.stop()

    try:
        first, left, stalled = asyncio.run(scenario())
        assert first == CANCELLED and left < 3
        assert stalled == 1, "the cancelled lookup was no longer stalled: nothing was shown"
    finally:
        trickle.stop()
