"""A release's stage and the materials it carries: signed with the release, inside its
manifest (`manifest.ReleaseManifest.stage`, `.materials`), so what a model was measured on
and what it falls back to travel with the file they describe, and nobody can change them
after the fact.

    experiment   the default, and what every release published before stages reads as
    internal     a release for the central team's own boxes
    production   a release for every box: it must carry every material, so that whoever
                 meets it on a box can tell what it is, how it was judged and how to undo it

The materials (`Materials`), besides the manifest's own `license`:

    eval_samples     the evaluation samples' file: sha256, count and the task kinds they
                     cover (`EVAL_KINDS`)
    eval_results     the results' file: sha256, and its metrics when it is a small table
    build            the llama.cpp build and quantization the results were measured on
    route            where it runs: `local`, or the name of an upstream
    degradation      what a box falls back to when it cannot serve it
    rollback_target  a published version of the same model to go back to
    review_by        when the release is to be looked at again (an ISO date)

What a stage needs is `missing` (pure): the controller refuses to publish or roll out a
production release it names anything for (`controller.releases.readiness`, which also
checks that the rollback target is published). Where a stage may go is the controller's
too (`controller.rings`). This module never reads files or the repository: data in,
data out, errors as ValueErrors naming the field.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator

from edge_agent.fleet.protocol.ids import VERSION, VERSION_RULE
from edge_agent.telemetry.task_kinds import TASK_KINDS, TaskKind

Stage = Literal["experiment", "internal", "production"]
STAGES: tuple[str, ...] = get_args(Stage)  # from the least proven to the most
PRODUCTION = "production"
# The task kinds an evaluation sample may exercise: a dialect, or a feature of the request
# path that a model can get wrong where another gets it right. The same words a box counts
# its requests by (`edge_agent_request_kinds_total`), so they are defined once, with it.
EvalKind = TaskKind
EVAL_KINDS: tuple[str, ...] = TASK_KINDS
# What a production release must carry, in the order a refusal names them.
PRODUCTION_NEEDS = ("license", "eval_samples", "eval_results", "build", "route",
                    "degradation", "rollback_target", "review_by")
MAX_METRICS = 64
_SHA256 = re.compile(r"[0-9a-f]{64}")
_UPSTREAM = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_METRIC = re.compile(r"[A-Za-z][A-Za-z0-9_.:/-]{0,63}")
_TEXT_CHARS = 500


class _Material(BaseModel):
    # extra ignored: a newer publisher's material never stops an older reader
    model_config = ConfigDict(extra="ignore", frozen=True)


class EvalSamples(_Material):
    """The evaluation samples' file, summarised: its content is not published."""

    sha256: str
    count: int = Field(ge=1)
    kinds: list[EvalKind] = Field(min_length=1)

    @field_validator("sha256")
    @classmethod
    def _digest(cls, value: str) -> str:
        return _sha256(value)

    @field_validator("kinds")
    @classmethod
    def _kinds(cls, value: list[str]) -> list[str]:
        return sorted(set(value), key=EVAL_KINDS.index)


class EvalResults(_Material):
    """The evaluation results' file: its digest always, its metrics when it is a small
    table of numbers (`metrics` is empty otherwise, and the digest names the file)."""

    sha256: str
    metrics: dict[str, float | int] = Field(default_factory=dict, max_length=MAX_METRICS)

    @field_validator("sha256")
    @classmethod
    def _digest(cls, value: str) -> str:
        return _sha256(value)

    @field_validator("metrics")
    @classmethod
    def _metrics(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key, number in value.items():
            if not _METRIC.fullmatch(key):
                raise ValueError(f"metric name {key[:40]!r} must be {_METRIC.pattern}")
            if isinstance(number, bool):
                raise ValueError(f"metric {key} must be a number")
        return value


class Materials(_Material):
    """What a release carries besides its file (module docstring); each may be absent."""

    eval_samples: EvalSamples | None = None
    eval_results: EvalResults | None = None
    build: str | None = Field(None, description="The llama.cpp build and quantization the "
                              "results were measured on, e.g. `llama.cpp b4500 Q4_K_M`.")
    route: str | None = Field(None, description="`local`, or the upstream it is sent to.")
    degradation: str | None = Field(None, description="What a box falls back to.")
    rollback_target: str | None = Field(None, description="A published version of the "
                                        "same model.")
    review_by: str | None = Field(None, description="An ISO date, YYYY-MM-DD.")

    @field_validator("build", "degradation")
    @classmethod
    def _text(cls, value: str | None) -> str | None:
        if value is not None and not 0 < len(value.strip()) <= _TEXT_CHARS:
            raise ValueError(f"must be 1-{_TEXT_CHARS} characters")
        return value.strip() if value is not None else None

    @field_validator("route")
    @classmethod
    def _route(cls, value: str | None) -> str | None:
        if value is not None and not _UPSTREAM.fullmatch(value):
            raise ValueError(f"route {value[:40]!r} must be `local` or an upstream's name")
        return value

    @field_validator("rollback_target")
    @classmethod
    def _rollback(cls, value: str | None) -> str | None:
        if value is not None and not VERSION.fullmatch(value):
            raise ValueError(f"rollback_target {value[:40]!r} must be {VERSION_RULE}")
        return value

    @field_validator("review_by")
    @classmethod
    def _review(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return dt.date.fromisoformat(value).isoformat()
        except ValueError:
            raise ValueError(f"review_by {value[:40]!r} is not an ISO date "
                             "(YYYY-MM-DD)") from None


def missing(stage: str, license_: str, materials: Materials) -> list[str]:
    """What a release of `stage` lacks, in `PRODUCTION_NEEDS`' order (none below
    production: an experiment carries what it has)."""
    if stage != PRODUCTION:
        return []
    have = {"license": license_.strip() or None, **materials.model_dump()}
    return [need for need in PRODUCTION_NEEDS if have.get(need) in (None, "")]


def needs(stage: str, absent: list[str]) -> str:
    """The refusal's words: `a production release needs: rollback_target`."""
    return f"a {stage} release needs: {', '.join(absent)}"


def _sha256(value: str) -> str:
    if not _SHA256.fullmatch(value):
        raise ValueError("sha256 must be 64 lowercase hex digits")
    return value
