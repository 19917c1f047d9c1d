"""[fleet]: the box's side of the link to a central controller (broker, identity, release
source, transfer and rollout knobs), and the broker URL and maintenance-window parsers the
controller's settings share.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from pydantic import Field, ValidationInfo, field_validator, model_validator

from edge_agent.config.base import MAX_INTERVAL_S, MIN_INTERVAL_S, _Section, renamed_key


class BrokerAddress(NamedTuple):
    """Where the fleet link connects: `mqtt://host:port` (plain) or `mqtts://` (TLS)."""

    host: str
    port: int
    tls: bool


_BROKER_SCHEMES = {"mqtt": (1883, False), "mqtts": (8883, True)}
# A download's progress is offered at most every 0.25 s (`fleet.device.release.transfer`), so an
# interval below that sends no more often; the floor only keeps the figure sane.
MIN_PROGRESS_INTERVAL_S = 0.1
# A cap above any link's speed (10 GB/s) caps nothing: no cap is written as unset.
MAX_DOWNLOAD_BYTES_PER_S = 10_000_000_000


def parse_broker(url: str, *, credentials: str = "fleet.username and fleet.password_file"
                 ) -> BrokerAddress:
    """`mqtt://host[:port]` (1883) or `mqtts://host[:port]` (8883); ValueError for anything
    else. Credentials never go in the URL (they would show in logs and `config show`):
    the settings named by `credentials` carry them."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:  # a port that is not a number or out of range
        raise ValueError(f"broker {url!r}: {exc}") from None
    if parts.scheme not in _BROKER_SCHEMES:
        raise ValueError(f"broker {url!r} must start with mqtt:// or mqtts:// (TLS)")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"broker {url!r} holds credentials: set {credentials} instead")
    if not parts.hostname:
        raise ValueError(f"broker {url!r} names no host")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"broker {url!r} must be only scheme://host[:port]")
    default_port, tls = _BROKER_SCHEMES[parts.scheme]
    return BrokerAddress(parts.hostname, port or default_port, tls)


