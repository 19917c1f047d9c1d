"""The CLI maps errors in one place, the root group: whatever a command lets through comes
out as one line, `edge-agent: <message>`, with the project's exit code (1 a check failed,
2 usage or configuration error), for every command there is and every one added later."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
import tomllib
from click.testing import CliRunner

from edge_agent.cli import EdgeAgentGroup, common, main
from edge_agent.config import ConfigError
from edge_agent.config import controller as controller_settings
from edge_agent.errors import EdgeAgentError, ModelFileError
from edge_agent.netaddr import is_loopback

ROOT = Path(__file__).resolve().parents[1]


def _walk(group: click.Group, prefix: tuple[str, ...] = ()
          ) -> list[tuple[tuple[str, ...], click.Command]]:
    out: list[tuple[tuple[str, ...], click.Command]] = []
    for name, cmd in group.commands.items():
        out.append(((*prefix, name), cmd))
        if isinstance(cmd, click.Group):
            out.extend(_walk(cmd, (*prefix, name)))
    return out


COMMANDS = _walk(main)
LEAVES = [(path, cmd) for path, cmd in COMMANDS if not isinstance(cmd, click.Group)]
# Commands that read no settings (their own input errors are tested beside them).
NO_SETTINGS = {("fleet", "broker-config"), ("bench", "fleet-scale"),  # no settings read
               ("bench", "agent-rollout"), ("bench", "fleet-slo"),
               ("fleet", "pki", "init"), ("fleet", "pki", "issue"), ("fleet", "pki", "list"),
               ("fleet", "pki", "renew"),  # files only, in --dir
               # what the package ships, printed
               ("fleet", "observability", "rules"), ("fleet", "observability", "dashboard")}


def _required_args(cmd: click.Command, tmp_path: Path) -> list[str]:
    """Values for a command's required arguments and options, so that it gets as far as
    loading its settings."""
    args: list[str] = []
    for param in cmd.params:
        if not param.required:
            continue
        value = "x:1"
        if isinstance(param.type, click.Choice):  # a choice click checks before the command
            value = str(param.type.choices[0])
        if isinstance(param.type, click.Path):
            value = str(tmp_path / "some.gguf")
            Path(value).write_bytes(b"GGUF")
        if isinstance(param, click.Option):
            args += [param.opts[0], value]
        else:
            args.append(value)
    return args


@pytest.mark.parametrize(("error", "code", "message"), [
    (EdgeAgentError("the store is broken"), 1, "the store is broken"),
    (ModelFileError("m:1: not a GGUF file"), 1, "m:1: not a GGUF file"),
    (ConfigError("invalid setting runtime.threads: too many"), 2,
     "invalid setting runtime.threads: too many"),
    (PermissionError(13, "Permission denied", "/var/lib/edge-agent"), 1,
     "[Errno 13] Permission denied: '/var/lib/edge-agent'"),
], ids=["EdgeAgentError", "ModelFileError", "ConfigError", "OSError"])
@pytest.mark.parametrize("path", [path for path, _ in LEAVES if path not in NO_SETTINGS],
                         ids=" ".join)
def test_an_error_in_any_command_is_one_line_and_an_exit_code(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, path: tuple[str, ...],
        error: Exception, code: int, message: str) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(common, "load_settings", fail)
    # The fleet controller's commands have settings of their own (file and state dir).
    monkeypatch.setattr(controller_settings, "load_controller_settings", fail)
    cmd = dict(LEAVES)[path]
    result = CliRunner().invoke(main, [*path, *_required_args(cmd, tmp_path),
                                       "--state-dir", str(tmp_path / "s")])
    assert result.exit_code == code, result.output
    assert result.output == f"edge-agent: {message}\n"
    assert isinstance(result.exception, SystemExit)


def test_the_mapping_is_the_root_groups_alone() -> None:
    assert isinstance(main, EdgeAgentGroup)
    below = [" ".join(path) for path, cmd in COMMANDS if isinstance(cmd, EdgeAgentGroup)]
    assert below == []


def test_a_bug_is_not_dressed_as_a_failed_check(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    def bug(*args: object, **kwargs: object) -> None:
        raise KeyError("oops")

    monkeypatch.setattr(common, "load_settings", bug)
    result = CliRunner().invoke(main, ["models", "list", "--state-dir", str(tmp_path)])
    assert isinstance(result.exception, KeyError)


def test_a_store_error_deep_in_a_command_exits_1(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["models", "rm", "nope:1", "--state-dir",
                                       str(tmp_path)])
    assert result.exit_code == 1
    assert result.output.startswith("edge-agent: ") and "nope:1" in result.output
    assert len(result.output.splitlines()) == 1


@pytest.mark.parametrize(("args", "message"), [
    (["bench", "--no-peers", "--concurrency", "1,four"],
     "--concurrency takes numbers like 1,4,8"),
    (["ledger", "stats", "--since", "soon"], "'soon' is not a duration like 30m, 1h or 7d"),
    (["ledger", "export", "--since", "1y"], "'1y' is not a duration like 30m, 1h or 7d"),
    (["keys", "create", "--tenant", "nobody"],
     "tenant 'nobody' is not in the configuration (tenants: none)"),
])
def test_bad_usage_exits_2_with_one_line(tmp_path: Path, args: list[str],
                                         message: str) -> None:
    result = CliRunner().invoke(main, [*args, "--state-dir", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert result.output == f"edge-agent: {message}\n"


def test_a_missing_ledger_is_a_failed_check_and_is_not_created(tmp_path: Path) -> None:
    for args in (["purge"], ["tail"], ["stats"], ["export"]):
        result = CliRunner().invoke(main, ["ledger", *args, "--state-dir", str(tmp_path)])
        assert result.exit_code == 1
        assert result.output == (f"edge-agent: no ledger at {tmp_path / 'ledger.db'} "
                                 "(the server creates it at start)\n")
    assert not (tmp_path / "ledger.db").exists()


def test_keys_revoke_of_an_unknown_prefix_exits_1(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["keys", "revoke", "abcd", "--state-dir",
                                       str(tmp_path)])
    assert result.exit_code == 1
    assert result.output == "edge-agent: no active key with prefix abcd\n"


@pytest.mark.parametrize("path", [path for path, _ in COMMANDS], ids=" ".join)
def test_every_command_and_option_has_help(path: tuple[str, ...]) -> None:
    result = CliRunner().invoke(main, [*path, "--help"])
    assert result.exit_code == 0
    cmd = dict(COMMANDS)[path]
    assert cmd.help and cmd.help.strip(), f"{' '.join(path)} has no help text"
    for param in cmd.params:
        if isinstance(param, click.Option):
            assert param.help, f"{' '.join(path)} {param.opts[0]} has no help text"


def test_the_entry_point_is_the_root_group() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, attr = scripts["edge-agent"].partition(":")
    assert module == "edge_agent.cli" and attr == "main"
    assert CliRunner().invoke(main, ["--version"]).output.startswith("edge-agent, version ")


@pytest.mark.parametrize(("host", "loopback"), [
    ("localhost", True), ("LOCALHOST", True), ("127.0.0.1", True), ("127.9.8.7", True),
    ("::1", True), ("::ffff:127.0.0.1", True),
    ("0.0.0.0", False), ("::", False), ("10.0.0.1", False), ("::ffff:10.0.0.1", False),
    ("", False), ("example.com", False), ("localhost.example.com", False),
])
def test_one_loopback_rule_for_serve_and_metrics(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
