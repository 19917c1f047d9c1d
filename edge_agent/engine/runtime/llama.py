"""llama.cpp through llama-cpp-python's low-level API: models, contexts, batches (the
sampler chains are `sampler`'s).

The high-level `Llama` class forces one sequence per context and its own sampling loop;
the scheduler needs to own contexts and sampler chains itself, so this module wraps the
C API directly. Everything here is called from the scheduler's worker thread only (a
llama context is not thread-safe); it never touches asyncio.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import llama_cpp as ll
import numpy as np

from edge_agent.errors import EdgeAgentError, InvalidRequest, ModelFileError

log = logging.getLogger("edge_agent.llama")

# Token kinds that only special-token parsing produces from text (see special_texts).
_FORGEABLE = ll.LLAMA_TOKEN_ATTR_CONTROL | ll.LLAMA_TOKEN_ATTR_UNKNOWN

# ggml's levels (1 DEBUG … 4 ERROR, 5 = continuation); llama.cpp's INFO chatter goes to DEBUG.
_LEVELS = {1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}


@ll.llama_log_callback
def _on_llama_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    message = text.decode("utf-8", errors="replace").rstrip("\n")
    if message:
        log.log(_LEVELS.get(level, logging.DEBUG), "%s", message)


class _Backend:
    """llama.cpp's process-wide initialisation, done once. The callback object must live
    as long as the process, so it is a module constant rather than a local."""

    _lock = threading.Lock()
    _ready = False

    @classmethod
    def ensure(cls) -> None:
        with cls._lock:
            if not cls._ready:
                ll.llama_log_set(_on_llama_log, ctypes.c_void_p(0))
                ll.llama_backend_init()
                cls._ready = True


def build_id() -> str:
    """llama.cpp as this process runs it: llama-cpp-python's version (which pins the
    vendored llama.cpp) and a digest of the backends and CPU features it was built with. A
    KV state is only reused under the same one (`prompt_cache.CacheShape`)."""
    info = hashlib.sha256(system_info().encode()).hexdigest()[:12]
    return f"{ll.__version__}+{info}"


def gpu_offload_supported() -> bool:
    return bool(ll.llama_supports_gpu_offload())


def system_info() -> str:
    return ll.llama_print_system_info().decode(errors="replace").strip()


def resolve_gpu_layers(setting: int | str) -> int:
    if setting == "auto":
        return 999 if gpu_offload_supported() else 0
    return int(setting)


def cpu_has_amx(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether the CPU advertises AMX (Intel Sapphire Rapids and later)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return False
    return any(line.startswith("flags") and " amx_int8" in f" {line.split(':', 1)[-1]}"
               for line in text.splitlines())


def resolve_extra_buffers(setting: str, *, has_amx: bool | None = None) -> bool:
    """llama.cpp's extra CPU buffer types (weight repacking, AMX).

    'auto' turns them off where the CPU has AMX: a natively built llama-cpp-python 0.3.36
    crashes (SIGSEGV in `ggml_backend_amx_mul_mat`) on the first prompt on such a CPU, with
    the embedded Q4_1 model; with them off it serves. Elsewhere they stay on (repacked
    Q4_0/Q4_K weights decode faster).
    """
    if setting == "auto":
        return not (cpu_has_amx() if has_amx is None else has_amx)
    return setting == "on"


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)))


class LlamaModel:
    """Weights and vocabulary of one GGUF, shared by that model's contexts."""

    def __init__(self, path: Path, *, n_gpu_layers: int, extra_buffers: bool | None = None
                 ) -> None:
        _Backend.ensure()
        params = ll.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.use_extra_bufts = resolve_extra_buffers("auto") if extra_buffers is None \
            else extra_buffers
        ptr = ll.llama_model_load_from_file(str(path).encode(), params)
        if not ptr:
            raise ModelFileError(f"llama.cpp could not load {path.name}")
        self.ptr = ptr
        self.n_gpu_layers = n_gpu_layers
        self.vocab = ll.llama_model_get_vocab(ptr)
        self.n_vocab = int(ll.llama_vocab_n_tokens(self.vocab))
        self.n_ctx_train = int(ll.llama_model_n_ctx_train(ptr))
        self.n_embd = int(ll.llama_model_n_embd(ptr))
        self.size = int(ll.llama_model_size(ptr))
        self.bos = int(ll.llama_vocab_bos(self.vocab))
        self.eos = int(ll.llama_vocab_eos(self.vocab))
        self._pieces: dict[int, bytes] = {}
        self._eog: dict[int, bool] = {}
        self._special_starts = self._forgeable_starts()
        # The BOS's text where the tokenizer adds a BOS (add_special): "" where it adds none.
        self._bos_text = self.token_text(self.bos) \
            if self.bos >= 0 and ll.llama_vocab_get_add_bos(self.vocab) else ""

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        """`parse_special`: text such as `<|im_end|>` becomes that control token. Only for
        text the server or the caller's raw prompt wrote, never for message contents."""
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate; the API refuses them earlier
            raise InvalidRequest("the prompt is not valid Unicode (a lone surrogate)",
                                 param="prompt") from exc
        if add_special and parse_special and self._bos_text and text.startswith(self._bos_text):
            # The text writes the BOS itself (a template's `{{ bos_token }}`): adding one
            # too would make two, which llama.cpp would warn of at every request.
            add_special = False
        capacity = len(data) + 8
        while True:
            buf = (ll.llama_token * capacity)()
            n = ll.llama_tokenize(self.vocab, data, len(data), buf, capacity, add_special,
                                  parse_special)
            if n >= 0:
                tokens = list(buf[:n])
                break
            capacity = -n
        # A template that writes the BOS text itself plus add_special would give two.
        if len(tokens) >= 2 and tokens[0] == tokens[1] == self.bos:
            tokens = tokens[1:]
        return tokens

    def special_texts(self, text: str) -> set[str]:
        """The texts in `text` that tokenizing with `parse_special` would turn into control
        (or unknown) tokens: what a client could forge by typing them. Exactly the texts
        llama.cpp matched, taken from the vocabulary, not a list of known markers."""
        if not any(c in text for c in self._special_starts):
            return set()  # most text: no second tokenization
        forged = set()
        for token in self.tokenize(text, add_special=False, parse_special=True):
            if ll.llama_vocab_get_attr(self.vocab, token) & _FORGEABLE:
                forged.add(ll.llama_vocab_get_text(self.vocab, token).decode(
                    "utf-8", errors="replace"))
        forged.discard("")
        return forged

    def _forgeable_starts(self) -> str:
        """The first characters of every control or unknown token's text ("<" for ChatML
        and Gemma): text without any of them cannot hold one. A scan of the vocabulary,
        once per load (~0.1 s for Gemma's 262,144 tokens)."""
        starts = set()
        for token in range(self.n_vocab):
            if ll.llama_vocab_get_attr(self.vocab, token) & _FORGEABLE:
                text = ll.llama_vocab_get_text(self.vocab, token).decode("utf-8", "replace")
                starts.add(text[:1])
        starts.discard("")
        return "".join(sorted(starts))

    def piece(self, token: int) -> bytes:
        cached = self._pieces.get(token)
        if cached is None:
            cached = self._render(token, special=False)
            self._pieces[token] = cached
        return cached

    def grammar_piece(self, token: int) -> bytes:
        """A token's text as llama.cpp's grammar reads it: special tokens rendered."""
        return self._render(token, special=True)

    def token_text(self, token: int) -> str:
        if token < 0:
            return ""
        return self._render(token, special=True).decode("utf-8", errors="replace")

    def _render(self, token: int, *, special: bool) -> bytes:
        size = 32
        while True:
            buf = ctypes.create_string_buffer(size)
            n = ll.llama_token_to_piece(self.vocab, token, buf, size, 0, special)
            if n >= 0:
                return buf.raw[:n]
            size = -n

    def is_eog(self, token: int) -> bool:
        """Asked of llama.cpp once per token id: a ctypes call every step costs ~10 us
        right after a decode, a dict lookup next to nothing."""
        known = self._eog.get(token)
        if known is None:
            known = self._eog[token] = bool(ll.llama_vocab_is_eog(self.vocab, token))
        return known

    def close(self) -> None:
        if self.ptr:
            ll.llama_model_free(self.ptr)
            self.ptr = None


