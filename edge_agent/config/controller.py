"""The controller's settings: its own TOML file and state dir, apart from the agent's.

Built once by `edge-agent fleet …` (defaults < TOML file < command-line flags) and passed
down; nothing else reads the file. Secrets are never settings: the broker password is read
from `broker.password_file` when connecting, and a database URL's password is never shown.

    state_dir = "/var/lib/edge-agent-fleet"
    db = "postgresql://fleet@db.example/fleet"   # unset: <state_dir>/controller.db
    command_signing_key_file = "/var/lib/edge-agent-fleet/keys/command.pem"
    [broker]
    url = "mqtts://broker.example:8883"
    username = "controller"
    password_file = "/etc/edge-agent-fleet/controller.password"
    ca_file = "/etc/edge-agent-fleet/ca.pem"
    [http]
    host = "127.0.0.1"
    port = 9464
    [retention]
    metrics_days = 30
    audit_days = 365
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from edge_agent.config import (
    BrokerAddress,
    ConfigError,
    HTTPSFiles,
    LayeredSettings,
    load_layered,
    parse_broker,
    renamed_key,
)
from edge_agent.names import check_fleet_id

# How long a box that answered "busy" waits before the controller sends it the rollout again
# (the wave policy, `fleet.controller.waves`, reads it from here).
BUSY_RETRY_S = 30.0
DEFAULT_CONFIG_FILE = Path("/etc/edge-agent-fleet/controller.toml")
DEFAULT_STATE_DIR = Path("/var/lib/edge-agent-fleet")


def broker_address(url: str) -> BrokerAddress:
    """The agent's rule for broker URLs (`config.parse_broker`), worded for the controller."""
    return parse_broker(url, credentials="broker.username and broker.password_file")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BrokerSettings(_Section):
    url: str = Field("mqtt://127.0.0.1:1883", description="mqtt://host[:port] or mqtts://…")
    username: str | None = Field("controller", description="The controller's broker user.")
    password_file: Path | None = Field(None, description="File holding its password.")
    ca_file: Path | None = Field(None, description="PEM CA for mqtts:// (unset: system's).")
    client_cert: Path | None = Field(None, description="PEM certificate the controller "
                                     "shows the broker (mutual TLS), with client_key.")
    client_key: Path | None = Field(None, description="Its private key, owner-only.")
    client_id: str = Field("edge-fleet-controller",
                           description="MQTT client id; the broker keeps its session by it.")
    session_expiry_s: int = Field(
        3600, ge=0, description="How long the broker keeps the controller's queue while it "
        "is away (MQTT 5 session expiry).")
    shared_group: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_-]{1,64}$", description="Beside other controllers of "
        "the same PostgreSQL store: the MQTT 5 shared subscription group they take the "
        "boxes' reports through (each report to one of them). Each controller needs a "
        "client_id of its own.")
    keepalive_s: int = Field(30, ge=5, le=65535, description="MQTT keepalive: the broker "
                             "counts the controller gone after 1.5 times this in silence.")
    receive_maximum: int = Field(
        1000, ge=1, le=65535, description="Messages the broker may have in flight to the "
        "controller; each is acknowledged to the broker only once it is committed.")

    @field_validator("username")
    @classmethod
    def _username(cls, name: str | None) -> str | None:
        return name or None  # "" in a TOML file: connect without a user name

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        broker_address(url)
        return url.strip()

    @model_validator(mode="after")
    def _complete(self) -> BrokerSettings:
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("broker.client_cert and broker.client_key go together")
        if not self.address.tls and (self.ca_file or self.client_cert):
            raise ValueError("broker.ca_file and broker.client_cert need an mqtts:// url")
        return self

    @property
    def address(self) -> BrokerAddress:
        return broker_address(self.url)


class ReleaseServerSettings(HTTPSFiles):
    """`fleet serve-releases`: the signed repository (`<state_dir>/releases/`) read-only to
    the boxes, on a listener of its own, so that the controller's API stays where only
    operators reach it."""

    host: str = Field("0.0.0.0", description="Address the boxes reach the release server "
                      "on (fleet serve-releases).")
    port: int = Field(9465, ge=1, le=65535, description="Its port; the boxes' "
                      "fleet.artifacts_url is https://HOST:PORT/releases/.")


