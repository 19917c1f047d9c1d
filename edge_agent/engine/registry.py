"""Loaded models: load on first use, keep for `keep_alive`, unload when it runs out.

Owns every `ModelWorker`. Loading (digest check, header probe, llama.cpp load) runs in a
thread so the event loop keeps answering; concurrent requests for a model that is being
loaded wait for the same load.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field

from edge_agent.config import Settings
from edge_agent.engine.catalog import InstalledModel, ModelStore, normalize_name
from edge_agent.engine.runtime import LlamaModel, default_threads, resolve_gpu_layers
from edge_agent.engine.scheduler import ModelWorker
from edge_agent.engine.templates import ChatTemplate
from edge_agent.errors import InvalidRequest

log = logging.getLogger(__name__)

DEFAULT_KEEP_ALIVE_S = 300.0
FOREVER = float("inf")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value: object) -> float | None:
    """Ollama's keep_alive: seconds or a Go duration ("5m", "1h30m"); negative = forever."""
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise InvalidRequest("keep_alive must be a duration or a number", param="keep_alive")
    if isinstance(value, (int, float)):
        return FOREVER if value < 0 else float(value)
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
        return FOREVER if negative and seconds > 0 else seconds
    raise InvalidRequest("keep_alive must be a duration or a number", param="keep_alive")


@dataclass
class LoadedModel:
    info: InstalledModel
    worker: ModelWorker
    template: ChatTemplate | None
    loaded_at: float
    keep_alive: float
    in_use: int = 0
    expires_at: float = FOREVER
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def size(self) -> int:
        return self.worker.model.size

    @property
    def size_vram(self) -> int:
        return self.size if self.worker.model.n_gpu_layers > 0 else 0


class ModelRegistry:
    def __init__(self, settings: Settings, store: ModelStore) -> None:
        self.settings = settings
        self.store = store
        self._loaded: dict[str, LoadedModel] = {}
        self._loading: dict[str, asyncio.Task[LoadedModel]] = {}

    def loaded(self) -> list[LoadedModel]:
        return list(self._loaded.values())

    def is_loaded(self, name: str) -> bool:
        return normalize_name(name) in self._loaded

    async def acquire(
        self, name: str, keep_alive: float | None = None
    ) -> tuple[LoadedModel, int]:
        """The loaded model and how long this call waited for it to load (ns)."""
        key = normalize_name(name)
        self.store.get(key)  # 404 before any waiting
        start = time.perf_counter_ns()
        model = self._loaded.get(key)
        if model is None:
            task = self._loading.get(key)
            if task is None:
                task = asyncio.create_task(self._load(key))
                self._loading[key] = task
                task.add_done_callback(lambda _t: self._loading.pop(key, None))
            model = await asyncio.shield(task)
        model.in_use += 1
        if keep_alive is not None:
            model.keep_alive = keep_alive
        model.expires_at = FOREVER
        return model, time.perf_counter_ns() - start

    async def release(self, model: LoadedModel) -> None:
        model.in_use -= 1
        if model.in_use > 0:
            return
        if model.keep_alive <= 0:
            await self.unload(model.info.name)
        else:
            model.expires_at = time.time() + model.keep_alive

    async def unload(self, name: str) -> bool:
        key = normalize_name(name)
        model = self._loaded.get(key)
        if model is None or model.in_use > 0:
            return False
        del self._loaded[key]
        await asyncio.to_thread(model.worker.close)
        log.info("unloaded %s", key)
        return True

    async def reap_expired(self) -> None:
        now = time.time()
        for model in list(self._loaded.values()):
            if model.in_use == 0 and model.expires_at <= now:
                await self.unload(model.info.name)

    async def close(self) -> None:
        for task in list(self._loading.values()):
            try:
                await task
            except Exception:
                pass
        for name in list(self._loaded):
            model = self._loaded.pop(name)
            await asyncio.to_thread(model.worker.close)

    async def _load(self, key: str) -> LoadedModel:
        info = self.store.get(key)
        loaded = await asyncio.to_thread(self._load_blocking, info)
        self._loaded[key] = loaded
        log.info("loaded %s (context %d, gpu layers %d)", key, loaded.worker.n_ctx,
                 loaded.worker.model.n_gpu_layers)
        return loaded

    def _load_blocking(self, info: InstalledModel) -> LoadedModel:
        self.store.verify(info)  # digest + header, every load: a blob may rot on disk
        rt = self.settings.runtime
        override = self.settings.model_override(info.name)
        gpu = resolve_gpu_layers(
            override.n_gpu_layers if override.n_gpu_layers is not None else rt.n_gpu_layers
        )
        threads = override.threads or rt.threads or default_threads()
        model = LlamaModel(info.blob_path(self.store.state_dir), n_gpu_layers=gpu)
        try:
            n_ctx = min(override.context_length or rt.context_length, model.n_ctx_train)
            worker = ModelWorker(model, n_ctx=n_ctx, n_batch=min(rt.batch_size, n_ctx),
                                 n_threads=threads, embed_ctx=rt.embedding_context)
        except BaseException:
            model.close()
            raise
        template = None
        if info.chat_template:
            template = ChatTemplate(info.chat_template, bos_token=model.token_text(model.bos),
                                    eos_token=model.token_text(model.eos))
        keep = FOREVER if info.name == normalize_name(self.settings.default_model) \
            else DEFAULT_KEEP_ALIVE_S
        return LoadedModel(info=info, worker=worker, template=template, loaded_at=time.time(),
                           keep_alive=keep)
