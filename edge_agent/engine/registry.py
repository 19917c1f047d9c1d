"""Loaded models: load on first use, keep for `keep_alive`, unload when it runs out.

Owns every `ModelScheduler`. Loading (digest check, header probe, llama.cpp load) runs in a
thread so the event loop keeps answering; concurrent requests for a model that is being
loaded wait for the same load.

A loaded model is one version of a name: keyed by (name, digest). `acquire(name)` reads the
name's active digest from `models.db` at each call (a cheap read; the CLI may switch it from
another process), so after a switch new requests load and use the new version while
requests already running finish on the old one, which is unloaded when its last user
releases it (or by `reap_expired` once idle). Both count against the memory budget while
both are loaded; `max_loaded_models` counts names, so two versions of one name take one
slot (a switch needs memory, not a slot).

A rollout (the fleet link, through `ModelOps`) may load a version that is not active yet
(`acquire(name, digest=...)`), `hold` versions so that being inactive does not unload
them (the new one before its switch, the old one until the new one passed its health
gate, so a switch back is instant), ask whether a version `fits` beside what is loaded,
and `drain` a name when it does not: new requests for it wait (up to
`fleet.switch_wait_s`, counted as their wait for the model) while running ones end and
the versions swap, and go on with the new one; only past that wait, 503 with Retry-After.
Holds and drains live in this process only: a restart forgets them, as it should.

On a first start the default model is still being copied into the store when the port
opens (`installing`): a request for it meanwhile waits for it, as for a load (503 with
Retry-After under `runtime.load_wait = false`), rather than hear that it does not exist,
which a client takes for good; if that install failed, 503 saying why. The default model,
evicted to make room for another, is loaded again by the reaper once it fits beside what
is loaded (never by evicting), so the box does not stay cold until its next request.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edge_agent.config import DRAFT_MODEL_TOKENS, Settings
from edge_agent.engine.models.catalog import InstalledModel, ModelStore
from edge_agent.engine.models.entries import prompt_cache_dir
from edge_agent.engine.models.gguf_probe import GGUFInfo, probe
from edge_agent.engine.request import EmbeddingResult, Event, Generation, GenerationSpec
from edge_agent.engine.runtime.llama import (
    LlamaModel,
    build_id,
    default_threads,
    kv_scale,
    resolve_extra_buffers,
    resolve_flash_attn,
    resolve_gpu_layers,
)
from edge_agent.engine.runtime.parallel_plan import auto_parallel
from edge_agent.engine.scheduling.draftmodel import vocabulary_difference
from edge_agent.engine.scheduling.prompt_cache import CacheShape, PromptCache
from edge_agent.engine.scheduling.prompt_disk import PromptDisk
from edge_agent.engine.scheduling.scheduler import (
    EmbeddingJob,
    GenerationJob,
    ModelScheduler,
    ThreadEmitter,
)
from edge_agent.engine.text.templates import ChatTemplate
from edge_agent.errors import InvalidRequest, MemoryShort, ModelNotFound, ServiceUnavailable
from edge_agent.names import ModelName, as_given
from edge_agent.priority import BACKGROUND_NICE, run_niced

MIB = 2**20

log = logging.getLogger(__name__)

DEFAULT_KEEP_ALIVE_S = 300.0
FOREVER = float("inf")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}

_CENTURY_S = 100 * 365 * 86400.0


def parse_keep_alive(value: object) -> float | None:
    """Ollama's keep_alive: seconds or a Go duration ("5m", "1h30m"); negative = forever."""
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise InvalidRequest("keep_alive must be a duration or a number", param="keep_alive")
    if isinstance(value, (int, float)):
        return _bounded(FOREVER if value < 0 else float(value))
    if isinstance(value, str):
        text = value.strip()
        negative = text.startswith("-")
        text = text.lstrip("+-")
        try:
            seconds = float(text)
        except ValueError:
            parts = _DURATION.findall(text)
            if not parts or "".join(n + u for n, u in parts) != text:
                raise InvalidRequest(f"keep_alive '{value}' is not a duration",
                                     param="keep_alive") from None
            seconds = sum(float(n) * _UNIT_S[u] for n, u in parts)
        return _bounded(FOREVER if negative and seconds > 0 else seconds)
    raise InvalidRequest("keep_alive must be a duration or a number", param="keep_alive")


