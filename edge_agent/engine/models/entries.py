"""The records the model store reads and writes: catalog entries and installed versions.

Shared by the store (`catalog`), its database (`versions`) and the manifest mirror
(`manifests`); data only, no file or database access beyond naming a blob's path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from edge_agent.names import ModelName


class InstalledModel(BaseModel):
    """What the store knows about an installed model version; written as its manifest."""

    name: ModelName
    digest: str
    size: int
    origin: str
    installed_at: float
    architecture: str
    family: str
    parameter_size: str
    quantization: str
    context_length: int | None
    embedding_length: int | None
    chat_template: str | None
    template_source: str
    has_fim: bool
    license: str = ""
    tier: str = "experimental"
    parameters: dict[str, Any] = Field(default_factory=dict)

    def blob_path(self, state_dir: Path) -> Path:
        return blobs_dir(state_dir) / f"sha256-{self.digest}"


def blobs_dir(state_dir: Path) -> Path:
    """Where the model store keeps its blobs (and stages new ones)."""
    return state_dir / "blobs"


def prompt_cache_dir(state_dir: Path) -> Path:
    """Where the prompt cache keeps shared prefixes' states, a folder per model digest
    (removed with the model's blob)."""
    return state_dir / "prompt-cache"


class ManifestExtras(BaseModel):
    """What a file's GGUF header does not say and its source does (a catalog entry, a
    rollout's manifest); empty fields fall back to the header's values."""

    model_config = ConfigDict(extra="forbid")
    family: str = ""
    parameter_size: str = ""
    quantization: str = ""
    license: str = ""
    tier: str = "experimental"
    chat_template: str | None = None
    template_source: str = "catalog"  # recorded when chat_template is given
    parameters: dict[str, Any] = Field(default_factory=dict)


class PackageSource(BaseModel):
    """A GGUF shipped inside a Python package: a file in its wheel, or a chunked assembly."""

    model_config = ConfigDict(extra="forbid")
    pypi: str
    file: str | None = None
    assemble: str | None = None


class CatalogEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str = ""
    family: str = ""
    parameter_size: str = ""
    quantization: str = ""
    context_length: int | None = None
    license: str = ""
    tier: str = "experimental"
    sha256: str
    size: int
    chat_template: str | None = None
    source: PackageSource
    parameters: dict[str, Any] = Field(default_factory=dict)

    def extras(self) -> ManifestExtras:
        return ManifestExtras(
            family=self.family, parameter_size=self.parameter_size,
            quantization=self.quantization, license=self.license, tier=self.tier,
            chat_template=self.chat_template, parameters=dict(self.parameters))
