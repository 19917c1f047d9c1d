#!/usr/bin/env python3
"""The manual's reference, generated from the code so that it cannot drift from it.

    python tools/reference.py --write    # regenerate what the code says
    python tools/reference.py --check    # exit 1 naming every page that differs

What it writes:

- whole pages under docs/reference/: the command line (every click command's `--help`), the
  settings (every field of the box's and the controller's pydantic-settings models), the
  fleet link's topics and command refusals (the fleet protocol's own constants), and the
  metrics (the Prometheus registries of the box and of the controller, as built);
- regions inside hand-written pages, between `<!-- generated: NAME -->` and
  `<!-- end generated: NAME -->`, where a table belongs beside its prose (the topics, the
  refusals, the command types from their registry, and the Ansible role's variables from
  its argument spec).

`tests/test_docs.py` runs the check, so `make test` fails when the code changes and the
manual does not. It also uses `settings_field` to hold the settings tables written by hand
(`<!-- settings: SECTION -->` before the table) to the models' keys and defaults.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # this checkout's edge_agent, not an installed one
    sys.path.insert(0, str(ROOT))

import click  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402
from pydantic import BaseModel  # noqa: E402
from pydantic.fields import FieldInfo  # noqa: E402
from pydantic_core import PydanticUndefined  # noqa: E402

from edge_agent.cli import main as cli_main  # noqa: E402
from edge_agent.config import (  # noqa: E402
    ModelOverride,
    ModelsSettings,
    Settings,
    TenantPolicy,
    UpstreamSettings,
)
from edge_agent.config.controller import ControllerSettings, SLOSettings  # noqa: E402
from edge_agent.fleet.controller.metrics import ControllerMetrics  # noqa: E402
from edge_agent.fleet.controller.slo_export import SLOExport  # noqa: E402
from edge_agent.fleet.protocol import command_types as fleet_commands  # noqa: E402
from edge_agent.fleet.protocol import refusals as fleet_refusals  # noqa: E402
from edge_agent.fleet.protocol import topics as fleet_topics  # noqa: E402
from edge_agent.fleet.protocol.envelope import class_of as envelope_class  # noqa: E402

# ---------------------------------------------------------------------------------------------
DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference"
GENERATED = ("This page is generated from the code by `python tools/reference.py --write`; "
             "`make test` fails when it differs from what the code says. Edit the code (or "
             "the notes in `tools/reference.py`), not this page.")

# What each topic kind carries: the one thing the protocol's constants do not say. A kind
# added to (or removed from) the protocol without a line here stops the generator.
TOPIC_NOTES = {
    "status": "birth at every connect, death as the MQTT Will (see "
              "[Birth and death](../fleet/link.md#birth-and-death))",
    "metrics": "the metrics summary of the last interval (droppable past the outbox "
               "budget, the drop reported)",
    "ledger": "ledger summaries",
    "events": "model and readiness changes, errors, outbox drops; after any change of the "
              "models, a `models.state` event with the whole list the birth carries",
    "cmd/result": "a command's result",
    "rollout": "a rollout's transitions, download progress and release evidence",
    "ack": "what the controller has stored, signed with the command key: "
           '`{"v":1,"device":"<id>","acks":{"<boot_id>":[[1,100],[105,107]]},"sig":"…"}`',
    "cmd": "a signed command (see [Signed commands](../fleet/commands.md#signed-commands))",
}

# Why a command is refused, in the order the box checks (the first that fails is the
# reason). A reason added to (or removed from) the protocol without a line here stops the
# generator.
REFUSAL_NOTES = {
    "oversized": "the message is over 64 KiB (checked before it is parsed)",
    "malformed": "not JSON, a field missing, unknown or of the wrong type, a number out of "
                 "its range (`seq` 1 … 2^63−1, what `fleet.db` stores; times finite), "
                 "`expires_at` not after `issued_at`, or a handler refusing its `args`",
    "wrong_device": "another fleet, another device, or a topic that is not this device's "
                    "(or the fleet's `all`) command topic",
    "bad_signature": "no signature, not base64, not the controller's key, any field "
                     "changed, or no `command_public_key_file`",
    "expired": "the box's clock is past `expires_at` by more than 30 s (allowance for a box "
               "clock a little behind)",
    "unknown_type": "a type this box has no handler for",
    "replay": "`seq` not above the last accepted in its stream; the box's own commands and "
              "fleet-wide commands are two streams",
}


# -- the command line ------------------------------------------------------------------------

WIDTH = 100


def _commands(group: click.Group, ctx: click.Context) -> Iterator[tuple[click.Context, str]]:
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if command is None or command.hidden:
            continue
        sub = click.Context(command, info_name=name, parent=ctx, terminal_width=WIDTH,
                            max_content_width=WIDTH)
        yield sub, sub.command_path
        if isinstance(command, click.Group):
            yield from _commands(command, sub)


def cli_page() -> str:
    root = click.Context(cli_main, info_name="edge-agent", terminal_width=WIDTH,
                         max_content_width=WIDTH)
    commands = [(root, "edge-agent"), *_commands(cli_main, root)]
    out = ["# Command line", "", GENERATED, "",
           "Exit codes: 0 ok, 1 a check failed, 2 a usage or configuration error (one line "
           "on stderr, `edge-agent: <message>`).", ""]
    out += [f"- [`{path}`](#{slug(path)})" for _, path in commands]
    for ctx, path in commands:
        out += ["", f"## {path}", "", "```text", ctx.command.get_help(ctx).rstrip(), "```"]
    return "\n".join(out) + "\n"


# -- settings --------------------------------------------------------------------------------

def _type(annotation: Any) -> str:
    """A field's type in words: `or` between alternatives, never a `|` (tables)."""
    origin = get_origin(annotation)
    if origin is Literal:
        return " or ".join(json.dumps(a) for a in get_args(annotation))
    if origin in (Union, types.UnionType):
        parts = [a for a in get_args(annotation) if a is not type(None)]
        text = " or ".join(_type(a) for a in parts)
        return text + (" (or unset)" if len(parts) < len(get_args(annotation)) else "")
    if origin is list:
        return "list of " + _type(get_args(annotation)[0])
    if origin is dict:
        return "table"
    if hasattr(annotation, "__metadata__"):  # Annotated[int, Field(ge=1, le=64)]
        return _type(get_args(annotation)[0]) + _bounds(annotation.__metadata__)
    names = {bool: "bool", int: "int", float: "float", str: "str", Path: "path"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _bounds(metadata: Any) -> str:
    """A field's numeric bounds: ` (1 … 64)`, ` (≥ 0)`, ` (> 0)`; empty when none."""
    found: dict[str, Any] = {}
    for item in metadata:
        if isinstance(item, FieldInfo):  # Annotated[int, Field(ge=1, le=64)]
            item = types.SimpleNamespace(**{k: getattr(b, k) for b in item.metadata
                                            for k in ("ge", "gt", "le", "lt") if hasattr(b, k)})
        for attr in ("ge", "gt", "le", "lt"):
            if getattr(item, attr, None) is not None:
                found[attr] = getattr(item, attr)
    if "ge" in found and "le" in found:
        return f" ({_number(found['ge'])} … {_number(found['le'])})"
    words = [f"{sign} {_number(found[attr])}" for attr, sign in
             (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")) if attr in found]
    return f" ({', '.join(words)})" if words else ""


def _number(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"{value:_}" if isinstance(value, int) and abs(value) >= 100_000 else str(value)


def toml_value(value: Any) -> str:
    """A default as it is written in the TOML file; `unset` for None."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Path):
        return json.dumps(str(value))
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{}" if not value else json.dumps(value)
    return str(value)


def default_of(field: FieldInfo) -> Any:
    if field.default_factory is not None:
        return field.default_factory()  # type: ignore[call-arg]
    return None if field.default is PydanticUndefined else field.default


def _cell(text: str) -> str:
    """Text for a table cell: one line, pipes escaped, `<WORD>` as code (not an HTML tag)."""
    text = re.sub(r"(?<!`)<([A-Za-z_][\w.:-]*)>(?!`)", r"`<\1>`", " ".join(text.split()))
    return text.replace("|", "\\|")


def _prose(doc: str | None) -> str:
    """A docstring as one paragraph; a leading `[section]` in code, so that Markdown does
    not read the line as a link definition."""
    text = _cell(doc or "")
    return re.sub(r"^\[([^]]+)\]", r"`[\1]`", text)


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _table(model: type[BaseModel]) -> list[str]:
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if _is_section(field.annotation) or get_origin(field.annotation) is dict:
            continue
        kind, bounds = _type(field.annotation), _bounds(field.metadata)
        if bounds and kind.endswith(" (or unset)"):
            kind = kind[:-len(" (or unset)")] + bounds + " (or unset)"
        else:
            kind += bounds
        rows.append(f"| `{name}` | {_cell(kind)} | `{toml_value(default_of(field))}` | "
                    f"{_cell(field.description or '')} |")
    return rows


def _sections(model: type[BaseModel], title: str,
              extra: Callable[[str, type[BaseModel]], list[str]] | None = None) -> list[str]:
    out = [f"### {title}", ""] + _table(model)
    for name, field in model.model_fields.items():
        if _is_section(field.annotation):
            section = field.annotation
            out += ["", f"### [{name}]", ""]
            if section.__doc__:
                out += [_prose(section.__doc__), ""]
            out += _table(section)
            if extra:
                out += extra(name, section)
    return out


def _box_extras(name: str, section: type[BaseModel]) -> list[str]:
    if section is ModelsSettings:
        return ["", '### [models."NAME"]', "",
                _prose(ModelOverride.__doc__), ""] + _table(ModelOverride)
    return []


def settings_page() -> str:
    out = ["# Settings", "", GENERATED, "",
           "## The box (`config.toml`)", "",
           "Read, lowest first, from: the defaults below, the TOML file (`--config FILE`, "
           "else the file `EDGE_AGENT_CONFIG` names, else `/etc/edge-agent/config.toml` when "
           "present), `EDGE_AGENT_*` environment "
           "variables (a table's key with `__`: `EDGE_AGENT_SERVER__PORT=8080`), then "
           "command-line flags; a fleet's `config.patch` overlay is applied over them. An "
           "unknown key or a bad value stops the start with one line naming it (exit 2). "
           "Explained in [Configuration](../operate/configuration.md).", ""]
    out += _sections(Settings, "Top level", _box_extras)
    tenants = Settings.model_fields["tenants"]
    out += ["", "### [tenants.NAME]", "",
            _prose(f"{tenants.description} {TenantPolicy.__doc__}"), ""] + _table(TenantPolicy)
    upstreams = Settings.model_fields["upstreams"]
    out += ["", "### [upstreams.NAME]", "",
            _prose(f"{upstreams.description} {UpstreamSettings.__doc__}"), ""] + \
        _table(UpstreamSettings)
    out += ["", "## The controller (`controller.toml`)", "",
            "Read from the defaults below, the TOML file (`--config FILE`, default "
            "`/etc/edge-agent-fleet/controller.toml` when present), then command-line flags; "
            "no environment variables. Explained in "
            "[Running a fleet](../fleet/controller.md).", ""]
    out += _sections(ControllerSettings, "Top level")
    return "\n".join(out) + "\n"


def settings_field(section: str, key: str) -> FieldInfo | None:
    """The field a hand-written settings table names: `section` is `server`, `fleet`,
    `runtime`… or `controller.broker`; `key` may be dotted (`runtime.max_queue`)."""
    model: type[BaseModel] = Settings
    parts = section.split(".") if section else []
    if parts and parts[0] == "controller":
        model, parts = ControllerSettings, parts[1:]
    parts += key.split(".")
    for part in parts[:-1]:
        field = model.model_fields.get(part)
        if field is None or not _is_section(field.annotation):
            return None
        model = field.annotation
    return model.model_fields.get(parts[-1])


# -- the fleet link's topics and refusals ----------------------------------------------------

def _same(kind: str, documented: set[str], actual: set[str]) -> None:
    if documented != actual:
        raise SystemExit(
            f"tools/reference.py: the {kind} in the code and in the notes differ: only in "
            f"the code {sorted(actual - documented)}, only in the notes "
            f"{sorted(documented - actual)}; update TOPIC_NOTES / REFUSAL_NOTES")


def topics_table() -> str:
    t = fleet_topics
    _same("topic kinds", set(TOPIC_NOTES), set(t.KINDS))
    rows = ["| kind | from → to | retained | payload |", "|---|---|---|---|"]
    for kind in TOPIC_NOTES:
        if kind in t.DEVICE_KINDS:
            way = "box → controller"
        else:
            way = "controller → box"
        retained = "yes" if kind == t.STATUS else "no"
        if kind in t.OUTBOX_KINDS:
            payload = f"outbox envelope, class `{envelope_class(kind)}`: {TOPIC_NOTES[kind]}"
        else:
            payload = TOPIC_NOTES[kind]
        rows.append(f"| `{kind}` | {way} | {retained} | {payload} |")
    return "\n".join(rows)


def topics_page() -> str:
    t = fleet_topics
    example = t.topic("emea", "store-042", "metrics")
    subscribed = ", ".join(f"`{f}`" for f in t.device_filter("emea", "store-042"))
    return "\n".join([
        "# Fleet topics", "", GENERATED, "",
        f"Every topic is `{t.PREFIX}/{{fleet}}/{{device}}/{{kind}}` (`{example}`); the "
        f"fleet-wide command topic is `{t.topic('emea', t.ALL, t.CMD)}`. Ids are "
        "`[A-Za-z0-9_-]`, 1–64 characters, and `all` is kept for the fleet-wide topic. "
        "Everything is QoS 1, MQTT 5. Explained in [The fleet link](../fleet/link.md).", "",
        topics_table(), "",
        f"A box subscribes to {subscribed}; the controller to `{t.CONTROLLER_FILTER}`. The "
        "broker's ACL lets a box publish only the kinds a box sends and read only those the "
        "controller sends; the box also checks every ack's signature.", ""])


def refusals_table() -> str:
    _same("refusal reasons", set(REFUSAL_NOTES), set(fleet_refusals.REASONS))
    rows = ["| reason | when |", "|---|---|"]
    rows += [f"| `{reason}` | {note} |" for reason, note in REFUSAL_NOTES.items()]
    return "\n".join(rows)


def refusals_page() -> str:
    return "\n".join([
        "# Command refusals", "", GENERATED, "",
        "A refused command never runs. The box checks in this order, and the first check "
        "that fails gives the reason (the result's `reason`, with `status: \"refused\"`). "
        "Explained in [Commands to the box](../fleet/commands.md).", "",
        refusals_table(), ""])


def command_types_table() -> str:
    """Every command type as `protocol.command_types` registers it."""
    rows = ["| type | args | result (`result` field) | sent by | changes the box | what it does |",
            "|---|---|---|---|---|---|"]
    for t in fleet_commands.COMMAND_TYPES.values():
        args, result = (_cell(fleet_commands.shape(m)) for m in (t.args, t.result))
        rows.append(f"| `{t.name}` | `{args}` | `{result}` | {t.role} or above | "
                    f"{'yes' if t.mutating else 'no'} | {_cell(t.description)} |")
    return "\n".join(rows)


# -- metrics ---------------------------------------------------------------------------------

def _fake_nvml() -> Any:
    """NVML as one GPU answers it: only the names of what it reads matter here."""
    ns = types.SimpleNamespace
    return ns(nvmlInit=lambda: None, nvmlSystemGetDriverVersion=lambda: "550.54",
              nvmlSystemGetCudaDriverVersion=lambda: 12040, nvmlDeviceGetCount=lambda: 1,
              nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetName=lambda h: "GPU",
              nvmlDeviceGetUtilizationRates=lambda h: ns(gpu=0),
              nvmlDeviceGetMemoryInfo=lambda h: ns(used=0, total=1),
              nvmlDeviceGetTemperature=lambda h, s: 0, NVML_TEMPERATURE_GPU=0,
              nvmlDeviceGetPowerUsage=lambda h: 0, nvmlDeviceGetClockInfo=lambda h, c: 0,
              NVML_CLOCK_SM=1, nvmlDeviceGetCurrentClocksThrottleReasons=lambda h: 0)


def _fake_jetson(root: Path) -> None:
    """A Jetson's sysfs, as the Jetson reader looks for it."""
    files = {"sys/devices/gpu.0/load": "0", "sys/class/thermal/thermal_zone0/type": "GPU-therm",
             "sys/class/thermal/thermal_zone0/temp": "40000",
             "proc/meminfo": "MemTotal: 1000 kB\nMemAvailable: 500 kB\n"}
    rail = "sys/bus/i2c/drivers/ina3221x/1-0040/hwmon/hwmon0/"
    files |= {rail + "in1_label": "VDD_IN", rail + "in1_input": "5000",
              rail + "curr1_input": "1000"}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def box_registry(scratch: Path) -> CollectorRegistry:
    """The box's registry as `/metrics` serves it, with every family present: one loaded
    model, a ledger writer, and hardware readers for psutil, an NVIDIA GPU and a Jetson."""
    from edge_agent.engine.scheduling.prompt_cache import PromptCache
    from edge_agent.telemetry.hardware import (
        HardwareSampler,
        JetsonReader,
        NvmlReader,
        PsutilReader,
    )
    from edge_agent.telemetry.metrics import Metrics

    ns = types.SimpleNamespace
    stats = ns(running=0, kv_used=0, kv_total=1, last_step_tokens=0, drafted=0,
               draft_accepted=0, put_back=0)
    model = ns(worker=ns(stats=stats, queued=0, threads_now=1), info=ns(name="m"), memory=0,
               parallel=1)
    _fake_jetson(scratch)
    sampler = HardwareSampler([PsutilReader(scratch), NvmlReader(_fake_nvml()),
                               JetsonReader(scratch)])
    sampler.snapshot = sampler.sample()
    metrics = Metrics(lambda: [model], sampler,  # type: ignore[list-item]
                      lambda: ns(lag_s=0.0, rows_written=0),  # type: ignore[arg-type,return-value]
                      PromptCache(2**20))
    return metrics.registry


def _labels(registry: CollectorRegistry, owner: object) -> dict[str, list[str]]:
    """Each family's label names: from its samples, else from the metric object that
    declares them (a labelled counter nothing has counted yet has no sample)."""
    declared = {m._name: list(m._labelnames) for m in vars(owner).values()
                if hasattr(m, "_labelnames")}
    out: dict[str, list[str]] = {}
    for family in registry.collect():
        names: list[str] = []
        for sample in family.samples:
            names += [k for k in sample.labels if k not in names and k not in ("le",)]
        out[family.name] = names or declared.get(family.name, [])
    return out


def _metrics_table(registry: CollectorRegistry, owner: object) -> list[str]:
    labels = _labels(registry, owner)
    rows = ["| series | type | labels | meaning |", "|---|---|---|---|"]
    families = sorted(registry.collect(), key=lambda f: f.name)
    for family in families:
        name = family.name + ("_total" if family.type == "counter" else "")
        labelled = ", ".join(f"`{label}`" for label in labels[family.name]) or "—"
        rows.append(f"| `{name}` | {family.type} | {labelled} | {_cell(family.documentation)} |")
    return rows


def _registries(scratch: Path) -> list[tuple[CollectorRegistry, object]]:
    """The box's registry and the controller's, each with the object that declares its
    metrics."""
    from edge_agent.telemetry.metrics import Metrics

    # One device in the store, so that the series read from it at scrape are there too.
    store = types.SimpleNamespace(devices=lambda: [
        {"device": "d", "fleet": "f", "online": True, "last_seen": 0.0}],
        registrations=lambda: {"d": {}})
    leadership = types.SimpleNamespace(controller_id="c", is_leader=lambda: True)
    controller = ControllerMetrics(store, leadership=leadership)  # type: ignore[arg-type]
    # One box and model with a fresh interval, and one rollout, for every SLO series.
    slo = types.SimpleNamespace(totals=lambda: [
        {"device": "d", "model": "m", "fleet": "f", "ok": 1, "client_errors": 0,
         "server_errors": 0, "tokens_out": 1, "upstream": 0, "feedback_good": 0,
         "feedback_bad": 0, "ttft_p50": 1.0, "ttft_p95": 1.0, "tpot_p50": 1.0,
         "tpot_p95": 1.0, "last_end": 0.0}],
        releases=lambda: [{"rollout": "r", "name": "m", "version": "1", "kind": "model",
                           "at": 0.0}])
    export = SLOExport(slo, SLOSettings.model_validate({}),  # type: ignore[arg-type]
                       clock=lambda: 0.0)
    return [(box_registry(scratch), Metrics(lambda: [])),
            (controller.registry, controller), (export.registry, export)]


def metric_names() -> set[str]:
    """Every series name a scrape shows, as the manual writes it: counters with `_total`,
    histograms by their base name."""
    with tempfile.TemporaryDirectory() as scratch:
        return {f.name + ("_total" if f.type == "counter" else "")
                for registry, _ in _registries(Path(scratch)) for f in registry.collect()}


def metrics_page() -> str:
    with tempfile.TemporaryDirectory() as scratch:
        (box, box_owner), (controller, controller_owner), (slo, slo_owner) = \
            _registries(Path(scratch))
        box_rows = _metrics_table(box, box_owner)
        controller_rows = _metrics_table(controller, controller_owner)
        slo_rows = _metrics_table(slo, slo_owner)
    return "\n".join([
        "# Metrics", "", GENERATED, "",
        "## The box (`GET /metrics`)", "",
        "Served to loopback clients, or to others that send `Authorization: Bearer "
        "<server.metrics_key>`. Series that llama.cpp's server also exports keep its names "
        "(`llamacpp:*`), so existing dashboards work. Per-model series exist for each loaded "
        "model; the hardware series for what the box has (an NVIDIA GPU through NVML, a "
        "Jetson's sensors): what a box lacks is absent. Histograms add `_bucket`, `_sum` "
        "and `_count`. Explained in [Health, metrics, doctor and "
        "logs](../operate/health.md).", "",
        *box_rows, "",
        "## The controller (`edge-agent fleet serve`, `GET /metrics`)", "",
        "Explained in [Running a fleet](../fleet/controller.md).", "",
        *controller_rows, "",
        "## The fleet's service levels (`edge-agent fleet serve`, `GET /fleet-metrics`)", "",
        "Per box and model, read from the store at scrape. Explained in [Service levels "
        "over time](../fleet/service-levels.md).", "",
        *slo_rows, ""])


# -- the Ansible role's variables ------------------------------------------------------------

ROLE = ROOT / "ansible" / "roles" / "edge_agent"


def _ansible_text(text: str | list[str]) -> str:
    """An argument spec's description as one cell: Ansible's C() and I() markup as code."""
    text = " ".join(text) if isinstance(text, list) else text
    return _cell(re.sub(r"\b[CI]\(([^)]*)\)", r"`\1`", text))


def _role_default(value: Any) -> str:
    if isinstance(value, str) and "|" in value and value.startswith("{{"):
        # A Jinja filter chain: each step in code of its own (a pipe inside a code span
        # would end the table cell on GitHub).
        steps = [s.strip() for s in value.strip("{} ").split("|")]
        return " → ".join(f"`{s}`" for s in steps)
    if isinstance(value, list):
        return "`[" + ", ".join(map(str, value)) + "]`"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, dict):
        return "`{}`" if not value else f"`{json.dumps(value)}`"
    return '`""`' if value == "" else f"`{value}`"


def role_variables_table() -> str:
    """The role's variables as its argument spec (meta/argument_specs.yml) types, defaults
    and describes them; Ansible checks every run against the same spec."""
    import yaml

    spec = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text())
    rows = ["| variable | type | default | what it is |", "|---|---|---|---|"]
    for name, option in spec["argument_specs"]["main"]["options"].items():
        kind = option["type"]
        if kind == "list":
            kind = f"list of {option.get('elements', 'raw')}"
        if "choices" in option:
            kind += f" ({', '.join(map(str, option['choices']))})"
        rows.append(f"| `{name}` | {kind} | {_role_default(option.get('default'))} | "
                    f"{_ansible_text(option['description'])} |")
    return "\n".join(rows)


# -- pages and regions -----------------------------------------------------------------------

PAGES: dict[str, Callable[[], str]] = {
    "cli.md": cli_page,
    "settings.md": settings_page,
    "topics.md": topics_page,
    "refusals.md": refusals_page,
    "metrics.md": metrics_page,
}
REGIONS: dict[str, Callable[[], str]] = {
    "topics": topics_table,
    "refusals": refusals_table,
    "command-types": command_types_table,
    "role-variables": role_variables_table,
}
REGION = re.compile(r"(<!-- generated: (\S+) -->\n)(.*?)(<!-- end generated: \2 -->)", re.S)


def slug(text: str) -> str:
    """A heading's anchor as mkdocs makes it (Python-Markdown's toc `slugify`)."""
    import unicodedata

    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def expected() -> dict[Path, str]:
    """Every generated file's text, and every page with regions as it should read."""
    out = {REFERENCE / name: make() for name, make in PAGES.items()}
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        if "<!-- generated: " not in text or page.parent == REFERENCE:
            continue

        def fill(m: re.Match[str], page: Path = page) -> str:
            name = m.group(2)
            if name not in REGIONS:
                raise SystemExit(f"{page.relative_to(ROOT)}: no generated region {name!r}")
            return f"{m.group(1)}\n{REGIONS[name]()}\n\n{m.group(4)}"

        out[page] = REGION.sub(fill, text)
    return out


def drifted() -> list[Path]:
    return [path for path, text in expected().items()
            if not path.is_file() or path.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="regenerate the pages")
    mode.add_argument("--check", action="store_true", help="exit 1 if a page differs")
    args = parser.parse_args(argv)
    if args.write:
        REFERENCE.mkdir(parents=True, exist_ok=True)
        for path, text in expected().items():
            if not path.is_file() or path.read_text() != text:
                path.write_text(text)
                print(f"wrote {path.relative_to(ROOT)}")
        return 0
    stale = drifted()
    for path in stale:
        print(f"{path.relative_to(ROOT)} differs from the code: "
              "run python tools/reference.py --write", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
