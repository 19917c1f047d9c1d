"""The release side as the rollout runner calls it (`rollout_rules.Releases`): a lookup
through TUF (`fleet.device.release.source`), the resumable verified download
(`fleet.device.release.transfer`), the install as an inactive version. It adapts shapes only:
every check is theirs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_agent.config import FleetSettings
from edge_agent.engine.modelops import ModelOps
from edge_agent.engine.models.entries import blobs_dir
from edge_agent.fleet.device.release import source as signed
from edge_agent.fleet.device.release import transfer
from edge_agent.fleet.protocol.agent_release import AgentManifest


@dataclass(frozen=True)
class Found:
    """A verified release as the runner reads it: the manifest as a plain mapping."""

    release: signed.Release

    @property
    def name(self) -> str:
        return self.release.name

    @property
    def version(self) -> str:
        return self.release.version

    @property
    def length(self) -> int:
        return self.release.length

    @property
    def sha256(self) -> str:
        return self.release.sha256

    @property
    def manifest(self) -> Mapping[str, Any]:
        return self.release.manifest.model_dump()

    @property
    def agent(self) -> AgentManifest | None:
        """An agent release's manifest (None: a model's)."""
        m = self.release.manifest
        return m if isinstance(m, AgentManifest) else None


class SignedReleases:
    def __init__(self, fleet: FleetSettings, state_dir: Path, *,
                 source: signed.ReleaseSource | None = None) -> None:
        self.source = source or signed.ReleaseSource(fleet, state_dir)
        self.pace = signed.Pace.of(fleet)
        self.blobs = blobs_dir(state_dir)

    def lookup(self, name: str, version: str) -> Found:
        return Found(self.source.lookup(name, version))

    def lookup_agent(self, version: str) -> Found:
        return Found(self.source.lookup_agent(version))

    def download(self, release: Found, dest_dir: Path, *,
                 progress: Callable[[int, int], None], max_bytes_per_s: int | None = None,
                 headroom: int) -> Path:
        def report(done: int, total: int, rate: float, eta: float | None) -> None:
            progress(done, total)  # a cancel raises here and leaves the part file

        return transfer.download(release.release, dest_dir, progress=report,
                                 max_bytes_per_s=max_bytes_per_s, headroom=headroom,
                                 install_copy=transfer.store_copy_needed(dest_dir, self.blobs),
                                 pace=self.pace)

    def install(self, release: Found, path: Path, modelops: ModelOps, *, by: str) -> Any:
        return signed.install(release.release, path, modelops, by=by)
