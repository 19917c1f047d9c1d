"""A release's manifest: what the controller signs about a model file besides its length
and sha256, and how it travels inside TUF's `custom` field.

Shared by both sides: the controller builds it (`fleet release add`) and encodes it into
the target's `custom` field; the device decodes it from a verified `TargetFile` and checks
it against itself (`compatibility`). It also owns the one mapping from a release's name and
version to its target path:

    gemma3:270m @ 2  ->  gemma3/270m/2/model.gguf

TUF signs canonical JSON, which has no floats (securesystemslib refuses to encode 0.7).
A manifest's floats (sampling parameters, a gate's ratios) are therefore written as their
shortest round-trip decimal text, and the JSON paths of those strings are listed under
`floats`, so the device restores exactly the floats that were floats and leaves a string
that only looks like a number ("0.7" as a stop sequence) alone:

    {"parameters": {"temperature": "0.7", "stop": ["0.7"]},
     "floats": [["parameters", "temperature"]], ...}

A release's stage and its materials (`materials`) travel here too: signed with the file.
An older device ignores them (the model ignores fields it does not know), so adding them
needed no new `format`.

This module never touches the network, the disk or keys: data in, data out, errors as
`ManifestError` (a ValueError) naming the field.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from edge_agent.engine.models.entries import ManifestExtras
from edge_agent.engine.request import SamplingParams
from edge_agent.errors import InvalidRequest
from edge_agent.fleet.protocol.ids import VERSION, VERSION_RULE
from edge_agent.fleet.protocol.materials import Materials, Stage
from edge_agent.names import ModelName

FORMAT = 1  # bumped when a device of this version could not read a newer manifest right
FLOATS = "floats"
TARGET_FILE = "model.gguf"
_AGENT_VERSION = re.compile(r"\d+(\.\d+){0,3}")
_TIER = re.compile(r"[a-z][a-z0-9_-]{0,31}")
# Parameters a release may set: the sampler's fields and stop sequences (what the server
# reads from a model's defaults, `engine.prompt.sampling_for` and `stops_for`).
PARAMETERS = SamplingParams.field_names() | {"stop"}
_MAX_TEMPLATE_CHARS = 1 << 16


class ManifestError(ValueError):
    """A manifest that cannot be built, encoded or decoded; the message names the field."""


class ReleaseManifest(BaseModel):
    """The signed description of one release of a model (one file)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    format: int = FORMAT
    name: ModelName
    version: str
    architecture: str
    quantization: str = "unknown"
    context_length: int | None = None
    parameter_size: str = ""
    license: str = ""
    tier: str = "experimental"
    chat_template: str | None = Field(
        None, description="Replaces the GGUF's own template when set.")
    parameters: dict[str, Any] = Field(default_factory=dict)
    min_agent_version: str | None = None
    gate: dict[str, Any] = Field(
        default_factory=dict, description="The health gate's spec, carried as given; the "
        "device's gate reads it.")
    created_at: int = 0
    # Where the release may go and what it carries (`materials`); a release published
    # before stages has neither, and reads as an experiment with no materials.
    stage: Stage = "experiment"
    materials: Materials = Field(default_factory=Materials)  # type: ignore[arg-type]

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        try:
            return ModelName.parse(value)
        except InvalidRequest as exc:
            raise ValueError(exc.message) from None

    @field_validator("version")
    @classmethod
    def _version(cls, value: str) -> str:
        if not VERSION.fullmatch(value):
            raise ValueError(f"version {value[:40]!r} must be {VERSION_RULE}")
        return value

    @field_validator("min_agent_version")
    @classmethod
    def _agent(cls, value: str | None) -> str | None:
        if value is not None and not _AGENT_VERSION.fullmatch(value):
            raise ValueError(f"min_agent_version {value[:40]!r} is not N[.N[.N[.N]]]")
        return value

    @field_validator("tier")
    @classmethod
    def _tier(cls, value: str) -> str:
        if not _TIER.fullmatch(value):
            raise ValueError(f"tier {value[:40]!r} must be a lowercase word "
                             "([a-z][a-z0-9_-]*)")
        return value

    @field_validator("chat_template")
    @classmethod
    def _template(cls, value: str | None) -> str | None:
        if value is not None and (not value.strip() or len(value) > _MAX_TEMPLATE_CHARS):
            raise ValueError(f"chat_template must be 1-{_MAX_TEMPLATE_CHARS} characters")
        return value

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, value: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(value) - PARAMETERS)
        if unknown:
            raise ValueError(f"unknown parameter(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(PARAMETERS))}")
        stop = value.get("stop", [])
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ValueError("parameters.stop must be a list of strings")
        for key, v in value.items():
            if key != "stop" and (isinstance(v, bool) or not isinstance(v, (int, float, list))):
                raise ValueError(f"parameters.{key} must be a number")
        return value

    @property
    def ref(self) -> str:
        """`name@version`, how the CLI and messages name a release."""
        return f"{self.name}@{self.version}"

    @property
    def target_path(self) -> str:
        return target_path(self.name, self.version)

    def extras(self) -> ManifestExtras:
        """What the model store records from the manifest (the GGUF header gives the
        rest: context length, embedding length, FIM)."""
        return ManifestExtras(
            parameter_size=self.parameter_size, quantization=self.quantization,
            license=self.license, tier=self.tier, chat_template=self.chat_template,
            template_source="release", parameters=dict(self.parameters))

    # -- the custom field --------------------------------------------------------------
    def to_custom(self) -> dict[str, Any]:
        """The manifest as TUF's `custom` field: floats as text, their paths listed."""
        floats: list[list[str | int]] = []
        body = _encode(self.model_dump(), [], floats)
        body[FLOATS] = floats
        return body

    @classmethod
    def from_custom(cls, custom: Mapping[str, Any] | None) -> ReleaseManifest:
        """The manifest from a verified target's `custom` field (floats restored)."""
        if not isinstance(custom, Mapping):
            raise ManifestError("the target carries no release manifest (custom field)")
        body = copy.deepcopy(dict(custom))  # the verified TargetFile stays as signed
        paths = body.pop(FLOATS, [])
        if not isinstance(paths, list):
            raise ManifestError("manifest floats is not a list")
        for path in paths:
            _restore_float(body, path)
        fmt = body.get("format")
        if isinstance(fmt, int) and fmt > FORMAT:
            raise ManifestError(f"manifest format {fmt} is newer than this agent reads "
                                f"({FORMAT}); update the agent")
        return parse(body)


