"""Signed releases: the controller's repository through the CLI (keygen, init, add, list,
show, timestamp), the manifest's float encoding, and the device's TUF client against the
artifacts router in a live server — including what it refuses before anything is
installed: a tampered blob, a tampered target entry, replayed metadata, expired metadata."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from tuf.api.metadata import Metadata, Targets

from edge_agent.cli import main
from edge_agent.engine.modelops import ModelOps
from edge_agent.engine.models.catalog import ModelStore
from edge_agent.errors import ModelNotFound
from edge_agent.fleet.device.release import source as rel
from edge_agent.fleet.device.release import transfer
from edge_agent.fleet.device.release.source import (
    ReleaseFailed,
    ReleaseRejected,
    ReleaseSource,
    install,
)
from edge_agent.fleet.protocol.manifest import (
    ManifestError,
    ReleaseManifest,
    agent_too_old,
    parse,
    parse_ref,
    target_path,
)
from tests.ggufgen import write_tiny_gguf
from tests.support.releasekit import ArtifactServer, Repo, device_settings, make_repo, mirror

# -- manifest ---------------------------------------------------------------------------


def test_target_paths_are_one_to_one_and_plain() -> None:
    assert target_path("gemma3:270m", "2") == "gemma3/270m/2/model.gguf"
    assert target_path("gemma3", "2") == "gemma3/latest/2/model.gguf"
    assert target_path("hf.co/org/m:q4", "1.0") == "hf.co/org/m/q4/1.0/model.gguf"
    assert rel.name_of(target_path("hf.co/org/m:q4", "1.0")) == "hf.co/org/m:q4"
    assert parse_ref("gemma3:270m@2") == ("gemma3:270m", "2")
    for bad in ("gemma3:270m", "@2", "x@../1", "a b@1"):
        with pytest.raises(ManifestError):
            parse_ref(bad)


def test_floats_travel_as_text_and_come_back_exactly() -> None:
    m = parse({"name": "m:1", "version": "1", "architecture": "llama",
               "parameters": {"temperature": 0.7, "top_p": 1e-05, "top_k": 40,
                              "stop": ["0.7", "</s>"]},
               "gate": {"tps_floor_ratio": 0.8, "golden": [{"prompt": "2+2=", "n": 3,
                                                           "score": 0.25}]}})
    custom = m.to_custom()
    assert custom["parameters"]["temperature"] == "0.7"
    assert custom["parameters"]["stop"] == ["0.7", "</s>"]  # text stays text
    assert ["gate", "golden", 0, "score"] in custom["floats"]
    assert not any(isinstance(v, float) for v in _leaves(custom))
    back = ReleaseManifest.from_custom(json.loads(json.dumps(custom)))
    assert back == m and back.parameters["top_p"] == 1e-05
    assert back.gate["golden"][0] == {"prompt": "2+2=", "n": 3, "score": 0.25}
    with pytest.raises(ManifestError, match="not there"):
        ReleaseManifest.from_custom({**custom, "floats": [["parameters", "nope"]]})
    with pytest.raises(ManifestError, match="finite"):
        parse({**m.model_dump(), "gate": {"x": float("nan")}}).to_custom()
    with pytest.raises(ManifestError, match="unknown parameter"):
        parse({**m.model_dump(), "parameters": {"temprature": 1}})
    with pytest.raises(ManifestError, match="newer"):
        ReleaseManifest.from_custom({**custom, "format": 99})


def test_agent_versions_compare_numerically() -> None:
    assert agent_too_old("0.14.0", "0.2.0")
    assert not agent_too_old("0.1", "0.1.0")
    assert not agent_too_old("0.1.0", "0.10.0.dev1")
    assert not agent_too_old(None, "0.0.1")


def _leaves(value: object) -> Iterator[object]:
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, list):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


# -- the CLI ----------------------------------------------------------------------------


def test_keygen_init_add_list_show_timestamp(tmp_path: Path) -> None:
    runner = CliRunner()
    keys, state = tmp_path / "keys", tmp_path / "state"

    def run(*args: str, code: int = 0) -> str:
        result = runner.invoke(main, ["fleet", *args])
        assert result.exit_code == code, result.output
        return result.output

    run("keygen", "--out", str(keys), "--root-keys", "2", "--root-threshold", "2")
    for name in ("command", "targets", "snapshot", "timestamp", "root/root1", "root/root2"):
        private = keys / f"{name}.pem"
        assert stat.S_IMODE(private.stat().st_mode) == 0o600, name
        assert (keys / f"{name}.pub.pem").exists()
    run("keygen", "--out", str(keys), code=2)  # never replaces a key
    run("release", "init", "--state-dir", str(state), "--keys", str(keys),
        "--expires", "timestamp=6h")
    root = json.loads((state / "releases" / "metadata" / "root.json").read_text())
    assert root["signed"]["roles"]["root"]["threshold"] == 2
    assert len(root["signatures"]) == 2
    run("release", "init", "--state-dir", str(state), "--keys", str(keys), code=2)

    # Adding needs only the online keys: the root keys go offline.
    os.rename(keys / "root", tmp_path / "usb")
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", context_length=512,
                           template="{{ messages }}")
    (tmp_path / "params.toml").write_text('temperature = 0.7\ntop_k = 40\nstop = ["<e>"]\n')
    (tmp_path / "gate.json").write_text(json.dumps(
        {"tps_floor_ratio": 0.8, "golden": [{"prompt": "2+2=", "contains": "4"}]}))
    (tmp_path / "tmpl.jinja").write_text("{% for m in messages %}é {{ m.content }}\n"
                                         "{% endfor %} 🙂")
    out = run("release", "add", str(tiny), "--name", "tiny:1b", "--version", "2",
              "--state-dir", str(state), "--parameters", str(tmp_path / "params.toml"),
              "--gate", str(tmp_path / "gate.json"), "--template", str(tmp_path / "tmpl.jinja"),
              "--min-agent-version", "0.1.0", "--tier", "production", "--license", "MIT",
              "--json")
    added = json.loads(out)  # no warning: the template was given
    assert added["target"] == "tiny/1b/2/model.gguf"
    assert added["manifest"]["context_length"] == 512
    assert added["manifest"]["parameters"] == {"temperature": 0.7, "top_k": 40,
                                               "stop": ["<e>"]}
    assert Path(added["blob"]).name == f"{added['sha256']}.model.gguf"
    run("release", "add", str(tiny), "--name", "tiny:1b", "--version", "2",
        "--state-dir", str(state), code=1)  # immutable
    run("release", "add", str(tiny), "--name", "bad name", "--version", "2",
        "--state-dir", str(state), code=2)
    (tmp_path / "bad.toml").write_text("temperature = ")
    run("release", "add", str(tiny), "--name", "tiny:1b", "--version", "3", "--state-dir",
        str(state), "--parameters", str(tmp_path / "bad.toml"), code=2)
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"GGUF" + os.urandom(100))
    run("release", "add", str(not_gguf), "--name", "tiny:1b", "--version", "3",
        "--state-dir", str(state), code=1)

    listed = json.loads(run("release", "list", "--state-dir", str(state), "--json"))
    assert [(e["name"], e["version"]) for e in listed] == [("tiny:1b", "2")]
    assert "tiny:1b" in run("release", "list", "--state-dir", str(state))
    shown = json.loads(run("release", "show", "tiny:1b@2", "--state-dir", str(state),
                           "--json"))
    assert shown["manifest"]["chat_template"].endswith("🙂")
    assert shown["manifest"]["gate"]["tps_floor_ratio"] == 0.8
    assert "production" in run("release", "show", "tiny:1b@2", "--state-dir", str(state))
    run("release", "show", "tiny:1b@9", "--state-dir", str(state), code=1)

    before = json.loads(run("release", "status", "--state-dir", str(state), "--json"))
    assert "re-signed timestamp" in run("release", "timestamp", "--state-dir", str(state))
    after = json.loads(run("release", "status", "--state-dir", str(state), "--json"))
    assert after["timestamp"]["version"] == before["timestamp"]["version"] + 1
    assert after["targets"]["version"] == before["targets"]["version"]
    assert 5 * 3600 < after["timestamp"]["expires_in_s"] <= 6 * 3600
    run("release", "timestamp", "--state-dir", str(state), "--force", "snapshot")
    assert json.loads(run("release", "status", "--state-dir", str(state), "--json"))[
        "snapshot"]["version"] == before["snapshot"]["version"] + 1

    # The yearly root re-sign: both holders' keys, or nothing.
    (tmp_path / "usb2").mkdir()
    for f in ("root1.pem", "root1.pub.pem"):
        os.rename(tmp_path / "usb" / f, tmp_path / "usb2" / f)
    assert "1 of them" in run("release", "root-sign", "--state-dir", str(state),
                              "--root-keys", str(tmp_path / "usb2"), code=2)
    assert "root v2 published" in run("release", "root-sign", "--state-dir", str(state),
                                      "--root-keys", str(tmp_path / "usb"),
                                      "--root-keys", str(tmp_path / "usb2"))
    root2 = json.loads((state / "releases" / "metadata" / "2.root.json").read_text())
    assert len(root2["signatures"]) == 2 and root2["signed"]["version"] == 2


def test_keygen_and_release_share_one_key_dir_found_through_the_config(tmp_path: Path) -> None:
    """`--config` on keygen and every release command: the state dir comes from the
    controller's file, and keygen writes the keys where init (and so add) finds them."""
    config = tmp_path / "controller.toml"
    state = tmp_path / "state"
    config.write_text(f'state_dir = "{state}"\n'
                      f'command_signing_key_file = "{state / "keys" / "command.pem"}"\n')
    runner = CliRunner()

    def run(*args: str) -> str:
        result = runner.invoke(main, ["fleet", *args, "--config", str(config)])
        assert result.exit_code == 0, result.output
        return result.output

    said = run("keygen")
    assert f"command_signing_key_file = {state / 'keys' / 'command.pem'}" in said
    assert "next: edge-agent fleet release init --config" in said
    run("release", "init")
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", context_length=512, template="{{ x }}")
    run("release", "add", str(tiny), "--name", "tiny:1b", "--version", "2")
    assert "tiny:1b" in run("release", "list")
    assert "re-signed timestamp" in run("release", "timestamp")
    assert "targets" in run("release", "status")
    assert "tiny:1b@2" in run("release", "show", "tiny:1b@2")
    assert (state / "keys" / "command.pub.pem").exists()
    assert (state / "releases" / "metadata" / "root.json").exists()