def resolve_flash_attn(setting: str) -> int:
    """llama.cpp's flash_attn_type (-1 auto, 0 off, 1 on).

    On a CPU its kernel reads the whole KV once per query row below 64 queries, where the
    plain path reads it once per batch: a 16-token prefill chunk 1,000 tokens deep costs
    1.2-1.6x as much a token with it (6.3 vs 5.3 ms, 10 vs 6.5 ms on two 2-core boxes).
    'auto' still leaves it to llama.cpp, because without it decode steps of 8 rows are ~10%
    slower and a greedy answer computed on cached cells differs more often from the same
    answer computed cold."""
    return {"on": 1, "off": 0}.get(setting, -1)


# The KV cache's cell types (`kv_cache_type`), and the bytes each takes per value beside f16's
# two: q8_0 keeps 32 values in 34 bytes, q4_0 in 18.
KV_TYPES = {"f16": ll.GGML_TYPE_F16, "q8_0": ll.GGML_TYPE_Q8_0, "q4_0": ll.GGML_TYPE_Q4_0}
KV_BYTES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


def kv_scale(kv_type: str) -> float:
    """A KV cache of `kv_type` against f16's size (what `kv_bytes_per_token` counts)."""
    return KV_BYTES[kv_type] / KV_BYTES["f16"]


