"""The transfer: the artifacts router's HTTP (Range, validators, traversal), and the device's
download — resumed after the server is cut mid-transfer and after the downloading process
is killed, rate-capped, refused for want of disk (a seam and a real tmpfs), stopped at the
signed length, verified, prechecked."""

from __future__ import annotations

import functools
import hashlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from edge_agent.fleet.controller.releases.artifacts import _resolve, artifacts_router
from edge_agent.fleet.device.release import transfer
from edge_agent.fleet.device.release.source import (
    HASH_MISMATCH,
    INVALID_MODEL,
    NO_SPACE,
    NOT_FOUND,
    UNREACHABLE,
    Release,
    ReleaseFailed,
    ReleaseRejected,
    ReleaseSource,
)
from edge_agent.fleet.protocol.manifest import parse
from tests.support.releasekit import (
    ArtifactServer,
    device_settings,
    make_repo,
    mirror,
    sized_gguf,
    small_filesystem,
)

MB = 1_000_000
FAST = transfer.Retry(attempts=20, base_s=0.05, max_s=0.5)


# -- the router -------------------------------------------------------------------------


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "releases"
    (root / "metadata").mkdir(parents=True)
    (root / "targets" / "m").mkdir(parents=True)
    (root / "metadata" / "timestamp.json").write_text('{"x": 1}')
    (root / "targets" / "m" / "blob.gguf").write_bytes(bytes(range(256)) * 4)
    (root / "repo.json").write_text("{}")
    return root


def test_range_requests(tree: Path) -> None:
    app = FastAPI()
    app.include_router(artifacts_router(tree), prefix="/releases")
    client = TestClient(app)
    url = "/releases/targets/m/blob.gguf"
    full = client.get(url)
    assert full.status_code == 200 and len(full.content) == 1024
    assert full.headers["accept-ranges"] == "bytes" and full.headers["etag"]
    assert full.headers["last-modified"].endswith("GMT")
    assert "immutable" in full.headers["cache-control"]
    etag = full.headers["etag"]
    part = client.get(url, headers={"Range": "bytes=10-19"})
    assert part.status_code == 206 and part.content == bytes(range(10, 20))
    assert part.headers["content-range"] == "bytes 10-19/1024"
    assert client.get(url, headers={"Range": "bytes=1000-"}).content == full.content[1000:]
    assert client.get(url, headers={"Range": "bytes=-4"}).content == full.content[-4:]
    past = client.get(url, headers={"Range": "bytes=1024-"})
    assert past.status_code == 416 and past.headers["content-range"] == "bytes */1024"
    assert client.get(url, headers={"Range": "bytes=0-1,5-6"}).status_code == 200
    assert client.get(url, headers={"Range": "bytes=5-", "If-Range": '"stale"'}
                      ).status_code == 200
    assert client.get(url, headers={"Range": "bytes=5-", "If-Range": etag}).status_code == 206
    assert client.get(url, headers={"If-None-Match": etag}).status_code == 304
    head = client.head(url, headers={"Range": "bytes=0-99"})
    assert head.status_code == 206 and head.headers["content-length"] == "100"
    assert head.content == b""
    ts = client.get("/releases/metadata/timestamp.json")
    assert ts.headers["cache-control"] == "no-cache"
    assert ts.headers["content-type"].startswith("application/json")
    for refused in ("/releases/repo.json", "/releases/metadata/nope.json",
                    "/releases/targets/m", "/releases/"):
        assert client.get(refused).status_code == 404, refused