def test_every_fleet_command_takes_the_controllers_config() -> None:
    def leaves(group: click.Group, path: tuple[str, ...]) -> list[tuple[str, ...]]:
        out: list[tuple[str, ...]] = []
        for name, cmd in group.commands.items():
            if isinstance(cmd, click.Group):
                out += leaves(cmd, (*path, name))
            else:
                out.append((*path, name))
        return out

    fleet = main.commands["fleet"]
    assert isinstance(fleet, click.Group)
    missing = []
    for path in leaves(fleet, ()):
        cmd: click.Command = fleet
        for part in path:
            assert isinstance(cmd, click.Group)
            cmd = cmd.commands[part]
        if "--config" not in {o for p in cmd.params for o in p.opts}:
            missing.append(" ".join(path))
    # Files only, read no controller: a broker's (broker-config), the fleet CA's (pki) and
    # what the package ships for Prometheus and Grafana (observability).
    assert sorted(missing) == sorted(["pki init", "pki issue", "pki list", "pki renew",
                                      "broker-config", "observability rules",
                                      "observability dashboard"])


def test_commands_say_what_is_missing(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["fleet", "release", "list", "--state-dir",
                                  str(tmp_path / "none")])
    assert result.exit_code == 2 and "release init" in result.output
    result = runner.invoke(main, ["fleet", "release", "init", "--state-dir",
                                  str(tmp_path / "s"), "--keys", str(tmp_path / "nokeys")])
    assert result.exit_code == 2 and "root" in result.output


