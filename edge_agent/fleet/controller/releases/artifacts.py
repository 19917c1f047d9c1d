"""Serving the release repository over HTTP: metadata and model files, with `Range`.

    GET|HEAD /metadata/<file>     TUF metadata (timestamp.json, N.snapshot.json, …)
    GET|HEAD /targets/<path>      release files by content name (<sha256>.model.gguf)

A router factory (`artifacts_router(root)`), no module state; the controller's API mounts
it under `/releases/` (`app.include_router(artifacts_router(releases_dir(state)),
prefix="/releases")`), and so does the release server of its own that `fleet
serve-releases` runs for the boxes (`release_app`), so a device's `fleet.artifacts_url` is
`https://HOST:PORT/releases/`. Everything here is public by design: integrity comes
from the TUF signatures the device checks, not from this server. Any static server with
`Range` can serve the same tree instead (nginx, MinIO, S3): the device needs nothing else.

HTTP as a download resumes it: one byte range per request (`bytes=a-b`, `bytes=a-`,
`bytes=-n`), answered 206 with `Content-Range`, 416 with `bytes */size` when it starts past
the end; several ranges, or a malformed header, get the whole file (200), as RFC 9110
allows. An end past the file, or a suffix longer than it, means the rest of it (RFC 9110
again). Positions are compared by their count of digits before any is converted: a number
of thousands of digits (which `int()` refuses past 4,300, and is slow at below that) is
answered like any other position past the end, never with a 500. `ETag` and
`Last-Modified` on every answer, `If-Range` honoured (a stale validator gets the whole
file), `If-None-Match` answered 304. Versioned metadata and content-named
files never change: they are marked immutable so a cache may keep them; `timestamp.json`
and `root.json` must be fetched fresh each time.

Only regular files under `metadata/` and `targets/` of the root are served: a path with
`..`, a NUL, a backslash or a dot file, or one that resolves outside (a symlink), is a 404
like a missing file — nothing tells a prober what exists elsewhere. This module never
writes.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from email.utils import formatdate
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

SERVED = ("metadata", "targets")
CHUNK = 1 << 20
_RANGE = re.compile(r"bytes=([0-9]*)-([0-9]*)")
_FRESH = {"timestamp.json", "root.json"}


def release_app(root: Path) -> FastAPI:
    """The release server of `fleet serve-releases`: `root` under `/releases/` and nothing
    else (no API, no document), every refusal `{"error": ...}` as the controller's."""
    app = FastAPI(title="edge-agent releases", docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.include_router(artifacts_router(root), prefix="/releases")

    @app.exception_handler(StarletteHTTPException)
    def refused(request: Request, exc: StarletteHTTPException) -> Response:
        return JSONResponse({"error": "only /releases/metadata/ and /releases/targets/ are "
                                      "served here" if exc.status_code == 404
                             else str(exc.detail)},
                            status_code=exc.status_code, headers=exc.headers)

    return app


def artifacts_router(root: Path) -> APIRouter:
    """A router serving `root` (`<state>/releases`): its metadata/ and targets/ trees."""
    router = APIRouter()
    base = root.resolve()

    @router.api_route("/{path:path}", methods=["GET", "HEAD"], include_in_schema=False)
    def artifact(path: str, request: Request) -> Response:
        found = _resolve(base, path)
        if found is None:
            return JSONResponse({"error": "no such release file"}, status_code=404)
        file, st = found
        etag = f'"{st.st_size:x}-{st.st_mtime_ns:x}"'
        headers = {"ETag": etag, "Last-Modified": formatdate(st.st_mtime, usegmt=True),
                   "Accept-Ranges": "bytes", "Cache-Control": _cache_control(file)}
        if etag in _tokens(request.headers.get("if-none-match")):
            return Response(status_code=304, headers=headers)
        start, end = 0, st.st_size - 1
        status = 200
        wanted = request.headers.get("range")
        if_range = request.headers.get("if-range")
        if wanted is not None and (if_range is None or if_range.strip() in
                                   (etag, headers["Last-Modified"])):
            parsed = _parse_range(wanted, st.st_size)
            if isinstance(parsed, str):  # unsatisfiable
                return Response(status_code=416, headers={
                    **headers, "Content-Range": f"bytes */{st.st_size}"})
            if parsed is not None:
                start, end = parsed
                status = 206
                headers["Content-Range"] = f"bytes {start}-{end}/{st.st_size}"
        length = max(0, end - start + 1)
        headers["Content-Length"] = str(length)
        media = "application/json" if file.suffix == ".json" else "application/octet-stream"
        if request.method == "HEAD":
            return Response(status_code=status, headers=headers, media_type=media)
        return StreamingResponse(_read(file, start, length), status_code=status,
                                 headers=headers, media_type=media)

    return router


def _resolve(base: Path, path: str) -> tuple[Path, os.stat_result] | None:
    parts = path.split("/")
    if (len(parts) < 2 or parts[0] not in SERVED or "\x00" in path or "\\" in path
            or any(p in ("", ".", "..") or p.startswith(".") for p in parts)):
        return None
    file = base.joinpath(*parts)
    try:
        real = file.resolve(strict=True)
        # A symlink out of the served tree is not followed; the tree itself may be one
        # (targets/ on a larger disk).
        real.relative_to((base / parts[0]).resolve(strict=True))
        st = real.stat()
    except (OSError, ValueError):
        return None
    return (real, st) if stat.S_ISREG(st.st_mode) else None


def _parse_range(value: str, size: int) -> tuple[int, int] | str | None:
    """(first, last) byte, "unsatisfiable", or None to send the whole file."""
    m = _RANGE.fullmatch(value.strip())
    if m is None or (not m[1] and not m[2]):
        return None  # several ranges, another unit, or garbage: the whole file
    if not m[1]:  # bytes=-n: the last n bytes
        n = _position(m[2], size)
        if n == 0:
            return "unsatisfiable"
        return max(0, size - n), size - 1
    first = _position(m[1], size)
    if first >= size:
        return "unsatisfiable"
    last = _position(m[2], size) if m[2] else size - 1
    if last < first:
        return None
    return first, min(last, size - 1)


def _position(digits: str, size: int) -> int:
    """A position or length of the header, capped at `size`: every number from `size` up
    means the same here (past the end; the whole file), and comparing the count of
    digits first keeps a header of thousands of them away from `int()`."""
    significant = digits.lstrip("0")
    if len(significant) > len(str(size)):
        return size
    return min(int(significant or "0"), size)


def _read(file: Path, start: int, length: int) -> Iterator[bytes]:
    """The bytes, read with pread in large chunks (Starlette runs this in a thread)."""
    fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
    try:
        offset, left = start, length
        while left > 0:
            chunk = os.pread(fd, min(CHUNK, left), offset)
            if not chunk:  # the file shrank under us: end the body short, the client sees it
                return
            offset += len(chunk)
            left -= len(chunk)
            yield chunk
    finally:
        os.close(fd)


def _cache_control(file: Path) -> str:
    if file.name in _FRESH:
        return "no-cache"
    return "public, max-age=31536000, immutable"


def _tokens(header: str | None) -> set[str]:
    if not header:
        return set()
    return {t.strip().removeprefix("W/") for t in header.split(",")}