def test_paths_outside_the_tree_are_not_served(tree: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("key")
    (tree / "targets" / "m" / "link").symlink_to(secret)
    (tree / "targets" / ".hidden").write_text("x")
    for path in ("metadata/../repo.json", "targets/../../secret.txt", "targets/m/link",
                 "targets/.hidden", "targets/m/./blob.gguf", "targets//m/blob.gguf",
                 "targets/m/blob.gguf\x00", "targets\\m\\blob.gguf", "/etc/passwd",
                 "repo.json"):
        assert _resolve(tree.resolve(), path) is None, path
    assert _resolve(tree.resolve(), "targets/m/blob.gguf") is not None
    # A targets/ that is itself a link (a larger disk) is served.
    big = tmp_path / "bigdisk"
    (tree / "targets").rename(big)
    (tree / "targets").symlink_to(big)
    assert _resolve(tree.resolve(), "targets/m/blob.gguf") is not None
    server = ArtifactServer(tree).start()
    try:  # raw request lines: no client-side normalisation of the path
        for raw in ("/releases/metadata/../repo.json", "/releases/metadata/%2e%2e/repo.json",
                    "/releases/targets/%2e%2e/%2e%2e/secret.txt",
                    "/releases/targets/m/link"):
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            conn.request("GET", raw)
            resp = conn.getresponse()
            assert resp.status == 404 and b"key" not in resp.read(), raw
            conn.close()
    finally:
        server.stop()


def test_absurd_range_numbers_are_answered_as_any_other_range(tree: Path) -> None:
    """Positions of thousands of digits (past int()'s 4,300-digit limit) over a live server:
    a start past the end is a 416 with `bytes */size`, an end or a suffix past the file
    is the whole of it (206, as RFC 9110 reads them), leading zeros are only zeros; a
    header that is not one byte range gets the whole file (200). Never a 500."""
    huge = "9" * 5000
    server = ArtifactServer(tree).start()
    try:
        def get(value: str) -> tuple[int, str | None, bytes]:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            try:
                conn.request("GET", "/releases/targets/m/blob.gguf", headers={"Range": value})
                resp = conn.getresponse()
                return resp.status, resp.getheader("content-range"), resp.read()
            finally:
                conn.close()

        whole = bytes(range(256)) * 4
        for value in (f"bytes={huge}-", f"bytes={huge}-{huge}"):
            assert get(value) == (416, "bytes */1024", b""), value[:20]
        for value in (f"bytes=0-{huge}", f"bytes=-{huge}"):
            assert get(value) == (206, "bytes 0-1023/1024", whole), value[:20]
        assert get(f"bytes=1000-{huge}") == (206, "bytes 1000-1023/1024", whole[1000:])
        assert get(f"bytes={'0' * 5000}10-{'0' * 5000}19") == (
            206, "bytes 10-19/1024", whole[10:20])
        for value in (f"bytes={huge}", f"bytes=-{huge}-", f"bytes={huge}-{huge},0-1"):
            assert get(value) == (200, None, whole), value[:20]
    finally:
        server.stop()


# -- downloads --------------------------------------------------------------------------


def _publish(file: Path, root: Path, name: str = "m") -> Release:
    """`file` into a served tree under its content name, and the Release a lookup would
    give for it (the transfer needs no TUF)."""
    data = file.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    blob = root / "targets" / name / "1" / f"{sha}.model.gguf"
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    manifest = parse({"name": f"{name}:1", "version": "1", "architecture": "llama"})
    return Release(f"{name}:1", "1", f"{name}/latest/1/model.gguf", len(data), sha,
                   f"http://unset/releases/targets/{name}/1/{sha}.model.gguf", manifest)


def _at(release: Release, server: ArtifactServer) -> Release:
    path = release.url.split("/releases/", 1)[1]
    return Release(release.name, release.version, release.target_path, release.length,
                   release.sha256, server.url + path, release.manifest)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[ArtifactServer, Release]]:
    """An 8 MB GGUF behind a live artifact server."""
    root = tmp_path / "releases"
    release = _publish(sized_gguf(tmp_path / "m.gguf", 8), root)
    server = ArtifactServer(root).start()
    yield server, _at(release, server)
    server.stop()


def _blob_bytes(server: ArtifactServer) -> int:
    return sum(n for p, n in server.counter.by_path.items() if "/targets/" in p)


