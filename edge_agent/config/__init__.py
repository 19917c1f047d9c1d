"""Settings: defaults < TOML file < EDGE_AGENT_* environment < command-line flags.

Built once at the entry point (`load_settings`) and passed down; nothing reads the
environment or the file anywhere else. The sections live here, but [fleet] and the broker
and window parsers (`config.fleet`) and the shared base (`config.base`); every name of the
box's settings is imported from `edge_agent.config`. The fleet controller's settings (its
own file, `/etc/edge-agent-fleet/controller.toml`) are `config.controller`, built on the same
base; only `edge-agent fleet …` imports them, so this module does not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, cast

import tomllib
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from edge_agent.config.base import (
    DRAFT_MODEL_TOKENS,
    MAX_DRAFT,
    MAX_INTERVAL_S,
    MIN_INTERVAL_S,
    ConfigError,
    HTTPSFiles,
    _Section,
    renamed_key,
)
from edge_agent.config.fleet import BrokerAddress, FleetSettings, parse_broker, parse_window
from edge_agent.config.upstreams import Egress, Route, RoutingSettings, UpstreamSettings

__all__ = ["DEFAULT_CONFIG_FILE", "DRAFT_MODEL_TOKENS", "MAX_DRAFT", "MAX_INTERVAL_S",
           "MIN_INTERVAL_S", "BatchSettings", "BrokerAddress", "ConfigError", "Egress",
           "FleetSettings", "HTTPSFiles", "LayeredSettings", "LedgerSettings", "ModelOverride",
           "ModelsSettings", "RedactionSettings", "RetentionSettings", "RiskSettings", "Route",
           "RoutingSettings", "RuntimeSettings", "ServerSettings", "Settings",
           "TelemetrySettings", "TenantPolicy", "UpstreamSettings", "load_layered",
           "load_settings", "parse_broker", "parse_window", "renamed_key"]

DEFAULT_CONFIG_FILE = Path("/etc/edge-agent/config.toml")


class ServerSettings(HTTPSFiles):
    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(11434, ge=0, le=65535, description="TCP port (Ollama's by default).")
    max_body_bytes: int = Field(
        8 * 1024 * 1024, gt=0, description="Largest request body accepted; larger gets 413."
    )
    metrics_key: str | None = Field(
        None, description="Bearer key for /metrics from other hosts (loopback needs none)."
    )
    header_timeout_s: float = Field(
        10.0, gt=0,
        description="A request's head (request line and headers) must arrive in full within "
        "this many seconds of the connection opening, or of its first byte after a "
        "keep-alive pause; else 408 and the connection is closed.",
    )
    body_timeout_s: float = Field(
        30.0, gt=0,
        description="A request's body must arrive in full within this many seconds of its "
        "head; else 408 and the connection is closed.",
    )
    keep_alive_timeout_s: float = Field(
        5.0, gt=0, description="An idle keep-alive connection is closed after this long."
    )
    stall_timeout_s: float = Field(
        30.0, gt=0,
        description="A client that takes none of the bytes owed to it (a stream it stopped "
        "reading) for this long is disconnected, and its generation cancelled.",
    )
    max_connections: int = Field(
        128, ge=1,
        description="Open connections at most; a request on a connection beyond gets 503 "
        "(Retry-After) and the connection is closed.",
    )
    stop_grace_s: float = Field(
        10.0, ge=0, le=300,
        description="At a stop (SIGTERM), running requests get this long to finish; then "
        "every stream still open ends with a 'shutting down' error in its dialect. The "
        "systemd unit's TimeoutStopSec covers it plus the ledger's flush.",
    )


class TenantPolicy(_Section):
    """One tenant under [tenants.NAME]. Unset ceilings fall back to the model's own."""

    models: list[str] = Field(["*"], description="Model names or globs the tenant may use.")
    max_context_tokens: int | None = Field(
        None, ge=16, description="Prompt (after templating) plus output must fit in this "
        "many tokens, below the model's own context (`truncate` says what happens past it); "
        "unset: the model's context.")
    max_output_tokens: int | None = Field(
        None, ge=1, description="Ceiling on max_tokens / num_predict (`output_limit`: 400 or "
        "clamp); unset: what the context leaves.")
    # Upper bounds far above what one box serves (a million requests a minute), so that a
    # limit is a limit: past them a figure is a typo or an attack on the arithmetic, not a
    # ceiling anyone means (unset is "no ceiling").
    requests_per_minute: int | None = Field(
        None, ge=1, le=1_000_000, description="Requests admitted in any 60 s (429 with "
        "Retry-After past it; kept across restarts); unset: no limit.")
    tokens_per_minute: int | None = Field(
        None, ge=1, le=1_000_000_000, description="Tokens (prompt less its cached part, plus "
        "output) in any 60 s; unset: no limit.")
    tokens_per_day: int | None = Field(
        None, ge=1, le=1_000_000_000_000, description="The same over any 24 h; unset: no "
        "limit.")
    priority: Literal["interactive", "batch"] = Field(
        "interactive", description="The class of the tenant's requests unless one says "
        "otherwise (X-Priority): batch work yields sequences to interactive work.")
    truncate: Literal["error", "oldest_turns"] = Field(
        "error", description="A prompt over the context: refuse (400) or drop oldest turns."
    )
    output_limit: Literal["error", "clamp"] = Field(
        "error", description="max_tokens over the ceiling: refuse (400) or clamp it."
    )
    redact_prompt: bool = Field(
        False, description="The model sees the prompt with personal data redacted."
    )
    manage_models: bool = Field(
        False, description="Every key of the tenant may manage models (delete, unload, load "
        "outside `models`), as an operator key does.",
    )
    risk: Literal["low", "normal", "high"] = Field(
        "normal", description="The risk tier of the tenant's requests, which decides what "
        "each gets when the box is saturated ([risk]); a request may raise its own with "
        "X-Edge-Risk, and lower it only with risk_may_lower.")
    risk_may_lower: bool = Field(
        False, description="Requests may ask a tier below `risk` (X-Edge-Risk); without it "
        "a lower tier is refused (403).")
    egress: Egress = Field(
        "never", description="What of the tenant's requests may leave the box for an "
        "upstream ([upstreams]): nothing (answered here or refused, with the reason), its "
        "text with personal data replaced by placeholders (restored in the answer), or all "
        "of it.")
    route: Route | None = Field(
        None, description="Where the tenant's requests may run, over the model's and "
        "[routing]'s route; unset: theirs.")


