"""`edge-agent fleet keygen` and `edge-agent fleet release …`: the central team's keys and
its signed release repository (The Update Framework).

    fleet keygen [--out KEYS] [--root-keys 2 --root-threshold 2]   (KEYS: <state>/keys)
    fleet release init [--keys KEYS] [--expires timestamp=1d …]
    fleet release add FILE.gguf --name gemma3:270m --version 2 [--template F]
                      [--parameters F] [--gate F] [--min-agent-version X] [--tier T]
                      [--license L] [--stage experiment|internal|production]
                      [--eval-samples F.jsonl] [--eval-results F.json] [--build B]
                      [--route local|UPSTREAM] [--degradation D] [--rollback-target V]
                      [--review-by YYYY-MM-DD]
    fleet release push FILE.gguf --name N --version V --keys DESK_KEYS --root root.json
                      --controller https://HOST:PORT --token-file F [the options of add]
    fleet release add-agent VERSION --wheelhouse DIR [--build cpu|cpu:F,F|cuda:CC,CC]
                      [--gate F] [--controller URL --token-file F --keys DESK_KEYS
                      --root root.json]
    fleet release list|agents|show NAME@VERSION|status [--json]
    fleet release timestamp              the cron job (every few hours)
    fleet release root-sign --root-keys DIR   yearly, with the offline root keys

`push` runs at a desk that holds the targets key: it signs on top of the controller's
metadata verified from the release root, uploads through the API, and verifies the result
the same way (`releases.push`). The others run on the controller, on its state dir
(`--state-dir`, else the `state_dir` of the controller's `--config`, default
/var/lib/edge-agent-fleet); the keys are `<state>/keys/`
unless `--out`/`--keys` says otherwise, the repository is `<state>/releases/`, which `fleet serve`
(or any static server with Range) publishes. Thin: each command parses its arguments and
calls `fleet.controller.releases.repository` / `release_keys`; their errors are mapped by the root
group (a bad flag or missing key: exit 2; a missing release or a bad file: exit 1).
"""

from __future__ import annotations

import json
import re
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import tomllib
from tuf.api.exceptions import DownloadError, RepositoryError

from edge_agent.cli.common import BadUsage, CheckFailed, F
from edge_agent.cli.fleet.client import client_options, controller_client, remote
from edge_agent.cli.fleet.options import controller_settings, files_options, given_options
from edge_agent.cli.output import echo_json, json_option, progress, table

if TYPE_CHECKING:
    from tuf.api.metadata import Metadata, Targets

    from edge_agent.fleet.controller.releases.repository import ReleaseEntry, ReleaseRepository
    from edge_agent.fleet.controller.releases.signing_keys import KeyDir
    from edge_agent.fleet.protocol.agent_release import AgentManifest
    from edge_agent.fleet.protocol.manifest import ReleaseManifest

# `protocol.materials.STAGES`, spelt here so that `--help` needs no import of the fleet
# (tests/fleet/controller/test_stages.py holds the two together)
STAGE_CHOICES = ("experiment", "internal", "production")
_DURATION = re.compile(r"(\d+)([smhd]?)")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def _keys_option(fn: F) -> F:
    return click.option(
        "--keys", "keys_dir", type=click.Path(path_type=Path, file_okay=False),
        help="Key dir from `fleet keygen` (default: the one given at `release init`, "
             "at init STATE_DIR/keys, where keygen writes them).")(fn)


def _state_dir() -> Path:
    """The controller state dir a command works in (--state-dir, else the controller
    config's `state_dir`, else /var/lib/edge-agent-fleet): the first step of every command
    here."""
    return controller_settings().state_dir


def _repo() -> ReleaseRepository:
    from edge_agent.fleet.controller.releases.repository import ReleaseRepository, releases_dir

    return ReleaseRepository(releases_dir(_state_dir()))


def _keys(repo: ReleaseRepository, keys_dir: Path | None) -> KeyDir:
    from edge_agent.fleet.controller.releases.signing_keys import KeyDir

    return KeyDir(keys_dir) if keys_dir is not None else repo.default_keys()