class FleetSettings(_Section):
    """[fleet]: the link to a central fleet controller over MQTT (off by default)."""

    enabled: bool = Field(
        False, description="Connect to the fleet broker. Serving never waits on the link: "
        "with the broker unreachable the box serves as without it.")
    broker: str = Field(
        "mqtt://127.0.0.1:1883",
        description="mqtt://host[:port] (1883) or mqtts://host[:port] (TLS, 8883).")
    fleet_id: str | None = Field(
        None, description="The fleet this box belongs to ([A-Za-z0-9_-], 1-64 characters); "
        "required when enabled.")
    device_id: str | None = Field(
        None, description="This box's id in the fleet and its broker user name "
        "([A-Za-z0-9_-], 1-64 characters, not 'all'); required when enabled.")
    username: str | None = Field(
        None, description="Broker user name (usually the device id); unset: none sent.")
    password_file: Path | None = Field(
        None, description="File holding the broker password (first line); needs username.")
    client_cert: Path | None = Field(
        None, description="PEM client certificate for mqtts:// (with client_key).")
    client_key: Path | None = Field(
        None, description="PEM private key of client_cert.")
    ca_file: Path | None = Field(
        None, description="PEM CA bundle the broker's certificate is checked against "
        "(mqtts://); unset: the system's.")
    command_public_key_file: Path | None = Field(
        None, description="The controller's ed25519 public key (PEM, `command.pub.pem` "
        "from `fleet keygen`; never the private `command.pem`). Commands are verified "
        "against it; unset: every command is refused (bad_signature). Formerly "
        "command_key_file, still read with a warning until the next release.")
    metrics_interval_s: float = Field(
        60.0, ge=MIN_INTERVAL_S, le=MAX_INTERVAL_S,
        description="Seconds between metrics messages (1 to 86400).")
    ledger_interval_s: float = Field(
        60.0, ge=MIN_INTERVAL_S, le=MAX_INTERVAL_S,
        description="Seconds between ledger summaries (1 to 86400).")
    outbox_max_bytes: int = Field(
        64 * 1024 * 1024, ge=64 * 1024,
        description="Bytes the outbox may hold; past it the oldest metrics rows are dropped "
        "(and the drop reported). Audit rows are never dropped.")
    keepalive_s: int = Field(30, ge=5, le=65535, description="MQTT keep-alive in seconds.")
    reconnect_min_s: float = Field(
        1.0, gt=0, description="First reconnect delay; doubled per failure, with jitter.")
    reconnect_max_s: float = Field(120.0, gt=0, description="Longest reconnect delay.")
    # -- model rollouts: signed releases (TUF), their transfer and their activation
    tuf_root_file: Path | None = Field(
        None, description="The release repository's root metadata (root.json) provisioned "
        "with the box; the only release metadata trusted without a signature chain. Unset: "
        "rollouts are refused.")
    artifacts_url: str | None = Field(
        None, description="Where release metadata and model files are served: the "
        "controller host's `fleet serve-releases` (e.g. https://releases.example:9465/"
        "releases/), or a static server (or object store with Range) over its `releases/`; "
        "the controller's own `/releases/` (its `http.port`, 9464) only where boxes reach "
        "that port.")
    artifacts_ca_file: Path | None = Field(
        None, description="PEM CA the release server's HTTPS certificate is checked "
        "against (a private CA, e.g. `fleet pki`'s ca.pem); unset: the system's CAs.")
    max_download_bytes_per_s: int | None = Field(
        None, ge=1024, le=MAX_DOWNLOAD_BYTES_PER_S,
        description="Cap on a model download's rate (1024 to 10^10 bytes a second); unset: "
        "as fast as the link allows.")
    download_headroom_bytes: int = Field(
        1 << 30, ge=0, description="Free disk a download must leave besides the file itself.")
    min_transfer_bytes_per_s: int = Field(
        4096, ge=1, description="The slowest a release's metadata and model file may arrive "
        "on average once transfer_grace_s has passed (TUF's slow-retrieval defence): a "
        "fetch that falls behind is cut (too_slow, retried by a rollout), so a file of N "
        "bytes has transfer_grace_s + N / this seconds. Under max_download_bytes_per_s a "
        "download's floor is at most half the cap.")
    transfer_grace_s: float = Field(
        30.0, gt=0, description="Seconds a release fetch has before "
        "min_transfer_bytes_per_s applies (connecting, the first bytes); also the longest "
        "a read waits for any byte.")
    metadata_deadline_s: float = Field(
        120.0, gt=0, description="Seconds one release lookup may spend fetching metadata "
        "(root, timestamp, snapshot, targets) in all; past it the lookup fails (too_slow).")
    progress_interval_s: float = Field(
        5.0, ge=MIN_PROGRESS_INTERVAL_S, le=MAX_INTERVAL_S,
        description="Seconds between a rollout's download progress messages over the link "
        "(audit, never dropped; 0.1 to 86400); the first and the last always go.")
    rollout_nice: int = Field(
        10, ge=0, le=19, description="How much lower the CPU priority of a rollout's "
        "download, verification and precheck runs than serving (nice increment; 0: the "
        "same), so requests keep their cores while a release arrives.")
    maintenance_window: str | None = Field(
        None, description='Local time when a staged release may be activated, "HH:MM-HH:MM" '
        '(may wrap midnight, e.g. "22:00-05:00"); unset: any time.')
    defer_while_busy: bool = Field(
        False, description="Activate only when the model's queue is empty, up to "
        "defer_deadline_s after staging.")
    defer_deadline_s: float = Field(
        3600.0, gt=0, description="Longest a busy model defers an activation.")
    switch_wait_s: float = Field(
        60.0, ge=0, le=600, description="When a new version cannot load beside the old one "
        "(memory), requests for the name wait this long for the swap (queue time, not a "
        "refusal); past it, or with 0, they get 503 with Retry-After.")
    rollout_max_failures: int = Field(
        3, ge=1, description="Attempts of a FAILED rollout (transfer, verification) before it "
        "stays FAILED.")
    agent_releases_dir: Path | None = Field(
        None, description="Where agent releases (edge-agent and its llama.cpp, `fleet "
        "rollout start --agent`) are installed side by side, with the `current` link the "
        "service runs. Unset: this box refuses agent releases. The Ansible role sets "
        "/opt/edge-agent/releases.")
    agent_max_boots: int = Field(
        3, ge=1, le=20, description="Starts a new agent version gets to pass its gate; at "
        "the next, the previous version comes back by itself.")
    agent_ready_timeout_s: float = Field(
        600.0, gt=0, le=86400, description="Longest from an agent switch to the new version "
        "passing its gate (its start, its default model loaded, the golden set); past it, "
        "the previous version comes back by itself.")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        # One name had two meanings: the controller's private key and the box's public one.
        return renamed_key(data, "command_key_file", "command_public_key_file", "fleet.")

    @field_validator("maintenance_window")
    @classmethod
    def _window(cls, value: str | None) -> str | None:
        if value is not None:
            parse_window(value)
        return value

    @field_validator("artifacts_url")
    @classmethod
    def _artifacts(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not re.fullmatch(r"https?://[^\s/]+(/[^\s]*)?", value):
            raise ValueError(f"fleet.artifacts_url {value!r} is not an http(s) URL")
        return value if value.endswith("/") else value + "/"

    @field_validator("fleet_id", "device_id")
    @classmethod
    def _id(cls, value: str | None, info: ValidationInfo) -> str | None:
        """Checked even while disabled: a bad id is a mistake to report before it is used."""
        from edge_agent.names import check_fleet_id

        if value is None:
            return None
        return check_fleet_id("fleet" if info.field_name == "fleet_id" else "device", value)

    @field_validator("broker")
    @classmethod
    def _broker(cls, url: str) -> str:
        parse_broker(url)
        return url.strip()

    @model_validator(mode="after")
    def _complete(self) -> FleetSettings:
        if self.enabled:
            for name in ("fleet_id", "device_id"):
                if getattr(self, name) is None:
                    raise ValueError(f"fleet.{name} is required when fleet.enabled is true")
        if self.password_file is not None and self.username is None:
            raise ValueError("fleet.password_file needs fleet.username")
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("fleet.client_cert and fleet.client_key go together")
        tls = parse_broker(self.broker).tls
        if not tls and (self.client_cert is not None or self.ca_file is not None):
            raise ValueError("fleet.client_cert and fleet.ca_file need an mqtts:// broker")
        if self.reconnect_min_s > self.reconnect_max_s:
            raise ValueError("fleet.reconnect_min_s is above fleet.reconnect_max_s")
        return self

    @property
    def broker_address(self) -> BrokerAddress:
        return parse_broker(self.broker)


def parse_window(text: str) -> tuple[int, int]:
    """A maintenance window "HH:MM-HH:MM" as (start, end) minutes after local midnight; an
    end before the start wraps past midnight. ValueError when malformed."""
    m = re.fullmatch(r"\s*(\d{1,2}):(\d{2})\s*-\s*(\d{1,2}):(\d{2})\s*", text)
    if not m:
        raise ValueError(f'maintenance window {text!r} is not "HH:MM-HH:MM"')
    h1, m1, h2, m2 = (int(g) for g in m.groups())
    if h1 > 23 or h2 > 23 or m1 > 59 or m2 > 59:
        raise ValueError(f"maintenance window {text!r} holds a time past 23:59")
    start, end = h1 * 60 + m1, h2 * 60 + m2
    if start == end:
        raise ValueError(f"maintenance window {text!r} is empty")
    return start, end