class RiskSettings(_Section):
    """[risk]: what a saturated box (the model's queue full, no memory to load it) does with
    a request, by its tier. A high-tier request is never degraded: it gets 503 with a
    reason and Retry-After, whatever is set here."""

    low: Literal["queue", "refuse"] = Field(
        "queue", description="A low-tier request that asked for it (X-Edge-Defer: batch) "
        "becomes a one-line batch (202, answered in its output file); 'refuse': 503.")
    normal: Literal["fallback", "refuse"] = Field(
        "fallback", description="A normal-tier request is answered by its model's `fallback` "
        "([models.\"name\"]) when that is installed and the tenant may use it; 'refuse': 503.")
    retry_after_s: float = Field(
        5.0, ge=1, le=3600, description="Retry-After of a refusal by tier, in seconds.")


class RedactionSettings(_Section):
    regions: list[str] = Field(["US", "GB", "DE", "FR"],
                               description="Phone-number regions (ISO 3166).")
    countries: list[Literal["us", "es", "it", "nl", "fr"]] = Field(
        ["us", "es", "it"], description="National-ID formats to detect.")
    operator: Literal["tag", "mask", "hmac"] = Field(
        "tag", description="tag: <EMAIL>; mask: ***; hmac: a keyed token per value.")
    policy_version: str = Field("1", description="Recorded with every redacted span.")


class LedgerSettings(_Section):
    batch_window_ms: int = Field(
        200, ge=1, le=10_000,
        description="Rows are committed together at most this often; a crash loses at most "
        "this window.",
    )


class RetentionSettings(_Section):
    # At least a day: the hourly purge with a smaller figure empties the ledger as it
    # fills; at most ten years (and a year of content, which is a short window by design).
    ledger_days: float = Field(
        90, ge=1, le=3650, description="Days request metadata is kept (1 to 3650).")
    content_hours: float = Field(
        0, ge=0, le=8760,
        description="Hours redacted prompt/response text is kept (0: never stored; at most "
        "8760, a year).")
    batch_days: float = Field(
        30, ge=1, le=3650,
        description="Days the batch queue keeps uploaded files, ended batches and their "
        "output and error files (they hold prompts and answers); a batch still running is "
        "kept until it ends (1 to 3650).")


