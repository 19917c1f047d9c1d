"""Agent releases for tests, made here: wheelhouses of a wheel written by hand (an
`edge-agent-appliance` whose llama.cpp check passes), packed as `add-agent` packs them;
`AgentReleases`, the runner's release side over them (`rollout_support.DirReleases`
with agent lookups); `VersionProbe`, a gate's probe answering as the agent version that
runs."""

from __future__ import annotations

import base64
import hashlib
import tarfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging import tags

from edge_agent.fleet.protocol.agent_release import AGENT_NAME, AgentManifest, parse
from tests.support.rollout_support import Answer, DirReleases, Release

GATE = {"prompts": [{"id": "hello", "prompt": "Say hello", "max_tokens": 8,
                     "expect": {"contains": ["hello"]}}], "tokens_per_s_floor": None}


def wheel(where: Path, name: str, version: str, files: dict[str, str]) -> Path:
    dist = f"{name.replace('-', '_')}-{version}"
    files = {**files, f"{dist}.dist-info/METADATA":
             f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}.dist-info/WHEEL":
             "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    path = where / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for arc, text in files.items():
            data = text.encode()
            z.writestr(arc, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            record.append(f"{arc},sha256={digest.decode()},{len(data)}")
        record.append(f"{dist}.dist-info/RECORD,,")
        z.writestr(f"{dist}.dist-info/RECORD", "\n".join(record) + "\n")
    return path


@dataclass(frozen=True)
class AgentFound(Release):
    """An agent release as the runner's release side finds it (its manifest parsed)."""

    agent: AgentManifest


class AgentReleases(DirReleases):
    def add_agent(self, tar: Path, manifest: AgentManifest) -> AgentFound:
        base = self.add(AGENT_NAME, manifest.version, tar)
        found = AgentFound(AGENT_NAME, manifest.version, base.length, base.sha256,
                           manifest.model_dump(), tar, manifest)
        self.releases[(AGENT_NAME, manifest.version)] = found  # type: ignore[assignment]
        return found

    def lookup_agent(self, version: str) -> AgentFound:
        return self.lookup(AGENT_NAME, version)  # type: ignore[return-value]

    def _check(self, path: Path, release: Any) -> None:
        pass  # a wheelhouse has no GGUF header; length and sha256 are the transfer's tests


@dataclass
class VersionProbe:
    """Answers as the agent version that runs (`running`), as the box's request path would."""

    answers: dict[str, str]
    running: list[str]
    calls: list[str] = field(default_factory=list)

    async def __call__(self, request: Any) -> Answer:
        version = self.running[0]
        self.calls.append(version)
        return Answer(self.answers.get(version, "hello"), 3, 20.0, 40.0, "d")


def agent_release(tmp: Path, version: str = "0.2.0", *,
                  platform: tuple[str, str, str] | None = None) -> tuple[Path, AgentManifest]:
    house = tmp / f"house-{version}"
    house.mkdir()
    wheel(house, "edge-agent-appliance", version, {
        "edge_agent/__init__.py": f"__version__ = '{version}'\n",
        "edge_agent/engine/__init__.py": "", "edge_agent/engine/runtime/__init__.py": "",
        "edge_agent/engine/runtime/native.py": "print('ok')\n"})
    mine = next(iter(tags.sys_tags()))
    python, abi, plat = platform or (mine.interpreter, mine.abi, mine.platform)
    m = parse({"version": version, "edge_agent": version, "llama_cpp_python": "0.3.36",
               "python": python, "abi": abi, "platform": plat,
               "requirement": f"edge-agent-appliance=={version}", "gate": GATE,
               "wheels": [p.name for p in house.iterdir()]})
    tar = tmp / f"agent-{version}.tar"
    with tarfile.open(tar, "w") as t:
        for p in house.iterdir():
            t.add(p, arcname=p.name)
    return tar, m
