"""Whether a release carries what its stage asks (`protocol.materials`): checked where it
is published (`repository.ReleaseRepository.add`, a desk's targets at `POST /releases`,
and at the desk before `fleet release push` uploads) and again where a rollout of it
starts (`rollouts.operations.start`), since a release published before the rule, or signed
by an older desk, may lack what the rule now asks.

Two refusals, each naming what is wrong:

    gemma3:270m@3: a production release needs: rollback_target, review_by
    gemma3:270m@3: its rollback target 1 is not a published version of gemma3:270m

The second holds for any stage that names a rollback target: a target nobody can install
is worse than none. Pure: the caller says which target paths are published.
"""

from __future__ import annotations

from collections.abc import Collection

from edge_agent.fleet.protocol.manifest import ReleaseManifest, target_path
from edge_agent.fleet.protocol.materials import missing, needs


def refusal(manifest: ReleaseManifest, published: Collection[str]) -> str | None:
    """Why `manifest` may not be published or rolled out, given the target paths
    `published` beside it (its own is never its rollback target); None when it may."""
    absent = missing(manifest.stage, manifest.license, manifest.materials)
    if absent:
        return f"{manifest.ref}: {needs(manifest.stage, absent)}"
    target = manifest.materials.rollback_target
    if target is not None and (target == manifest.version
                               or target_path(manifest.name, target) not in published):
        return (f"{manifest.ref}: its rollback target {target} is not a published version "
                f"of {manifest.name}")
    return None