class BatchSettings(_Section):
    """[batches]: the OpenAI Batch API's limits (/v1/files, /v1/batches) and how its lines
    yield to interactive requests."""

    max_file_bytes: int = Field(
        50 * 1024 * 1024, ge=1024,
        description="Largest file accepted by POST /v1/files; larger gets 413.")
    max_lines: int = Field(
        50_000, ge=1, description="Most lines (requests) one batch input file may hold; more "
        "gets 400 at upload.")
    max_line_bytes: int = Field(
        1024 * 1024, ge=64,
        description="Largest line of a batch input file, in bytes (server.max_body_bytes "
        "bounds it too: a line is a request body); a longer one gets 400 at upload.")
    max_in_flight: int = Field(
        2, ge=1, le=64,
        description="Batch lines under way at once (waiting at their model or generating), "
        "all batches together. A model's scheduler starts one only within its free "
        "sequences less reserve_slots and while no other request waits for a sequence, "
        "and puts a running one back (run again later) when an interactive request waits "
        "with every sequence taken.")
    reserve_slots: int = Field(
        1, ge=0,
        description="Sequences of a model that batch lines leave free, so that an "
        "interactive request arriving starts at the next step without waiting (at most "
        "parallel - 1: a model with one sequence lends it to a line while idle, and the "
        "line gives it back when a request arrives).")
    idle_ms: int = Field(
        500, ge=0, le=600_000,
        description="A batch line starts only once no interactive request has been "
        "running or waiting for this long, and lines generating when one arrives are put "
        "back (run again later; 3 times at most each): on a CPU every row of a step costs "
        "the others time, so batch work fills the pauses in the interactive traffic (0: "
        "lines also run beside interactive requests, within the free sequences).")


class TelemetrySettings(_Section):
    interval_s: float = Field(
        5.0, ge=MIN_INTERVAL_S, le=MAX_INTERVAL_S,
        description="Seconds between hardware samples (1 to 86400).")
    hardware: bool = Field(True, description="Sample CPU, memory, GPU and Jetson sensors.")
    metrics: bool = Field(True, description="Serve /metrics and observe every request.")