@click.command("keygen")
@files_options
@click.option("--out", type=click.Path(path_type=Path, file_okay=False),
              help="Directory for the keys (default STATE_DIR/keys, where `release init` "
                   "looks; created 0700; existing keys are never replaced).")
@click.option("--root-keys", type=click.IntRange(1, 16), default=1, show_default=True,
              help="Release root keys to make (one per key holder).")
@click.option("--root-threshold", type=click.IntRange(1, 16), default=1, show_default=True,
              help="Root signatures a new root version needs.")
def keygen(out: Path | None, root_keys: int, root_threshold: int) -> None:
    """Make the controller's keys: command signing, and the release (TUF) role keys."""
    from edge_agent.fleet.controller.releases.signing_keys import keygen as make

    out = out if out is not None else _state_dir() / "keys"
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    made = make(out, root_keys=root_keys, root_threshold=root_threshold)
    for name, keyid in made.items():
        click.echo(f"{name:<12} {keyid}")
    click.echo(f"controller: command_signing_key_file = {out / 'command.pem'} (it never "
               "leaves the controller)", err=True)
    click.echo(f"devices: fleet.command_public_key_file = a copy of {out / 'command.pub.pem'}"
               "; next: edge-agent fleet release init" + _given_keys(out), err=True)
    click.echo(f"root keys ({root_threshold} of {root_keys} sign a root): {out / 'root'}; "
               "move them offline after `release init`", err=True)


def _given_keys(out: Path) -> str:
    """The words a follow-up command needs to find `out`: none where it is the default."""
    given = given_options()
    if out.absolute() != _state_dir() / "keys":
        given = f"{given} --keys {shlex.quote(str(out))}".strip()
    return f" {given}" if given else ""


@click.group()
def release() -> None:
    """Signed model releases (TUF): init the repository, add, list, show, re-sign."""


@release.command("init")
@files_options
@_keys_option
@click.option("--root-keys", "root_key_dir", type=click.Path(path_type=Path,
              file_okay=False), help="Root key dir (default KEYS/root).")
@click.option("--root-threshold", type=click.IntRange(1, 16),
              help="Root signatures required (default: as at keygen).")
@click.option("--expires", multiple=True, metavar="ROLE=DURATION",
              help="Expiry of a role's metadata, e.g. timestamp=1d, snapshot=30d, "
                   "targets=365d, root=365d (s, m, h, d). Repeatable.")
def release_init(keys_dir: Path | None, root_key_dir: Path | None,
                 root_threshold: int | None, expires: tuple[str, ...]) -> None:
    """Create the repository: root metadata signed by the root keys, empty targets."""
    from edge_agent.fleet.controller.releases.repository import ReleaseRepository, releases_dir
    from edge_agent.fleet.controller.releases.signing_keys import KeyDir

    state = _state_dir()
    keys = KeyDir(keys_dir if keys_dir is not None else state / "keys")
    repo = ReleaseRepository.create(releases_dir(state), keys,
                                    root_key_dir=root_key_dir, root_threshold=root_threshold,
                                    expiry_s=dict(_expiry(e) for e in expires))
    root = repo.metadata / "root.json"
    click.echo(f"release repository {repo.root} (root v1)")
    click.echo(f"devices: fleet.tuf_root_file = a copy of {root}; fleet.artifacts_url = "
               "http://<controller>:<port>/releases/", err=True)
    click.echo("the root keys are not needed again until the root is re-signed: keep them "
               "offline; schedule `edge-agent fleet release timestamp` (cron, every 6 h)",
               err=True)