def _bounded(seconds: float) -> float:
    """NaN is no duration; anything past a century (1e12, Infinity) means forever, as a
    negative value does: an expiry past the year 9999 cannot be shown by /api/ps."""
    if seconds != seconds:
        raise InvalidRequest("keep_alive must be a number, not NaN", param="keep_alive")
    return FOREVER if seconds > _CENTURY_S else seconds


@dataclass
class LoadedModel:
    info: InstalledModel
    worker: ModelScheduler
    template: ChatTemplate | None
    keep_alive: float
    memory: int  # weights + KV cache, bytes
    in_use: int = 0
    expires_at: float = FOREVER
    last_used: float = field(default_factory=time.monotonic)
    draft_model: str | None = None  # the model that guesses for it, where one does

    @property
    def speculation(self) -> dict[str, Any]:
        """How it speculates, for /api/ps: guesses a step for requests that set none (0:
        off), and from where ("prompt", or the draft model's name)."""
        tokens = self.worker.prompt_lookup
        source = self.draft_model if self.worker.drafter is not None else "prompt"
        return {"draft_tokens": tokens, "source": source if tokens else None}

    @property
    def size(self) -> int:
        return self.memory

    def expected_wait_s(self) -> float:
        return self.worker.expected_wait_s()

    @property
    def size_vram(self) -> int:
        return self.memory if self.worker.model.n_gpu_layers > 0 else 0

    @property
    def parallel(self) -> int:
        """Sequences decoded together (`parallel`, "auto" resolved at load)."""
        return self.worker.stats.parallel

    @property
    def saturated(self) -> bool:
        """Every sequence is taken: a job queued now waits for one to end."""
        stats = self.worker.stats
        return stats.running >= stats.parallel

    # -- the narrow interface the request path uses (gateway/): nothing else of the worker
    @property
    def n_ctx(self) -> int:
        """Tokens per sequence: the most one request's prompt and answer may take."""
        return self.worker.n_ctx

    @property
    def embed_ctx(self) -> int:
        return self.worker.embed_ctx

    @property
    def n_vocab(self) -> int:
        return self.worker.model.n_vocab

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return self.worker.model.tokenize(text, add_special=add_special,
                                          parse_special=parse_special)

    def special_texts(self, text: str) -> set[str]:
        return self.worker.model.special_texts(text)

    def generate(self, spec: GenerationSpec, loop: asyncio.AbstractEventLoop
                 ) -> Generation:
        """Queue a generation; its events arrive on the returned queue, in the loop."""
        events: asyncio.Queue[Event] = asyncio.Queue()
        job = GenerationJob(prompt=spec.prompt, params=spec.params, grammar=spec.grammar,
                            max_tokens=spec.max_tokens, stops=spec.stops,
                            emit=ThreadEmitter(loop, events), priority=spec.priority,
                            load_ns=spec.load_ns, cache_key=spec.cache_key,
                            draft=spec.draft, stream=spec.stream, yields=spec.yields,
                            system_tokens=spec.system_tokens)
        self.worker.submit(job)
        return Generation(events=events, cancelled=job.cancelled,
                          submitted_ns=job.submitted_ns)

    def embed(self, inputs: list[list[int]], truncated: int,
              done: Callable[[EmbeddingResult | Exception], None]) -> threading.Event:
        """Queue an embedding; `done` is called once, from the worker thread. Setting the
        returned event stops the work at its next chunk."""
        job = EmbeddingJob(inputs=inputs, truncated_tokens=truncated, done=done)
        self.worker.submit(job)
        return job.cancelled


def _key(info: InstalledModel) -> tuple[str, str]:
    return info.name, info.digest