# -- the device -------------------------------------------------------------------------


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[Repo, ArtifactServer, Path]]:
    """A repository with one release, served from a mirror of it; a device state dir."""
    repo = make_repo(tmp_path / "ctl")
    repo.add(write_tiny_gguf(tmp_path / "v1.gguf", context_length=300), "tiny:1", "1",
             parameters={"temperature": 0.6})
    served = mirror(repo.repo.root, tmp_path / "served")
    server = ArtifactServer(served).start()
    yield repo, server, tmp_path / "device"
    server.stop()


def _source(server: ArtifactServer, repo: Repo, device: Path, **kw: object) -> ReleaseSource:
    settings = device_settings(device, repo.root_file, server.url)
    return ReleaseSource(settings.fleet, device, **kw)  # type: ignore[arg-type]


def _pipeline(source: ReleaseSource, device: Path, name: str, version: str) -> None:
    """What a rollout does: lookup, download, install (inactive)."""
    release = source.lookup(name, version)
    path = transfer.download(release, transfer.downloads_dir(device),
                             retry=transfer.Retry(attempts=1, base_s=0.01))
    install(release, path, ModelOps(ModelStore(device)), by="test")


def _installed(device: Path) -> list[str]:
    store = ModelStore(device)
    try:
        return [v.digest for n in ("tiny:1", "tiny:2") for v in store.versions(n)]
    finally:
        store.close()