class RuntimeSettings(_Section):
    context_length: int = Field(
        4096, ge=64,
        description="Context window of each request (sequence), capped by the model's own.",
    )
    threads: int = Field(0, ge=0, description="CPU threads for llama.cpp; 0 picks the cores.")
    threads_follow_load: bool = Field(
        True, description="Decode with fewer threads while other processes keep cores busy "
        "(a core counts from 0.4 of it busy): llama.cpp's threads spin-wait for each "
        "other, so one sharing its core with another program stalls every pass (beside a "
        "busy core, 2 threads decoded at a third of their quiet speed, 1 thread at 0.87 of "
        "it). false: always `threads`.")
    batch_size: int = Field(512, ge=1, description="Prompt tokens decoded per llama.cpp call.")
    n_gpu_layers: int | Literal["auto"] = Field(
        "auto",
        description="Layers to offload: 'auto' offloads all when llama.cpp has a GPU backend.",
    )
    flash_attn: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Flash attention ('auto': llama.cpp decides). 'off' makes prompt chunks "
        "deep in a context ~1.2-1.5x faster on a CPU, and short 8-row decode steps ~10% "
        "slower; past ~250 cells deep, decode steps ~1.6-3x faster.",
    )
    cpu_extra_buffers: Literal["auto", "on", "off"] = Field(
        "auto",
        description="llama.cpp's extra CPU weight layouts (repacking, AMX). 'auto' is off on "
        "CPUs with AMX, where llama.cpp's AMX kernels crash, and on elsewhere.",
    )
    compute_nice: int = Field(
        5, ge=0, le=19,
        description="Niceness added to the generation threads, so that the HTTP side (a "
        "stream's next token, a new request, a health check) gets a core at once when "
        "llama.cpp keeps every core busy (0: same priority as the rest).",
    )
    embedding_context: int = Field(
        2048, ge=64, description="Largest input, in tokens, accepted by the embedding context."
    )
    max_embedding_inputs: int = Field(
        64, ge=1, description="Most inputs one embedding request may carry; more get 400."
    )
    max_embedding_tokens: int = Field(
        65536, ge=1,
        description="Most tokens (after truncation) one embedding request may carry, all "
        "inputs together; more get 400. The default is 32 inputs of a full embedding_context.",
    )
    parallel: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = Field(
        "auto", description="Sequences decoded together per model; 'auto': as many as the "
        "model's share of memory_budget holds at context_length, 8 to 4 per thread on a CPU "
        "(32 on a GPU).")
    max_queue: int = Field(
        64, ge=0, description="Requests that may wait per model; more get 503 + Retry-After."
    )
    prefill_chunk: int = Field(
        256, ge=0,
        description="Most prompt tokens per step while others decode (0: up to batch_size).",
    )
    max_step_stall: float = Field(
        3.0, ge=0,
        description="A prompt being prefilled may slow others' steps at most this many times "
        "(0: only prefill_chunk limits it).",
    )
    aging_s: float = Field(
        10.0, ge=0, description="A waiting batch-class request goes first after this long."
    )
    deterministic: bool = Field(
        False,
        description="Batch-invariant decoding (same output batched or alone), at a cost.",
    )
    request_timeout_ms: int = Field(
        0, ge=0, description="Default deadline per request (0: none); clients may ask less."
    )
    kv_cache_type: Literal["f16", "q8_0", "q4_0"] = Field(
        "f16", description="The KV cache's cell type: 'q8_0' holds about twice the tokens "
        "(or sequences) of 'f16' in the same memory, 'q4_0' about 3.5 times, at some cost "
        "to the answers (greedy answers may differ) and, on a CPU, to speed. A capacity "
        "setting: fleet rollouts gate it.")
    max_loaded_models: int = Field(
        2, ge=1, description="Model names resident at once. Two versions of one name (a "
        "rollout's new one beside the old, until its gate passes) count once: a version "
        "switch needs memory, not a slot.")
    memory_budget: int = Field(
        0, ge=0,
        description="Bytes of RAM/VRAM for weights + KV of all loaded models (0: 80% of RAM).",
    )
    load_wait: bool = Field(
        True, description="Requests wait for a model that is loading (false: 503 at once)."
    )
    prompt_lookup: int = Field(
        0, ge=0, le=MAX_DRAFT,
        description="Speculative decoding by prompt lookup: most draft tokens a step, taken "
        "from where the answer's last tokens occurred before in the prompt or the answer "
        "(0: off). The answer is the same; a stream that quotes its prompt gets it faster. "
        "Only a stream decoding alone drafts on a CPU (up to 4 together on a GPU). A request "
        "may set its own (`options.prompt_lookup`, `X-Edge-Prompt-Lookup`).")
    answer_drafts: int = Field(
        8, ge=0, le=MAX_DRAFT,
        description="Speculative decoding from an earlier answer: a greedy request "
        "(temperature 0) whose whole prompt a sequence or the prompt cache holds with an "
        "answer after it decodes up to this many tokens of that answer as draft rows a step, "
        "for as long as they come true (0: off). The answer is the request's own; the same "
        "order sent again is answered faster. Only a stream decoding alone drafts on a CPU.")
    prompt_cache_mib: int = Field(
        1024, ge=0,
        description="Host RAM, in MiB, for the KV state of prompts that left their "
        "sequence (a conversation another one displaced, a system prompt), restored into a "
        "free sequence when a new prompt starts the same way; least recently used first, "
        "one bound for every model (0: off, only what the sequences still hold is reused). "
        "Not counted in memory_budget.")
    prompt_cache_disk_mib: int = Field(
        256, ge=0,
        description="Disk, in MiB, under the state dir for system prompts that more than "
        "one request sent, kept across restarts so the first request after one does not "
        "compute its system prompt again (0: off; needs prompt_cache_mib).")
    structured_close_tokens: int = Field(
        48, ge=0, le=4096,
        description="A JSON-schema or tool-call answer's last tokens of max_tokens, at most "
        "(at most a quarter of it, but 8 for a small one), spent closing the document: from "
        "there on, where the model's token would go on writing, a token that ends the open "
        "string, object or array is taken if the grammar allows one, so the answer ends "
        "whole with `stop` instead of cut with `length` (0: off; counted in "
        "edge_agent_structured_closed_total, `closed` in the ledger).")