def parse(data: Mapping[str, Any]) -> ReleaseManifest:
    """A manifest from plain values; ManifestError naming the first bad field."""
    try:
        return ReleaseManifest.model_validate(dict(data))
    except ValidationError as exc:
        raise ManifestError(first_error(exc)) from None


def first_error(exc: ValidationError) -> str:
    """`field: what is wrong`, of the first error pydantic found."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "manifest"
    return f"{where}: {first['msg'].removeprefix('Value error, ')}"


def target_path(name: str, version: str) -> str:
    """`gemma3:270m`, `2` -> `gemma3/270m/2/model.gguf`.

    One-to-one: a normalized name has exactly one ':' (before its tag) and parts of
    [A-Za-z0-9_.-] that never start with '.', so the path reads back unambiguously (tag,
    version and file are its last three parts) and has no odd character for a web server
    or an object store.
    """
    key = _model_name(name)
    if not VERSION.fullmatch(version):
        raise ManifestError(f"version {version[:40]!r} must be {VERSION_RULE}")
    base, tag = key.rsplit(":", 1)
    return f"{base}/{tag}/{version}/{TARGET_FILE}"


def _model_name(name: str) -> ModelName:
    try:
        return ModelName.parse(name)  # a no-op for one parsed before
    except InvalidRequest as exc:
        raise ManifestError(exc.message) from None


def parse_ref(ref: str) -> tuple[ModelName, str]:
    """`NAME@VERSION` -> (normalized name, version)."""
    name, sep, version = ref.rpartition("@")
    if not sep or not name or not version:
        raise ManifestError(f"{ref[:80]!r} is not NAME@VERSION (e.g. gemma3:270m@2)")
    key = _model_name(name)
    target_path(key, version)  # validates the version
    return key, version


def version_tuple(version: str) -> tuple[int, ...]:
    """`0.14.2` -> (0, 14, 2); the numeric prefix of an agent version such as 0.2.0.dev1."""
    parts = []
    for part in version.split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.end() != len(part):
            break
    return tuple(parts) or (0,)


def agent_too_old(min_version: str | None, agent_version: str) -> bool:
    if min_version is None:
        return False
    want, have = version_tuple(min_version), version_tuple(agent_version)
    width = max(len(want), len(have))
    return have + (0,) * (width - len(have)) < want + (0,) * (width - len(want))


def _encode(value: Any, path: list[str | int], floats: list[list[str | int]]) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ManifestError(f"{_shown(path)} is {value}; only finite numbers are signed")
        floats.append(list(path))
        return repr(value)  # the shortest text that reads back as the same float
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ManifestError(f"{_shown(path)} has a non-text key {key!r}")
            out[key] = _encode(item, [*path, key], floats)
        return out
    if isinstance(value, (list, tuple)):
        return [_encode(item, [*path, i], floats) for i, item in enumerate(value)]
    raise ManifestError(f"{_shown(path)} is a {type(value).__name__}; a manifest holds "
                        "only text, numbers, booleans, lists and tables")


def _restore_float(body: dict[str, Any], path: Any) -> None:
    if not isinstance(path, list) or not path:
        raise ManifestError(f"manifest floats holds a bad path {path!r:.80}")
    parent: Any = body
    for step in path[:-1]:
        parent = _step(parent, step, path)
    last = path[-1]
    text = _step(parent, last, path)
    try:
        number = float(text) if isinstance(text, str) else math.nan
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise ManifestError(f"manifest float at {_shown(path)} is not a finite number")
    parent[last] = number


def _step(container: Any, step: Any, path: Sequence[Any]) -> Any:
    if isinstance(container, dict) and isinstance(step, str) and step in container:
        return container[step]
    if isinstance(container, list) and isinstance(step, int) and not isinstance(step, bool) \
            and 0 <= step < len(container):
        return container[step]
    raise ManifestError(f"manifest floats names {_shown(path)}, which is not there")


def _shown(path: Sequence[Any]) -> str:
    return ".".join(str(p) for p in path) or "manifest"