def _manifest_options(fn: F) -> F:
    """A release's file and what is signed about it: `add` and `push` alike."""
    for option in reversed((
            click.argument("file", type=click.Path(path_type=Path, dir_okay=False,
                                                   exists=True)),
            click.option("--name", required=True,
                         help="Model name on the boxes, e.g. gemma3:270m."),
            click.option("--version", "version", required=True,
                         help="Release version, e.g. 2."),
            click.option("--template", type=click.Path(path_type=Path, dir_okay=False,
                                                       exists=True),
                         help="Chat template (Jinja) replacing the GGUF's own."),
            click.option("--parameters", type=click.Path(path_type=Path, dir_okay=False,
                                                         exists=True),
                         help="Default parameters, TOML or JSON (temperature, top_k, stop, …)."),
            click.option("--gate", type=click.Path(path_type=Path, dir_okay=False,
                                                   exists=True),
                         help="Health gate spec, TOML or JSON (golden prompts, tokens/s "
                              "floor, …)."),
            click.option("--min-agent-version",
                         help="Oldest agent that may install it (N.N.N)."),
            click.option("--tier", help="Tier recorded with the model (default experimental)."),
            click.option("--license", "license_", help="License recorded with the model "
                         "(an SPDX id, or the licence's name or URL)."),
            *_material_options())):
        fn = option(fn)
    return fn


def _material_options() -> tuple[Callable[[F], F], ...]:
    """The release's stage and materials (`protocol.materials`), signed in its manifest."""
    file = click.Path(path_type=Path, dir_okay=False, exists=True)
    return (
        click.option("--stage", type=click.Choice(STAGE_CHOICES),
                     help="Where it may go and what it must carry (default experiment); "
                          "production needs --license and every option below."),
        click.option("--eval-samples", type=file,
                     help="Evaluation samples, JSON Lines, each naming its `kind` (ollama, "
                          "openai, schema, tools, long_context): their sha256, count and "
                          "kinds are signed; the file goes nowhere."),
        click.option("--eval-results", type=file,
                     help="Evaluation results: a JSON or TOML table of metric = number "
                          "(signed as it is when small), or any file (its sha256)."),
        click.option("--build", help="The llama.cpp build and quantization it was measured "
                                     "on, e.g. 'llama.cpp b4500 Q4_K_M'."),
        click.option("--route", metavar="local|UPSTREAM",
                     help="Where it runs: local, or the name of an upstream."),
        click.option("--degradation", help="What a box falls back to when it cannot serve "
                                           "it, e.g. 'gemma3:270m@1' or 'upstream cloud'."),
        click.option("--rollback-target", metavar="VERSION",
                     help="A published version of the same name to go back to."),
        click.option("--review-by", metavar="YYYY-MM-DD",
                     help="When the release is to be reviewed again."))


def _manifest(file: Path, name: str, version: str, template: Path | None,
              parameters: Path | None, gate: Path | None, min_agent_version: str | None,
              tier: str | None, license_: str | None, staged: dict[str, Any]
              ) -> ReleaseManifest:
    """The manifest `_manifest_options` describe (`staged`: `_material_options`' values),
    with a warning for what boxes will miss."""
    from edge_agent.fleet.controller.releases.repository import manifest_for
    from edge_agent.fleet.protocol.manifest import ManifestError

    notes: list[str] = []
    stage, materials = _materials(**staged)
    try:
        manifest = manifest_for(
            file, name=name, version=version, notes=notes, license=license_, tier=tier,
            chat_template=template.read_text(encoding="utf-8") if template else None,
            parameters=_table(parameters, "--parameters"), gate=_table(gate, "--gate"),
            min_agent_version=min_agent_version, stage=stage, materials=materials)
    except ManifestError as exc:
        raise BadUsage(str(exc)) from None
    for note in notes:
        click.echo(f"warning: {note}", err=True)
    return manifest


