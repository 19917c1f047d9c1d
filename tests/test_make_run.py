"""`make run` and the README's other commands act on one box: the Makefile's own recipes
write `config.toml` and `env` into a state dir, a shell that sources `env` runs the README's
commands with no flags, and the server `make run` starts (its command line read from
`make -n run`) serves the key that shell created, for the tenant the file defines.

The Makefile is run with `VENV` pointing at this Python's environment, so that nothing is
installed; the state dir is pre-seeded with the default model (`clone_state`).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from edge_agent.cli.common import CONFIG_ENV
from edge_agent.config import load_settings
from tests.conftest import clone_state, free_port

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(sys.prefix)

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def make(state: Path, *targets: str, dry_run: bool = False) -> str:
    """`make` in the checkout, on `state` and this Python's venv."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    args = ["make", "-s", *(["-n"] if dry_run else []), f"STATE={state}", f"VENV={VENV}",
            *targets]
    return subprocess.run(args, cwd=ROOT, env=env, check=True, capture_output=True,
                          text=True).stdout


def in_env_shell(state: Path, command: str) -> subprocess.CompletedProcess[str]:
    """`command` in a shell that has sourced `STATE/env`, as the README says, from a folder
    that is not the checkout and with no config named beforehand."""
    env = {k: v for k, v in os.environ.items() if k != CONFIG_ENV}
    return subprocess.run(["bash", "-c", f". {shlex.quote(str(state / 'env'))} && {command}"],
                          cwd=state.parent, env=env, capture_output=True, text=True,
                          timeout=120)


def test_make_writes_one_config_that_the_cli_and_the_server_share(tmp_path: Path) -> None:
    state = tmp_path / "var"
    make(state, f"{state}/config.toml", f"{state}/env")
    config = state / "config.toml"
    settings = load_settings(config)
    assert settings.state_dir == state
    assert "app" in settings.tenants  # the README's `keys create --tenant app`

    shown = in_env_shell(state, f'command -v edge-agent; echo "${CONFIG_ENV}"')
    where, named = shown.stdout.split()
    assert Path(where) == VENV / "bin" / "edge-agent"
    assert Path(named) == config

    serve = [line for line in make(state, "run", dry_run=True).splitlines()
             if " serve " in line]
    assert serve == [f"{VENV}/bin/edge-agent serve --config {state}/config.toml"]

    config.write_text(config.read_text() + '\n[tenants.other]\nmodels = ["nothing:*"]\n')
    listed = in_env_shell(state, "edge-agent keys list --json")
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout) == []
    written = config.read_text()
    make(state, f"{state}/config.toml")  # written once: the reader's edits stay
    assert config.read_text() == written


@pytest.mark.integration
def test_a_key_the_cli_creates_works_against_the_server_make_run_starts(
        model_cache: Path, tmp_path: Path) -> None:
    state = clone_state(model_cache, tmp_path / "var")
    make(state, f"{state}/config.toml", f"{state}/env")
    created = in_env_shell(state, "edge-agent keys create --tenant app")
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()

    serve = next(line for line in make(state, "run", dry_run=True).splitlines()
                 if " serve " in line)
    port = free_port()
    server = subprocess.Popen([*shlex.split(serve), "--port", str(port)], cwd=tmp_path,
                              env={**os.environ, "EDGE_AGENT_RUNTIME__THREADS": "1"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.communicate()[1]
            try:
                if httpx.get(f"{base}/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.2)
        assert httpx.get(f"{base}/v1/models").status_code == 401
        models = httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert models.status_code == 200, models.text

        doctor = in_env_shell(state, f"edge-agent doctor --port {port} --json")
        checks = json.loads(doctor.stdout)
        assert doctor.returncode == 0, checks
    finally:
        server.terminate()
        server.wait(timeout=60)
