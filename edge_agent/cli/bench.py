"""`edge-agent bench`."""

from __future__ import annotations

import click

from edge_agent.cli.common import BadUsage, common_options, load
from edge_agent.cli.output import echo_json, json_option


def _levels(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    try:
        return sorted({int(x) for x in value.split(",") if x.strip()})
    except ValueError:
        raise BadUsage("--concurrency takes numbers like 1,4,8") from None


@click.command()
@common_options
@click.option("--model", help="Model to measure (default: the configured default).")
@click.option("--concurrency", "levels", default="1,4,8", show_default=True, callback=_levels,
              help="Comma-separated concurrency levels.")
@click.option("--requests", type=click.IntRange(1), default=7, show_default=True,
              help="Single-stream requests per peer; medians are reported.")
@click.option("--max-tokens", type=click.IntRange(2), default=128, show_default=True,
              help="Tokens per single-stream request.")
@click.option("--no-peers", is_flag=True, help="Skip llama-cpp-python's server as a peer.")
@json_option("Print the figures as JSON too.")
def bench(model: str | None, levels: list[int], requests: int, max_tokens: int,
          no_peers: bool, as_json: bool) -> None:
    """Measure TTFT, TPOT and tokens/s against peers in one run; print the ratios."""
    from edge_agent.bench.run import run_bench
    from edge_agent.engine.runtime import default_threads

    settings = load()
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    if not no_peers:
        try:
            # The package ships llama_cpp.server without its extra's dependencies.
            import llama_cpp.server.app  # noqa: F401
        except ImportError:
            raise BadUsage("the peer needs llama-cpp-python[server]: pip install -e "
                           "'.[bench]' (or pass --no-peers)") from None
    result = run_bench(settings.state_dir, model or settings.default_model, levels=levels,
                       requests=requests, max_tokens=max_tokens,
                       threads=settings.runtime.threads or default_threads(),
                       context=settings.runtime.context_length, peers=not no_peers,
                       echo=click.echo)
    if as_json:
        echo_json(result)
