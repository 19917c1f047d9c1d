"""A signed release installed by hand: `edge-agent models pull NAME@VERSION`.

    pulled = pull(settings, modelops, "gemma3:270m", "2", by="cli:ops", progress=bar)

The steps a rollout takes, from the same modules, so nothing is checked differently:
1. the TUF lookup (`release.ReleaseSource`: `fleet.tuf_root_file`, `fleet.artifacts_url`,
   the box's `<state>/tuf/`); tampered, replayed or expired metadata is refused there;
2. the resumable, verified download (`transfer.download`) into `<state>/downloads/`,
   where a cut pull leaves its part and the next pull of the release resumes it
   (`max_download_bytes_per_s` and `download_headroom_bytes` apply, and the floor of
   `min_transfer_bytes_per_s` after `transfer_grace_s`: a trickling server fails the pull
   `too_slow` within its deadline rather than holding it);
3. the install as a new version of the name (`release.install`), then, unless
   `activate` is False, the switch to it (`ModelOps.activate`). A version installed
   already is not fetched again.

No health gate runs (that is a rollout's). The name is held against a rollout of it in a
running server for the whole pull (`name_claim`): a live rollout of the name refuses the
pull, and a rollout.start arriving meanwhile is refused `busy`. Without the two settings
the pull is a configuration error naming them. Errors are the release module's
(`ReleaseRejected`, `ReleaseFailed`), `NameHeld`, or the store's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from edge_agent.config import ConfigError, Settings
from edge_agent.engine.modelops import ModelOps
from edge_agent.engine.models.entries import InstalledModel
from edge_agent.fleet.device.release import source as signed
from edge_agent.fleet.device.release import transfer
from edge_agent.fleet.device.rollout.name_claim import name_claim, refuse_live_rollout
from edge_agent.names import ModelName


@dataclass(frozen=True)
class Pulled:
    model: InstalledModel
    ref: str
    downloaded: bool  # False: that version was installed already
    active: bool


def pull(settings: Settings, ops: ModelOps, name: str, version: str, *, by: str,
         activate: bool = True, progress: transfer.Progress | None = None,
         source: signed.ReleaseSource | None = None,
         retry: transfer.Retry | None = None, force: bool = False) -> Pulled:
    fleet = settings.fleet
    missing = [f"fleet.{key}" for key in ("tuf_root_file", "artifacts_url")
               if getattr(fleet, key) is None]
    if missing:
        raise ConfigError(f"models pull {name}@{version} installs a signed release: set "
                          f"{' and '.join(missing)} (the release repository's root and URL)")
    key = ModelName.parse(name)
    ref = f"{key}@{version}"
    state = settings.state_dir
    with name_claim(state, key, {"pull": ref, "pid": os.getpid()}):
        if not force:  # `models pull --force`: the claim, not the rollout check
            refuse_live_rollout(state, key)
        release = (source or signed.ReleaseSource(fleet, state)).lookup(key, version)
        have = [v.model for v in ops.versions(key, missing_ok=True) if v.digest == release.sha256]
        if have:
            model = have[0]
        else:
            dest = transfer.downloads_dir(state)
            path = transfer.download(release, dest, progress=progress,
                                     max_bytes_per_s=fleet.max_download_bytes_per_s,
                                     headroom=fleet.download_headroom_bytes, retry=retry,
                                     pace=signed.Pace.of(fleet),
                                     install_copy=transfer.store_copy_needed(
                                         dest, ops.blobs))
            model = signed.install(release, path, ops, by=by)
        if activate:
            model = ops.activate(key, release.sha256, by=by)
    return Pulled(model, ref, downloaded=not have,
                  active=ops.active_digest(key) == release.sha256)

