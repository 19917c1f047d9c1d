"""`edge-agent models activate|rollback|history` and versions from the CLI, over ModelOps."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from edge_agent.cli import main
from edge_agent.engine.models.catalog import packaged_catalog_dir, read_catalog
from edge_agent.names import ModelName
from tests.ggufgen import write_tiny_gguf


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def _two_versions(tmp_path: Path) -> tuple[str, str, str]:
    """A state dir where tiny:1 has two versions (the second active); their digests."""
    state = str(tmp_path / "s")
    digests = []
    for ctx in (128, 256):
        path = write_tiny_gguf(tmp_path / f"tiny{ctx}.gguf", context_length=ctx)
        code, out = _run("models", "import", str(path), "--name", "tiny:1", "--state-dir", state)
        assert code == 0, out
        shown = _run("models", "show", "tiny:1", "--json", "--state-dir", state)[1]
        digests.append(json.loads(shown)["digest"])
    assert digests[0] != digests[1]
    return state, digests[0], digests[1]


def _active(state: str) -> str:
    return str(json.loads(_run("models", "show", "tiny:1", "--json", "--state-dir", state)[1])
               ["digest"])


def test_a_second_import_becomes_the_active_version(tmp_path: Path) -> None:
    state, first, second = _two_versions(tmp_path)
    assert _active(state) == second
    code, out = _run("models", "history", "tiny:1", "--json", "--state-dir", state)
    assert code == 0, out
    data = json.loads(out)
    assert [(v["digest"], v["active"]) for v in data["versions"]] == [
        (second, True), (first, False)]
    newest = data["history"][0]
    assert newest["action"] == "activate" and newest["digest"] == second
    assert newest["previous"] == first and newest["by"].startswith("cli")


def test_activate_by_prefix_then_rollback(tmp_path: Path) -> None:
    state, first, second = _two_versions(tmp_path)
    code, out = _run("models", "activate", "tiny:1", first[:12], "--state-dir", state)
    assert code == 0, out
    assert f"now serves sha256:{first[:12]}" in out and second[:12] in out
    assert _active(state) == first
    code, out = _run("models", "rollback", "tiny:1", "--state-dir", state)
    assert code == 0, out
    assert _active(state) == second
    code, out = _run("models", "history", "tiny:1", "--state-dir", state)
    assert code == 0 and "rollback" in out and "activate" in out and "install" in out


def test_unknown_digest_short_prefix_and_nothing_to_roll_back_to(tmp_path: Path) -> None:
    state, first, _ = _two_versions(tmp_path)
    code, out = _run("models", "activate", "tiny:1", "0" * 64, "--state-dir", state)
    assert code == 1 and "no installed version" in out and first[:12] in out
    code, out = _run("models", "activate", "tiny:1", first[:6], "--state-dir", state)
    assert code == 1 and "12" in out
    code, out = _run("models", "rm", "tiny:1", "--digest", first[:12], "--state-dir", state)
    assert code == 0 and f"@{first[:12]}" in out
    code, out = _run("models", "rollback", "tiny:1", "--state-dir", state)
    assert code == 1 and "edge-agent:" in out


def test_a_staged_import_does_not_switch(tmp_path: Path) -> None:
    state, first, second = _two_versions(tmp_path)
    third = write_tiny_gguf(tmp_path / "t3.gguf", context_length=512)
    code, out = _run("models", "import", str(third), "--name", "tiny:1", "--no-activate",
                     "--state-dir", state)
    assert code == 0 and "not active" in out
    assert _active(state) == second
    code, out = _run("models", "verify", "--state-dir", state)
    assert code == 0 and out.count("ok ") == 3


def test_show_prints_the_template_and_parameters_for_a_release(tmp_path: Path) -> None:
    """`models show NAME --template` / `--parameters`: what `fleet release add --template
    --parameters` takes, as Ollama's `show --template` / `--parameters` print them."""
    state = str(tmp_path / "s")
    template = "{% for m in messages %}<turn>{{ m['content'] }}</turn>\n{% endfor %}"
    path = write_tiny_gguf(tmp_path / "t.gguf", template=template)
    assert _run("models", "import", str(path), "--name", "tiny:1", "--state-dir", state)[0] == 0
    code, out = _run("models", "show", "tiny:1", "--template", "--state-dir", state)
    assert code == 0 and out == template + "\n"
    code, out = _run("models", "show", "tiny:1", "--parameters", "--state-dir", state)
    assert code == 0 and isinstance(json.loads(out), dict)
    assert _run("models", "show", "tiny:1", "--template", "--parameters", "--state-dir",
                state)[0] == 2
    bare = write_tiny_gguf(tmp_path / "b.gguf")
    assert _run("models", "import", str(bare), "--name", "bare:1", "--state-dir", state)[0] == 0
    code, out = _run("models", "show", "bare:1", "--template", "--state-dir", state)
    assert code == 1 and "has no chat template" in out


def test_show_prints_the_catalogs_template_and_parameters_where_not_installed(
        tmp_path: Path) -> None:
    """A desk publishing a catalog model's release installs no model: `--template` and
    `--parameters` print the catalog's entry; the whole manifest stays the installed one's."""
    state = str(tmp_path / "empty")
    entry = read_catalog(packaged_catalog_dir())[ModelName.parse("gemma3:270m")]
    code, out = _run("models", "show", "gemma3:270m", "--template", "--state-dir", state)
    assert code == 0 and out == entry.chat_template  # the exact text, for --template
    code, out = _run("models", "show", "gemma3:270m", "--parameters", "--state-dir", state)
    assert code == 0 and json.loads(out) == entry.parameters
    code, out = _run("models", "show", "gemma3:270m", "--state-dir", state)
    assert code == 1 and "not found" in out
    code, out = _run("models", "show", "nosuch:1b", "--template", "--state-dir", state)
    assert code == 1 and "not found" in out
    # A catalog model whose GGUF carries its template: its release needs none, and says so.
    code, out = _run("models", "show", "smollm2:135m", "--template", "--state-dir", state)
    assert code == 1 and "its GGUF carries its own" in out, out