def _materials(stage: str | None, eval_samples: Path | None, eval_results: Path | None,
               build: str | None, route: str | None, degradation: str | None,
               rollback_target: str | None, review_by: str | None
               ) -> tuple[str | None, dict[str, Any]]:
    """(stage, materials) from `_material_options`: the eval files hashed and summarised
    here (`releases.evaluation`), never sent anywhere."""
    from edge_agent.fleet.controller.releases.evaluation import (
        results_summary,
        samples_summary,
    )

    materials: dict[str, Any] = {
        "build": build, "route": route, "degradation": degradation,
        "rollback_target": rollback_target, "review_by": review_by}
    from edge_agent.errors import InvalidRequest

    try:
        if eval_samples is not None:
            materials["eval_samples"] = samples_summary(
                eval_samples.read_bytes(), source=f"--eval-samples {eval_samples}"
            ).model_dump()
        if eval_results is not None:
            materials["eval_results"] = results_summary(
                eval_results.read_bytes(), json_file=eval_results.suffix.lower() == ".json",
                source=f"--eval-results {eval_results}").model_dump()
    except InvalidRequest as exc:  # a file that does not read as it should: a bad argument
        raise BadUsage(exc.message) from None
    return stage, {k: v for k, v in materials.items() if v is not None}


@release.command("add")
@files_options
@_keys_option
@_manifest_options
@json_option()
def release_add(keys_dir: Path | None, file: Path, name: str, version: str,
                template: Path | None, parameters: Path | None, gate: Path | None,
                min_agent_version: str | None, tier: str | None, license_: str | None,
                as_json: bool, **staged: Any) -> None:
    """Publish a GGUF as NAME@VERSION: signed targets, snapshot and timestamp. A
    production release is refused without its materials (--license and the rest)."""
    repo = _repo()
    keys = _keys(repo, keys_dir)
    started = time.perf_counter()
    manifest = _manifest(file, name, version, template, parameters, gate, min_agent_version,
                         tier, license_, staged)
    entry = repo.add(file, manifest, keys, progress=None if as_json else progress("publishing"))
    if as_json:
        echo_json(entry.to_json())
        return
    m = entry.manifest
    click.echo(f"published {m.ref}: {entry.length / 1e6:.1f} MB, sha256 {entry.sha256[:12]}, "
               f"{m.architecture} {m.quantization}, context {m.context_length or '-'} "
               f"({time.perf_counter() - started:.2f} s)")
    click.echo(f"target {entry.target_path} -> {entry.blob}", err=True)


@release.command("add-agent")
@_keys_option
@client_options
@click.option("--root", "root_file",
              type=click.Path(path_type=Path, dir_okay=False, exists=True),
              help="With --controller: the release root (root.json) the boxes were given, "
                   "as for `release push`.")
@click.option("--expires", default="365d", show_default=True,
              help="With --controller: expiry of the targets this push signs.")
@click.argument("version")
@click.option("--wheelhouse", required=True, type=click.Path(path_type=Path),
              help="The wheelhouse the Ansible role installs from: edge-agent VERSION's "
                   "wheel, its llama-cpp-python build and every dependency.")
@click.option("--build", default="cpu", show_default=True,
              help="What the llama.cpp build needs of a box: cpu, cpu:FLAG[,FLAG] (CPU "
                   "flags, e.g. cpu:avx2,fma) or cuda:CC[,CC] (compute capabilities, e.g. "
                   "cuda:86,89).")
@click.option("--gate", type=click.Path(path_type=Path, dir_okay=False, exists=True),
              help="Health gate spec, TOML or JSON: golden prompts the box's default model "
                   "answers before and after the switch.")
