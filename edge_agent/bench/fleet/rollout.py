"""`edge-agent bench rollout`: a model rollout on one box over loopback, every part real — a
signed release repository (`fleet keygen`, `fleet release init|add`), `fleet serve` serving
/releases/ and ingesting, a private Mosquitto, and `edge-agent serve` with its link on.

- time to ACTIVE: from `fleet send DEV rollout.start` to the controller storing the box's
  ACTIVE transition, split by state (the gaps between the stored transitions' `ts`);
- download vs curl: `transfer.download` of the release (to the verified file) against
  `curl` of the same URL from the same `fleet serve`, in turns; the ratio of the medians;
- serving gap: while the box switches, one client streams long answers and another asks
  short questions; the longest interval between two tokens of a running stream, and the
  p99 TTFT of the short requests during the switch against before it;
- the controller's cost of a rollout in waves over `boxes` simulated boxes
  (`rollout_waves`): its CPU and the messages it handled a second.

Each run rolls out a new version (a copy of the default model with one byte of its
general.name changed: another digest that loads and answers as fast). Targets:
`targets.py` (`rollout.*`). Must never: write to the box's own state dir (the server gets
a state dir of its own, its blobs linked), use a system broker, import from tests/.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge_agent.bench.fleet.rollout_waves import run_waves, sim_devices
from edge_agent.bench.fleet.run import _server_state
from edge_agent.bench.serving.peers import EdgeAgentPeer, Sample
from edge_agent.bench.targets import report
from edge_agent.engine.models.catalog import ModelStore
from edge_agent.fleet.sim.testbed import Broker, ControllerProcess, wait_until
from edge_agent.names import ModelName

if TYPE_CHECKING:
    from edge_agent.fleet.device.release.source import Release

Echo = Callable[[str], None]
FLEET, DEV = "bench", "bench-box"
GATE = {"prompts": [{"id": "hello", "prompt": "Hello", "max_tokens": 4,
                     "expect": {"max_output_tokens": 4}}], "tokens_per_s_floor": None}
STATES = ("RECEIVED", "DOWNLOADING", "VERIFYING", "STAGED", "ACTIVATING", "GATING")


def _cli(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "edge_agent", *args], capture_output=True,
                          text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"edge-agent {' '.join(args[:3])} failed:\n{done.stderr[-2000:]}")
    return done.stdout


def variant(blob: Path, dest: Path, letter: bytes) -> Path:
    """A copy of a model file with the first letter of its general.name changed: another
    digest that loads and answers as the original does (the same weights: the same greedy
    answers, the same speed). The bench's and the tests' new versions."""
    shutil.copyfile(blob, dest)
    with dest.open("r+b") as fh:
        head = fh.read(1 << 16)
        at = head.index(b"general.name") + len(b"general.name") + 4 + 8
        fh.seek(at)
        fh.write(letter)
    return dest


def _p99(values: list[float]) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


def _transitions(db: Path, rollout_id: str) -> list[dict[str, Any]]:
    from edge_agent.fleet.controller.store import SQLiteStore

    store = SQLiteStore(db)
    try:
        rows = store.messages(DEV, kind="rollout", limit=10_000)
    finally:
        store.close()
    return sorted((m["body"] for m in rows if m["body"].get("rollout_id") == rollout_id
                   and m["body"].get("event") == "rollout.transition"),
                  key=lambda b: b["ts"])



class Load:
    """A long stream, over and over, and short questions, one after another."""

    def __init__(self, box: EdgeAgentPeer, long_tokens: int) -> None:
        self.box, self.long_tokens = box, long_tokens
        self.streams: list[Sample] = []
        self.shorts: list[Sample] = []
        self.failed = 0
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._loop, args=(True,), daemon=True),
                        threading.Thread(target=self._loop, args=(False,), daemon=True)]

    def _loop(self, long: bool) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            try:
                if long:
                    self.streams.append(self.box.chat(
                        [{"role": "user", "content": f"Tell a long story, part {i}."}],
                        self.long_tokens))
                else:
                    self.shorts.append(self.box.chat(
                        [{"role": "user", "content": f"Question {i}: is it open?"}], 4))
            except Exception:  # noqa: BLE001 — a failed request is a figure, not a crash
                self.failed += 1
                time.sleep(0.2)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)

    def ttfts(self, start: float, end: float) -> list[float]:
        return [s.ttft_s for s in list(self.shorts) if start <= s.start < end and s.arrivals]

    def longest_gap(self, start: float, end: float, *, begun: bool = False) -> float:
        """The longest interval without a token in a stream running within [start, end)
        (`begun`: only the intervals that began in it)."""
        gap = 0.0
        for s in list(self.streams):
            for a, b in pairwise(s.arrivals):
                if (start <= a if begun else b >= start) and a < end:
                    gap = max(gap, b - a)
        return gap


def _download_vs_curl(ctl_url: str, root_file: Path, work: Path, version: str,
                      model: str, runs: int) -> dict[str, Any]:
    from edge_agent.config import load_settings
    from edge_agent.fleet.device.release.source import ReleaseSource

    device = work / "device"
    settings = load_settings(None, state_dir=device, **{
        "fleet.tuf_root_file": str(root_file), "fleet.artifacts_url": f"{ctl_url}/releases/"})
    return download_vs_curl(ReleaseSource(settings.fleet, device).lookup(model, version),
                            work, runs)


def download_vs_curl(release: Release, work: Path, runs: int) -> dict[str, Any]:
    """`transfer.download` of a verified release against `curl` of its URL, in turns:
    MB/s to the last byte (`transfer`), with the sha256 and GGUF precheck that follow
    (`download`), and curl's; the ratios of the medians."""
    from edge_agent.fleet.device.release import transfer

    times: dict[str, list[float]] = {"transfer": [], "download": [], "curl": []}
    for _ in range(runs):
        dest = work / "dl"
        shutil.rmtree(dest, ignore_errors=True)
        ends: list[float] = []

        def last_byte(done: int, total: int, rate: float, eta: float | None,
                      ends: list[float] = ends) -> None:
            if done == total:
                ends.append(time.perf_counter())

        t0 = time.perf_counter()
        transfer.download(release, dest, progress=last_byte)
        times["download"].append(time.perf_counter() - t0)
        times["transfer"].append((ends[0] if ends else time.perf_counter()) - t0)
        shutil.rmtree(dest, ignore_errors=True)
        out = work / "curl.out"
        t0 = time.perf_counter()
        subprocess.run(["curl", "-sSf", "-o", str(out), release.url], check=True)
        times["curl"].append(time.perf_counter() - t0)
        out.unlink()
    size = release.length
    mb_s = {k: [size / t / 1e6 for t in v] for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in mb_s.items()}
    return {"bytes": size, "runs": runs, "MB_per_s": mb_s, "median_MB_per_s": med,
            "ratio": med["transfer"] / med["curl"],
            "ratio_with_verification": med["download"] / med["curl"]}