def test_lookup_returns_the_verified_manifest(setup: tuple[Repo, ArtifactServer, Path]
                                              ) -> None:
    repo, server, device = setup
    release = _source(server, repo, device).lookup("tiny:1", "1")
    assert release.manifest.parameters == {"temperature": 0.6}
    assert release.manifest.context_length == 300
    assert release.length == repo.repo.get("tiny:1", "1").length
    assert release.url.startswith(server.url + "targets/tiny/1/1/")
    assert (device / "tuf" / "timestamp.json").exists()
    with pytest.raises(ReleaseRejected) as unknown:
        _source(server, repo, device).lookup("tiny:1", "7")
    assert unknown.value.reason == rel.UNKNOWN_RELEASE
    with pytest.raises(ReleaseRejected) as old:
        _too_new(repo, server, device)
    assert old.value.reason == rel.AGENT_TOO_OLD and "9.0" in old.value.message
    with pytest.raises(ReleaseRejected) as arch:
        _source(server, repo, device, supported_architectures={"gemma3"}).lookup(
            "tiny:1", "1")
    assert arch.value.reason == rel.UNSUPPORTED_ARCHITECTURE


def _too_new(repo: Repo, server: ArtifactServer, device: Path) -> None:
    repo.add(write_tiny_gguf(device.parent / "v9.gguf", context_length=301), "tiny:1", "9",
             min_agent_version="9.0")
    mirror(repo.repo.root, server.root)
    _source(server, repo, device).lookup("tiny:1", "9")


def test_a_tampered_blob_is_refused_before_install(setup: tuple[Repo, ArtifactServer, Path]
                                                   ) -> None:
    repo, server, device = setup
    blob = next((server.root / "targets" / "tiny" / "1" / "1").iterdir())
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF  # one byte of tensor data: the header still reads
    blob.write_bytes(bytes(data))
    with pytest.raises(ReleaseFailed) as err:
        _pipeline(_source(server, repo, device), device, "tiny:1", "1")
    assert err.value.reason == rel.HASH_MISMATCH and "signed" in err.value.message
    assert _installed(device) == []
    assert list(transfer.downloads_dir(device).glob("*.part")) == []


def test_a_tampered_target_entry_is_refused(setup: tuple[Repo, ArtifactServer, Path]) -> None:
    repo, server, device = setup
    _source(server, repo, device).lookup("tiny:1", "1")  # the device has seen v(n)
    repo.add(write_tiny_gguf(device.parent / "v2.gguf", context_length=302), "tiny:2", "1")
    mirror(repo.repo.root, server.root)
    newest = max((server.root / "metadata").glob("*.targets.json"),
                 key=lambda p: int(p.name.split(".")[0]))
    doc = json.loads(newest.read_text())
    entry = doc["signed"]["targets"]["tiny/2/1/model.gguf"]
    entry["custom"]["min_agent_version"] = "0.0.1"  # signature kept: now it lies
    newest.write_text(json.dumps(doc))
    with pytest.raises(ReleaseRejected) as err:
        _pipeline(_source(server, repo, device), device, "tiny:2", "1")
    assert err.value.reason == rel.BAD_SIGNATURE
    assert "not signed by the trusted keys" in err.value.message
    assert _installed(device) == []