def _context_params(
    n_ctx: int, n_batch: int, n_threads: int, n_seq: int = 1, flash_attn: int = -1,
    kv_type: str = "f16",
) -> ll.llama_context_params:
    p = ll.llama_context_default_params()
    p.flash_attn_type = flash_attn
    p.type_k = p.type_v = KV_TYPES[kv_type]
    p.n_ctx = n_ctx
    p.n_batch = n_batch
    p.n_ubatch = min(n_batch, 512)
    p.n_seq_max = n_seq
    p.n_threads = n_threads
    p.n_threads_batch = n_threads
    p.kv_unified = False  # one KV stream per sequence: no sequence can see another's cells
    p.swa_full = False  # as llama.cpp's server: sliding-window layers keep only their window
    return p


# llama_get_logits_ith as a function of our own that returns the address as a plain int:
# llama-cpp-python's returns a ctypes pointer, and making a numpy array of that goes through
# ctypes' and numpy's bridges, which right after a decode (the weights having pushed the
# interpreter's own working set out of the caches) cost more than the sampling itself: a
# greedy token took 85 us to sample that way, 65 with `BatchContext.row_logits` (c=1 on a
# 2-core box, medians of 630 steps).
_LOGITS_ITH = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32)(
    ctypes.cast(ll.llama_get_logits_ith, ctypes.c_void_p).value or 0)


