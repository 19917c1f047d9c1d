"""An agent release: edge-agent itself and its llama.cpp, shipped as one signed TUF target,
and the rule deciding which boxes may take it.

The target is the wheelhouse the Ansible role installs from, packed as one tar (wheels are
compressed already), at

    agent/<VERSION>/wheelhouse.tar

with this manifest in its `custom` field (`kind: agent` tells it from a model's):

    {"kind": "agent", "version": "0.2.0", "edge_agent": "0.2.0",
     "llama_cpp_python": "0.3.36", "build": "cpu", "python": "cp311", "abi": "cp311",
     "platform": "linux_x86_64", "requirement": "edge-agent-appliance[default-model]==0.2.0",
     "wheels": [...], "gate": {...}}

A box takes a release only where pip would install its llama-cpp-python wheel (the
`python`, `abi`, `platform` triple among the box's own supported tags, as pip decides) and
where its build runs: `cpu` anywhere, `cpu:avx2,fma` where the CPU has those flags,
`cuda:86,89` where a GPU of one of those compute capabilities is present. `refusal` says
why not, before anything is downloaded. Rollouts of agent releases travel under the
reserved name `AGENT_NAME`, so that the rollout machinery (one live rollout per name,
waves, evidence) is the models' own; no model may be published under it.

No I/O: the box's facts come in as a `BoxPlatform` (`fleet.device.agent.platform` reads
them), the controller's from the wheel names it read.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from edge_agent.fleet.protocol.ids import VERSION, VERSION_RULE
from edge_agent.fleet.protocol.manifest import first_error
from edge_agent.names import ModelName

KIND: Literal["agent"] = "agent"
FORMAT = 1
TARGET_FILE = "wheelhouse.tar"
AGENT_NAME = ModelName.parse("edge-agent")
_BUILD = re.compile(r"cpu(:[a-z0-9_]{1,24}(,[a-z0-9_]{1,24}){0,15})?"
                    r"|cuda:\d{2,3}(,\d{2,3}){0,15}")
_TAG = re.compile(r"[A-Za-z0-9_.]{1,64}")
BUILD_RULE = "cpu, cpu:FLAG[,FLAG] (CPU flags the build needs) or cuda:CC[,CC] (compute " \
    "capabilities, 86 for 8.6)"


class AgentManifestError(ValueError):
    """An agent manifest that cannot be built or read; the message names the field."""


class AgentManifest(BaseModel):
    """The signed description of one agent release (its wheelhouse)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    kind: Literal["agent"] = KIND
    format: int = FORMAT
    version: str
    edge_agent: str
    llama_cpp_python: str
    build: str = "cpu"
    python: str
    abi: str
    platform: str
    requirement: str
    wheels: list[str] = Field(default_factory=list)
    gate: dict[str, Any] = Field(
        default_factory=dict, description="The health gate's spec, as a model release's: "
        "its golden set runs on the box's default model before and after the switch.")
    created_at: int = 0

    @field_validator("version")
    @classmethod
    def _version(cls, value: str) -> str:
        agent_target_path(value)
        return value

    @field_validator("build")
    @classmethod
    def _build(cls, value: str) -> str:
        if not _BUILD.fullmatch(value):
            raise ValueError(f"build {value[:40]!r} must be {BUILD_RULE}")
        return value

    @field_validator("python", "abi", "platform")
    @classmethod
    def _tag(cls, value: str) -> str:
        if not _TAG.fullmatch(value):
            raise ValueError(f"{value[:40]!r} is not a wheel tag")
        return value

    @property
    def ref(self) -> str:
        return f"{AGENT_NAME.given}@{self.version}"

    @property
    def target_path(self) -> str:
        return agent_target_path(self.version)

    @property
    def build_kind(self) -> str:
        return self.build.split(":", 1)[0]

    @property
    def build_needs(self) -> tuple[str, ...]:
        _, _, needs = self.build.partition(":")
        return tuple(n for n in needs.split(",") if n)

    def to_custom(self) -> dict[str, Any]:
        return self.model_dump()

    @classmethod
    def from_custom(cls, custom: Mapping[str, Any] | None) -> AgentManifest:
        if not is_agent(custom):
            raise AgentManifestError("the target carries no agent manifest (custom.kind)")
        assert custom is not None
        fmt = custom.get("format")
        if isinstance(fmt, int) and fmt > FORMAT:
            raise AgentManifestError(f"agent manifest format {fmt} is newer than this agent "
                                     f"reads ({FORMAT})")
        return parse(custom)


def parse(data: Mapping[str, Any]) -> AgentManifest:
    try:
        return AgentManifest.model_validate(dict(data))
    except ValidationError as exc:
        raise AgentManifestError(first_error(exc)) from None


def is_agent(custom: Mapping[str, Any] | None) -> bool:
    """Whether a target's `custom` field is an agent release's (a model's has no kind)."""
    return isinstance(custom, Mapping) and custom.get("kind") == KIND


def is_agent_name(name: str) -> bool:
    return str(name) == AGENT_NAME


def agent_target_path(version: str) -> str:
    """`0.2.0` -> `agent/0.2.0/wheelhouse.tar`; a version is also a folder name on the box,
    beside the `current` link, which no version may be called."""
    if not VERSION.fullmatch(version) or version == "current":
        raise AgentManifestError(f"version {version[:40]!r} must be {VERSION_RULE}, and not "
                                 "'current'")
    return f"{KIND}/{version}/{TARGET_FILE}"


@dataclass(frozen=True)
class BoxPlatform:
    """What a box is, as far as an agent release cares: the wheel tags its Python installs
    (best first, as pip orders them), its CPU flags, its GPUs' compute capabilities."""

    tags: tuple[tuple[str, str, str], ...]
    cpu_flags: frozenset[str] = field(default_factory=frozenset)
    cuda: frozenset[str] = field(default_factory=frozenset)  # "86" for 8.6

    def shown(self) -> str:
        python, abi, plat = self.tags[0] if self.tags else ("?", "?", "?")
        gpus = f", GPU compute {','.join(sorted(self.cuda))}" if self.cuda else ", no GPU"
        return f"{python}-{abi}-{plat}{gpus}"


def refusal(manifest: AgentManifest, box: BoxPlatform) -> str | None:
    """Why this box cannot run the release as built (None: it can)."""
    want = (manifest.python, manifest.abi, manifest.platform)
    if want not in box.tags:
        return (f"{manifest.ref} is built for {'-'.join(want)}; this box installs "
                f"{box.shown()} wheels")
    needs = manifest.build_needs
    if manifest.build_kind == "cpu":
        missing = [n for n in needs if n not in box.cpu_flags]
        if missing:
            return (f"{manifest.ref} is built for CPUs with {', '.join(needs)}; this CPU "
                    f"lacks {', '.join(missing)}")
        return None
    if not box.cuda:
        return f"{manifest.ref} is a CUDA build ({manifest.build}); this box has no NVIDIA GPU"
    if not box.cuda & set(needs):
        return (f"{manifest.ref} is built for compute capability {', '.join(needs)}; this "
                f"box's GPU is {', '.join(sorted(box.cuda))}")
    return None