class ModelOverride(_Section):
    """Per-model settings under [models."name:tag"]; unset fields fall back to [runtime]."""

    context_length: int | None = Field(None, ge=64, description="This model's "
                                       "runtime.context_length; unset: [runtime]'s.")
    n_gpu_layers: int | Literal["auto"] | None = Field(
        None, description="This model's runtime.n_gpu_layers; unset: [runtime]'s.")
    threads: int | None = Field(None, ge=0, description="This model's runtime.threads; "
                                "unset: [runtime]'s.")
    parallel: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] | None = Field(
        None, description="This model's runtime.parallel; unset: [runtime]'s.")
    kv_cache_type: Literal["f16", "q8_0", "q4_0"] | None = Field(
        None, description="This model's runtime.kv_cache_type; unset: [runtime]'s.")
    prompt_lookup: int | None = Field(None, ge=0, le=MAX_DRAFT, description="This model's "
                                      "runtime.prompt_lookup; unset: [runtime]'s.")
    # Speculation by a smaller installed model with the same vocabulary (guesses from it,
    # not from the prompt): its name, and the most guesses a step (DRAFT_MODEL_TOKENS
    # when unset; a request's prompt_lookup option or header bounds it too).
    draft_model: str | None = Field(
        None, description="A smaller installed model with the same vocabulary that guesses "
        "tokens for this one to check (speculative decoding); unset: none.")
    draft_tokens: int | None = Field(
        None, ge=1, le=MAX_DRAFT, description=f"The draft model's guesses a step; unset: "
        f"{DRAFT_MODEL_TOKENS} (a request's prompt_lookup bounds it too).")
    # The smaller installed model that answers a normal-tier request when this one is
    # saturated ([risk] normal = "fallback"); never a high-tier one.
    fallback: str | None = Field(
        None, description="The installed model that answers this one's normal-tier requests "
        "while it is saturated ([risk] normal = \"fallback\"); never a high-tier request "
        "or an embedding.")

    route: Route | None = Field(
        None, description="Where this model's requests may run ([routing] route); unset: "
        "[routing]'s.")

    @field_validator("fallback")
    @classmethod
    def _fallback_name(cls, name: str | None) -> str | None:
        """A typo stops the start, not the first saturated minute."""
        from edge_agent.errors import InvalidRequest
        from edge_agent.names import ModelName

        if name is not None:
            try:
                ModelName.parse(name)
            except InvalidRequest as exc:
                raise ValueError(exc.message) from None
        return name


class ModelsSettings(BaseModel):
    """[models]: `keep_previous`, and one table per model name for its overrides
    ([models."smollm2:135m"]), side by side as the TOML has them."""

    model_config = ConfigDict(extra="allow")
    # Every other key is a model name; its table is validated as a ModelOverride.
    __pydantic_extra__: dict[str, ModelOverride] = Field(init=False)  # type: ignore[assignment]

    keep_previous: int = Field(
        1, ge=0,
        description="After a model name switches to another installed version, how many "
        "of the versions it had before stay installed for a rollback (the most recently "
        "active); older ones are removed with their blobs unless another name uses them. "
        "Versions installed but never active are kept until removed.",
    )

    @model_validator(mode="before")
    @classmethod
    def _tables(cls, data: Any) -> Any:
        """A scalar under a name is a typo of `keep_previous` or a table written wrong:
        say which, rather than 'not a valid dictionary'."""
        if isinstance(data, dict):
            for key, value in data.items():
                if key != "keep_previous" and not isinstance(value, (dict, ModelOverride)):
                    raise ValueError(
                        f"'{key}' is neither keep_previous nor a table of settings for a "
                        f"model (write [models.\"{key}\"])")
        return data

    @property
    def overrides(self) -> dict[str, ModelOverride]:
        return dict(self.__pydantic_extra__ or {})


class LayeredSettings(BaseSettings):
    """Settings read in layers, each over the ones before: defaults < TOML file <
    environment < keyword arguments; `load_layered` names the file.

    The environment is a layer only for a class with a prefix of its own (EDGE_AGENT_*):
    without one, pydantic-settings would read bare field names (STATE_DIR, DB) that the
    environment may hold for other programs."""

    model_config = SettingsConfigDict(extra="forbid")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings]
        if settings_cls.model_config.get("env_prefix"):
            sources.append(env_settings)
        toml_file = settings_cls.model_config.get("toml_file")
        if toml_file:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_file))
        return tuple(sources)