@json_option()
def release_add_agent(keys_dir: Path | None, root_file: Path | None, expires: str,
                      version: str, wheelhouse: Path, build: str, gate: Path | None,
                      as_json: bool) -> None:
    """Publish a wheelhouse as agent release VERSION (edge-agent and its llama.cpp): on
    the controller host with its keys, or from a desk with --controller, --keys (the
    targets key) and --root, signed there as `release push` signs a model."""
    import tempfile

    from edge_agent.fleet.controller.releases.agent_build import manifest_for, pack

    pushed = remote()  # the settings first: a bad one is the first thing said
    if not wheelhouse.is_dir():
        raise BadUsage(f"--wheelhouse {wheelhouse}: not a folder")
    manifest = manifest_for(wheelhouse, version=version, build=build,
                            gate=_table(gate, "--gate"))
    if pushed:
        if keys_dir is None or root_file is None:
            raise BadUsage("add-agent with --controller signs at this desk: --keys (the "
                           "targets key) and --root (the release root) are needed")
        with tempfile.TemporaryDirectory(prefix="agent-release-") as tmp:
            tar = pack(wheelhouse, manifest, Path(tmp) / "wheelhouse.tar")
            _push(tar, manifest, keys_dir, root_file, expires, as_json)
        return
    repo = _repo()
    keys = _keys(repo, keys_dir)
    with tempfile.TemporaryDirectory(prefix="agent-release-") as tmp:
        tar = pack(wheelhouse, manifest, Path(tmp) / "wheelhouse.tar")
        entry = repo.add_agent(tar, manifest, keys,
                               progress=None if as_json else progress("publishing"))
    if as_json:
        echo_json(entry.to_json())
        return
    m = entry.manifest
    click.echo(f"published agent {m.version}: {len(m.wheels)} wheels, "
               f"{entry.length / 1e6:.1f} MB, sha256 {entry.sha256[:12]}, llama-cpp-python "
               f"{m.llama_cpp_python} {m.python}-{m.abi}-{m.platform} {m.build}")


@release.command("push")
@client_options
@_manifest_options
@click.option("--keys", "keys_dir", required=True, type=click.Path(path_type=Path),
              help="The desk's key dir holding targets.pem and targets.pub.pem.")
@click.option("--root", "root_file", required=True,
              type=click.Path(path_type=Path, dir_okay=False, exists=True),
              help="The release root (root.json) the boxes were given: what the "
                   "controller's metadata is verified against, before and after.")
@click.option("--expires", default="365d", show_default=True,
              help="Expiry of the targets this push signs (s, m, h, d).")
@json_option()
def release_push(file: Path, name: str, version: str, template: Path | None,
                 parameters: Path | None, gate: Path | None, min_agent_version: str | None,
                 tier: str | None, license_: str | None, keys_dir: Path, root_file: Path,
                 expires: str, as_json: bool, **staged: Any) -> None:
    """Publish a GGUF as NAME@VERSION from a desk: signed here with the targets key,
    uploaded through the controller's API, verified from the release root."""
    if not remote():
        raise BadUsage("release push publishes through a controller's API: --controller "
                       "https://HOST:PORT (on the controller host, with the targets key "
                       "there: fleet release add)")
    manifest = _manifest(file, name, version, template, parameters, gate, min_agent_version,
                         tier, license_, staged)
    _push(file, manifest, keys_dir, root_file, expires, as_json)


def _push(file: Path, manifest: ReleaseManifest | AgentManifest, keys_dir: Path,
          root_file: Path, expires: str, as_json: bool) -> None:
    """`file` as `manifest`'s release, signed here and published through the controller's
    API (`releases.push`): a model's or an agent's alike."""
    import tempfile

    from edge_agent.fleet.controller.releases.push import (
        file_target,
        next_targets,
        trusted_targets,
    )
    from edge_agent.fleet.controller.releases.readiness import refusal
    from edge_agent.fleet.controller.releases.signing_keys import KeyDir
    from edge_agent.fleet.protocol.manifest import ReleaseManifest

    expires_s = _duration(expires, "--expires")
    signer = KeyDir(keys_dir).signer("targets")
    root = root_file.read_bytes()
    started = time.perf_counter()
    entry = file_target(file, manifest)
    sha256 = entry.hashes["sha256"]
    with controller_client() as api, tempfile.TemporaryDirectory() as work:

        def verified(step: str) -> Metadata[Targets]:
            where = Path(work) / step
            where.mkdir()
            try:
                return trusted_targets(api.http, root, where)
            except (RepositoryError, DownloadError) as exc:
                raise CheckFailed(f"the controller's release metadata does not verify from "
                                  f"{root_file} ({step}): {type(exc).__name__}: {exc}") from None

        before = verified("before")
        if entry.path in before.signed.targets:
            raise CheckFailed(f"release {manifest.ref} exists: a release never changes: "
                              "publish a new version")
        unready = refusal(manifest, before.signed.targets) \
            if isinstance(manifest, ReleaseManifest) else None
        if unready is not None:  # the controller refuses it too: nothing goes up
            raise CheckFailed(unready)
        uploaded = api.put_file(f"/release-files/{sha256}", file)
        answer = api.post("/releases", {"targets": next_targets(
            before, entry, signer, expires_s=expires_s).to_dict()})
        after = verified("after")
    if after.signed.targets.get(entry.path) != entry:
        raise CheckFailed(f"the controller took {manifest.ref}, but its metadata verified "
                          f"from {root_file} does not list it as signed here")
    if as_json:
        echo_json({**answer, "uploaded": uploaded, "verified_targets_version":
                   after.signed.version})
        return
    click.echo(f"published {manifest.ref}: {entry.length / 1e6:.1f} MB, sha256 "
               f"{sha256[:12]}, targets v{after.signed.version}, verified from {root_file} "
               f"({time.perf_counter() - started:.2f} s)")


