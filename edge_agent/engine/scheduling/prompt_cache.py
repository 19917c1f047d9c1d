"""The prompt cache beyond the sequences: the KV state of prompts that leave a sequence,
kept in host RAM and restored into a free sequence when a new prompt starts the way one of
them did.

A store's assistant sends the same long system prompt with every question and resends a
whole conversation at each turn, to more conversations than a model has sequences: the
cells a sequence held are overwritten by the next conversation long before the first
comes back. Before a sequence's cells are dropped, the scheduler hands their state here
(`keep`); at every start it asks for the longest cached prefix of the prompt (`find`),
and restores it where it covers more than any sequence holds.

**The RAM tier** is bounded in bytes (`[runtime] prompt_cache_mib`) and evicted least
recently used first; one cache serves every loaded model, so a model unloaded and loaded
again finds its prompts still there. **The index** is a chain of hashes over blocks of
BLOCK tokens: an entry is listed under the hash of each of its whole blocks, each hash
covering every block before it, so the deepest block a new prompt shares with any entry is
found in one dictionary lookup per block (a 2,000-token prompt: 125), and only the
entries listed there are compared token by token for the rest.

**Validity**: an entry is only ever found for the same `CacheShape` (the model's digest,
llama.cpp's build, the context per sequence, the KV cell type, flash attention): the cells
of another model, build or KV type would decode garbage, and no check in llama.cpp would
notice. The shape is part of every index key, not a check made afterwards.

**Shared prefixes**: a request's system part (its system message as the template renders
it: a store's instructions, menu and offers, a tenant's policies) is computed alone the
first time and kept as an entry of its own, beside the conversations that start with it.
**The disk tier** (`prompt_disk`) keeps the ones a second request used across restarts:
they are loaded into this tier when their model is, so the first request after a restart
or a model switch does not compute its system prompt again.

Entries are written and read by the schedulers' worker threads (one per model) and read
by `/metrics`; a lock guards the index, never a llama.cpp call.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

from edge_agent.engine.scheduling.steppolicy import common_prefix

log = logging.getLogger(__name__)

BLOCK = 16  # tokens a hash of the index covers
# A prompt shorter than this (a template's opening, a short question) is cheaper to compute
# again than to keep: its state is not cached.
MIN_ENTRY_TOKENS = 2 * BLOCK

State = ctypes.Array[ctypes.c_uint8]


@dataclass(frozen=True)
class CacheShape:
    """What a KV state is only valid for."""

    model: str  # the GGUF's sha256
    build: str  # llama.cpp's version and build (`runtime.llama.build_id`)
    n_ctx_seq: int
    kv_type: str
    flash_attn: int

    @property
    def key(self) -> str:
        """A short stable name of the shape (the disk tier's file names start with it)."""
        text = "|".join(str(v) for v in asdict(self).values())
        return hashlib.sha256(text.encode()).hexdigest()[:16]


class DiskTier(Protocol):
    """The tier below RAM (`prompt_disk.PromptDisk`)."""

    limit_bytes: int

    def usage(self) -> tuple[int, int]: ...

    def save(self, shape: CacheShape, tokens: list[int], state: bytes) -> bool: ...

    def load(self, shape: CacheShape) -> tuple[list[tuple[list[int], bytes]], int]: ...


@dataclass(eq=False)
class CachedPrompt:
    """One entry: the tokens whose cells `state` holds (positions 0..n-1)."""

    shape: CacheShape
    tokens: list[int]
    state: State
    tier: str = "ram"  # "disk": loaded from, or written to, the disk tier
    shared: bool = False  # a request's system part (kept beside longer entries)
    on_disk: bool = False  # written to the disk tier (or loaded from it)
    hashes: list[int] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.state)


@dataclass
class PromptCacheStats:
    """Counters since the start, and the tiers' sizes now (read without the lock)."""

    lookups: int = 0
    hits: dict[str, int] = field(default_factory=lambda: {"ram": 0, "disk": 0})
    restored_tokens: int = 0
    restore_s: float = 0.0
    evictions: int = 0
    ram_bytes: int = 0
    ram_entries: int = 0
    disk_bytes: int = 0
    disk_entries: int = 0
    disk_written: int = 0
    disk_loaded: int = 0
    disk_refused: int = 0  # files of another shape or damaged, not loaded