class Settings(LayeredSettings):
    model_config = SettingsConfigDict(
        env_prefix="EDGE_AGENT_",
        env_nested_delimiter="__",
        extra="forbid",
    )

    state_dir: Path = Field(Path("/var/lib/edge-agent"), description="Ledger, blobs, outbox.")
    catalog_dir: Path | None = Field(
        None, description="Folder of catalog TOML files; the packaged catalog when unset."
    )
    default_model: str = Field("smollm2:135m", description="Model loaded at start.")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="The least severe log line written.")
    log_format: Literal["text", "json"] = Field(
        "text", description="'json': one object per line, with the request id on each."
    )
    server: ServerSettings = Field(default_factory=ServerSettings)  # type: ignore[arg-type]
    runtime: RuntimeSettings = Field(default_factory=RuntimeSettings)  # type: ignore[arg-type]
    telemetry: TelemetrySettings = Field(
        default_factory=TelemetrySettings)  # type: ignore[arg-type]
    ledger: LedgerSettings = Field(default_factory=LedgerSettings)  # type: ignore[arg-type]
    retention: RetentionSettings = Field(
        default_factory=RetentionSettings)  # type: ignore[arg-type]
    redaction: RedactionSettings = Field(
        default_factory=RedactionSettings)  # type: ignore[arg-type]
    risk: RiskSettings = Field(default_factory=RiskSettings)  # type: ignore[arg-type]
    fleet: FleetSettings = Field(default_factory=FleetSettings)  # type: ignore[arg-type]
    batches: BatchSettings = Field(default_factory=BatchSettings)  # type: ignore[arg-type]
    models: ModelsSettings = Field(default_factory=ModelsSettings)  # type: ignore[arg-type]
    tenants: dict[str, TenantPolicy] = Field(
        default_factory=dict, description="Tenant policies; API keys name their tenant.")
    upstreams: dict[str, UpstreamSettings] = Field(
        default_factory=dict, description="OpenAI-compatible servers requests may be sent to "
        "([routing]); none: every request is answered here.")
    routing: RoutingSettings = Field(
        default_factory=RoutingSettings)  # type: ignore[arg-type]

    @field_validator("state_dir", "catalog_dir")
    @classmethod
    def _absolute(cls, path: Path | None) -> Path | None:
        """A relative folder (`--state-dir ./var`) is pinned to where the command ran:
        the server and the processes it starts may later work from elsewhere, and links
        made inside the state (the bench's) must not dangle."""
        return None if path is None else path.expanduser().absolute()

    @field_validator("default_model")
    @classmethod
    def _model_name(cls, name: str) -> str:
        """Held to the rule every model name meets, so a typo stops the start with one line."""
        from edge_agent.errors import InvalidRequest
        from edge_agent.names import ModelName

        try:
            ModelName.parse(name)
        except InvalidRequest as exc:
            raise ValueError(exc.message) from None
        return name

    @model_validator(mode="after")
    def _kv_needs_flash_attention(self) -> Settings:
        """llama.cpp keeps a quantized KV cache only with flash attention: say so at the
        start, not as a model that fails to load."""
        if self.runtime.flash_attn == "off":
            types = {self.runtime.kv_cache_type} | {
                o.kv_cache_type for o in self.models.overrides.values() if o.kv_cache_type}
            if types - {"f16"}:
                raise ValueError(f"kv_cache_type '{sorted(types - {'f16'})[0]}' needs flash "
                                 "attention: set runtime.flash_attn to 'auto' or 'on'")
        return self

    def model_override(self, name: str) -> ModelOverride:
        return self.models.overrides.get(name) or ModelOverride.model_validate({})


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    """Turn {'server.port': 1} into {'server': {'port': 1}}, dropping unset (None) flags."""
    nested: dict[str, Any] = {}
    for dotted, value in flat.items():
        if value is None:
            continue
        node = nested
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


L = TypeVar("L", bound=LayeredSettings)


def load_layered(cls: type[L], config_file: Path | None, default_file: Path,
                 flags: dict[str, Any]) -> L:
    """`cls` from its layers: the TOML file `config_file` (else `default_file` if it
    exists), then `flags`, dotted keys for nested values (None: unset). Raises ConfigError
    with one line naming the file or the bad key."""
    path = config_file
    if path is None and default_file.is_file():
        path = default_file
    if path is not None:
        try:
            with path.open("rb") as fh:
                tomllib.load(fh)  # only for its errors: the TOML layer reads the file
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"config file {path}: {exc}") from exc
        cls = cast("type[L]", type(cls.__name__, (cls,), {
            "model_config": {**cls.model_config, "toml_file": path}}))
    try:
        return cls(**_nest(flags))
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "(root)"
        where = f" in {path}" if path else ""
        raise ConfigError(f"invalid setting {key}{where}: {err['msg']}") from exc


def load_settings(config_file: Path | None = None, **flags: Any) -> Settings:
    """Build the settings; raises ConfigError with one line naming the bad key.

    `flags` use dotted keys for nested values (`**{"server.port": 8080}`).
    """
    return load_layered(Settings, config_file, DEFAULT_CONFIG_FILE, flags)