def test_replayed_older_metadata_is_refused(setup: tuple[Repo, ArtifactServer, Path]) -> None:
    repo, server, device = setup
    old_copy = mirror(repo.repo.root, device.parent / "old")
    _source(server, repo, device).lookup("tiny:1", "1")
    repo.add(write_tiny_gguf(device.parent / "v2.gguf", context_length=302), "tiny:2", "1")
    mirror(repo.repo.root, server.root)
    md = server.root / "metadata"
    v = max(int(p.name.split(".")[0]) for p in md.glob("*.targets.json"))
    (md / f"{v}.targets.json").write_bytes((md / f"{v - 1}.targets.json").read_bytes())
    with pytest.raises(ReleaseRejected) as err:
        _pipeline(_source(server, repo, device), device, "tiny:2", "1")
    assert err.value.reason == rel.ROLLBACK and "replay" in err.value.message
    # The device sees the newest state, then the whole repository is served as it was.
    mirror(repo.repo.root, server.root)
    _source(server, repo, device).lookup("tiny:2", "1")
    mirror(old_copy, server.root)
    with pytest.raises(ReleaseRejected) as err:
        _pipeline(_source(server, repo, device), device, "tiny:1", "1")
    assert err.value.reason == rel.ROLLBACK and "timestamp" in err.value.message
    assert _installed(device) == []
    assert Metadata[Targets].from_file(str(device / "tuf" / "targets.json")).signed.version \
        == v


def test_expired_timestamp_is_refused_and_retryable(setup: tuple[Repo, ArtifactServer, Path]
                                                    ) -> None:
    repo, server, device = setup
    repo.repo.refresh(repo.keys, timestamp_expires_s=-3600)  # validly signed, expired
    mirror(repo.repo.root, server.root)
    with pytest.raises(ReleaseFailed) as err:
        _pipeline(_source(server, repo, device), device, "tiny:1", "1")
    assert err.value.reason == rel.EXPIRED and err.value.retry
    assert "expired" in err.value.message and "UTC" in err.value.message
    assert _installed(device) == []
    repo.repo.refresh(repo.keys)  # the cron job runs: the same device goes on
    mirror(repo.repo.root, server.root)
    assert _source(server, repo, device).lookup("tiny:1", "1").version == "1"


def test_a_re_signed_root_reaches_devices(setup: tuple[Repo, ArtifactServer, Path]) -> None:
    repo, server, device = setup
    _source(server, repo, device).lookup("tiny:1", "1")
    assert repo.repo.resign_root([repo.keys.root_dir]) == 2
    mirror(repo.repo.root, server.root)
    _source(server, repo, device).lookup("tiny:1", "1")  # the provisioned root is still v1
    trusted = json.loads((device / "tuf" / "root.json").read_text())
    assert trusted["signed"]["version"] == 2


def test_transport_failures_are_retryable(setup: tuple[Repo, ArtifactServer, Path],
                                          tmp_path: Path) -> None:
    repo, server, device = setup
    (server.root / "metadata" / "timestamp.json").unlink()
    with pytest.raises(ReleaseFailed) as missing:
        _source(server, repo, device).lookup("tiny:1", "1")
    assert missing.value.reason == rel.NOT_FOUND
    server.stop()
    with pytest.raises(ReleaseFailed) as down:
        _source(server, repo, device).lookup("tiny:1", "1")
    assert down.value.reason == rel.UNREACHABLE and down.value.message
    settings = device_settings(device, tmp_path / "nowhere.json", server.url)
    with pytest.raises(ReleaseRejected) as unset:
        ReleaseSource(settings.fleet, device).lookup("tiny:1", "1")
    assert unset.value.reason == rel.NOT_CONFIGURED