def block_hashes(tokens: Sequence[int], shape: CacheShape) -> list[int]:
    """The chained hash of each whole block of `tokens` (the shape's in the first)."""
    out: list[int] = []
    h = hash(shape)
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        h = hash((h, tuple(tokens[start : start + BLOCK])))
        out.append(h)
    return out


class PromptCache:
    """The RAM tier and its index (see the module's docstring); `disk`, where given, is
    the tier below it."""

    def __init__(self, limit_bytes: int, disk: DiskTier | None = None) -> None:
        self.limit_bytes = limit_bytes
        self.disk = disk
        self.stats = PromptCacheStats()
        self._entries: OrderedDict[int, CachedPrompt] = OrderedDict()  # by id, LRU first
        self._index: dict[int, set[int]] = {}  # block hash -> entry ids
        self._lock = threading.Lock()
        self._loaded: set[CacheShape] = set()
        # Shared prefixes by their exact tokens: a request's system part (`keep_shared`).
        self._shared: dict[tuple[CacheShape, tuple[int, ...]], CachedPrompt] = {}
        if disk is not None:
            self.stats.disk_bytes, self.stats.disk_entries = disk.usage()

    @property
    def enabled(self) -> bool:
        return self.limit_bytes > 0

    # -- finding ---------------------------------------------------------------------------
    def find(self, shape: CacheShape, prompt: Sequence[int], limit: int
             ) -> tuple[CachedPrompt | None, int]:
        """The entry sharing the longest prefix with `prompt` (at most `limit` tokens), and
        that length; (None, 0) where none shares a whole block. Counts a lookup, not a hit:
        the caller says whether it used it (`restored`)."""
        if not self.enabled:
            return None, 0
        with self._lock:
            self.stats.lookups += 1
            best, n = self._longest(shape, prompt, limit)
            if best is not None:
                self._entries.move_to_end(id(best))
        return best, n

    def _longest(self, shape: CacheShape, tokens: Sequence[int], limit: int
                 ) -> tuple[CachedPrompt | None, int]:
        """`find`'s answer, under the lock, without counting or touching the LRU order:
        among the entries listed under the deepest block `tokens` shares with any, the one
        sharing the most (the smaller on a tie)."""
        ids: set[int] = set()
        for h in reversed(block_hashes(tokens[:limit], shape)):
            ids = self._index.get(h, set())
            if ids:
                break
        best, n = None, 0
        for i in ids:
            entry = self._entries[i]
            shared = common_prefix(entry.tokens, tokens, limit)
            if shared > n or (shared == n and best is not None and entry.size < best.size):
                best, n = entry, shared
        return best, n

    def restored(self, entry: CachedPrompt, tokens: int, seconds: float) -> None:
        """`entry`'s first `tokens` cells were put into a sequence in `seconds`."""
        with self._lock:
            self.stats.hits[entry.tier] += 1
            self.stats.restored_tokens += tokens
            self.stats.restore_s += seconds

    def covers(self, shape: CacheShape, tokens: Sequence[int]) -> bool:
        """Whether an entry already holds every one of `tokens`' cells."""
        with self._lock:
            entry, n = self._longest(shape, tokens, len(tokens))
        return entry is not None and n == len(tokens)

    # -- keeping ---------------------------------------------------------------------------
    def worth_keeping(self, shape: CacheShape, tokens: Sequence[int]) -> bool:
        """Whether cells holding `tokens` would add anything: long enough, and not already
        held whole by an entry."""
        return self.enabled and len(tokens) >= MIN_ENTRY_TOKENS \
            and not self.covers(shape, tokens)

    def keep(self, shape: CacheShape, tokens: Sequence[int], state: State, *,
             tier: str = "ram", shared: bool = False) -> CachedPrompt | None:
        """Keeps `state` (the cells of `tokens`) in the RAM tier, evicting the least
        recently used entries to stay within the bound; entries it extends go (it holds
        all they held), unless they are shared prefixes. None where it does not fit."""
        if not self.enabled or len(state) > self.limit_bytes or len(tokens) < BLOCK:
            return None
        entry = CachedPrompt(shape, list(tokens), state, tier=tier, shared=shared)
        entry.hashes = block_hashes(entry.tokens, shape)
        with self._lock:
            for old in self._extended_by(entry):
                self._drop(old)
            self._entries[id(entry)] = entry
            for h in entry.hashes:
                self._index.setdefault(h, set()).add(id(entry))
            self.stats.ram_bytes += entry.size
            self.stats.ram_entries += 1
            while self.stats.ram_bytes > self.limit_bytes:
                _, victim = next(iter(self._entries.items()))
                self._drop(victim)
                self.stats.evictions += 1
        return entry

    def _extended_by(self, entry: CachedPrompt) -> list[CachedPrompt]:
        """Entries whose every token `entry` starts with (not shared prefixes): the last
        whole block of each is one of `entry`'s."""
        out = []
        for k, h in enumerate(entry.hashes):
            for i in self._index.get(h, ()):
                old = self._entries[i]
                if not old.shared and len(old.hashes) == k + 1 \
                        and len(old.tokens) <= len(entry.tokens) \
                        and entry.tokens[: len(old.tokens)] == old.tokens:
                    out.append(old)
        return out

    def _drop(self, entry: CachedPrompt) -> None:
        if self._entries.pop(id(entry), None) is None:
            return
        for h in entry.hashes:
            ids = self._index.get(h)
            if ids is not None:
                ids.discard(id(entry))
                if not ids:
                    del self._index[h]
        self.stats.ram_bytes -= entry.size
        self.stats.ram_entries -= 1
        if entry.shared:
            self._shared.pop((entry.shape, tuple(entry.tokens)), None)

    # -- shared prefixes and the disk tier --------------------------------------------------
    def has_shared(self, shape: CacheShape, tokens: Sequence[int]) -> bool:
        """Whether the cells of exactly `tokens` are kept as a shared prefix."""
        with self._lock:
            return (shape, tuple(tokens)) in self._shared

    def keep_shared(self, shape: CacheShape, tokens: Sequence[int], state: State) -> None:
        """A request's system part, computed alone: kept in RAM beside the longer entries
        that start with it (they come and go with conversations; it stays as long as it is
        used), and on disk once a second request used it (`shared_used`)."""
        if not self.enabled or self.has_shared(shape, tokens):
            return
        entry = self.keep(shape, tokens, state, shared=True)
        if entry is not None:
            with self._lock:
                self._shared[(shape, tuple(entry.tokens))] = entry

    def shared_used(self, shape: CacheShape, tokens: Sequence[int]) -> None:
        """A request started on the cells of `tokens`, a shared prefix computed before: a
        system prompt more than one request sends, worth keeping across a restart. Written
        to the disk tier once, by a thread of its own (a file of a few MB, fsynced)."""
        if self.disk is None:
            return
        with self._lock:
            entry = self._shared.get((shape, tuple(tokens)))
            if entry is None or entry.on_disk:
                return
            entry.on_disk = True
            self._entries.move_to_end(id(entry))
        data = bytes(entry.state)
        threading.Thread(target=self._write, args=(shape, entry.tokens, data),
                         name="prompt-cache-disk", daemon=True).start()

    def _write(self, shape: CacheShape, tokens: list[int], data: bytes) -> None:
        assert self.disk is not None
        try:
            written = self.disk.save(shape, tokens, data)
        except Exception:  # the next start computes it: nothing worse
            log.exception("keeping a prompt's state on disk failed")
            written = False
        with self._lock:
            if written:
                self.stats.disk_written += 1
            self.stats.disk_bytes, self.stats.disk_entries = self.disk.usage()

    def load(self, shape: CacheShape) -> int:
        """The disk tier's entries of `shape` into RAM, once per shape (a model's load);
        the number loaded."""
        if not self.enabled or self.disk is None or shape in self._loaded:
            return 0
        self._loaded.add(shape)
        loaded, refused = self.disk.load(shape)
        n = 0
        for tokens, data in loaded:
            state = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
            entry = self.keep(shape, tokens, state, tier="disk", shared=True)
            if entry is not None:
                entry.on_disk = True
                with self._lock:
                    self._shared[(shape, tuple(entry.tokens))] = entry
                n += 1
        with self._lock:
            self.stats.disk_loaded += n
            self.stats.disk_refused += refused
            self.stats.disk_bytes, self.stats.disk_entries = self.disk.usage()
        return n
