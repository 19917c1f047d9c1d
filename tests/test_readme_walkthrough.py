"""The manual's walk-through ("one machine, one broker, two boxes", steps 1 to 6, in
docs/fleet/rollouts.md), and the README's "A fleet in five minutes", run as a reader runs
them: their ```sh and ```toml blocks are read from the page, not copied here, and run in
order in one folder, so neither page can drift from what works.

Only what a tester on a shared machine must change is changed, each change checked to
apply (an edit of the page that drops one fails here rather than running on a real port):

- free ports for 1883 (the broker: `fleet broker-config --port`, and the URLs of the
  configs), 9464 (`fleet serve`'s HTTP) and 11434 / 11435 (the boxes), since the machine
  may run its own Mosquitto and Ollama;
- `--soak 3s` for `--soak 2m`;
- the commands find this Python's `edge-agent` and `gguf-new-metadata` (and Mosquitto) on
  PATH, and run with one thread and a small context each (`rolloutkit.ENV`): a broker, a
  controller, two boxes and their clients share the two cores of a CI machine;
- a command ending in `&` is a process this test starts, waits for (the port, /healthz,
  /ready and online at the controller, as a reader looks before the next step) and stops
  at the end;
- the page shows store-001's `[fleet]` TOML; store-002's is the same with store-002 for
  store-001, and each box's `release-root.json` is the copy its comment asks for, unless
  the page's commands make it.

The boxes are pre-seeded with the default model (`clone_state`), which `serve` would
otherwise assemble at start; `models pull gemma3:270m` still runs as written (from the
catalog's package: nothing is downloaded). Clients stream chat to gemma3:270m on both
boxes all along, through the official OpenAI (no retries) and Ollama clients in turn; the
rollout started by step 6 must reach COMPLETED with both boxes ACTIVE on version 2, shown
so by `fleet devices`, and no client request may fail. The figures (requests, the longest
wait a request saw while its box switched, time to ACTIVE) are printed (`pytest -s`).
Last, the console in headless Chromium shows both boxes online serving version 2, and the
rollout with each box's download done and its gate evidence (the manual's pictures of
those two pages, with EDGE_AGENT_SCREENSHOTS=DIR).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import clone_state, free_port
from tests.support.brokers import find_mosquitto, wait_port
from tests.support.console import shot, sign_in, text, windows
from tests.support.fleetkit import wait_until
from tests.support.processes import stop_in_reverse
from tests.support.rolloutkit import ENV, Box, Controller, Request, Streams, get_json

pytestmark = [pytest.mark.integration, pytest.mark.broker]

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "fleet" / "rollouts.md"
SECTION = "## Walk-through: one machine, one broker, two boxes"
SECTION_END = "With a real fleet, the same command reads"
GEMMA = "gemma3:270m"
BOXES = ("store-001", "store-002")
SOAK = "3s"


def walkthrough_blocks(page: str) -> list[tuple[str, str]]:
    """The section's ```sh and ```toml blocks, in order, as (language, text); the output
    samples (plain ```) are left out."""
    assert SECTION in page, f"{PAGE.name}: no {SECTION!r}"
    section = page.split(SECTION, 1)[1]
    assert SECTION_END in section, (
        f"{PAGE.name}: the walk-through no longer ends at {SECTION_END!r}")
    section = section.split(SECTION_END, 1)[0]
    return [(m.group(1), m.group(2))
            for m in re.finditer(r"^```(sh|toml)\n(.*?)^```", section, re.S | re.M)]


def shell_steps(block: str) -> list[tuple[str, bool]]:
    """A sh block cut into (script, background): the commands ending in `&` alone, the
    runs of other commands between them together (a variable set by one is used by the
    next). Continuation lines and here-documents stay with their command."""
    steps: list[tuple[str, bool]] = []
    pending: list[str] = []
    lines = iter(block.splitlines())
    for line in lines:
        command = line
        while command.endswith("\\"):
            command += "\n" + next(lines)
        heredoc = re.search(r"<<-?\s*'?\"?(\w+)", command)
        if heredoc and not command.lstrip().startswith("#"):
            for body in lines:
                command += "\n" + body
                if body.strip() == heredoc.group(1):
                    break
        stripped = command.rstrip()
        if stripped.endswith("&") and not stripped.endswith("&&"):
            if pending:
                steps.append(("\n".join(pending), False))
                pending = []
            steps.append((stripped[:-1].rstrip(), True))
        else:
            pending.append(command)
    if any(p.strip() and not p.lstrip().startswith("#") for p in pending):
        steps.append(("\n".join(pending), False))
    return steps


@dataclass
class Walkthrough:
    """One run of the walk-through in `folder`: the ports in place of the page's, the
    processes it started (stopped by `close`, the last started first) and their logs."""

    folder: Path
    env: dict[str, str]
    mqtt: int = field(default_factory=free_port)
    http: int = field(default_factory=free_port)
    ports: dict[str, int] = field(default_factory=lambda: {b: free_port() for b in BOXES})
    procs: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)
    boxes: dict[str, Box] = field(default_factory=dict)

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.http}"

    @property
    def central(self) -> Controller:
        ctl = self.folder / "fleet"
        return Controller(self.folder / "controller.toml", ctl / "keys", ctl,
                          f"{self.api}/releases/", self.api)

    def substitute(self, text: str) -> str:
        """The page's text with this run's ports and soak: only what a tester must
        change."""
        for old, new in (
                ("edge-agent fleet broker-config ",
                 f"edge-agent fleet broker-config --port {self.mqtt} "),
                ("127.0.0.1:1883", f"127.0.0.1:{self.mqtt}"),
                ("127.0.0.1:9464", f"127.0.0.1:{self.http}"),
                ("port = 9464", f"port = {self.http}"),
                ("--port 11434", f"--port {self.ports['store-001']}"),
                ("--port 11435", f"--port {self.ports['store-002']}"),
                ("--soak 2m", f"--soak {SOAK}")):
            text = text.replace(old, new)
        return text

    def run(self, script: str, timeout: float = 180) -> str:
        """A foreground script, as a shell runs it (stopping at the first failure); its
        output."""
        done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=self.folder,
                              env=self.env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, (f"the walk-through: `{script}` exited "
                                      f"{done.returncode}\n{done.stdout}{done.stderr}"
                                      f"{self.logs()}")
        return done.stdout

    def start(self, command: str) -> None:
        """A `&` command: started as this test's process, waited for as a reader waits
        before the next step."""
        name = re.sub(r"\W+", "-", command)[:60]
        log = (self.folder / f"{name}.log").open("wb")
        proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=self.folder,
                                env=self.env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.procs.append((name, proc))
        if re.match(r"mosquitto\b", command):
            wait_port(self.mqtt, 15, proc)
        elif re.match(r"edge-agent fleet serve\b", command):
            assert wait_until(lambda: proc.poll() is None and get_json(f"{self.api}/healthz"),
                              60, 0.2), f"fleet serve is not up{self.logs()}"
        elif box := re.match(r"edge-agent serve --config (\S+)\.toml .*--port (\d+)",
                             command):
            device = Path(box.group(1)).name
            self.boxes[device] = Box(device, proc, f"http://127.0.0.1:{box.group(2)}",
                                     self.folder / device)
            try:
                self.boxes[device].wait_ready(self.central)
            except AssertionError:
                raise AssertionError(f"{device} is not up{self.logs()}") from None
        else:
            raise AssertionError(f"the walk-through starts {command!r}: how is it up?")

    def logs(self) -> str:
        """The tail of each started process's log, for a failure's message."""
        return "".join(f"\n--- {name} ---\n" + (self.folder / f"{name}.log").read_text(
            errors="replace")[-3000:] for name, _ in self.procs)

    def close(self) -> None:
        stop_in_reverse(proc for _, proc in self.procs)


@pytest.fixture
def walkthrough(model_cache: Path) -> Iterator[Walkthrough]:
    """A folder the broker's own user can enter (Mosquitto started as root drops to
    `mosquitto`, and pytest's folders are private), the boxes' state dirs seeded with the
    default model, and an environment whose PATH has this Python's scripts and
    Mosquitto."""
    mosquitto = find_mosquitto()
    if mosquitto is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    scripts = Path(sys.executable).parent
    for script in ("edge-agent", "gguf-new-metadata"):
        if not (scripts / script).exists():
            pytest.skip(f"no {script} beside {sys.executable} (pip install -e .)")
    folder = Path(tempfile.mkdtemp(prefix="edge-walkthrough-"))
    folder.chmod(0o755)
    for device in BOXES:
        clone_state(model_cache, folder / device)
    path = os.pathsep.join([str(scripts), str(Path(mosquitto).parent), ENV.get("PATH", "")])
    run = Walkthrough(folder, {**ENV, "PATH": path})
    try:
        yield run
    finally:
        run.close()
        shutil.rmtree(folder, ignore_errors=True)


def test_the_walkthrough_rolls_version_2_out_to_both_boxes_with_no_failed_request(
        walkthrough: Walkthrough, tmp_path: Path) -> None:
    began = time.monotonic()
    run = walkthrough
    blocks = walkthrough_blocks(PAGE.read_text())
    text = "\n".join(body for _, body in blocks)
    for needle in ("1883", "9464", "11434", "11435", "--soak 2m",
                   "edge-agent fleet broker-config"):
        assert needle in text, f"the walk-through: {needle!r} is gone; update this test"
    for needle in ("1883", "9464", "11434", "11435", "--soak 2m"):
        assert needle not in run.substitute(text), f"{needle!r} left after the substitutions"
    assert blocks[-1][0] == "sh" and "fleet rollout start" in blocks[-1][1], blocks[-1]
    copy_root = not any("release-root.json" in body for lang, body in blocks if lang == "sh")

    for language, body in blocks[:-1]:  # steps 1 to 5
        body = run.substitute(body)
        if language == "toml":
            _write_config(run, body, copy_root=copy_root)
            continue
        for script, background in shell_steps(body):
            if background:
                run.start(script)
            else:
                out = run.run(script)
                if "fleet devices" in script:  # "# both online"
                    assert all(re.search(rf"^{d}\s.*\bonline\b", out, re.M) for d in BOXES), out
    release = run.folder / "gemma3-270m-q4_k_m.gguf"  # step 5's version 2
    assert release.exists(), "step 5 made no gemma3-270m-q4_k_m.gguf"
    new = _sha256(release)
    old = {name: box.digest(GEMMA) for name, box in run.boxes.items()}
    assert set(old) == set(BOXES) and new not in old.values()
    prepared = time.monotonic() - began

    streams = Streams(GEMMA, list(run.boxes.values()), num_predict=8,
                      clients=("openai", "ollama"))
    streams.start()
    try:
        assert wait_until(lambda: all(streams.served.get(b, 0) >= 2 for b in BOXES)
                          or streams.failures, 120, 0.1), streams.served
        rolled = time.monotonic()
        out = run.run(run.substitute(blocks[-1][1]))  # step 6: fleet rollout start
        started = re.search(r"^rollout (\S+): ", out, re.M)
        follow = re.search(r"follow it with: (.+)$", out, re.M)
        assert started and follow, out
        # What the rollout says to follow it with, until it has ended.
        watched = run.run(f"{follow.group(1)} --watch 0.5 --json", timeout=240)
        rolled = time.monotonic() - rolled
        # The clients go on until each box has answered one of them with version 2: on a
        # loaded box the rollout can end before the first such answer has.
        switched = f"fp_{new[:12]}"
        wait_until(lambda: all(any(r.box == b and r.fingerprint == switched
                                   for r in list(streams.requests)) for b in BOXES)
                   or streams.failures, 120, 0.1)
    finally:
        streams.stop()
    report: dict[str, Any] = json.loads(watched)
    assert report["id"] == started.group(1)
    rows = {d["device"]: d for d in report["devices"]}
    print(f"\n{_figures(report, rows, streams.requests)}\n  steps 1-5 {prepared:.1f} s, "
          f"step 6 to its end {rolled:.1f} s, test {time.monotonic() - began:.1f} s")

    outcome = {d["device"]: (d["state"], d.get("reason")) for d in report["devices"]}
    assert report["state"] == "COMPLETED", f"{report['reason']}: {outcome}{run.logs()}"
    assert report["states"] == {"ACTIVE": 2}, outcome
    assert streams.failures == [], streams.failures
    for name, box in run.boxes.items():  # version 2 serves, as its release
        assert box.digest(GEMMA) == new, name
        show = httpx.post(f"{box.base}/api/show", json={"model": GEMMA}, timeout=10).json()
        assert show["modelfile"].startswith(f"# source: release:{GEMMA}@2"), name
        # The clients streamed across the switch: served by both versions.
        mine = [r for r in streams.requests if r.box == name]
        assert {r.fingerprint for r in mine} >= {f"fp_{old[name][:12]}", f"fp_{new[:12]}"}
        assert min(r.started for r in mine) < rows[name]["started_at"], name
        assert max(r.ended for r in mine) > rows[name]["active_at"], name
    # `fleet devices`, as in step 4: version 2 active on both boxes.
    devices = next(script for _, body in blocks if "fleet devices" in body
                   for script, background in shell_steps(run.substitute(body))
                   if not background and "fleet devices" in script)
    shown: list[str] = []
    assert wait_until(lambda: _shows(run, devices, new, shown), 30, 0.5), shown[-1:]
    _console(run, report["id"], tmp_path)


def _console(run: Walkthrough, rollout: str, tmp_path: Path) -> None:
    """The console as the central team opens it once the rollout is done, in headless
    Chromium: the real boxes online with the release they serve, and the rollout with each
    box's download and gate evidence (the manual's pictures of both pages). Last: the
    operator made here makes the loopback API ask for tokens from then on."""
    from selenium.webdriver.common.by import By

    token = run.run("edge-agent fleet operators create desk --role operator "
                    "--config controller.toml").strip()
    with windows() as browser:
        driver = browser()
        sign_in(driver, run.api, token)
        rows = {r.get_attribute("data-device"): r.text
                for r in driver.find_elements(By.CSS_SELECTOR, "#devices tbody tr")}
        assert set(rows) == set(BOXES), rows
        assert all("online" in row and f"{GEMMA}@2" in row for row in rows.values()), rows
        shot(driver, tmp_path, "fleet")
        driver.get(f"{run.api}/console/rollouts/{rollout}")
        assert text(driver, "state").startswith("COMPLETED"), text(driver, "state")
        cells = {r.get_attribute("data-device"): r.find_elements(By.TAG_NAME, "td")
                 for r in driver.find_elements(By.CSS_SELECTOR, "table.devices tbody tr")}
        assert set(cells) == set(BOXES), cells
        for device, row in cells.items():
            state, download, evidence = row[0].text, row[2].text, row[4].text
            assert state == "ACTIVE" and download == "done", (device, state, download)
            assert re.match(r"ACTIVE: (\d+)/\1 checks passed", evidence), (device, evidence)
        # The evidence unfolded, as a reader clicks it open (the live part redraws every
        # two seconds: the picture is taken at once).
        driver.execute_script(
            "document.querySelectorAll('table.devices details').forEach(d => d.open = true)")
        shot(driver, tmp_path, "rollout")


def _write_config(run: Walkthrough, body: str, *, copy_root: bool) -> None:
    """A toml block: the controller's block names its file in its first line; the box's
    `[fleet]` is store-001's (`--config store-001.toml`), and store-002's the same with
    store-002. A box's `release-root.json` is the copy its comment asks for, unless the
    page's commands make it (`copy_root` false)."""
    named = re.match(r"#\s*(\S+\.toml)\s*\n", body)
    if named:
        (run.folder / named.group(1)).write_text(body)
        return
    assert 'device_id = "store-001"' in body, body
    for device in BOXES:
        config = body.replace("store-001", device)
        (run.folder / f"{device}.toml").write_text(config)
        root = re.search(r'tuf_root_file = "([^"]+)"\s*#.*copy of (\S+)', config)
        assert root, config
        if copy_root:
            shutil.copyfile(run.folder / root.group(2), run.folder / root.group(1))


def _shows(run: Walkthrough, command: str, digest: str, shown: list[str]) -> bool:
    """Whether `fleet devices` shows both boxes online with version `digest` active: the
    controller learns it from the box's next status, a moment after ACTIVE."""
    out = run.run(command)
    shown.append(out)
    return all(re.search(rf"^{d}\s.*\bonline\b.*{GEMMA}@{digest[:12]}", out, re.M)
               for d in BOXES)


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _figures(report: dict[str, Any], rows: dict[str, dict[str, Any]],
             requests: list[Request]) -> str:
    """Requests made and failed; per box, its wave, the time to ACTIVE from the rollout's
    start, and the longest wait (first text, whole request) of the requests that ran while
    it switched (from its `rollout.start` to its ACTIVE)."""
    failed = sum(1 for r in requests if r.error)
    lines = [f"walk-through rollout {report['id']}: {report['state']}; "
             f"requests {len(requests)}, failed {failed}"]
    for name in sorted(rows, key=lambda n: rows[n]["wave"]):
        row = rows[name]
        mine = [r for r in requests if r.box == name]
        versions = ", ".join(sorted({r.fingerprint or "?" for r in mine if r.fingerprint}))
        if row["started_at"] is None or row["active_at"] is None:  # a failure's figures
            lines.append(f"  {name}: wave {row['wave']}, {row['state']}; {len(mine)} requests; "
                         f"served by {versions}")
            continue
        during = [r for r in mine
                  if r.started < row["active_at"] and r.ended > row["started_at"]]
        ttft = max((r.ttft_s for r in during if r.ttft_s is not None), default=0.0)
        longest = max((r.duration_s for r in during), default=0.0)
        lines.append(
            f"  {name}: wave {row['wave']}, ACTIVE {row['active_at'] - report['created_at']:.1f}"
            f" s after the start (switch {row['active_at'] - row['started_at']:.1f} s); "
            f"{len(mine)} requests, {len(during)} during its switch: longest first text "
            f"{ttft:.2f} s, longest request {longest:.2f} s; served by {versions}")
    return "\n".join(lines)


README_SECTION = "## A fleet in five minutes"


def readme_fleet_blocks(readme: str) -> list[tuple[str, str]]:
    """The README's five-minute fleet: its ```sh and ```toml blocks, in order."""
    assert README_SECTION in readme, f"README.md: no {README_SECTION!r}"
    section = readme.split(README_SECTION, 1)[1].split("\n## ", 1)[0]
    return [(m.group(1), m.group(2))
            for m in re.finditer(r"^```(sh|toml)\n(.*?)^```", section, re.S | re.M)]


def test_the_readmes_fleet_brings_a_box_online_and_it_answers_a_signed_ping(
        walkthrough: Walkthrough) -> None:
    """The README's "A fleet in five minutes", run as written (ports excepted): a broker, a
    controller and store-001; `fleet devices` shows it online and `fleet send … ping` gets
    its answer."""
    run = walkthrough
    blocks = readme_fleet_blocks((ROOT / "README.md").read_text())
    text = "\n".join(body for _, body in blocks)
    for needle in ("1883", "9464", "11434", "edge-agent fleet broker-config", "fleet send"):
        assert needle in text, f"README's fleet: {needle!r} is gone; update this test"
    for needle in ("1883", "9464", "11434"):
        assert needle not in run.substitute(text), f"{needle!r} left after the substitutions"
    seen = set()
    for language, body in blocks:
        body = run.substitute(body)
        if language == "toml":
            _write_config(run, body, copy_root=False)
            continue
        for script, background in shell_steps(body):
            if background:
                run.start(script)
                continue
            out = run.run(script)
            if "fleet devices" in script:  # "# store-001 online"
                assert re.search(r"^store-001\s.*\bonline\b", out, re.M), out
                seen.add("devices")
            if "fleet send" in script:
                assert re.search(r"^store-001\s+ok\s", out, re.M), out
                seen.add("send")
    assert seen == {"devices", "send"} and set(run.boxes) == {"store-001"}
