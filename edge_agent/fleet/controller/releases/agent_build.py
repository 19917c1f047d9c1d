"""An agent release from a wheelhouse (`fleet release add-agent VERSION --wheelhouse DIR`):
the manifest read from its wheels' names, and the one tar the boxes download.

The wheelhouse is the Ansible role's: edge-agent's wheel, its llama-cpp-python build and
every dependency, so that a box installs it with `pip --no-index` and nothing else. The
names say what the release is: edge-agent's version (which must be the release's), the
llama-cpp-python version and the wheel tags it was built for (the one binary that decides
where the release runs). What the names cannot say — the CPU flags or the CUDA
architectures the llama.cpp build needs — the operator says with `--build`.
"""

from __future__ import annotations

import tarfile
import time
from pathlib import Path
from typing import Any

from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

from edge_agent.errors import InvalidRequest
from edge_agent.fleet.protocol.agent_release import (
    AgentManifest,
    AgentManifestError,
    parse,
)

DISTRIBUTION = "edge-agent-appliance"
EXTRAS = "default-model"


def manifest_for(wheelhouse: Path, *, version: str, build: str = "cpu",
                 gate: dict[str, Any] | None = None) -> AgentManifest:
    """The manifest of `wheelhouse` as agent release `version` (InvalidRequest naming what
    is missing or does not match)."""
    wheels = sorted(p for p in wheelhouse.glob("*.whl") if p.is_file())
    if not wheels:
        raise InvalidRequest(f"{wheelhouse}: no wheels (.whl) in it", param="wheelhouse")
    agent = llama = None
    for wheel in wheels:
        try:
            name, ver, _, tags = parse_wheel_filename(wheel.name)
        except InvalidWheelFilename as exc:
            raise InvalidRequest(f"{wheelhouse}: {exc}", param="wheelhouse") from None
        if name == canonicalize_name(DISTRIBUTION):
            agent = str(ver)
        elif name == canonicalize_name("llama-cpp-python"):
            tag = sorted(tags, key=str)[0]
            llama = (str(ver), tag.interpreter, tag.abi, tag.platform)
    if agent is None:
        raise InvalidRequest(f"{wheelhouse}: no {DISTRIBUTION} wheel", param="wheelhouse")
    if agent != version:
        raise InvalidRequest(f"{wheelhouse}: its {DISTRIBUTION} wheel is version {agent}, "
                             f"not {version}: an agent release is named for the agent it "
                             "installs", param="version")
    if llama is None:
        raise InvalidRequest(f"{wheelhouse}: no llama-cpp-python wheel (build it into the "
                             "wheelhouse, as the manual's wheelhouse page does)",
                             param="wheelhouse")
    try:
        return parse({"version": version, "edge_agent": agent, "llama_cpp_python": llama[0],
                      "build": build, "python": llama[1], "abi": llama[2],
                      "platform": llama[3],
                      "requirement": f"{DISTRIBUTION}[{EXTRAS}]=={version}",
                      "wheels": [w.name for w in wheels], "gate": gate or {},
                      "created_at": int(time.time())})
    except AgentManifestError as exc:
        raise InvalidRequest(str(exc), param="build") from None


def pack(wheelhouse: Path, manifest: AgentManifest, dest: Path) -> Path:
    """The manifest's wheels in one uncompressed tar at `dest`, flat, in name order, with
    fixed owners and times (the same wheelhouse packs to the same bytes)."""
    with tarfile.open(dest, "w", format=tarfile.PAX_FORMAT) as tar:
        for name in manifest.wheels:
            info = tar.gettarinfo(str(wheelhouse / name), arcname=name)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            info.mode = 0o644
            with (wheelhouse / name).open("rb") as fh:
                tar.addfile(info, fh)
    return dest