@release.command("list")
@files_options
@json_option()
def release_list(as_json: bool) -> None:
    """The releases the current signed targets list."""
    entries = _repo().releases()
    if as_json:
        echo_json([e.to_json() for e in entries])
        return
    table([("NAME", "<24"), ("VERSION", "<8"), ("SIZE", ">9"), ("ARCH", "<10"),
           ("QUANT", "<8"), ("CONTEXT", ">7"), ("TIER", "<12"), ("STAGE", "<10"),
           ("MIN AGENT", "<9"), ("SHA256", "")],
          ([e.manifest.name, e.manifest.version, f"{e.length / 1e6:.0f}MB",
            e.manifest.architecture, e.manifest.quantization,
            e.manifest.context_length or "-", e.manifest.tier, e.manifest.stage,
            e.manifest.min_agent_version or "-", e.sha256[:12]] for e in entries))


@release.command("agents")
@files_options
@json_option()
def release_agents(as_json: bool) -> None:
    """The agent releases the current signed targets list."""
    entries = _repo().agents()
    if as_json:
        echo_json([e.to_json() for e in entries])
        return
    table([("VERSION", "<12"), ("LLAMA-CPP", "<10"), ("BUILT FOR", "<28"), ("BUILD", "<14"),
           ("SIZE", ">9"), ("SHA256", "")],
          ([e.manifest.version, e.manifest.llama_cpp_python,
            f"{e.manifest.python}-{e.manifest.abi}-{e.manifest.platform}", e.manifest.build,
            f"{e.length / 1e6:.0f}MB", e.sha256[:12]] for e in entries))


@release.command("show")
@files_options
@click.argument("ref", metavar="NAME@VERSION")
@json_option()
def release_show(ref: str, as_json: bool) -> None:
    """One release: its file, length, sha256 and the signed manifest."""
    from edge_agent.fleet.protocol.manifest import ManifestError, parse_ref

    repo = _repo()
    try:
        name, version = parse_ref(ref)
    except ManifestError as exc:
        raise BadUsage(str(exc)) from None
    entry = repo.get(name, version)
    if as_json:
        echo_json(entry.to_json())
        return
    _show(entry)


@release.command("status")
@files_options
@json_option()
def release_status(as_json: bool) -> None:
    """Each role's metadata version and expiry (a device refuses expired metadata)."""
    status = _repo().status()
    if as_json:
        echo_json(status)
        return
    table([("ROLE", "<10"), ("VERSION", ">7"), ("EXPIRES", "<26"), ("LEFT", "")],
          ([role, s["version"], s["expires"], _left(s["expires_in_s"])]
           for role, s in status.items()))


@release.command("timestamp")
@files_options
@_keys_option
@click.option("--force", type=click.Choice(["snapshot", "targets"]), multiple=True,
              help="Re-sign this role too, whatever its expiry.")