def _total_ram() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


@dataclass
class _Drain:
    """A name's version swap under way: requests wait on `done`."""

    retry_after: float
    done: asyncio.Event = field(default_factory=asyncio.Event)


class ModelRegistry:
    """Loads on demand within `max_loaded_models` and a memory budget, evicting the least
    recently used idle model to make room; a model serving requests is never evicted."""

    def __init__(self, settings: Settings, store: ModelStore) -> None:
        self.settings = settings
        self.store = store
        rt = settings.runtime
        self.memory_budget = rt.memory_budget or int(0.8 * _total_ram())
        self._loaded: dict[tuple[str, str], LoadedModel] = {}
        self._loading: dict[tuple[str, str], asyncio.Task[LoadedModel]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._held: set[tuple[str, str]] = set()
        self._draining: dict[str, _Drain] = {}  # name -> its swap under way
        self._installing: dict[str, asyncio.Future[Any]] = {}
        self._install_failed: dict[str, str] = {}  # name -> why its install failed
        self._freed = False  # a model was unloaded since the last reaper pass
        self._displaced = False  # the default model was evicted to make room for another
        # One prompt cache for every model (its entries are found for their own model's
        # shape only), outliving their loads: a model loaded again finds its prompts.
        disk = PromptDisk(prompt_cache_dir(store.state_dir), rt.prompt_cache_disk_mib * MIB) \
            if rt.prompt_cache_disk_mib > 0 else None
        self.prompt_cache = PromptCache(rt.prompt_cache_mib * MIB, disk)

    def loaded(self) -> list[LoadedModel]:
        return list(self._loaded.values())

    @property
    def _default_model(self) -> ModelName:
        """The setting, read at each use (a restart or a patch may change it)."""
        return ModelName.parse(self.settings.default_model)

    def is_loaded(self, name: ModelName) -> bool:
        """Some version of `name` is loaded (right after a switch, maybe the old one)."""
        key = name
        return any(k[0] == key for k in self._loaded)

    def is_loading(self, name: ModelName) -> bool:
        key = name
        return any(k[0] == key for k in self._loading)

    def installing(self, name: ModelName, done: asyncio.Future[Any]) -> None:
        """`name` is being put into the store until `done` ends; if it ends in an error,
        requests for the name that is still not installed hear why (`install_failure`)."""
        key = name
        self._installing[key] = done
        self._install_failed.pop(key, None)

        def ended(f: asyncio.Future[Any]) -> None:
            self._installing.pop(key, None)
            exc = None if f.cancelled() else f.exception()
            if exc is not None:
                self._install_failed[key] = getattr(exc, "message", None) or str(exc) \
                    or type(exc).__name__

        done.add_done_callback(ended)

    def is_installing(self, name: ModelName) -> bool:
        return name in self._installing

    def install_failure(self, name: ModelName) -> str | None:
        """Why the install `installing` announced for `name` failed (None: it did not)."""
        return self._install_failed.get(name)

    async def _installed(self, name: ModelName) -> None:
        """Returns once `name` is not being installed (waiting, or 503 without load_wait);
        whether the install worked is for the store lookup that follows to say."""
        key = name
        pending = self._installing.get(key)
        if pending is None:
            return
        if not self.settings.runtime.load_wait:
            raise ServiceUnavailable(f"model '{key}' is being installed; retry shortly",
                                     retry_after=2.0)
        await asyncio.wait([pending])

    async def acquire(
        self, name: ModelName, keep_alive: float | None = None, digest: str | None = None
    ) -> tuple[LoadedModel, int]:
        """The name's active version (or its installed version `digest`, a full digest),
        loaded, and how long this call waited for it to load (ns). A draining name
        refuses requests for its active version (503, Retry-After)."""
        start = time.perf_counter_ns()
        if digest is None:
            await self._installed(name)
            await self._swapped(name)
            try:
                info = self.store.get(name)  # the pointer, read now; 404 before any waiting
            except ModelNotFound:
                failed = self.install_failure(name)
                if failed is None:
                    raise
                # Not the client's mistake, and not for it to fix: say so, not "not found".
                raise ServiceUnavailable(
                    f"model '{as_given(name)}' could not be installed at start: "
                    f"{failed} (fix it, then restart the service)", retry_after=60.0) from None
        else:
            info = self._version(name, digest)
        key = _key(info)
        model = self._loaded.get(key)
        if model is None:
            task = self._loading.get(key)
            if task is None:
                task = asyncio.create_task(self._load(info))
                self._loading[key] = task
                task.add_done_callback(lambda _t: self._loading.pop(key, None))
            elif not self.settings.runtime.load_wait:
                raise ServiceUnavailable(f"model '{info.name}' is loading; retry shortly",
                                         retry_after=2.0)
            model = await asyncio.shield(task)
        model.in_use += 1
        model.last_used = time.monotonic()
        if keep_alive is not None:
            model.keep_alive = keep_alive
        model.expires_at = FOREVER
        return model, time.perf_counter_ns() - start

    async def release(self, model: LoadedModel) -> None:
        model.in_use -= 1
        model.last_used = time.monotonic()
        if model.in_use > 0:
            return
        if model.keep_alive <= 0 or self._superseded(model):
            await self._unload(model)
        else:
            model.expires_at = time.time() + model.keep_alive

    def _superseded(self, model: LoadedModel) -> bool:
        """No longer the active version of its name (switched, or removed), and not held."""
        return _key(model.info) not in self._held and \
            self.store.active_digest(model.info.name) != model.info.digest

    def _version(self, name: ModelName, digest: str) -> InstalledModel:
        key = name
        for version in self.store.versions(key):
            if version.digest == digest:
                return version.model
        raise ModelNotFound(f"model '{key}' has no installed version sha256:{digest[:12]}",
                            param="model")

    def hold(self, name: ModelName, digest: str, held: bool = True) -> None:
        """Keep (or stop keeping) version `digest` of `name` loaded while it is not the
        active one. Releasing a hold unloads nothing by itself: `unload` does, once idle."""
        key = (name, digest)
        if held:
            self._held.add(key)
        else:
            self._held.discard(key)

    def drain(self, name: ModelName, on: bool = True, retry_after: float = 2.0) -> None:
        """Hold back (on) or let go (off) new requests for `name`'s active version: they
        wait in `acquire` for the swap, and get the new version once it is off."""
        key = name
        if on:
            self._draining.setdefault(key, _Drain(retry_after))
        else:
            drain = self._draining.pop(key, None)
            if drain is not None:
                drain.done.set()

    async def _swapped(self, key: str) -> None:
        """Returns once `key` is not draining: waits for the swap, bounded by
        `fleet.switch_wait_s` (503 with Retry-After past it, or at once without load_wait
        or a wait)."""
        drain = self._draining.get(key)
        if drain is None:
            return
        wait = self.settings.fleet.switch_wait_s
        if not self.settings.runtime.load_wait or wait <= 0:
            raise ServiceUnavailable(f"model '{key}' is switching versions; retry shortly",
                                     retry_after=drain.retry_after)
        try:
            await asyncio.wait_for(drain.done.wait(), wait)
        except asyncio.TimeoutError:
            raise ServiceUnavailable(f"model '{key}' is still switching versions after "
                                     f"{wait:g} s; retry shortly",
                                     retry_after=drain.retry_after) from None

    def _names(self, also: ModelName | None = None) -> int:
        """Distinct names loaded (with `also`): what `max_loaded_models` limits."""
        names = {k[0] for k in self._loaded}
        if also is not None:
            names.add(also)
        return len(names)

    async def fits(self, name: ModelName, digest: str) -> bool:
        """Whether version `digest` of `name` can load beside every loaded model, without
        evicting any (True when it is loaded already)."""
        info = self._version(name, digest)
        if _key(info) in self._loaded:
            return True
        gguf = await run_niced(BACKGROUND_NICE, probe, info.blob_path(self.store.state_dir))
        _, _, parallel, n_ctx, _ = self._plan(info, gguf)
        need = info.size + self._kv_bytes(info, gguf) * parallel * n_ctx
        used = sum(m.memory for m in self._loaded.values())
        return self._names(name) <= self.settings.runtime.max_loaded_models and \
            used + need <= self.memory_budget

    async def unload(self, name: ModelName, digest: str | None = None) -> bool:
        """Unloads the loaded versions of `name` (or the one `digest`) that serve nothing.
        True when one was loaded and none is left; False when none was loaded or one is
        still serving requests (it stays)."""
        key = name
        matching = [m for k, m in self._loaded.items()
                    if k[0] == key and (digest is None or k[1] == digest)]
        for model in matching:
            await self._unload(model)
        return bool(matching) and all(_key(m.info) not in self._loaded for m in matching)

    async def _unload(self, model: LoadedModel) -> bool:
        key = _key(model.info)
        if self._loaded.get(key) is not model or model.in_use > 0:
            return False
        del self._loaded[key]
        self._freed = True
        await asyncio.to_thread(model.worker.close)
        log.info("unloaded %s (sha256:%s)", key[0], key[1][:12])
        if model.keep_alive == FOREVER and self._superseded(model):
            self._reload(model.info.name)
        return True

    def _reload(self, name: ModelName, why: str = "after its switch") -> None:
        """A pinned model (the default) that was switched to another version: its new
        version is loaded now, not by the next request, so the box stays ready."""
        if self.is_loaded(name) or self.is_loading(name) or not self.store.is_installed(name):
            return

        async def load() -> None:
            try:
                model, _ = await self.acquire(name)
                await self.release(model)
            except Exception as exc:
                log.error("%s not loaded %s: %s", name, why, exc)

        task = asyncio.get_running_loop().create_task(load())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def reap_expired(self) -> None:
        """Unloads idle models whose keep_alive ran out, and idle versions that are no
        longer active (switched by this process or another); then, if anything was
        unloaded since the last pass, brings the default model back if a load displaced
        it and it fits again."""
        now = time.time()
        for model in list(self._loaded.values()):
            if model.in_use == 0 and (model.expires_at <= now or self._superseded(model)):
                await self._unload(model)
        if self._displaced and self._freed:
            self._freed = await self._restore_default()

    async def _restore_default(self) -> bool:
        """The default model, displaced by another model's load (`max_loaded_models`, the
        memory budget), loaded again once it fits beside what is loaded, never by
        evicting: until then the box was cold and `/ready` 503 until its next request.
        Tried only after an unload (room may have come back), so the probe that `fits`
        takes is not paid at every pass; True: look again at the next pass (a load or a
        switch was under way)."""
        name = self._default_model
        if self.is_loaded(name):
            self._displaced = False
            return False
        if self._loading or self.is_installing(name) or name in self._draining:
            return True
        digest = self.store.active_digest(name)
        if digest is None or self._names(name) > self.settings.runtime.max_loaded_models \
                or not await self.fits(name, digest):
            return False
        log.info("loading %s again: there is room for it beside the loaded models", name)
        self._reload(name, "again once there was room")
        return False

    async def close(self) -> None:
        for reload in list(self._background):
            reload.cancel()
        for task in list(self._loading.values()):
            try:
                await task
            except Exception:
                pass
        for name in list(self._loaded):
            model = self._loaded.pop(name)
            await asyncio.to_thread(model.worker.close)

    def _plan(self, info: InstalledModel, gguf: GGUFInfo) -> tuple[int, int, int, int, int]:
        """(gpu layers, threads, parallel, context per sequence, batch) for a model;
        `parallel = "auto"` sized by `parallel_plan` from the file's KV bytes per token."""
        rt = self.settings.runtime
        override = self.settings.model_override(info.name)
        gpu = resolve_gpu_layers(
            override.n_gpu_layers if override.n_gpu_layers is not None else rt.n_gpu_layers)
        threads = override.threads or rt.threads or default_threads()
        n_ctx = self._planned_context(info)
        parallel = override.parallel or rt.parallel
        if parallel == "auto":
            parallel = auto_parallel(
                kv_bytes_per_token=self._kv_bytes(info, gguf), context=n_ctx,
                weights=info.size, budget=self.memory_budget, models=rt.max_loaded_models,
                threads=threads, gpu=gpu > 0)
        return gpu, threads, parallel, n_ctx, min(rt.batch_size, n_ctx)

    def _kv_type(self, info: InstalledModel) -> str:
        return self.settings.model_override(info.name).kv_cache_type or \
            self.settings.runtime.kv_cache_type

    def _kv_bytes(self, info: InstalledModel, gguf: GGUFInfo) -> int:
        """KV bytes per cached token at the model's `kv_cache_type`."""
        return int(gguf.kv_bytes_per_token() * kv_scale(self._kv_type(info)))

    def _prompt_lookup(self, info: InstalledModel) -> int:
        own = self.settings.model_override(info.name).prompt_lookup
        return self.settings.runtime.prompt_lookup if own is None else own

    def _planned_context(self, info: InstalledModel) -> int:
        n_ctx = self.settings.model_override(info.name).context_length or \
            self.settings.runtime.context_length
        return min(n_ctx, info.context_length) if info.context_length else n_ctx

    def served_context(self, info: InstalledModel) -> int:
        """Tokens per request the box serves `info` with: the loaded model's window, or
        what a load would give it (the configured context, capped by the trained one)."""
        loaded = self._loaded.get(_key(info))
        return loaded.worker.n_ctx if loaded is not None else self._planned_context(info)

    async def _make_room(self, key: ModelName, need: int) -> None:
        """Evicts idle models, least recently used first, until `need` fits. A version
        still serving after a switch counts like any model serving requests."""
        limit = self.settings.runtime.max_loaded_models
        while self._loaded and (
            self._names(key) > limit
            or sum(m.memory for m in self._loaded.values()) + need > self.memory_budget
        ):
            idle = [m for m in self._loaded.values() if m.in_use == 0]
            if not idle:
                raise MemoryShort(
                    f"no room to load '{key}': every loaded model is serving requests",
                    retry_after=5.0)
            victim = min(idle, key=lambda m: m.last_used)
            log.info("evicting %s to make room for %s", victim.info.name, key)
            if victim.info.name == self._default_model:
                self._displaced = True
            await self._unload(victim)
        if need > self.memory_budget:
            raise ServiceUnavailable(
                f"'{key}' needs {need / 2**20:.0f} MiB, over the memory budget of "
                f"{self.memory_budget / 2**20:.0f} MiB", retry_after=60.0)

    async def _load(self, info: InstalledModel) -> LoadedModel:
        key = info.name
        # Digest + header on every load: a blob may rot on disk after it was installed.
        # Below the generation threads' priority: the models serving meanwhile keep the
        # cores (the load itself is not niced: its scheduler's threads would keep it).
        gguf = await run_niced(BACKGROUND_NICE, self.store.verify, info)
        gpu_layers, _, parallel, n_ctx, _ = self._plan(info, gguf)
        need = info.size + self._kv_bytes(info, gguf) * parallel * n_ctx
        draft = await self._draft_info(info)
        if draft is not None:
            need += draft[0].size + draft[1].kv_bytes_per_token() * parallel * n_ctx
        await self._make_room(key, need)
        # The weights below the generation threads' priority too; the scheduler (its
        # context and threads) at the usual one, or its threads would keep the raised value.
        rt = self.settings.runtime
        model = await run_niced(BACKGROUND_NICE, LlamaModel,
                                info.blob_path(self.store.state_dir),
                                n_gpu_layers=gpu_layers,
                                extra_buffers=resolve_extra_buffers(rt.cpu_extra_buffers))
        draft_model = None
        if draft is not None:
            try:
                draft_model = await run_niced(BACKGROUND_NICE, LlamaModel,
                                              draft[0].blob_path(self.store.state_dir),
                                              n_gpu_layers=gpu_layers,
                                              extra_buffers=resolve_extra_buffers(
                                                  rt.cpu_extra_buffers))
            except Exception:
                log.exception("%s: its draft model %s could not be loaded; it runs "
                              "without", key, draft[0].name)
        try:
            loaded = await asyncio.to_thread(self._load_blocking, info, need, model, gguf,
                                             draft_model)
        except BaseException:
            if draft_model is not None:
                draft_model.close()  # idempotent: the scheduler may have closed it
            raise
        self._loaded[_key(info)] = loaded
        log.info("loaded %s sha256:%s (%d x %d context, gpu layers %d, ~%d MiB)", key,
                 info.digest[:12], parallel, loaded.worker.n_ctx,
                 loaded.worker.model.n_gpu_layers, need // 2**20)
        return loaded

    async def _draft_info(self, info: InstalledModel) -> tuple[InstalledModel, GGUFInfo] | None:
        """The installed draft model `info`'s override names, checked like any load, or
        None: none named, or one that cannot be used (logged; the model runs without)."""
        name = self.settings.model_override(info.name).draft_model
        if not name:
            return None
        try:
            draft = self.store.get(ModelName.parse(name))  # a setting: parsed here
            return draft, await run_niced(BACKGROUND_NICE, self.store.verify, draft)
        except Exception as exc:
            log.error("%s: its draft model %s cannot be used (%s); it runs without",
                      info.name, name, exc)
            return None

    def _load_blocking(self, info: InstalledModel, memory: int, model: LlamaModel,
                       gguf: GGUFInfo, draft: LlamaModel | None = None) -> LoadedModel:
        rt = self.settings.runtime
        _, threads, parallel, n_ctx, n_batch = self._plan(info, gguf)
        override = self.settings.model_override(info.name)
        lookup = self._prompt_lookup(info)
        if draft is not None:
            differs = vocabulary_difference(model, draft)
            if differs is not None:
                log.error("%s: its draft model %s has another vocabulary (%s); it runs "
                          "without", info.name, override.draft_model, differs)
                draft.close()
                draft = None
            else:
                lookup = override.draft_tokens or DRAFT_MODEL_TOKENS
        # What the context's cells depend on: the prompt cache's key for them.
        shape = CacheShape(model=info.digest, build=build_id(), n_ctx_seq=n_ctx,
                           kv_type=self._kv_type(info),
                           flash_attn=resolve_flash_attn(rt.flash_attn))
        try:
            worker = ModelScheduler(
                model, parallel=parallel, n_ctx_seq=n_ctx, n_batch=n_batch, n_threads=threads,
                embed_ctx=rt.embedding_context, max_queue=rt.max_queue,
                prefill_chunk=rt.prefill_chunk, max_step_stall=rt.max_step_stall,
                aging_s=rt.aging_s, deterministic=rt.deterministic,
                flash_attn=shape.flash_attn, kv_type=shape.kv_type,
                nice=rt.compute_nice,
                prompt_lookup=lookup, answer_drafts=rt.answer_drafts, draft_model=draft,
                close_tokens=rt.structured_close_tokens,
                yield_idle_s=self.settings.batches.idle_ms / 1000,
                yield_reserve=self.settings.batches.reserve_slots,
                prompt_cache=self.prompt_cache,
                threads_follow_load=rt.threads_follow_load,
                cache_shape=shape)
        except BaseException:
            model.close()
            raise
        template = None
        if info.chat_template:
            template = ChatTemplate(info.chat_template, bos_token=model.token_text(model.bos),
                                    eos_token=model.token_text(model.eos))
        keep = FOREVER if info.name == self._default_model \
            else DEFAULT_KEEP_ALIVE_S
        return LoadedModel(info=info, worker=worker, template=template,
                           keep_alive=keep, memory=memory,
                           draft_model=override.draft_model if draft is not None else None)
