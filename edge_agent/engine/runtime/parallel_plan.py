"""How many sequences a model decodes together when `parallel = "auto"` (the default).

Two bounds, the smaller wins:

- memory: the sequences' KV cache at the full context must fit the model's share of the
  memory budget (`memory_budget / max_loaded_models`, less the weights), so that the other
  models the box may load still fit beside it;
- hardware: on a CPU a decode step costs about as much per row once the cores are busy,
  so rows beyond ~4 per thread only stretch every stream's token gap; a GPU's batched step
  is nearly flat over tens of rows. At least 8 either way: with 4, an 8-client burst on a
  2-core box queued half of itself (TTFT p50 1.2 s at c=8 with smollm2:135m, against 0.3 s
  with 8).

Pure and unit-tested; the registry calls it with the GGUF's KV size per token.
"""

from __future__ import annotations

MIN_AUTO = 8  # an 8-client burst runs at once wherever its KV fits
ROWS_PER_THREAD = 4
GPU_ROWS = 32
MAX_PARALLEL = 64  # the setting's own bound


def hardware_cap(*, threads: int, gpu: bool) -> int:
    """The most sequences worth decoding together on this hardware."""
    rows = GPU_ROWS if gpu else ROWS_PER_THREAD * max(1, threads)
    return min(MAX_PARALLEL, max(MIN_AUTO, rows))


def auto_parallel(*, kv_bytes_per_token: int, context: int, weights: int, budget: int,
                  models: int, threads: int, gpu: bool) -> int:
    """Sequences of `context` tokens whose KV fits this model's share of `budget` (bytes,
    shared by up to `models` loaded models), capped by `hardware_cap`; at least 1."""
    share = budget // max(1, models) - weights
    per_sequence = max(1, kv_bytes_per_token * context)
    fits = max(1, share // per_sequence)
    return int(min(fits, hardware_cap(threads=threads, gpu=gpu)))
