"""Figures for signed releases (not a test): download throughput against curl of the same
file from the same server (the measurement of `edge-agent bench rollout`, against a bare
artifacts server and a file of any size), and the time of `fleet release add`.

    python -m tests.support.release_bench [--mb 200] [--runs 5] [--gguf FILE] [--workdir DIR]

The server (the artifacts router under uvicorn) runs in its own process, so the client
measured here and curl compete with it alike. The device's figure is `transfer.download`
to the last byte (`transfer`), and with the verification and the GGUF precheck in the
bounded child that follow (`download`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from edge_agent.bench.fleet.rollout import download_vs_curl
from edge_agent.fleet.device.release.source import ReleaseSource
from tests.conftest import free_port
from tests.support.releasekit import device_settings, make_repo, sized_gguf

_SERVER = """
import sys
from pathlib import Path
import uvicorn
from fastapi import FastAPI
from edge_agent.fleet.controller.releases.artifacts import artifacts_router
app = FastAPI()
app.include_router(artifacts_router(Path(sys.argv[1])), prefix="/releases")
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
"""


def _wait_up(port: int) -> None:
    import socket

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError("server did not start")


def throughput(work: Path, mb: float, runs: int) -> dict[str, object]:
    repo = make_repo(work / "ctl")
    gguf = sized_gguf(work / "big.gguf", mb)
    repo.add(gguf, "bench:1", "1")
    gguf.unlink()
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    server = subprocess.Popen([sys.executable, "-c", _SERVER, str(repo.repo.root), str(port)],
                              env=env)
    try:
        _wait_up(port)
        url = f"http://127.0.0.1:{port}/releases/"
        device = work / "device"
        source = ReleaseSource(device_settings(device, repo.root_file, url).fleet, device)
        release = source.lookup("bench:1", "1")
        result = download_vs_curl(release, work, runs)
    finally:
        server.terminate()
        server.wait()
    med = result["median_MB_per_s"]
    return {"bytes": result["bytes"], "runs": runs,
            "MB_per_s": {k: [round(x) for x in v] for k, v in result["MB_per_s"].items()},
            "median_MB_per_s": {k: round(v) for k, v in med.items()},
            "ratio_transfer_vs_curl": round(result["ratio"], 2),
            "ratio_download_vs_curl": round(result["ratio_with_verification"], 2)}


def release_add(work: Path, gguf: Path, runs: int) -> dict[str, object]:
    repo = make_repo(work / "add")
    state = repo.repo.root.parent
    times = []
    for i in range(runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "edge_agent", "fleet", "release", "add",
                        str(gguf), "--name", "smollm2:135m", "--version", str(i + 1),
                        "--state-dir", str(state), "--keys", str(repo.keys.path), "--json"],
                       check=True, capture_output=True,
                       env={**os.environ,
                            "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
        times.append(time.perf_counter() - t0)
    return {"file": str(gguf), "bytes": gguf.stat().st_size,
            "cli_seconds": [round(t, 2) for t in times]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=200)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--gguf", type=Path, help="A real GGUF for the `release add` timing.")
    ap.add_argument("--workdir", type=Path)
    a = ap.parse_args()
    work = a.workdir or Path(tempfile.mkdtemp(prefix="release-bench-"))
    try:
        result: dict[str, object] = {"throughput": throughput(work, a.mb, a.runs)}
        if a.gguf:
            result["release_add"] = release_add(work, a.gguf, a.runs)
        print(json.dumps(result, indent=2))
    finally:
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