def test_a_cut_transfer_resumes_from_its_offset(tmp_path: Path) -> None:
    """Through a real lookup: the server stops at ~50 %, comes back, the device goes on."""
    repo = make_repo(tmp_path / "ctl")
    entry = repo.add(sized_gguf(tmp_path / "m.gguf", 8), "big:1", "1")
    server = ArtifactServer(mirror(repo.repo.root, tmp_path / "served")).start()
    device = tmp_path / "device"
    try:
        source = ReleaseSource(device_settings(device, repo.root_file, server.url).fleet,
                               device)
        release = source.lookup("big:1", "1")
        stopped = server.cut_at(server.counter.served + entry.length // 2)
        result: dict[str, object] = {}

        def fetch() -> None:
            try:
                result["path"] = transfer.download(release, transfer.downloads_dir(device),
                                                   retry=FAST)
            except Exception as exc:  # reported below
                result["error"] = exc

        worker = threading.Thread(target=fetch)
        worker.start()
        assert stopped.wait(30), "the server was not cut"
        part = transfer.paths(release, transfer.downloads_dir(device))[1]
        at_cut, deadline = -1, time.monotonic() + 30
        while True:  # the device writes what reached it before the cut, then retries
            time.sleep(0.3)
            size = part.stat().st_size if part.exists() else 0
            if size == at_cut and size > 0 or time.monotonic() > deadline:
                break
            at_cut = size
        assert 0.3 * entry.length < at_cut <= 0.5 * entry.length + 1, server.counter.requests
        server.start()  # the device was retrying against a closed port meanwhile
        worker.join(60)
        assert "error" not in result, result
        path = result["path"]
        assert isinstance(path, Path) and path.stat().st_size == entry.length
        fetched = _blob_bytes(server)
        assert fetched <= 1.1 * entry.length, (fetched, entry.length)
        resumed = [r for r in server.counter.requests if "/targets/" in r][-1]
        assert resumed.endswith(f"bytes={at_cut}-"), server.counter.requests
    finally:
        server.stop()


def test_a_killed_download_resumes_from_its_part(served: tuple[ArtifactServer, Release],
                                                 tmp_path: Path) -> None:
    server, release = served
    dest = tmp_path / "downloads"
    server.counter.throttle_bps = 4 * MB  # time to kill it mid-way
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, json.dumps(release.to_json()), str(dest)],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[3])})
    part = transfer.paths(release, dest)[1]
    deadline = time.monotonic() + 60
    while not (part.exists() and part.stat().st_size >= release.length // 2):
        assert time.monotonic() < deadline and child.poll() is None
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    child.wait()
    server.counter.throttle_bps = None
    have = part.stat().st_size
    assert have < release.length
    path = transfer.download(release, dest, retry=FAST)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == release.sha256
    assert not part.exists()
    assert _blob_bytes(server) <= 1.1 * release.length
    assert server.counter.requests[-1].endswith(f"bytes={have}-")


_CHILD = """
import json, sys
from pathlib import Path
from edge_agent.fleet.device.release import transfer
from edge_agent.fleet.device.release.source import Release
transfer.download(Release.from_json(json.loads(sys.argv[1])), Path(sys.argv[2]))
"""


def test_the_rate_cap_holds(tmp_path: Path) -> None:
    root = tmp_path / "releases"
    release = _publish(sized_gguf(tmp_path / "m.gguf", 3), root)
    server = ArtifactServer(root).start()
    try:
        cap = 1_500_000
        calls: list[tuple[float, int, float]] = []
        transfer.download(_at(release, server), tmp_path / "dl", max_bytes_per_s=cap,
                          progress=lambda d, t, r, e: calls.append((time.monotonic(), d, r)))
    finally:
        server.stop()
    (t0, d0, _), (t1, d1, _) = calls[0], calls[-1]
    measured = (d1 - d0) / (t1 - t0)
    assert 0.8 * cap <= measured <= 1.2 * cap, measured
    assert d1 == release.length and len(calls) >= 6  # throttled callbacks, not per read
    assert 0.5 * cap < calls[-2][2] < 1.5 * cap  # the reported rate is the real one


def test_not_enough_disk_is_refused_with_the_numbers(served: tuple[ArtifactServer, Release],
                                                     tmp_path: Path) -> None:
    server, release = served
    dest = tmp_path / "dl"
    with pytest.raises(ReleaseRejected) as err:
        transfer.download(release, dest, headroom=1000, free_space=lambda p: 5 * MB)
    e = err.value
    assert e.reason == NO_SPACE and not e.retry
    needed = 2 * release.length + 1000
    assert (e.details["needed"], e.details["free"], e.details["where"]) == (
        needed, 5 * MB, str(dest))
    assert f"{needed} bytes needed" in e.message and f"{5 * MB} free" in e.message
    assert not list(dest.glob("*.part")) and _blob_bytes(server) == 0
    # What is already there counts: half a part needs half the download.
    transfer.paths(release, dest)[1].write_bytes(b"\0" * (release.length // 2))
    with pytest.raises(ReleaseRejected) as err:
        transfer.download(release, dest, install_copy=False, free_space=lambda p: 1)
    assert err.value.details["download"] == release.length - release.length // 2


def test_a_real_small_filesystem_refuses_the_download(tmp_path: Path,
                                                      served: tuple[ArtifactServer, Release]
                                                      ) -> None:
    _, release = served
    with small_filesystem(tmp_path / "tmpfs", "8m") as mnt:
        with pytest.raises(ReleaseRejected) as err:
            transfer.download(release, mnt / "downloads", headroom=0)
        assert err.value.reason == NO_SPACE
        assert 7 * MB < err.value.details["free"] <= 8 * 1024 * 1024
        assert err.value.details["needed"] == 2 * release.length


def test_stops_at_the_signed_length_and_verifies(served: tuple[ArtifactServer, Release],
                                                 tmp_path: Path) -> None:
    server, release = served
    blob = server.root / release.url.split("/releases/", 1)[1]
    with blob.open("ab") as fh:
        fh.write(os.urandom(3 * MB))  # longer than signed: the rest is never written
    path = transfer.download(release, tmp_path / "a", retry=FAST)
    assert path.stat().st_size == release.length
    # A corrupted part: found at the end, deleted, the next attempt starts from zero.
    dest = tmp_path / "b"
    dest.mkdir()
    part = transfer.paths(release, dest)[1]
    part.write_bytes(b"\1" * (release.length // 2))
    with pytest.raises(ReleaseFailed) as err:
        transfer.download(release, dest, retry=FAST)
    assert err.value.reason == HASH_MISMATCH and err.value.retry and not part.exists()
    assert transfer.download(release, dest, retry=FAST).stat().st_size == release.length
    # Finished before a stop (killed while verifying): checked again, no network needed.
    server.stop()
    assert transfer.download(release, dest, retry=FAST).stat().st_size == release.length


def test_a_server_without_range_is_read_from_the_start(tmp_path: Path) -> None:
    root = tmp_path / "releases"
    release = _publish(sized_gguf(tmp_path / "m.gguf", 2), root)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(
        _QuietHandler, directory=str(root.parent)))  # python -m http.server: no Range
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_port}/releases/" + \
            release.url.split("/releases/", 1)[1]
        moved = Release(release.name, release.version, release.target_path, release.length,
                        release.sha256, url, release.manifest)
        dest = tmp_path / "dl"
        dest.mkdir()
        transfer.paths(moved, dest)[1].write_bytes(
            (root / release.url.split("/releases/", 1)[1]).read_bytes()[:MB])
        path = transfer.download(moved, dest, retry=FAST)
        assert hashlib.sha256(path.read_bytes()).hexdigest() == release.sha256
    finally:
        httpd.shutdown()
        httpd.server_close()


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def test_http_errors_and_files_that_are_not_models(served: tuple[ArtifactServer, Release],
                                                   tmp_path: Path) -> None:
    server, release = served
    gone = Release(release.name, release.version, release.target_path, release.length,
                   "0" * 64, server.url + "targets/m/1/missing.gguf", release.manifest)
    with pytest.raises(ReleaseFailed) as err:
        transfer.download(gone, tmp_path / "a", retry=FAST)
    assert err.value.reason == NOT_FOUND
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(os.urandom(100_000))
    bad = _at(_publish(junk, server.root, name="junk"), server)
    with pytest.raises(ReleaseRejected) as rejected:
        transfer.download(bad, tmp_path / "b", retry=FAST)
    assert rejected.value.reason == INVALID_MODEL
    assert not list((tmp_path / "b").glob("*.gguf"))
    blob = server.root / release.url.split("/releases/", 1)[1]
    os.truncate(blob, release.length // 2)  # shorter than signed: no endless resuming
    with pytest.raises(ReleaseFailed) as short:
        transfer.download(release, tmp_path / "d", retry=FAST)
    assert short.value.reason == HASH_MISMATCH and "server's file is" in short.value.message
    server.stop()
    with pytest.raises(ReleaseFailed) as down:
        transfer.download(release, tmp_path / "c",
                          retry=transfer.Retry(attempts=2, base_s=0.01))
    assert down.value.reason == UNREACHABLE and "2 failed attempts" in down.value.message


def test_a_release_server_with_a_private_ca_is_trusted_through_artifacts_ca_file(
        tmp_path: Path) -> None:
    """A release server whose certificate the fleet's own CA signed (`fleet pki issue
    releases`): metadata and model files come over HTTPS once `fleet.artifacts_ca_file`
    names that CA, and neither does without it (the system's CAs do not know it)."""
    import ssl

    from edge_agent.config import FleetSettings
    from edge_agent.fleet.controller.pki import FleetCA
    from edge_agent.fleet.device.release.source import Pace, _PacedFetcher

    ca = FleetCA.init(tmp_path / "pki")
    ca.issue("releases", "releases", ips=["127.0.0.1"])
    root = tmp_path / "releases"
    release = _publish(sized_gguf(tmp_path / "m.gguf", 2), root)
    (root / "metadata").mkdir()
    (root / "metadata" / "timestamp.json").write_text('{"signed": {}}')
    handler = functools.partial(_QuietHandler, directory=str(tmp_path))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(ca.folder / "releases.pem", ca.folder / "releases.key")
    httpd.socket = tls.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base = f"https://127.0.0.1:{httpd.server_address[1]}/releases/"
    https = Release(release.name, release.version, release.target_path, release.length,
                    release.sha256, base + release.url.split("/releases/", 1)[1],
                    release.manifest)
    trusted = Pace.of(FleetSettings.model_validate({"artifacts_ca_file": ca.cert_file}))
    untrusted = Pace.of(FleetSettings.model_validate({}))
    try:
        fetched = b"".join(_PacedFetcher(trusted, "test")._fetch(
            base + "metadata/timestamp.json"))
        assert fetched == b'{"signed": {}}'
        with pytest.raises(Exception, match="(?i)certificate"):
            b"".join(_PacedFetcher(untrusted, "test")._fetch(base + "metadata/timestamp.json"))
        path = transfer.download(https, tmp_path / "ok", retry=FAST, pace=trusted)
        assert hashlib.sha256(path.read_bytes()).hexdigest() == release.sha256
        with pytest.raises(ReleaseFailed, match="(?i)certificate"):
            transfer.download(https, tmp_path / "refused", pace=untrusted,
                              retry=transfer.Retry(attempts=1, base_s=0.01))
    finally:
        httpd.shutdown()
        httpd.server_close()
