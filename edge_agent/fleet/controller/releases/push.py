"""A release signed at a desk and pushed to a controller (`fleet release push`): the way a
central team publishes when the targets key never sits on the controller's host.

1. The controller's current metadata is fetched from its public `/releases/metadata/` and
   verified as a box verifies it (python-tuf's `Updater`, from the root file the desk was
   given at provisioning: root → timestamp → snapshot → targets): the desk signs on top of
   what root vouches for, never on top of what the server says.
2. The new targets are that version plus one, with the release's entry
   (`repository.release_target`: length, sha256, manifest), signed with the desk's targets
   key.
3. The file goes up by content (`PUT /release-files/<sha256>`), then the signed targets
   (`POST /releases`); the controller checks both and re-signs snapshot and timestamp.
4. The desk verifies again from its root and finds the release there, with its length and
   sha256: what it reports as published is what a box would install.

Never: send a key anywhere, sign metadata it has not verified, or trust the controller's
answer in place of step 4.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
from securesystemslib.signer import Signer
from tuf.api import exceptions as tuf_errors
from tuf.api.metadata import Metadata, TargetFile, Targets
from tuf.ngclient import FetcherInterface, Updater

from edge_agent.fleet.controller.releases.repository import release_target
from edge_agent.fleet.protocol.agent_release import AgentManifest
from edge_agent.fleet.protocol.manifest import ReleaseManifest

METADATA = "/releases/metadata/"


class _ClientFetcher(FetcherInterface):
    """python-tuf's downloads through the desk's own client (its CA, its timeouts)."""

    def __init__(self, http: httpx.Client) -> None:
        self.http = http

    def _fetch(self, url: str) -> Iterator[bytes]:
        try:
            response = self.http.send(self.http.build_request("GET", url), stream=True)
        except httpx.HTTPError as exc:
            raise tuf_errors.DownloadError(f"{url}: {exc}") from exc
        if response.status_code >= 400:
            response.close()
            raise tuf_errors.DownloadHTTPError(f"{url}: HTTP {response.status_code}",
                                               response.status_code)

        def body() -> Iterator[bytes]:
            try:
                yield from response.iter_bytes()
            finally:
                response.close()
        return body()


def trusted_targets(http: httpx.Client, root: bytes, work: Path) -> Metadata[Targets]:
    """The controller's targets as its metadata chain from `root` vouches for them (`work`:
    an empty directory python-tuf keeps what it verified in)."""
    base = str(http.base_url).rstrip("/") + METADATA
    updater = Updater(metadata_dir=str(work), metadata_base_url=base,
                      fetcher=_ClientFetcher(http), bootstrap=root)
    updater.refresh()
    return Metadata[Targets].from_file(str(work / "targets.json"))


def file_target(file: Path, manifest: ReleaseManifest | AgentManifest) -> TargetFile:
    """The targets entry of `file` as `manifest`'s release (one read, to hash it)."""
    digest, length = hashlib.sha256(), 0
    with file.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
            length += len(chunk)
    return release_target(manifest, length, digest.hexdigest())


def next_targets(trusted: Metadata[Targets], entry: TargetFile, signer: Signer, *,
                 expires_s: int) -> Metadata[Targets]:
    """`trusted` plus `entry`, one version on, expiring `expires_s` from now, signed by
    `signer` alone."""
    md = Metadata[Targets].from_bytes(trusted.to_bytes())
    md.signed.version += 1
    md.signed.expires = (datetime.now(timezone.utc).replace(microsecond=0)
                         + timedelta(seconds=expires_s))
    md.signed.targets[entry.path] = TargetFile.from_dict(entry.to_dict(), entry.path)
    md.signatures.clear()
    md.sign(signer)
    return md