class HTTPSettings(HTTPSFiles):
    host: str = Field("127.0.0.1", description="Address of the API, the console, /metrics "
                      "and /releases/; any other than loopback needs TLS (tls_cert_file) and "
                      "an operator (fleet operators create).")
    port: int = Field(9464, ge=0, le=65535, description="Port of the API, the console, "
                      "/metrics and /releases/.")
    metrics_open: bool | None = Field(
        None, description="Whether /metrics and /healthz answer without an operator token "
        "(null: yes on a loopback host, no elsewhere).")


class RetentionSettings(_Section):
    metrics_days: float | None = Field(
        30.0, gt=0, description="Days the store keeps a box's metrics messages (null: for "
        "ever); Prometheus, scraping /metrics, is where long history lives.")
    audit_days: float | None = Field(
        365.0, gt=0, description="Days the store keeps audit messages (rollout transitions "
        "and evidence, command results' reports…; null: for ever).")
    every_s: float = Field(3600.0, gt=0, description="Seconds between two purges.")
    batch: int = Field(5000, ge=1, description="Messages removed per transaction.")


class SLOSettings(_Section):
    """`[slo]`: the service levels the fleet is held to. The alerting rules
    (`edge-agent fleet observability rules`) read them from the export
    (`edge_fleet_slo_target_seconds`, `edge_fleet_slo_target_ratio`), so changing one here
    moves the alert without editing a rule."""

    ttft_p95_ms: float = Field(2000.0, gt=0, description="Time to first token, p95 of a "
                               "box's interval, above which its alert fires.")
    tpot_p95_ms: float = Field(250.0, gt=0, description="Time per output token, p95.")
    error_rate: float = Field(0.05, gt=0, le=1, description="Share of a fleet's requests "
                              "that may fail with a server error after a release.")
    compare_s: float = Field(1800.0, ge=60, description="The window either side of a box's "
                             "update that a release's before/after table compares.")


class IngestSettings(_Section):
    batch_max: int = Field(500, ge=1, description="Messages committed in one transaction.")
    batch_wait_s: float = Field(0.05, gt=0, description="Longest wait to fill a batch.")


class ClientSettings(_Section):
    """`[controller]`: where a desk's `edge-agent fleet …` commands go (a desk's own file,
    given with --config; the flags and EDGE_AGENT_CONTROLLER* win over it)."""

    url: str | None = Field(None, description="The controller's API, https://HOST:PORT; "
                            "unset: this host's store, in-process.")
    token_file: Path | None = Field(None, description="File holding the operator token.")
    ca_file: Path | None = Field(None, description="PEM CA the controller's certificate is "
                                 "checked against (default: the system's).")

    @field_validator("token_file", "ca_file")
    @classmethod
    def _absolute_file(cls, path: Path | None) -> Path | None:
        return None if path is None else path.expanduser().absolute()


# A fleet's ring: the least proven release stage its boxes take (`fleet.protocol.materials`
# orders the stages; tests/fleet/controller/test_stages.py holds the two lists together).
Ring = Literal["experiment", "internal", "production"]


class StageSettings(_Section):
    """`[stages]`: which release stages each fleet's boxes take (`fleet.controller.rings`):
    `fleets = { lab = "experiment", staff = "internal", shops = "production" }` puts each
    fleet in a ring (experiment: its boxes take every stage; internal: internal and
    production releases; production: production releases only). A rollout whose devices
    reach a box its release's stage may not go to is refused."""

    fleets: dict[str, Ring] = Field(
        default_factory=dict, description="Each fleet's ring, by fleet id: experiment "
        "(its boxes take every stage), internal (internal and production releases) or "
        "production (production releases only).")
    unlisted: Ring = Field(
        "experiment", description="The ring of a fleet not listed in fleets (experiment: "
        "every stage, as before stages existed; production: a new fleet takes only "
        "production releases until it is listed).")

    @field_validator("fleets")
    @classmethod
    def _fleet_ids(cls, fleets: dict[str, Ring]) -> dict[str, Ring]:
        for fleet in fleets:
            check_fleet_id("fleet", fleet)
        return fleets