def run_rollout_bench(state_dir: Path, model: ModelName, *, runs: int, threads: int, context: int,
                      before_s: float = 5.0, long_tokens: int = 64, boxes: int = 100,
                      soak_s: float = 1.0, echo: Echo) -> dict[str, Any]:

    store = ModelStore(state_dir)
    try:
        if not store.is_installed(model):
            store.pull(model)
        blob = store.get(model).blob_path(state_dir)
        entry = store.catalog().get(model)
    finally:
        store.close()
    echo(f"edge-agent bench rollout: {model}, {blob.stat().st_size / 1e6:.0f} MB, "
         f"{runs} run(s), {os.cpu_count()} CPUs")
    result: dict[str, Any] = {"model": model, "bytes": blob.stat().st_size, "runs": runs}
    with tempfile.TemporaryDirectory(prefix="edge-bench-rollout-") as tmp:
        root = Path(tmp)
        keys, box_root = root / "keys", root / "box"
        ctl = box_root / "controller"  # ControllerProcess's state dir
        _cli("fleet", "keygen", "--out", str(keys))
        _cli("fleet", "release", "init", "--state-dir", str(ctl), "--keys", str(keys))
        (root / "gate.json").write_text(json.dumps(GATE))
        extra: list[str] = []  # what a catalog entry adds to its file, the release carries
        if entry is not None and entry.chat_template:
            (root / "template.jinja").write_text(entry.chat_template)
            extra += ["--template", str(root / "template.jinja")]
        if entry is not None and entry.parameters:
            (root / "parameters.json").write_text(json.dumps(entry.parameters))
            extra += ["--parameters", str(root / "parameters.json")]
        versions = [str(i + 2) for i in range(runs)]
        for i, version in enumerate(versions):
            gguf = variant(blob, root / f"v{version}.gguf", b"ABCDEFGHIJKLMNOP"[i % 16:][:1])
            _cli("fleet", "release", "add", str(gguf), "--name", model, "--version", version,
                 "--state-dir", str(ctl), "--keys", str(keys), "--gate",
                 str(root / "gate.json"), *extra)
            gguf.unlink()
        root_file = root / "provisioned-root.json"
        shutil.copyfile(ctl / "releases" / "metadata" / "1.root.json", root_file)
        sims = sim_devices(boxes)
        broker = Broker(box_root, fleet=FLEET, devices=(DEV, *sims), passwd_tool=not sims,
                        log_types=("error", "warning")).start()
        config = box_root / "controller.toml"
        signing_key = keys / "command.pem"
        config.write_text(f'state_dir = "{ctl}"\ncommand_signing_key_file = "{signing_key}"\n'
                          f'[broker]\nurl = "{broker.url}"\nusername = "controller"\n'
                          f'password_file = "{broker.password_file("controller")}"\n')
        controller = ControllerProcess(broker, box_root)
        box: EdgeAgentPeer | None = None
        try:
            controller.start()
            echo("download throughput, transfer.download vs curl, same file, same server")
            dl = _download_vs_curl(controller.url, root_file, root, versions[0], model, runs)
            med = dl["median_MB_per_s"]
            echo(f"  {dl['bytes'] / 1e6:.0f} MB: edge-agent {med['transfer']:.0f} MB/s to the "
                 f"last byte ({med['download']:.0f} MB/s verified and prechecked), curl "
                 f"{med['curl']:.0f} MB/s (median of {runs})")
            report(echo, "rollout.download_vs_curl", dl["ratio"], runs=runs)
            result["download"] = dl
            fleet_env = {
                "EDGE_AGENT_FLEET__ENABLED": "true", "EDGE_AGENT_FLEET__BROKER": broker.url,
                "EDGE_AGENT_FLEET__FLEET_ID": FLEET, "EDGE_AGENT_FLEET__DEVICE_ID": DEV,
                "EDGE_AGENT_FLEET__USERNAME": DEV,
                "EDGE_AGENT_FLEET__PASSWORD_FILE": str(broker.password_file(DEV)),
                "EDGE_AGENT_FLEET__COMMAND_PUBLIC_KEY_FILE": str(keys / "command.pub.pem"),
                "EDGE_AGENT_FLEET__TUF_ROOT_FILE": str(root_file),
                "EDGE_AGENT_FLEET__ARTIFACTS_URL": f"{controller.url}/releases/",
                "EDGE_AGENT_FLEET__DOWNLOAD_HEADROOM_BYTES": "0",
                "EDGE_AGENT_FLEET__RECONNECT_MIN_S": "0.2",
                "EDGE_AGENT_FLEET__RECONNECT_MAX_S": "1.0",
                "EDGE_AGENT_TELEMETRY__HARDWARE": "false"}
            box = EdgeAgentPeer(_server_state(state_dir, root / "serve"), model,
                                threads=threads, context=context, parallel=2, env=fleet_env)
            box.chat([{"role": "user", "content": "warm up"}], 4)
            if not wait_until(lambda: controller.device(DEV).get("online") is True, 60, 0.2):
                raise RuntimeError("the box's link did not reach the controller")
            result["rollouts"] = [
                _one_rollout(box, controller.db, config, model, version, before_s,
                             long_tokens, echo) for version in versions]
            box.close()
            box = None
            if sims:
                result["waves"] = run_waves(controller, broker, config, keys,
                                            f"{model}@{versions[0]}", sims, root, runs=runs,
                                            soak_s=soak_s, echo=echo)
        finally:
            if box is not None:
                box.close()
            controller.stop()
            broker.stop()
    rolls = result["rollouts"]
    total = statistics.median(r["to_active_s"] for r in rolls)
    per_state = {s: statistics.median(r["states_s"].get(s, 0.0) for r in rolls)
                 for s in STATES}
    gap = statistics.median(r["longest_gap_ms"] for r in rolls)
    before = statistics.median(r["ttft_p99_before_ms"] for r in rolls)
    during = statistics.median(r["ttft_p99_during_ms"] for r in rolls)
    echo(f"summary (median of {len(rolls)})")
    echo(f"  rollout start to ACTIVE {total:.2f} s: " + ", ".join(
        f"{s} {v:.2f}" for s, v in per_state.items()))
    echo(f"  longest gap between tokens during the switch {gap:.0f} ms; TTFT p99 before "
         f"{before:.0f} ms, during {during:.0f} ms")
    report(echo, "rollout.to_active_s", total)
    report(echo, "rollout.longest_gap_ms", gap)
    report(echo, "rollout.ttft_p99_ratio", during / before if before else float("nan"))
    result["summary"] = {"to_active_s": total, "states_s": per_state, "longest_gap_ms": gap,
                         "ttft_p99_before_ms": before, "ttft_p99_during_ms": during,
                         "ttft_p99_ratio": during / before if before else float("nan"),
                         "download_vs_curl": result["download"]["ratio"]}
    if "waves" in result:
        med = result["waves"]["median"]
        result["summary"]["waves"] = {"devices": boxes, "controller_cpu_s": med["cpu_s"],
                                      "core_percent": med["core_percent"],
                                      "msgs_per_s": med["msgs_per_s"], "wall_s": med["wall_s"]}
    return result


