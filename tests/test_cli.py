from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from edge_agent.cli import main
from tests.conftest import DEFAULT_MODEL, clone_state
from tests.ggufgen import write_tiny_gguf


def _commands(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for name, cmd in group.commands.items():
        out.append((*prefix, name))
        if isinstance(cmd, click.Group):
            out.extend(_commands(cmd, (*prefix, name)))
    return out


@pytest.mark.parametrize("path", _commands(main))
def test_every_command_has_help(path: tuple[str, ...]) -> None:
    result = CliRunner().invoke(main, [*path, "--help"])
    assert result.exit_code == 0
    cmd: click.Command = main
    for part in path:
        assert isinstance(cmd, click.Group)
        cmd = cmd.commands[part]
    assert cmd.help and cmd.help.strip(), f"{' '.join(path)} has no help text"


def test_models_list_json_shows_installed_and_available(model_cache: Path,
                                                        tmp_path: Path) -> None:
    state = clone_state(model_cache, tmp_path / "s")
    result = CliRunner().invoke(main, ["models", "list", "--json", "--state-dir", str(state)])
    assert result.exit_code == 0, result.output
    rows = {r["name"]: r for r in json.loads(result.output)}
    assert rows[DEFAULT_MODEL]["installed"] is True
    assert rows["gemma3:270m"]["installed"] is False


def test_import_verify_and_rm(tmp_path: Path) -> None:
    runner = CliRunner()
    state = str(tmp_path / "s")
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", context_length=128)
    result = runner.invoke(main, ["models", "import", str(tiny), "--name", "tiny:1",
                                  "--state-dir", state])
    assert result.exit_code == 0, result.output
    assert "context 128" in result.output
    assert runner.invoke(main, ["models", "verify", "--state-dir", state]).exit_code == 0
    show = runner.invoke(main, ["models", "show", "tiny:1", "--json", "--state-dir", state])
    assert json.loads(show.output)["architecture"] == "llama"
    blob = next((tmp_path / "s" / "blobs").glob("sha256-*"))
    blob.write_bytes(blob.read_bytes()[:-1] + b"x")
    verify = runner.invoke(main, ["models", "verify", "tiny:1", "--state-dir", state])
    assert verify.exit_code == 1 and "FAIL" in verify.output
    assert runner.invoke(main, ["models", "rm", "tiny:1", "--state-dir", state]).exit_code == 0
    missing = runner.invoke(main, ["models", "show", "tiny:1", "--state-dir", state])
    assert missing.exit_code == 1 and "not found" in missing.output


def test_import_of_a_non_gguf_file_fails_cleanly(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"\0" * 4096)
    result = CliRunner().invoke(main, ["models", "import", str(junk), "--name", "junk:1",
                                       "--state-dir", str(tmp_path / "s")])
    assert result.exit_code == 1
    assert "not a GGUF file" in result.output


def test_bad_config_exits_2_with_one_line_naming_the_key(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[runtime]\ncontext_length = 'big'\n")
    result = CliRunner().invoke(main, ["models", "list", "--config", str(cfg)])
    assert result.exit_code == 2
    assert "runtime.context_length" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_serve_refuses_a_public_address_without_keys(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["serve", "--host", "0.0.0.0", "--state-dir",
                                       str(tmp_path)])
    assert result.exit_code == 2
    assert "refusing to listen on 0.0.0.0" in result.output
