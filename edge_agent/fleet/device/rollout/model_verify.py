"""`model.verify`: whether a version of a model is still on this box and would start (the
central review asks it of a production model's rollback target), answered without
changing anything.

A version is named by its release (`version`, as `rollout.start` takes it) or by its bytes
(`digest`). A release's version is found in two records, in this order:

1. the model store's version whose origin is that release (`release.source.install`
   records it, for a rollout and a `models pull` alike);
2. the digest the latest rollout of that release on this box recorded
   (`RolloutStore.release_digest`): the release's bytes may have been installed before
   under another origin (the rollout then found them "already installed"), or removed
   since — then the answer can still say which digest is gone.

A version neither names is no error: the answer is `present: false` with the reason, so
the controller can count the boxes without it. Args that break the schema are refused
(`malformed`) before anything is read.

The checks are the model store's (`ModelOps.check`): the blob is there, has the version's
size and sha256, and its GGUF header reads in the bounded child (`gguf_probe`). The hash
reads the whole file, gigabytes on a real model: it runs on the link's `fleet-commands`
worker, never on the owner thread, so the link goes on meanwhile; and on a thread of its
own at a rollout verification's priority (`fleet.rollout_nice`, `priority.call_niced`), so
requests keep their cores.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from edge_agent.engine.modelops import ModelOps
from edge_agent.fleet.device.link.command_gate import Handler, command_args
from edge_agent.fleet.device.release.source import release_origin
from edge_agent.fleet.protocol.command import Command
from edge_agent.fleet.protocol.command_types import VerifyArgs
from edge_agent.fleet.protocol.ids import release_version
from edge_agent.names import ModelName
from edge_agent.priority import call_niced

__all__ = ["RecordedDigest", "model_verify_handler"]

# The digest a rollout here recorded for release (name, version); None: none did.
RecordedDigest = Callable[[ModelName, str], str | None]


def model_verify_handler(ops: ModelOps, *, recorded: RecordedDigest | None = None,
                         nice: Callable[[], int] = lambda: 0) -> Handler:
    """`model.verify`, args `{"name", "version"}` or `{"name", "digest"}`; the answer is
    `protocol.command_types.ModelVerified`. `recorded`: the rollouts' record of a
    release's digest (None: a box without rollouts reads the model store only). `nice`:
    the hash's nice increment, read at each command (`fleet.rollout_nice` may be patched)."""

    def handle(command: Command) -> dict[str, Any]:
        args = command_args(command, VerifyArgs)
        name = ModelName.parse(args.name)
        if args.digest is not None:
            return _answer(ops, name, args.digest.removeprefix("sha256:"), nice(),
                           {"digest": args.digest},
                           f"no version {args.digest[:19]}… of {name} on this box")
        version = release_version(args.version)
        missing = f"no version {version} of {name} on this box"
        digest = _installed_digest(ops, name, version)
        if digest is None and recorded is not None:
            digest = recorded(name, version)
            if digest is not None:
                missing += f" (its digest sha256:{digest[:12]} is not installed)"
        return _answer(ops, name, digest, nice(), {"version": version}, missing)

    return handle


def _installed_digest(ops: ModelOps, name: ModelName, version: str) -> str | None:
    """The installed version of `name` that release `version` put there, if one did."""
    origin = release_origin(name, version)
    return next((v.digest for v in ops.versions(name, missing_ok=True)
                 if v.model.origin == origin), None)


def _answer(ops: ModelOps, name: ModelName, digest: str | None, nice: int,
            asked: dict[str, Any], missing: str) -> dict[str, Any]:
    answer: dict[str, Any] = {"name": name, **asked,
                              "digest": f"sha256:{digest}" if digest else None,
                              "present": False, "verified": False, "loads": False,
                              "size_bytes": None, "detail": missing}
    checked = None if digest is None else call_niced(nice, ops.check, name, digest)
    if checked is None:
        return answer
    return {**answer, "present": checked.present, "verified": checked.verified,
            "loads": checked.loads, "size_bytes": checked.model.size,
            "detail": "; ".join(checked.problems)}