class Batch:
    """A llama_batch whose arrays are views of preallocated numpy arrays: filling a row is
    a numpy store, not a ctypes call (about 1 µs a step for 8 rows)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.token = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        self.seq = np.zeros(capacity, dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        self._seq_ptrs = (ctypes.POINTER(ctypes.c_int32) * capacity)()
        base = self.seq.ctypes.data
        for i in range(capacity):
            self._seq_ptrs[i] = ctypes.cast(base + 4 * i, ctypes.POINTER(ctypes.c_int32))
        i32 = ctypes.POINTER(ctypes.c_int32)
        self.raw = ll.llama_batch(
            n_tokens=0,
            token=self.token.ctypes.data_as(i32),
            embd=None,
            pos=self.pos.ctypes.data_as(i32),
            n_seq_id=self.n_seq_id.ctypes.data_as(i32),
            seq_id=self._seq_ptrs,
            logits=self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )
        self.n = 0

    def clear(self) -> None:
        self.n = 0

    def add(self, token: int, pos: int, seq: int, logits: bool) -> int:
        """Adds a row; returns its index (what the sampler needs for this row's logits)."""
        i = self.n
        self.token[i], self.pos[i], self.seq[i], self.logits[i] = token, pos, seq, logits
        self.n += 1
        return i

    def add_span(self, tokens: Sequence[int], start_pos: int, seq: int, *,
                 last_logits: bool) -> int:
        i, n = self.n, len(tokens)
        self.token[i : i + n] = tokens
        self.pos[i : i + n] = np.arange(start_pos, start_pos + n, dtype=np.int32)
        self.seq[i : i + n] = seq
        self.logits[i : i + n] = 0
        if last_logits:
            self.logits[i + n - 1] = 1
        self.n += n
        return i + n - 1

    @property
    def room(self) -> int:
        return self.capacity - self.n


class BatchContext:
    """A llama context holding `n_seq` sequences, each with its own KV stream of
    `n_ctx_seq` cells; the scheduler decodes one batch for all of them per step."""

    def __init__(self, model: LlamaModel, *, n_seq: int, n_ctx_seq: int, n_batch: int,
                 n_threads: int, flash_attn: int = -1, kv_type: str = "f16") -> None:
        self.model = model
        params = _context_params(n_ctx_seq * n_seq, n_batch, n_threads, n_seq, flash_attn,
                                 kv_type)
        ptr = ll.llama_init_from_model(model.ptr, params)
        if not ptr:
            raise EdgeAgentError(
                f"llama.cpp could not create a context of {n_seq} x {n_ctx_seq} tokens"
                + (f" with a {kv_type} KV cache" if kv_type != "f16" else ""))
        self.ptr = ptr
        self.mem = ll.llama_get_memory(ptr)
        self.n_seq = n_seq
        self.n_ctx_seq = int(ll.llama_n_ctx_seq(ptr))
        self.n_batch = n_batch
        self.batch = Batch(n_batch)
        self._views: dict[int, np.ndarray] = {}  # logits rows by address (`row_logits`)

    def row_logits(self, row: int) -> np.ndarray:
        """Batch row `row`'s logits after a decode: a numpy view of llama.cpp's own buffer,
        valid until the next decode. Views are kept by address, so a step reuses the last
        one's: a view is only ever read right after llama.cpp has handed out its address
        for the current batch, so one whose buffer llama.cpp has since replaced is never
        read again, only forgotten (the cache is emptied past a few batches' worth)."""
        addr = _LOGITS_ITH(self.ptr, row)
        if not addr:
            raise EdgeAgentError(f"llama.cpp has no logits for batch row {row}")
        view = self._views.get(addr)
        if view is None:
            if len(self._views) >= 4 * self.n_batch:
                self._views.clear()
            n = self.model.n_vocab
            view = np.ctypeslib.as_array((ctypes.c_float * n).from_address(addr))
            self._views[addr] = view
        return view

    def decode(self) -> None:
        self.batch.raw.n_tokens = self.batch.n
        rc = ll.llama_decode(self.ptr, self.batch.raw)
        if rc != 0:
            raise EdgeAgentError(f"llama_decode failed with code {rc}")

    def set_threads(self, n: int) -> None:
        """The threads the next passes use (`free_cores`): llama.cpp reads them per pass."""
        ll.llama_set_n_threads(self.ptr, n, n)

    def keep_prefix(self, seq: int, n: int) -> bool:
        """Drop a sequence's cells from position n on; False if the cache cannot (then the
        caller must clear the sequence)."""
        if not ll.llama_memory_seq_rm(self.mem, seq, n, -1):
            return False
        return n == 0 or ll.llama_memory_seq_pos_min(self.mem, seq) <= 0

    def clear(self, seq: int) -> None:
        ll.llama_memory_seq_rm(self.mem, seq, -1, -1)

    def copy_prefix(self, src: int, dst: int, n: int) -> bool:
        """Give `dst` the first n cells of `src` (a shared system prompt, say), at once."""
        state = self.seq_state(src)
        return state is not None and self.restore(dst, state, n)

    def seq_state(self, seq: int) -> ctypes.Array[ctypes.c_uint8] | None:
        """A copy of every cell `seq` holds (llama.cpp's sequence state), or None where
        llama.cpp could not write it. The buffer is a bytearray's, which the state may
        outlive as a ctypes view of it (the prompt cache keeps it)."""
        size = ll.llama_state_seq_get_size(self.ptr, seq)
        if size <= 0:
            return None
        buf = (ctypes.c_uint8 * size).from_buffer(bytearray(size))
        if ll.llama_state_seq_get_data(self.ptr, buf, size, seq) != size:
            return None
        return buf

    def restore(self, seq: int, state: ctypes.Array[ctypes.c_uint8], n: int) -> bool:
        """Replace `seq`'s cells by the first n of `state` (`seq_state`'s, of this model
        under the same context settings: the caller's to check); False, with `seq`
        emptied, where llama.cpp refused it or could not cut it at n."""
        self.clear(seq)
        if ll.llama_state_seq_set_data(self.ptr, state, len(state), seq) == 0:
            self.clear(seq)
            return False
        if not self.keep_prefix(seq, n):
            self.clear(seq)
            return False
        return True

    def close(self) -> None:
        if self.ptr:
            ll.llama_free(self.ptr)
            self.ptr = None


class EmbeddingContext:
    """A context of its own for embeddings: one sequence, no pooling by llama.cpp.

    The scheduler feeds an input in chunks between generation steps and averages the
    rows' hidden states itself, so a long input delays running streams no more than a
    prompt chunk does; llama.cpp's MEAN pooling computes the same mean, but needs the
    whole input in one micro-batch. A causal model's hidden state of a token
    does not depend on the tokens after it, which is what makes the chunks add up; a
    bidirectional encoder (BERT-like) is found out by `_is_causal` and gets its input in
    one piece. Without flash attention (`flash_attn=0`) the vector on a CPU is the same,
    bit for bit, however the input is chunked. The vector is L2-normalised (what Ollama's
    /api/embed and OpenAI return).
    """

    def __init__(self, model: LlamaModel, *, n_ctx: int, n_threads: int,
                 n_batch: int | None = None, flash_attn: int = -1) -> None:
        self.model = model
        self.ptr = None
        self._open(n_ctx, min(n_batch or n_ctx, n_ctx), n_threads, flash_attn)
        self.causal = self._is_causal()
        if not self.causal and self.n_batch < self.n_ctx:
            self.close()
            self._open(n_ctx, n_ctx, n_threads, flash_attn)

    def _open(self, n_ctx: int, n_batch: int, n_threads: int, flash_attn: int) -> None:
        p = _context_params(n_ctx, n_batch, n_threads, flash_attn=flash_attn)
        p.n_ubatch = n_batch
        p.embeddings = True
        p.pooling_type = ll.LLAMA_POOLING_TYPE_NONE
        ptr = ll.llama_init_from_model(self.model.ptr, p)
        if not ptr:
            raise EdgeAgentError("llama.cpp could not create the embedding context")
        self.ptr = ptr
        self.mem = ll.llama_get_memory(ptr)
        self.n_ctx = int(ll.llama_n_ctx(ptr))
        self.n_batch = min(n_batch, self.n_ctx)
        self._batch = Batch(self.n_batch)

    def _rows(self, tokens: Sequence[int], pos: int) -> np.ndarray:
        """The hidden states of `tokens` placed at `pos` (a view, valid until the next call)."""
        n = len(tokens)
        if not 0 < n <= self.n_batch:
            raise EdgeAgentError(f"an embedding chunk of {n} tokens (at most {self.n_batch})")
        self._batch.clear()
        self._batch.add_span(tokens, pos, 0, last_logits=False)
        self._batch.logits[:n] = 1
        self._batch.raw.n_tokens = n
        rc = ll.llama_decode(self.ptr, self._batch.raw)
        if rc != 0:
            raise EdgeAgentError(f"llama_decode failed with code {rc}")
        ptr = ll.llama_get_embeddings(self.ptr)
        if not ptr:
            raise EdgeAgentError("llama.cpp returned no embeddings")
        return np.ctypeslib.as_array(ptr, shape=(n, self.model.n_embd))

    def _is_causal(self) -> bool:
        """Whether the first token's state ignores the tokens after it (a decoder), probed
        with four tokens: a bidirectional encoder moves it by far more than the 1e-3
        that batch shapes can."""
        probe = [max(self.model.bos, 0), 1, 2, 3]
        self.reset()
        alone = self._rows(probe[:1], 0)[0].astype(np.float64)
        self.reset()
        first = self._rows(probe, 0)[0].astype(np.float64)
        self.reset()
        scale = float(np.abs(alone).max()) or 1.0
        return float(np.abs(alone - first).max()) <= 1e-3 * scale

    def reset(self) -> None:
        """Forget the previous input (before the first chunk of the next)."""
        ll.llama_memory_clear(self.mem, True)

    def feed(self, tokens: Sequence[int], pos: int) -> np.ndarray:
        """Decodes the chunk `tokens` of the current input, which starts at `pos`; the sum
        of its hidden states (float64), for the caller's running mean."""
        return self._rows(tokens, pos).sum(axis=0, dtype=np.float64)

    def embed(self, tokens: list[int]) -> list[float]:
        """One whole input at once, in chunks of `n_batch`."""
        if not tokens:
            raise InvalidRequest("input is empty", param="input")
        self.reset()
        total = np.zeros(self.model.n_embd, dtype=np.float64)
        step = self.n_batch if self.causal else len(tokens)
        for start in range(0, len(tokens), step):
            total += self.feed(tokens[start : start + step], start)
        return normalised_mean(total, len(tokens))

    def close(self) -> None:
        if self.ptr:
            ll.llama_free(self.ptr)
            self.ptr = None


def normalised_mean(total: np.ndarray, count: int) -> list[float]:
    """The mean of `count` hidden states summed in `total`, L2-normalised."""
    vec = total / max(count, 1)
    norm = float(np.linalg.norm(vec))
    return (vec / norm if norm > 0 else vec).tolist()
