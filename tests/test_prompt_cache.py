"""The prompt cache beyond the sequences: its RAM tier and index, its disk tier, and the
scheduler restoring from both on the real model."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from edge_agent.engine.request import SamplingParams
from edge_agent.engine.runtime.llama import LlamaModel, build_id
from edge_agent.engine.scheduling.prompt_cache import (
    BLOCK,
    CacheShape,
    PromptCache,
)
from edge_agent.engine.scheduling.prompt_disk import PromptDisk
from edge_agent.engine.scheduling.scheduler import GenerationJob, ModelScheduler
from tests.support.fleetkit import wait_until
from tests.test_scheduler import _Collector

SHAPE = CacheShape(model="a" * 64, build="0.3.36+abc", n_ctx_seq=512, kv_type="f16",
                   flash_attn=-1)
OTHERS = {
    "another model": dataclasses.replace(SHAPE, model="b" * 64),
    "another llama.cpp build": dataclasses.replace(SHAPE, build="0.3.37+abc"),
    "another KV type": dataclasses.replace(SHAPE, kv_type="q8_0"),
    "another context": dataclasses.replace(SHAPE, n_ctx_seq=1024),
    "flash attention switched": dataclasses.replace(SHAPE, flash_attn=0),
}


def _state(size: int, fill: int = 7) -> ctypes.Array[ctypes.c_uint8]:
    return (ctypes.c_uint8 * size).from_buffer_copy(bytes([fill]) * size)


def test_the_longest_cached_prefix_is_found_and_only_whole_blocks_index_it() -> None:
    cache = PromptCache(10_000)
    base = list(range(100, 100 + 5 * BLOCK))
    cache.keep(SHAPE, base, _state(100))
    cache.keep(SHAPE, base[: 2 * BLOCK] + [1] * 3 * BLOCK, _state(100))
    entry, n = cache.find(SHAPE, base[: 4 * BLOCK + 3] + [9, 9, 9], 10_000)
    assert entry is not None and entry.tokens == base and n == 4 * BLOCK + 3
    entry, n = cache.find(SHAPE, base[: 2 * BLOCK] + [1] * 20, 10_000)
    assert entry is not None and n == 2 * BLOCK + 20
    # Less than one whole block shared: nothing (a template's opening is not worth it).
    assert cache.find(SHAPE, base[: BLOCK - 1] + [5] * 40, 10_000) == (None, 0)
    # The limit: the last prompt token is always computed.
    assert cache.find(SHAPE, base, len(base) - 1)[1] == len(base) - 1


@pytest.mark.parametrize("other", list(OTHERS))
def test_a_state_is_never_found_for_another_model_build_kv_type_or_context(other: str
                                                                         ) -> None:
    cache = PromptCache(10_000)
    tokens = list(range(3 * BLOCK))
    cache.keep(SHAPE, tokens, _state(64))
    assert cache.find(OTHERS[other], tokens + [1], 10_000) == (None, 0)
    assert cache.find(SHAPE, tokens + [1], 10_000)[1] == len(tokens)


def test_the_ram_tier_stays_within_its_bound_least_recently_used_first() -> None:
    cache = PromptCache(1000)
    prompts = [[k] * (2 * BLOCK) + list(range(BLOCK)) for k in range(6)]
    for p in prompts[:3]:
        cache.keep(SHAPE, p, _state(300))
    cache.find(SHAPE, prompts[0], 10_000)  # used: the last to go
    cache.keep(SHAPE, prompts[3], _state(300))
    assert cache.stats.ram_bytes <= 1000 and cache.stats.evictions == 1
    assert cache.find(SHAPE, prompts[1], 10_000) == (None, 0)  # the least recently used
    assert cache.find(SHAPE, prompts[0], 10_000)[0] is not None
    assert cache.keep(SHAPE, prompts[4], _state(1001)) is None  # larger than the bound
    assert cache.stats.ram_bytes <= 1000
    # An entry a longer one extends goes, however much longer (a conversation's next
    # turn): the new one holds every cell it held.
    cache.keep(SHAPE, prompts[0] + [1] * BLOCK, _state(300))
    assert cache.stats.ram_entries == 3 and cache.stats.ram_bytes == 900
    cache.keep(SHAPE, prompts[0] + [1] * BLOCK + [2] * (5 * BLOCK + 3), _state(300))
    assert cache.stats.ram_entries == 3 and cache.find(SHAPE, prompts[0] + [1] * BLOCK,
                                                       10_000)[0].tokens[-1] == 2
    assert PromptCache(0).keep(SHAPE, prompts[5], _state(10)) is None  # off


def test_the_disk_tier_loads_only_what_was_computed_under_the_same_shape(tmp_path: Path
                                                                         ) -> None:
    disk = PromptDisk(tmp_path / "prompt-cache", 10 * 2**20)
    tokens = list(range(80))
    assert disk.save(SHAPE, tokens, b"state bytes")
    assert not disk.save(SHAPE, tokens, b"state bytes")  # there already
    files = list((tmp_path / "prompt-cache" / SHAPE.model).iterdir())
    assert len(files) == 1 and stat.S_IMODE(files[0].stat().st_mode) == 0o600
    assert disk.load(SHAPE) == ([(tokens, b"state bytes")], 0)
    # The same model's file read under another build, KV type or context: refused and
    # deleted, never handed to llama.cpp.
    for shape in (OTHERS["another llama.cpp build"], OTHERS["another KV type"],
                  OTHERS["another context"]):
        disk.save(SHAPE, tokens, b"state bytes")
        assert disk.load(shape) == ([], 1)
        assert not any(p.suffix == ".kv" for p in files[0].parent.iterdir())
    # Damaged bytes: refused.
    disk.save(SHAPE, tokens, b"state bytes")
    files = list(files[0].parent.iterdir())
    files[0].write_bytes(files[0].read_bytes()[:-1] + b"X")
    assert disk.load(SHAPE) == ([], 1)
    # Bounded: the oldest goes first.
    small = PromptDisk(tmp_path / "small", 11_000)
    for k in range(4):
        assert small.save(SHAPE, [k] * 80, b"x" * 3000)
        path = tmp_path / "small" / SHAPE.model / PromptDisk.file_name(SHAPE, [k] * 80)
        os.utime(path, (1000 + k, 1000 + k))
    used, files_left = small.usage()
    assert files_left == 3 and used <= small.limit_bytes
    assert sorted(tokens[0] for tokens, _ in small.load(SHAPE)[0]) == [1, 2, 3]
    small.remove_model(SHAPE.model)
    assert small.usage() == (0, 0)


# -- on the real model ----------------------------------------------------------------------
def _job(sched: ModelScheduler, tokens: list[int], *, max_tokens: int = 8,
         system_tokens: int = 0) -> tuple[GenerationJob, _Collector]:
    out = _Collector()
    no_eos = tuple((t, -100.0) for t in range(sched.model.n_vocab) if sched.model.is_eog(t))
    job = GenerationJob(prompt=tokens, params=SamplingParams(temperature=0.0, seed=1,
                                                             logit_bias=no_eos),
                        grammar=None, max_tokens=max_tokens, stops=[], emit=out.emit,
                        system_tokens=system_tokens)
    return job, out


def _run(sched: ModelScheduler, tokens: list[int], **kw: int) -> tuple[str, int]:
    job, out = _job(sched, tokens, **kw)
    sched.submit(job)
    done = out.result()
    return done.text, done.usage.cached_tokens


@pytest.fixture
def cached_scheduler(model_path: Path) -> Iterator[Callable[..., ModelScheduler]]:
    made: list[ModelScheduler] = []

    def make(cache: PromptCache, **kw: object) -> ModelScheduler:
        shape = CacheShape(model=str(kw.pop("digest", "d" * 64)), build=build_id(),
                           n_ctx_seq=512, kv_type="f16", flash_attn=-1)
        sched = ModelScheduler(LlamaModel(model_path, n_gpu_layers=0),
                               n_ctx_seq=512, n_batch=256, n_threads=2, embed_ctx=256,
                               max_queue=8, prefill_chunk=64, aging_s=10.0,
                               prompt_cache=cache, cache_shape=shape,
                               **{"parallel": 2, **kw})  # type: ignore[arg-type]
        made.append(sched)
        return sched

    yield make
    for sched in made:
        sched.close()


def _chats(model: LlamaModel, n: int) -> list[list[int]]:
    return [model.tokenize(f"Customer {k} asks the bakery for {k + 2} loaves of rye, a "
                           f"cake for {k + 3} people and the opening hours on day {k}. "
                           "The assistant answers politely and briefly:",
                           add_special=True, parse_special=False) for k in range(n)]


@pytest.mark.integration
def test_a_prompt_displaced_from_its_sequence_is_restored_and_answers_the_same(
        cached_scheduler: Callable[..., ModelScheduler]) -> None:
    cache = PromptCache(256 * 2**20)
    sched = cached_scheduler(cache, parallel=1)
    chats = _chats(sched.model, 4)
    cold = [_run(sched, p) for p in chats]  # each displaces the one before
    assert all(cached < BLOCK for _, cached in cold)  # a few tokens of the opening
    assert cache.stats.ram_entries >= 2  # the displaced ones were kept
    warm = [_run(sched, p) for p in chats[:2]]  # neither is in a sequence any more
    assert [cached for _, cached in warm] == [len(p) - 1 for p in chats[:2]]
    assert [text for text, _ in warm] == [text for text, _ in cold[:2]]
    assert cache.stats.hits["ram"] == 2 and cache.stats.restored_tokens == sum(
        len(p) - 1 for p in chats[:2]) and cache.stats.restore_s > 0
    # Restored whole but its last token: that token goes in as a row of the rows pass,
    # with no prompt pass of its own; so again, from the sequence that now holds it.
    passes = sched.stats.prompt_passes
    text, cached = _run(sched, chats[2])
    assert (text, cached) == (cold[2][0], len(chats[2]) - 1)
    assert _run(sched, chats[2]) == (text, cached)
    assert sched.stats.prompt_passes == passes and cache.stats.hits["ram"] == 3
    # The same cache seen by a context of another shape (another model's digest here;
    # build, KV type and context are the same key): nothing restored there.
    other = cached_scheduler(cache, digest="e" * 64)
    assert _run(other, chats[0])[1] == 0
    assert cache.stats.hits["ram"] == 3


@pytest.mark.integration
def test_a_system_prompt_two_requests_sent_is_warm_after_a_restart(
        cached_scheduler: Callable[..., ModelScheduler], tmp_path: Path) -> None:
    disk_dir = tmp_path / "prompt-cache"
    cache = PromptCache(256 * 2**20, PromptDisk(disk_dir, 64 * 2**20))
    sched = cached_scheduler(cache)
    system = sched.model.tokenize("You take orders at a bakery counter. " * 12,
                                  add_special=True, parse_special=False)
    n = len(system)
    asks = [system + sched.model.tokenize(f" Question {k}: do you have rye bread?",
                                          add_special=False, parse_special=False)
            for k in range(3)]
    _run(sched, asks[0], system_tokens=n)
    assert cache.has_shared(sched.shape, system)  # computed alone, kept apart
    assert _run(sched, asks[1], system_tokens=n)[1] >= n
    wait_until(lambda: cache.stats.disk_written == 1, timeout=30)  # the second use
    # A new process: a new cache over the same folder, the model loaded again.
    fresh = PromptCache(256 * 2**20, PromptDisk(disk_dir, 64 * 2**20))
    again = cached_scheduler(fresh)
    assert fresh.stats.disk_loaded == 1
    text, cached = _run(again, asks[2], system_tokens=n)
    assert cached == n and fresh.stats.hits["disk"] == 1
    assert text == _run(cached_scheduler(PromptCache(0)), asks[2])[0]  # as computed cold
    # Under another model's digest (the same folder): not loaded.
    other = PromptCache(256 * 2**20, PromptDisk(disk_dir, 64 * 2**20))
    cached_scheduler(other, digest="f" * 64)
    assert other.stats.disk_loaded == 0


def _answer(sched: ModelScheduler, tokens: list[int], **kw: Any) -> tuple[str, int, int]:
    """(text, draft tokens decoded, steps) of one greedy job of 32 tokens."""
    job, out = _job(sched, tokens, max_tokens=32)
    for key, value in kw.items():
        setattr(job, key, value)
    drafted, steps = sched.stats.drafted, sched.stats.steps
    sched.submit(job)
    text = out.result().text
    return text, sched.stats.drafted - drafted, sched.stats.steps - steps


@pytest.mark.integration
def test_the_same_prompt_again_is_decoded_from_its_earlier_answer_and_answers_the_same(
        cached_scheduler: Callable[..., ModelScheduler]) -> None:
    """A greedy prompt sent again (from the sequence that holds it and its answer, and
    restored from the RAM tier after another displaced it) has its earlier answer decoded
    as draft rows: the same text in fewer steps. A sampled job, one whose request turned
    speculation off, and one whose answer goes another way get their own answers."""
    cache = PromptCache(256 * 2**20)
    sched = cached_scheduler(cache, parallel=1, answer_drafts=8)
    plain = cached_scheduler(PromptCache(0), parallel=1)  # no cache, no drafts
    chats = _chats(sched.model, 2)
    first, drafted, steps = _answer(sched, chats[0])
    assert drafted == 0 and steps >= 32  # nothing to guess from: a step a token
    assert _answer(plain, chats[0])[0] == first
    again, drafted, steps = _answer(sched, chats[0])  # held by the sequence
    assert again == first and drafted >= 24 and steps <= 12
    assert sched.stats.draft_accepted >= 24
    _answer(sched, chats[1])  # displaces it: its cells and answer go to the RAM tier
    restored, drafted, steps = _answer(sched, chats[0])
    assert cache.stats.hits["ram"] >= 1
    assert restored == first and drafted >= 24 and steps <= 12
    # Not for a sampled job, nor one whose request asked for no speculation.
    assert _answer(sched, chats[0], params=SamplingParams(temperature=0.7, seed=3))[1] == 0
    _, drafted, steps = _answer(sched, chats[0], draft=0)
    assert drafted == 0 and steps >= 32
    # An answer that goes another way from its first token (banned here, as another
    # schema or bias would): no guess is decoded, and the text is its own.
    job, out = _job(plain, chats[0], max_tokens=1)
    plain.submit(job)
    banned = out.result().context[-1]
    params = SamplingParams(temperature=0.0, seed=1, logit_bias=((banned, -100.0),))
    other, drafted, _ = _answer(sched, chats[0], params=params)
    assert other != first and drafted == 0
    assert other == _answer(plain, chats[0], params=params)[0]
