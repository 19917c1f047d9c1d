"""Every type of signed command a box takes, in one table: its name, the schema of its
`args`, the least operator role that may send it, whether it changes the box, the shape of
its result and one line on what it does. `protocol.command` is the envelope around it.

Everything that names a command type reads it from here, so that they cannot drift apart:

- the box's dispatch (`device.link.dispatch`) holds its handlers to this table: each type
  exactly one handler, and no handler for a type not in it;
- the controller's `POST /commands` (`fleet send`) refuses an unknown type, an operator
  below the type's role and `args` that do not fit its schema, before anything is signed;
- the simulator scripts every type but the link's own (`sim.fleet.SCRIPT_TYPES`);
- `fleet send --help` lists the types, and the manual's table of commands is generated
  from this one (`tools/reference.py`, region `command-types` of docs/fleet/commands.md).

So adding a command type is one entry in `COMMAND_TYPES` and one handler on the box.

An args schema is the shape the controller can check without the box (its fields, their
types and patterns). The box's handler stays the authority on what the values mean (a
`config.patch` key's bounds need the box's own settings; a rollout's name its models) and
refuses what it cannot run (`malformed`); where the two check the same rule they share the
constant defined here. A result model describes what the handler returns, for the manual
and the tests; nothing refuses a result on its shape.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from edge_agent.errors import InvalidRequest
from edge_agent.fleet.protocol.ids import ROLLOUT_ID, ROLLOUT_ID_RULE, release_version
from edge_agent.names import ModelName

__all__ = ["CAPACITY_KEYS", "COMMAND_TYPES", "DIGEST", "KEY_PREFIX", "MAX_PATCH_KEYS", "ROLES",
           "BadArgs", "CommandType", "UnknownType", "lookup", "shape", "typed_args"]

# The controller's operator roles, least first (`controller.operators.ROLES`, which a test
# holds to these): the protocol names them but cannot import the controller.
ROLES = ("viewer", "operator", "admin")
KEY_PREFIX = re.compile(r"[A-Za-z0-9]{1,64}")  # an API key's public part (`keys list`)
MAX_PATCH_KEYS = 64  # keys in one config.patch
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")  # a model version's bytes, as a command names them
# A capacity change: the runtime settings that change a model's speed *and* its answers. A
# `rollout.start` with `config` ships them as a gated release (`device.rollout.capacity`);
# a `config.patch` of them is refused unless it says `ungated` (`device.link.overlay`).
CAPACITY_KEYS = ("parallel", "context_length", "threads", "prompt_lookup", "kv_cache_type",
                 "draft_model", "draft_tokens")


class UnknownType(ValueError):
    """A command type this table does not hold."""


class BadArgs(ValueError):
    """`args` that do not fit a type's schema; the message names the field, as the
    controller's other refusals do (`args.prefix: Field required`)."""


# -- the args' schemas ---------------------------------------------------------------------