class ControllerSettings(LayeredSettings):
    # No environment layer (no env_prefix); keys in the file are spelt as here.
    model_config = SettingsConfigDict(extra="forbid", case_sensitive=True)

    state_dir: Path = Field(
        DEFAULT_STATE_DIR, description="controller.db, the keys (keys/, from `fleet keygen`) "
        "and the release repository (releases/) live here.")
    db: str | None = Field(None, description="postgresql://… (unset: SQLite in state_dir).")
    broker: BrokerSettings = Field(default_factory=BrokerSettings)  # type: ignore[arg-type]
    http: HTTPSettings = Field(default_factory=HTTPSettings)  # type: ignore[arg-type]
    releases: ReleaseServerSettings = Field(
        default_factory=ReleaseServerSettings)  # type: ignore[arg-type]
    stages: StageSettings = Field(default_factory=StageSettings)  # type: ignore[arg-type]
    ingest: IngestSettings = Field(default_factory=IngestSettings)  # type: ignore[arg-type]
    controller: ClientSettings = Field(default_factory=ClientSettings)  # type: ignore[arg-type]
    slo: SLOSettings = Field(default_factory=SLOSettings)  # type: ignore[arg-type]
    retention: RetentionSettings = Field(
        default_factory=RetentionSettings)  # type: ignore[arg-type]
    command_signing_key_file: Path | None = Field(
        None, description="The controller's ed25519 private key (PEM, `command.pem` from "
        "`fleet keygen`) that signs commands, acks and rollouts; it never leaves the "
        "controller: boxes hold its public half as fleet.command_public_key_file. Formerly "
        "command_key_file, still read with a warning until the next release.")
    command_ttl_s: float = Field(300.0, gt=0, description="Seconds a sent command stays valid.")
    rollout_tick_s: float = Field(1.0, gt=0, le=60, description="Seconds between two passes "
                                  "of the rollout engine over the running rollouts.")
    rollout_busy_retry_s: float = Field(BUSY_RETRY_S, gt=0, description="Seconds before a box that "
                                        "refused rollout.start as busy (another change of "
                                        "the name under way there) is asked again.")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        # One name had two meanings: the controller's private key and the box's public one.
        return renamed_key(data, "command_key_file", "command_signing_key_file", "")

    @field_validator("state_dir")
    @classmethod
    def _absolute(cls, path: Path) -> Path:
        return path.expanduser().absolute()

    @field_validator("db")
    @classmethod
    def _db(cls, url: str | None) -> str | None:
        if url is not None and urlsplit(url).scheme not in ("postgresql", "postgres", "sqlite"):
            raise ValueError("db must be postgresql://… or sqlite:///path")
        return url

    @model_validator(mode="after")
    def _shared(self) -> ControllerSettings:
        if self.broker.shared_group is not None and not (
                self.db or "").startswith(("postgresql://", "postgres://")):
            raise ValueError("broker.shared_group is for two or more controllers on one "
                             "PostgreSQL store (db = postgresql://…); a SQLite store has one")
        return self

    def broker_password(self) -> str | None:
        """The first line of broker.password_file; ConfigError if it cannot be read."""
        path = self.broker.password_file
        if path is None:
            return None
        try:
            return path.read_text(encoding="utf-8").splitlines()[0].strip()
        except (OSError, IndexError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read broker.password_file {path}: {exc}") from exc


def load_controller_settings(config_file: Path | None = None,
                             **flags: Any) -> ControllerSettings:
    """Defaults < the TOML file (default /etc/edge-agent-fleet/controller.toml if present)
    < `flags` (dotted keys, None = unset). ConfigError with one line naming the bad key."""
    return load_layered(ControllerSettings, config_file, DEFAULT_CONFIG_FILE, flags)