def _one_rollout(box: EdgeAgentPeer, db: Path, config: Path, model: str, version: str,
                 before_s: float, long_tokens: int, echo: Echo) -> dict[str, Any]:
    rid = f"bench-{version}"
    echo(f"rollout {rid}: version {version}, with a stream and short requests running")
    with Load(box, long_tokens) as load:
        t_before = time.perf_counter()
        time.sleep(before_s)
        t_send = time.perf_counter()
        _cli("fleet", "send", DEV, "rollout.start", "--config", str(config), "--wait", "0",
             "--arg", f"rollout_id={rid}", "--arg", f"name={model}",
             "--arg", f"version={version}")
        if not wait_until(lambda: any(b["to"] in ("ACTIVE", "ROLLED_BACK", "FAILED")
                                      for b in _transitions(db, rid)), 600, 0.2):
            raise RuntimeError(f"rollout {rid} did not finish")
        t_active = time.perf_counter()
        time.sleep(0.5)  # the streams running at the end of the switch go on a little
    bodies = _transitions(db, rid)
    if bodies[-1]["to"] != "ACTIVE":
        raise RuntimeError(f"rollout {rid} ended {bodies[-1]['to']}: {bodies[-1]}")
    states = {a["to"]: b["ts"] - a["ts"] for a, b in pairwise(bodies)}
    # Where the gaps begin: each state's span on this process's clock (the box stamps
    # transitions with its wall clock, the same machine's).
    shift = time.time() - time.perf_counter()
    gaps = {a["to"]: round(load.longest_gap(a["ts"] - shift, b["ts"] - shift, begun=True)
                           * 1000) for a, b in pairwise(bodies)}
    before = load.ttfts(t_before, t_send)
    during = load.ttfts(t_send, t_active)
    row = {"version": version, "to_active_s": t_active - t_send, "states_s": states,
           "timings": bodies[-1].get("timings") or {},
           "longest_gap_ms": load.longest_gap(t_send, t_active) * 1000,
           "longest_gap_before_ms": load.longest_gap(t_before, t_send) * 1000,
           "longest_gap_by_state_ms": gaps,
           "ttft_p99_before_ms": _p99(before) * 1000, "ttft_p99_during_ms": _p99(during) * 1000,
           "short_requests": {"before": len(before), "during": len(during)},
           "failed_requests": load.failed}
    echo(f"  ACTIVE after {row['to_active_s']:.2f} s; " + ", ".join(
        f"{s} {v:.2f}" for s, v in states.items()))
    echo(f"  longest gap {row['longest_gap_ms']:.0f} ms (before "
         f"{row['longest_gap_before_ms']:.0f}); TTFT p99 {row['ttft_p99_during_ms']:.0f} ms "
         f"during ({len(during)}), {row['ttft_p99_before_ms']:.0f} ms before ({len(before)}); "
         f"failed {load.failed}")
    return row