def release_timestamp(keys_dir: Path | None, force: tuple[str, ...]) -> None:
    """Re-sign the timestamp (the cron job); snapshot and targets too when near expiry."""
    repo = _repo()
    signed = repo.refresh(_keys(repo, keys_dir), force=force)
    status = repo.status()
    click.echo(f"re-signed {', '.join(signed)}; timestamp v{status['timestamp']['version']} "
               f"expires {status['timestamp']['expires']}")
    root_left = status["root"]["expires_in_s"]
    if root_left < 30 * 86400:
        click.echo(f"warning: root metadata expires in {_left(root_left)}; re-sign it with "
                   "the offline root keys (edge-agent fleet release root-sign)", err=True)


@release.command("root-sign")
@files_options
@click.option("--root-keys", "root_key_dirs", multiple=True, required=True,
              type=click.Path(path_type=Path),
              help="A dir holding root private keys (repeat for each holder's copy).")
def release_root_sign(root_key_dirs: tuple[Path, ...]) -> None:
    """Re-sign the root metadata with the offline root keys (same keys, new expiry)."""
    repo = _repo()
    version = repo.resign_root(list(root_key_dirs))
    click.echo(f"root v{version} published, expires {repo.status()['root']['expires']}")


def _show(entry: ReleaseEntry) -> None:
    m = entry.manifest
    rows: list[tuple[str, Any]] = [
        ("release", m.ref), ("target", entry.target_path), ("blob", entry.blob),
        ("length", entry.length), ("sha256", entry.sha256),
        ("architecture", m.architecture), ("quantization", m.quantization),
        ("context", m.context_length or "-"), ("parameter size", m.parameter_size or "-"),
        ("license", m.license or "-"), ("tier", m.tier), ("stage", m.stage),
        ("min agent", m.min_agent_version or "-"),
        ("created", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created_at))),
        ("parameters", json.dumps(m.parameters) if m.parameters else "-"),
        ("gate", json.dumps(m.gate) if m.gate else "-"),
        ("template", "(the GGUF's own)" if m.chat_template is None else
         f"{len(m.chat_template)} characters, replaces the GGUF's"),
    ]
    rows += _material_rows(m)
    for key, value in rows:
        click.echo(f"{key:<15} {value}")


def _material_rows(m: ReleaseManifest) -> list[tuple[str, Any]]:
    """`release show`'s lines for the materials (`-` for one not given)."""
    x = m.materials
    samples = x.eval_samples
    results = x.eval_results
    return [
        ("eval samples", "-" if samples is None else
         f"{samples.count} ({', '.join(samples.kinds)}), sha256 {samples.sha256[:12]}"),
        ("eval results", "-" if results is None else
         ", ".join([*(f"{k}={v}" for k, v in results.metrics.items()),
                    f"sha256 {results.sha256[:12]}"])),
        ("build", x.build or "-"), ("route", x.route or "-"),
        ("degradation", x.degradation or "-"), ("rollback to", x.rollback_target or "-"),
        ("review by", x.review_by or "-")]


def _table(path: Path | None, flag: str) -> dict[str, Any] | None:
    """A TOML or JSON file's top-level table (JSON by its .json suffix)."""
    if path is None:
        return None
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
        else:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:  # JSON and TOML errors are ValueErrors
        raise BadUsage(f"{flag} {path}: {exc}") from None
    if not isinstance(data, dict):
        raise BadUsage(f"{flag} {path}: not a table (an object of keys and values)")
    return data


def _expiry(text: str) -> tuple[str, int]:
    role, sep, value = text.partition("=")
    m = _DURATION.fullmatch(value.strip())
    if not sep or m is None or int(m[1]) == 0:
        raise BadUsage(f"--expires {text!r}: ROLE=DURATION, e.g. timestamp=1d or "
                       "snapshot=720h")
    return role.strip(), int(m[1]) * _UNITS[m[2]]


def _duration(text: str, flag: str) -> int:
    m = _DURATION.fullmatch(text.strip())
    if m is None or int(m[1]) == 0:
        raise BadUsage(f"{flag} {text!r}: a duration, e.g. 365d or 720h")
    return int(m[1]) * _UNITS[m[2]]


def _left(seconds: int) -> str:
    if seconds < 0:
        return f"EXPIRED {(-seconds) // 3600}h ago"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"
