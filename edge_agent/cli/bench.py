"""`edge-agent bench` (the serving figures) and `edge-agent bench fleet` (the fleet link's).

`bench` is a group that runs the serving bench when called without a subcommand, so
`edge-agent bench --state-dir ./var …` (and `make bench`) work as they always did; its
options go before a subcommand's name, the subcommand's after it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

import click

from edge_agent.cli.common import BadUsage, common_options, load
from edge_agent.cli.output import echo_json, json_option
from edge_agent.names import ModelName

if TYPE_CHECKING:
    from edge_agent.config import Settings


def _levels(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    try:
        return sorted({int(x) for x in value.split(",") if x.strip()})
    except ValueError:
        raise BadUsage("--concurrency takes numbers like 1,4,8") from None


def _devices(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    try:
        sizes = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise BadUsage("--devices takes device counts like 1000 or 1000,10000")
    return sizes


@click.group(invoke_without_command=True)
@common_options
@click.option("--model", help="Model to measure (default: the configured default).")
@click.option("--concurrency", "levels", default="1,4,8", show_default=True, callback=_levels,
              help="Comma-separated concurrency levels.")
@click.option("--requests", type=click.IntRange(1), default=7, show_default=True,
              help="Single-stream requests per peer; medians are reported.")
@click.option("--max-tokens", type=click.IntRange(2), default=128, show_default=True,
              help="Tokens per single-stream request.")
@click.option("--no-peers", is_flag=True, help="Skip llama-cpp-python's server as a peer.")
@click.option("--llama-server", "llama_server",
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="llama.cpp's llama-server binary: also compare edge-agent with it (plain "
              "and JSON-schema output, alternating requests).")
@json_option("Print the figures as JSON too.")
@click.pass_context
def bench(ctx: click.Context, model: str | None, levels: list[int], requests: int,
          max_tokens: int, no_peers: bool, llama_server: Path | None, as_json: bool) -> None:
    """Measure TTFT, TPOT and tokens/s against peers in one run; print the ratios.
    `bench fleet` measures the fleet link and a simulated fleet instead."""
    if ctx.invoked_subcommand is not None:
        return
    from edge_agent.bench.serving.run import run_bench
    from edge_agent.engine.runtime.llama import default_threads

    settings = load()
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    if not no_peers:
        try:
            # The package ships llama_cpp.server without its extra's dependencies.
            import llama_cpp.server.app  # noqa: F401
        except ImportError:
            raise BadUsage("the peer needs llama-cpp-python[server]: pip install -e "
                           "'.[bench]' (or pass --no-peers)") from None
    result = run_bench(settings.state_dir, ModelName.parse(model or settings.default_model),
                       levels=levels, requests=requests, max_tokens=max_tokens,
                       threads=settings.runtime.threads or default_threads(),
                       context=settings.runtime.context_length, peers=not no_peers,
                       echo=click.echo, llama_server=llama_server)
    if as_json:
        echo_json(result)


def _installed(settings: Settings, model: str | None) -> ModelName:
    """The model to measure (the default one unless named), pulled into the state dir if
    it is not there, by the name it is served under."""
    from edge_agent.engine.models.catalog import ModelStore

    settings.state_dir.mkdir(parents=True, exist_ok=True)
    name = ModelName.parse(model or settings.default_model)
    store = ModelStore(settings.state_dir)
    try:
        if not store.is_installed(name):
            store.pull(name)
        return store.get(name).name
    finally:
        store.close()


@bench.command("batches")
@common_options
@click.option("--model", help="Model to measure (default: the configured default).")
@click.option("--lines", type=click.IntRange(1), default=200, show_default=True,
              help="Lines (chat requests) of the batch.")
@click.option("--streams", type=click.IntRange(1), default=4, show_default=True,
              help="Interactive streams a burst.")
@click.option("--rounds", type=click.IntRange(1), default=6, show_default=True,
              help="Bursts in each phase (without, with, without the batch).")
@click.option("--gap", "gap_s", type=click.FloatRange(min=0), default=1.5, show_default=True,
              help="Seconds between bursts (the pauses a batch runs in).")
@json_option("Print the figures as JSON too.")
def bench_batches(model: str | None, lines: int, streams: int, rounds: int, gap_s: float,
                  as_json: bool) -> None:
    """Interactive TTFT p50 with a batch running over without one, and the batch's
    lines/s, on a server of its own over --state-dir."""
    from edge_agent.bench.serving.batches import run_batch_bench
    from edge_agent.engine.runtime.llama import default_threads

    settings = load()
    served = _installed(settings, model)
    result = run_batch_bench(settings.state_dir, served,
                             threads=settings.runtime.threads or default_threads(),
                             context=settings.runtime.context_length, lines=lines,
                             streams=streams, rounds=rounds, gap_s=gap_s, echo=click.echo)
    if as_json:
        echo_json(result)


@bench.command("upstream")
@common_options
@click.option("--model", help="Model to measure (default: the configured default).")
@click.option("--clients", type=click.IntRange(1), default=16, show_default=True,
              help="Concurrent clients.")
@click.option("--requests", type=click.IntRange(1), default=2, show_default=True,
              help="Streamed chats each client sends, one after another.")
@click.option("--parallel", type=click.IntRange(1, 64), default=2, show_default=True,
              help="The box's sequences.")
@click.option("--passes", type=click.IntRange(1), default=20, show_default=True,
              help="Requests measured straight and through the box, alternating.")
@click.option("--llama-server", "llama_server",
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="llama.cpp's llama-server binary: measure the time the box adds with it "
              "as the upstream too.")
@json_option("Print the figures as JSON too.")
def bench_upstream(model: str | None, clients: int, requests: int, parallel: int,
                   passes: int, llama_server: Path | None, as_json: bool) -> None:
    """A saturated box with and without a loopback upstream (tokens/s, TTFT p95), and the
    time the box adds to a request it passes through, on servers of their own over
    --state-dir (the pool's models in STATE_DIR/bench-upstream-pool)."""
    from edge_agent.bench.serving.upstream import run_upstream_bench
    from edge_agent.engine.runtime.llama import default_threads

    settings = load()
    served = _installed(settings, model)
    result = run_upstream_bench(settings.state_dir, str(served),
                                threads=settings.runtime.threads or default_threads(),
                                context=settings.runtime.context_length, clients=clients,
                                requests=requests, parallel=parallel, passes=passes,
                                llama_server=llama_server, echo=click.echo)
    if as_json:
        echo_json(result)


@bench.command("fleet")
@common_options
@click.option("--devices", "sizes", default="1000", show_default=True, callback=_devices,
              help="Simulated devices; a comma-separated list runs each size in turn.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              help="Seconds between a simulated device's metrics messages.")
@click.option("--duration", type=click.FloatRange(min=1), default=60.0, show_default=True,
              help="Seconds each simulated fleet produces (after one warm-up interval).")
@click.option("--broker-restart/--no-broker-restart", default=True, show_default=True,
              help="Kill the broker (SIGKILL) halfway and start it again 5 s later.")
@click.option("--device-store", type=click.Choice(["memory", "files"]), default="memory",
              show_default=True, help="The simulated devices' outbox and link state: "
              "in-memory SQLite, or files as on a box (7 descriptors each, an fsync a commit).")
@click.option("--model", help="Model of the serving figure (default: the configured default).")
@click.option("--no-serving", is_flag=True, help="Skip the TTFT figure (needs the model).")
@click.option("--runs", type=click.IntRange(1), default=3, show_default=True,
              help="Outbox throughput runs (the median is judged).")
@click.option("--messages", type=click.IntRange(1), default=20_000, show_default=True,
              help="Messages per outbox throughput run.")
@click.option("--requests", type=click.IntRange(1), default=15, show_default=True,
              help="TTFT requests per server, link on and off.")
@click.option("--idle", "idle_s", type=click.FloatRange(min=1), default=20.0,
              show_default=True, help="Seconds the idle link's CPU is measured.")
@json_option("Print the figures as JSON on stdout (the report goes to stderr).")
def bench_fleet(sizes: list[int], interval: float, duration: float, broker_restart: bool,
                device_store: Literal["memory", "files"], model: str | None, no_serving: bool,
                runs: int, messages: int, requests: int, idle_s: float, as_json: bool) -> None:
    """Measure the fleet link (outbox throughput vs plain paho, TTFT with the link on vs
    off, idle CPU) and a simulated fleet against a private broker and controller."""
    from edge_agent.bench.fleet.run import run_fleet_bench
    from edge_agent.engine.models.catalog import ModelStore
    from edge_agent.engine.runtime.llama import default_threads

    settings = load()
    name: ModelName | None = None
    if not no_serving:
        name = ModelName.parse(model or settings.default_model)
        settings.state_dir.mkdir(parents=True, exist_ok=True)
        store = ModelStore(settings.state_dir)
        try:
            if not store.is_installed(name):
                store.pull(name)
        finally:
            store.close()

    def echo(line: str) -> None:
        click.echo(line, err=as_json)

    result = run_fleet_bench(settings.state_dir, name, devices=sizes, interval_s=interval,
                             duration_s=duration, broker_restart=broker_restart,
                             device_store=device_store, runs=runs,
                             messages=messages, requests=requests, idle_s=idle_s,
                             threads=settings.runtime.threads or default_threads(),
                             context=settings.runtime.context_length, echo=echo)
    if as_json:
        echo_json(result)


@bench.command("fleet-scale")
@click.option("--devices", type=click.IntRange(2), default=10_000, show_default=True,
              help="Simulated devices, dealt out over the regions.")
@click.option("--regions", type=click.IntRange(1, 16), default=2, show_default=True,
              help="Regional brokers, each bridged to the central one.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=30.0, show_default=True,
              help="Seconds between a simulated device's metrics messages (10,000 devices "
              "every 10 s saturate two cores: see the manual's bench page).")
@click.option("--duration", type=click.FloatRange(min=2), default=90.0, show_default=True,
              help="Seconds the fleet produces: half with both controllers, half after "
              "the leader's SIGKILL.")
@click.option("--runs", type=click.IntRange(1), default=3, show_default=True,
              help="Runs, each on fresh servers (medians printed).")
@click.option("--ack-timeout", type=click.FloatRange(min=1), default=60.0, show_default=True,
              help="Seconds a simulated device waits for the controller's ack before it "
              "sends a message again (what the killed controller held comes back then).")
@json_option("Print the figures as JSON on stdout (the report goes to stderr).")
def bench_fleet_scale(devices: int, regions: int, interval: float, duration: float,
                      runs: int, ack_timeout: float, as_json: bool) -> None:
    """Measure a fleet past one machine: regional brokers bridged to a central one, two
    controllers on one PostgreSQL, the leader killed halfway (ingest per controller,
    failover time, messages lost and duplicated)."""
    from edge_agent.bench.fleet.scale import run_fleet_scale

    def echo(line: str) -> None:
        click.echo(line, err=as_json)

    try:
        result = run_fleet_scale(devices=devices, regions=regions, interval_s=interval,
                                 duration_s=duration, runs=runs, echo=echo,
                                 ack_timeout_s=ack_timeout)
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        echo_json(result)


@bench.command("fleet-slo")
@click.option("--devices", type=click.IntRange(1), default=10_000, show_default=True,
              help="Simulated boxes in the store.")
@click.option("--models", type=click.IntRange(1, 16), default=2, show_default=True,
              help="Models each box serves.")
@click.option("--minutes", type=click.IntRange(2), default=60, show_default=True,
              help="The window: one metrics message a minute from each box.")
@click.option("--repeats", type=click.IntRange(1), default=5, show_default=True,
              help="Times each read is timed (medians printed).")
@click.option("--db", default=None, help="postgresql://… (unset: SQLite in a temp dir).")
@json_option("Print the figures as JSON on stdout (the report goes to stderr).")
def bench_fleet_slo(devices: int, models: int, minutes: int, repeats: int, db: str | None,
                    as_json: bool) -> None:
    """Measure the service levels' cost at a fleet's size: the console's page over the
    window, the /fleet-metrics scrape and its series, a release's before/after table."""
    from edge_agent.bench.fleet.slo import run_fleet_slo

    result = run_fleet_slo(devices=devices, models=models, minutes=minutes, repeats=repeats,
                           db=db, echo=lambda line: click.echo(line, err=as_json))
    if as_json:
        echo_json(result)


@bench.command("llama-server")
@common_options
@click.argument("binary", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--model", help="Model to measure (default: the configured default).")
@click.option("--rounds", type=click.IntRange(1), default=5, show_default=True,
              help="Alternating rounds; the median of their ratios is judged.")
@click.option("--client-side", "client_side", is_flag=True,
              help="Only the section measured as a client sees it (default settings, "
              "whole and streamed answers, c=1 and c=8, with where each request's time "
              "went), with the cases below.")
@click.option("--repeats", "repeats", is_flag=True,
              help="Only the client-side cases where clients repeat themselves (recurring "
              "prompts, multi-turn conversations, the first request after a restart) and "
              "beside other work (a busy core), with llama-bench's ceiling.")
@json_option("Print the figures as JSON on stdout (the report goes to stderr).")
def bench_llama_server(binary: Path, model: str | None, rounds: int, client_side: bool,
                       repeats: bool, as_json: bool) -> None:
    """Only the comparison with llama.cpp's own server (BINARY: a llama-server built from
    the llama.cpp that llama-cpp-python vendors): plain, JSON-schema and tool-call output,
    a long shared prefix, a burst of 8, and the requests as an app sends them, each ratio
    against its target."""
    from edge_agent.bench.serving.run import run_llama_server_bench
    from edge_agent.engine.runtime.llama import default_threads

    settings = load()
    settings.state_dir.mkdir(parents=True, exist_ok=True)

    def echo(line: str) -> None:
        click.echo(line, err=as_json)

    result = run_llama_server_bench(
        settings.state_dir, ModelName.parse(model or settings.default_model), binary,
        threads=settings.runtime.threads or default_threads(),
        context=settings.runtime.context_length, rounds=rounds, echo=echo,
        client_side_only=client_side, repeats_only=repeats)
    if as_json:
        echo_json(result)


@bench.command("structured-coverage")
@common_options
@click.option("--model", help="Model to measure (default: the configured default).")
@click.option("--llama-server", "llama_server",
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="llama.cpp's llama-server binary: also send every schema to it, on the "
              "same file.")
@click.option("--per-category", type=click.IntRange(1), default=None,
              help="Only the first N schemas of each category (default: all 25).")
@click.option("--category", "categories", multiple=True,
              help="Only this category (repeatable), e.g. Github_hard.")
@click.option("--parallel", type=click.IntRange(1, 16), default=4, show_default=True,
              help="Requests at a time, and slots of each server.")
@json_option("Print the figures as JSON on stdout (the report goes to stderr).")
def bench_structured_coverage(model: str | None, llama_server: Path | None,
                              per_category: int | None, categories: tuple[str, ...],
                              parallel: int, as_json: bool) -> None:
    """Send each schema of a JSONSchemaBench sample (250 real-world schemas, 25 from each
    of 10 categories) once as `response_format`: schemas accepted, answers that fit them,
    that do not, and that ran out of tokens, per category; with --llama-server, beside
    llama.cpp's own server."""
    from edge_agent.bench.serving.run import run_schema_coverage_bench
    from edge_agent.bench.serving.schema_coverage import load_sample
    from edge_agent.engine.runtime.llama import default_threads

    known = load_sample().categories
    unknown = sorted(set(categories) - set(known))
    if unknown:
        raise BadUsage(f"no category {', '.join(unknown)} (known: {', '.join(known)})")
    settings = load()
    settings.state_dir.mkdir(parents=True, exist_ok=True)

    def echo(line: str) -> None:
        click.echo(line, err=as_json)

    result = run_schema_coverage_bench(
        settings.state_dir, ModelName.parse(model or settings.default_model),
        threads=settings.runtime.threads or default_threads(),
        context=settings.runtime.context_length, llama_server=llama_server,
        per_category=per_category, categories=categories, parallel=parallel, echo=echo)
    if as_json:
        echo_json(result)


@bench.command("agent-rollout")
@click.option("--boxes", type=click.IntRange(10, 100_000), default=10_000, show_default=True,
              help="Simulated boxes (the agent's own link code each, on one loop).")
@click.option("--runs", type=click.IntRange(1), default=3, show_default=True,
              help="Runs, each an agent release that completes and one that aborts.")
@click.option("--fail", "fail_share", type=click.FloatRange(0, 0.5), default=0.01,
              show_default=True, help="Share of the boxes scripted to fail their gate "
              "(each rolls back by itself).")
@click.option("--soak", "soak_s", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="Seconds each wave soaks.")
@json_option("Print the figures as JSON on stdout (the report goes to stderr).")
def bench_agent_rollout(boxes: int, runs: int, fail_share: float, soak_s: float,
                        as_json: bool) -> None:
    """Agent releases in waves over simulated boxes, driven by `fleet serve`: one that
    completes with the failing share rolled back by the boxes themselves, one that the
    abort threshold stops in the wave that crosses it; the controller's view of versions
    checked after each."""
    from edge_agent.bench.fleet.agent_rollout import run_agent_rollout_bench

    def echo(line: str) -> None:
        click.echo(line, err=as_json)

    result = run_agent_rollout_bench(boxes=boxes, runs=runs, fail_share=fail_share,
                                     soak_s=soak_s, echo=echo)
    if as_json:
        echo_json(result)


@bench.command("rollout")
@common_options
@click.option("--model", help="Model to roll out (default: the configured default).")
@click.option("--runs", type=click.IntRange(1), default=3, show_default=True,
              help="Rollouts (one new version each) and download runs; medians are judged.")
@click.option("--before", "before_s", type=click.FloatRange(min=1), default=5.0,
              show_default=True, help="Seconds of load measured before each rollout starts.")
@click.option("--boxes", type=click.IntRange(0), default=100, show_default=True,
              help="Simulated boxes for the controller's figure (a rollout in waves); 0 "
              "skips it.")
@click.option("--soak", "soak_s", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="Seconds each wave soaks in the simulated rollout.")
@json_option("Print the figures as JSON on stdout (the report goes to stderr).")
def bench_rollout(model: str | None, runs: int, before_s: float, boxes: int, soak_s: float,
                  as_json: bool) -> None:
    """Roll a new version of the model out to one box over loopback (private broker,
    `fleet serve`, `edge-agent serve`): time to ACTIVE by state, download vs curl, and
    the serving gap while it switches; then a rollout in waves over simulated boxes:
    the controller's CPU and message rate."""
    from edge_agent.bench.fleet.rollout import run_rollout_bench
    from edge_agent.engine.runtime.llama import default_threads

    settings = load()
    settings.state_dir.mkdir(parents=True, exist_ok=True)

    def echo(line: str) -> None:
        click.echo(line, err=as_json)

    result = run_rollout_bench(settings.state_dir, ModelName.parse(model or settings.default_model),
                               runs=runs, threads=settings.runtime.threads or default_threads(),
                               context=settings.runtime.context_length, before_s=before_s,
                               boxes=boxes, soak_s=soak_s, echo=echo)
    if as_json:
        echo_json(result)