def test_a_release_of_a_catalog_name_without_its_template_or_parameters_is_warned_of(
        tmp_path: Path) -> None:
    """gemma3:270m's GGUF has no template and the catalog gives it parameters: a release
    that carries neither says so, and where to get them; one that carries both says
    nothing."""
    from edge_agent.fleet.controller.releases.repository import manifest_for

    gguf = write_tiny_gguf(tmp_path / "g.gguf")
    notes: list[str] = []
    manifest_for(gguf, name="gemma3:270m", version="2", notes=notes)
    assert len(notes) == 2, notes
    assert "no chat template" in notes[0] and "models show gemma3:270m --template" in notes[0]
    assert "(stop, temperature, top_k, top_p)" in notes[1]
    assert "models show gemma3:270m --parameters" in notes[1]
    notes.clear()
    manifest_for(gguf, name="gemma3:270m", version="2", notes=notes, chat_template="{{ x }}",
                 parameters={"stop": ["<end_of_turn>"]})
    assert notes == []
    manifest_for(gguf, name="tiny:1", version="2", notes=notes, chat_template="{{ x }}")
    assert notes == []  # not a catalog name: no parameters expected


def test_end_to_end_release_to_an_inactive_version(setup: tuple[Repo, ArtifactServer, Path],
                                                   tmp_path: Path) -> None:
    repo, server, device = setup
    ops = ModelOps(ModelStore(device))
    current = ops.import_file(write_tiny_gguf(tmp_path / "cur.gguf", context_length=128),
                              "tiny:1", by="test")
    gguf = write_tiny_gguf(tmp_path / "v2.gguf", context_length=1024)
    result = CliRunner().invoke(main, [
        "fleet", "release", "add", str(gguf), "--name", "tiny:1", "--version", "2",
        "--state-dir", str(repo.repo.root.parent), "--keys", str(repo.keys.path),
        "--license", "MIT", "--tier", "production"])
    assert result.exit_code == 0, result.output
    # No template in the GGUF, none given: said before the boxes find out.
    assert "warning: tiny:1@2: the GGUF has no chat template" in result.stderr
    mirror(repo.repo.root, server.root)
    source = _source(server, repo, device)
    release = source.lookup("tiny:1", "2")
    seen: list[tuple[int, int, float, float | None]] = []
    path = transfer.download(release, transfer.downloads_dir(device),
                             progress=lambda *a: seen.append(a))
    assert seen[-1][0] == seen[-1][1] == release.length
    inode = path.stat().st_ino
    model = install(release, path, ops, by="rollout:test")
    assert not path.exists()  # the store took it by rename: no second copy on the disk
    assert model.blob_path(device).stat().st_ino == inode
    assert (model.digest, model.license, model.tier, model.origin) == (
        release.sha256, "MIT", "production", "release:tiny:1@2")
    assert [(v.digest, v.active) for v in ops.versions("tiny:1")] == [
        (current.digest, True), (release.sha256, False)]
    assert ops.show("tiny:1").digest == current.digest
    with pytest.raises(ModelNotFound):
        repo.repo.get("tiny:1", "3")


def test_the_controllers_http_serves_the_repository_under_releases(tmp_path: Path) -> None:
    """`fleet serve` mounts the signed repository at /releases/ (what boxes point
    fleet.artifacts_url at), with Range."""
    from fastapi.testclient import TestClient

    from edge_agent.fleet.controller.api import create_app
    from edge_agent.fleet.controller.metrics import ControllerMetrics
    from edge_agent.fleet.controller.store import SQLiteStore

    root = tmp_path / "releases"
    (root / "metadata").mkdir(parents=True)
    (root / "metadata" / "timestamp.json").write_bytes(b'{"signed": {}}')
    store = SQLiteStore(tmp_path / "controller.db")
    try:
        client = TestClient(create_app(store, ControllerMetrics(store), state_dir=tmp_path))
        whole = client.get("/releases/metadata/timestamp.json")
        assert whole.status_code == 200 and whole.content == b'{"signed": {}}'
        part = client.get("/releases/metadata/timestamp.json", headers={"Range": "bytes=2-7"})
        assert part.status_code == 206 and part.content == b'signed'
        assert client.get("/releases/../controller.db").status_code == 404
        assert client.get("/devices").status_code == 200
    finally:
        store.close()