class _Args(BaseModel):
    """Exactly the fields named, each of its JSON type: a bool is not a number, and a
    string is never read as one."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class IgnoredArgs(BaseModel):
    """A type that reads no args: any object is taken and ignored, so a controller may
    send fields a later handler reads."""

    model_config = ConfigDict(extra="allow")


class PatchArgs(_Args):
    set: dict[str, float | None] = Field(min_length=1, max_length=MAX_PATCH_KEYS)
    ungated: bool = False  # capacity keys outside the gate: marked so in the evidence


class PurgeArgs(_Args):
    before: float | None = None


class RevokeArgs(_Args):
    prefix: str = Field(pattern=f"^{KEY_PREFIX.pattern}$")


def _rollout_id(value: Any) -> Any:
    if not isinstance(value, str) or not ROLLOUT_ID.fullmatch(value):
        raise ValueError(ROLLOUT_ID_RULE)
    return value


def _model_name(value: Any) -> Any:
    try:
        if not isinstance(value, str):
            raise InvalidRequest("not a string")
        ModelName.parse(value)
    except InvalidRequest as exc:
        raise ValueError(exc.message[:100]) from None
    return value


def _capacity(value: Any) -> Any:
    if value is None:
        return value
    if not isinstance(value, dict) or not value:
        raise ValueError(f"an object of capacity settings ({', '.join(CAPACITY_KEYS)})")
    for key, item in value.items():
        if key not in CAPACITY_KEYS:
            raise ValueError(f"{str(key)[:64]!r} is not a capacity setting (one of "
                             f"{', '.join(CAPACITY_KEYS)})")
        if isinstance(item, bool) or not isinstance(item, int | str):
            raise ValueError(f"{key}: a whole number or a string")
    return value


class StartArgs(_Args):
    rollout_id: str
    name: str
    version: int | str  # a whole number, or a version's text
    # A capacity release: these settings, gated with the release's golden set on the
    # version the box serves (the release's own); absent: a model release.
    config: dict[str, int | str] | None = None

    _config = field_validator("config", mode="before")(_capacity)

    _id = field_validator("rollout_id", mode="before")(_rollout_id)
    _name = field_validator("name", mode="before")(_model_name)

    @field_validator("version", mode="before")
    @classmethod
    def _version(cls, value: Any) -> Any:
        release_version(value)
        return value


def _one_of(schema: dict[str, Any]) -> None:
    """The schema says what the check says: one field or the other."""
    fields = schema.pop("properties")
    schema.pop("type", None)
    schema.pop("additionalProperties", None)
    schema["anyOf"] = [{"type": "object", "properties": {name: {"type": "string"}},
                        "required": [name], "additionalProperties": False}
                       for name in fields]


class TargetArgs(_Args):
    """`{"rollout_id": …}` or `{"name": …}`: one of the two, never both."""

    model_config = ConfigDict(json_schema_extra=_one_of)
    rollout_id: str | None = None
    name: str | None = None

    _id = field_validator("rollout_id", mode="before")(_rollout_id)
    _name = field_validator("name", mode="before")(_model_name)

    @model_validator(mode="after")
    def _one(self) -> TargetArgs:
        if len(self.model_fields_set) != 1:
            raise ValueError("give rollout_id or name, one of them")
        return self


def _name_and_version_or_digest(schema: dict[str, Any]) -> None:
    """The schema says what the check says: `name`, and `version` or `digest`."""
    name = schema.pop("properties")["name"]
    for key in ("type", "additionalProperties", "required"):
        schema.pop(key, None)
    one_of = {"version": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
              "digest": {"type": "string", "pattern": f"^{DIGEST.pattern}$"}}
    schema["anyOf"] = [{"type": "object", "properties": {"name": name, key: field},
                        "required": ["name", key], "additionalProperties": False}
                       for key, field in one_of.items()]


class VerifyArgs(_Args):
    """`{"name": …, "version": …}` (a release's version, as `rollout.start` takes it) or
    `{"name": …, "digest": "sha256:<64 hex>"}` (the version by its bytes): one of the two,
    never both."""

    model_config = ConfigDict(json_schema_extra=_name_and_version_or_digest)
    name: str
    version: int | str | None = None
    digest: str | None = None

    _name = field_validator("name", mode="before")(_model_name)

    @field_validator("version", mode="before")
    @classmethod
    def _version(cls, value: Any) -> Any:
        release_version(value)  # an explicit null too: a version is named or left out
        return value

    @field_validator("digest", mode="before")
    @classmethod
    def _digest(cls, value: Any) -> Any:
        if not isinstance(value, str) or not DIGEST.fullmatch(value):
            raise ValueError("sha256:<64 lowercase hex digits>")
        return value

    @model_validator(mode="after")
    def _one(self) -> VerifyArgs:
        if len(self.model_fields_set & {"version", "digest"}) != 1:
            raise ValueError("give version or digest, one of them")
        return self


# -- the results' shapes -------------------------------------------------------------------

class _Result(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Pong(_Result):
    pong: bool
    ts: float


class Reborn(_Result):
    bdseq: int


class Patched(_Result):
    set: dict[str, float | None]
    live: list[str]  # the keys applied to the running box
    on_restart: list[str]  # the keys that wait for the next start
    ungated: bool = False  # capacity keys were set outside the gate


class Purged(_Result):
    removed: int  # request rows
    before: float | None


class Revoked(_Result):
    prefix: str
    revoked: bool  # False: unknown or revoked already (the same end state)


class ModelVerified(_Result):
    """One version checked: each flag its own check, `detail` every one that failed."""

    name: str
    version: str | None = None  # as asked, as text
    digest: str | None = None  # as asked, or the one the version names here; None: unknown
    present: bool  # installed, and its blob is in the model store
    verified: bool  # the blob's size and sha256 are its digest's
    loads: bool  # its GGUF header reads
    size_bytes: int | None  # as installed; None: not installed
    detail: str  # what is wrong, one line ("" when nothing is)


class RolloutAnswer(BaseModel):
    """Whether the box took it (`refused` says why not) and the rollout's summary."""

    model_config = ConfigDict(extra="allow")
    accepted: bool
    refused: str = ""  # busy, unknown, activating, superseded: only when not accepted


# -- the table -----------------------------------------------------------------------------

@dataclass(frozen=True)
class CommandType:
    name: str
    description: str  # one line: the help of `fleet send` and the manual's table
    args: type[BaseModel]
    result: type[BaseModel]
    role: str = "operator"  # the least controller role that may send it
    mutating: bool = True  # whether it changes the box (settings, keys, ledger, models)
    rebirth_after: bool = False  # once it succeeded the birth goes again (its facts moved)
    example: Mapping[str, Any] = field(default_factory=dict)  # args that fit, for the tests

    def check_args(self, args: Any) -> None:
        """BadArgs naming the first field that breaks this type's schema."""
        self.parse(args)

    def parse(self, args: Any) -> BaseModel:
        """`args` as this type's model; BadArgs naming the first field that breaks it."""
        try:
            return self.args.model_validate(args)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(["args", *(str(p) for p in err["loc"])])
            message = str(err["ctx"]["error"]) if err["type"] == "value_error" \
                and "ctx" in err else err["msg"]
            raise BadArgs(f"{where}: {message} ({self.name} takes {shape(self.args)})"
                          ) from None


_TYPES = (
    CommandType("ping", "Answers at once, with the box's clock: is its link alive.",
                IgnoredArgs, Pong, mutating=False),
    CommandType("rebirth", "Publishes the birth again (the box's facts, models and "
                "config fingerprint).", IgnoredArgs, Reborn, mutating=False),
    CommandType("config.patch", "Changes settings from the allow-list, at once where they "
                "can, and keeps them over the config file; capacity settings only with "
                "`ungated` (else they ship as a gated release).", PatchArgs, Patched,
                rebirth_after=True, example={"set": {"telemetry.interval_s": 10}}),
    CommandType("ledger.purge", "Deletes what retention says now; with `before`, also "
                "every request row older than that unix time.", PurgeArgs, Purged,
                example={"before": 1764500000}),
    CommandType("keys.revoke", "Revokes the API key with that prefix; it stops working at "
                "once.", RevokeArgs, Revoked, example={"prefix": "1a2b3c4d"}),
    # Reads only, but hashes a whole model file on the box: an operator's, not a viewer's.
    CommandType("model.verify", "Checks, changing nothing, that a version of a model (a "
                "release's version or a digest) is installed, hashes to its digest and has "
                "a GGUF header that reads.", VerifyArgs, ModelVerified, role="operator",
                mutating=False, example={"name": "gemma3:270m", "version": 1}),
    CommandType("rollout.start", "Starts a rollout of a signed release: download, verify, "
                "stage, switch, health gate; with `config`, a capacity release (those "
                "runtime settings, gated on the version served).", StartArgs, RolloutAnswer,
                example={"rollout_id": "r1", "name": "gemma3:270m", "version": 2}),
    CommandType("rollout.cancel", "Cancels a rollout before its switch (from ACTIVATING on, "
                "only a rollback goes back).", TargetArgs, RolloutAnswer,
                example={"rollout_id": "r1"}),
    CommandType("rollout.rollback", "Switches back to the previous version, or cancels a "
                "rollout not yet active.", TargetArgs, RolloutAnswer,
                example={"name": "gemma3:270m"}),
)
COMMAND_TYPES: Mapping[str, CommandType] = MappingProxyType({t.name: t for t in _TYPES})


M = TypeVar("M", bound=BaseModel)


def typed_args(name: str, args: Any, model: type[M]) -> M:
    """The `args` of a command of type `name` as `model`, the type's registered one: the
    box's handlers read what the controller checked, through the same schema."""
    found = lookup(name)
    if found.args is not model:
        raise TypeError(f"{name} takes {found.args.__name__}, not {model.__name__}")
    return cast(M, found.parse(args))


def lookup(name: str) -> CommandType:
    """The type called `name`; UnknownType listing the ones there are."""
    found = COMMAND_TYPES.get(name)
    if found is None:
        raise UnknownType(f"no command type {name[:64]!r} (one of "
                          f"{', '.join(COMMAND_TYPES)})")
    return found


# -- shapes, for the help and the manual ------------------------------------------------------

def shape(model: type[BaseModel]) -> str:
    """A model as one line of JSON-like text: `{"before"?: number or null}` (`?`: may be
    left out), `{key: number or null}` for a map, `…` for fields beyond those named, `any
    (ignored)` for args a type does not read."""
    schema = model.model_json_schema()
    return _shape(schema, schema.get("$defs", {}))


_SCALARS = {"string": "string", "integer": "integer", "number": "number",
            "boolean": "boolean", "null": "null"}


def _shape(node: Mapping[str, Any], defs: Mapping[str, Any]) -> str:
    if "$ref" in node:
        return _shape(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
    if "anyOf" in node:
        return " or ".join(dict.fromkeys(_shape(n, defs) for n in node["anyOf"]))
    kind = node.get("type")
    if kind == "array":
        return f"[{_shape(node.get('items', {}), defs)}]"
    if kind == "object":
        if not node.get("properties") and node.get("additionalProperties", True) is True:
            return "any (ignored)"
        required = set(node.get("required", ()))
        parts = [f'"{name}"{"" if name in required else "?"}: {_shape(field, defs)}'
                 for name, field in node.get("properties", {}).items()]
        extra = node.get("additionalProperties", True)
        if isinstance(extra, Mapping):
            parts.append(f"key: {_shape(extra, defs)}")
        elif extra is not False:
            parts.append("…")
        return "{" + ", ".join(parts) + "}"
    return _SCALARS.get(str(kind), "any")
