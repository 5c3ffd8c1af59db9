"""The thin layer over the cffi bindings: every native call llmsession makes goes through here.

Each native object (model, context, batch, sampler) has exactly one owner object here, freed by a
``weakref.finalize`` on every path: ``close()``, garbage collection or interpreter exit. Return
codes are checked by ``check`` and ``not_null``; nothing else in llmsession touches ``lib``.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ContextOverflowError, ModelLoadError, NativeError
from .options import LLAMA_DEFAULT_SEED, GenerationOptions

GGUF_MAGIC = b"GGUF"
DECODE_ABORTED = 2
DECODE_NO_KV_SLOT = 1

_loaded: tuple[Any, Any] | None = None


def bindings() -> tuple[Any, Any]:
    """The loaded libraries and the ffi, opened on first use (importing llmsession loads nothing)."""
    global _loaded
    if _loaded is None:
        from llama_cffi import LibraryNotFoundError, load

        try:
            _loaded = load()
        except LibraryNotFoundError as error:
            raise ModelLoadError(str(error)) from error
    return _loaded


def check(code: int, what: str, ok: Callable[[int], bool] = lambda c: c == 0) -> int:
    """Raise NativeError unless a native return code means success."""
    if not ok(code):
        raise NativeError(f"{what} failed (return code {code})")
    return code


def not_null(pointer: Any, what: str, error: type[Exception] = NativeError) -> Any:
    _, ffi = bindings()
    if pointer == ffi.NULL:
        raise error(f"{what} failed")
    return pointer


def c_string(text: str, what: str) -> bytes:
    """UTF-8 bytes for a NUL-terminated C string; a NUL inside would silently truncate it."""
    if "\0" in text:
        raise ValueError(f"{what} contains a NUL character, which C strings cannot carry")
    return text.encode("utf-8")


def default_threads() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


class NativeModel:
    """Owns a ``llama_model``."""

    def __init__(self, path: str | Path, *, gpu_layers: int = 0) -> None:
        lib, ffi = bindings()
        path = Path(path)
        _check_gguf_file(path)
        params = lib.llama_model_default_params()
        params.n_gpu_layers = gpu_layers
        pointer = lib.llama_model_load_from_file(c_string(str(path), "model path"), params)
        self.ptr = not_null(pointer, f"loading model {path}", ModelLoadError)
        self._free = weakref.finalize(self, lib.llama_model_free, self.ptr)
        self.vocab = lib.llama_model_get_vocab(self.ptr)
        self.n_vocab: int = lib.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train: int = lib.llama_model_n_ctx_train(self.ptr)
        self.n_swa: int = lib.llama_model_n_swa(self.ptr)
        self.is_recurrent = bool(lib.llama_model_is_recurrent(self.ptr) or lib.llama_model_is_hybrid(self.ptr))
        self.has_encoder = bool(lib.llama_model_has_encoder(self.ptr))
        self.add_bos = bool(lib.llama_vocab_get_add_bos(self.vocab))
        self._piece = ffi.new("char[256]")

    def close(self) -> None:
        self._free()

    def chat_template(self) -> str | None:
        lib, ffi = bindings()
        text = lib.llama_model_chat_template(self.ptr, ffi.NULL)
        return None if text == ffi.NULL else ffi.string(text).decode("utf-8", "replace")

    def meta(self, key: str) -> str | None:
        lib, ffi = bindings()
        buf = ffi.new("char[4096]")
        n = lib.llama_model_meta_val_str(self.ptr, c_string(key, "key"), buf, len(buf))
        return None if n < 0 else ffi.string(buf).decode("utf-8", "replace")

    def token_text(self, token: int) -> str:
        """The special-token spelling of a token (for BOS/EOS text in templates)."""
        lib, ffi = bindings()
        if token < 0:
            return ""
        return ffi.string(lib.llama_vocab_get_text(self.vocab, token)).decode("utf-8", "replace")

    def bos(self) -> int:
        return int(bindings()[0].llama_vocab_bos(self.vocab))

    def eos(self) -> int:
        return int(bindings()[0].llama_vocab_eos(self.vocab))

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        lib, ffi = bindings()
        data = text.encode("utf-8")  # llama_tokenize takes a length: NUL characters survive
        capacity = len(data) + 8
        for _ in range(2):
            out = ffi.new("llama_token[]", capacity)
            n = lib.llama_tokenize(self.vocab, data, len(data), out, capacity, add_special, parse_special)
            if n >= 0:
                return list(ffi.unpack(out, n))
            capacity = -n
        raise NativeError("llama_tokenize failed")

    def piece(self, token: int) -> bytes:
        """A token's bytes, without special-token text (generation output)."""
        lib, ffi = bindings()
        n = lib.llama_token_to_piece(self.vocab, token, self._piece, 256, 0, False)
        if n < 0:
            buf = ffi.new("char[]", -n)
            n = check(lib.llama_token_to_piece(self.vocab, token, buf, -n, 0, False), "token_to_piece", _non_negative)
            return bytes(ffi.buffer(buf, n))
        return bytes(ffi.buffer(self._piece, n))

    def detokenize(self, tokens: Sequence[int], *, special: bool = False) -> str:
        lib, ffi = bindings()
        ids = ffi.new("llama_token[]", list(tokens))
        capacity = max(64, 8 * len(tokens))
        for _ in range(2):
            buf = ffi.new("char[]", capacity)
            n = lib.llama_detokenize(self.vocab, ids, len(tokens), buf, capacity, False, special)
            if n >= 0:
                return bytes(ffi.buffer(buf, n)).decode("utf-8", "replace")
            capacity = -n
        raise NativeError("llama_detokenize failed")

    def is_eog(self, token: int) -> bool:
        return bool(bindings()[0].llama_vocab_is_eog(self.vocab, token))

    def apply_template(self, template: str | None, messages: Sequence[tuple[str, str]], add_ass: bool) -> str | None:
        """llama_chat_apply_template; None when llama.cpp does not know the template."""
        lib, ffi = bindings()
        keep = [(c_string(role, "role"), c_string(content, "message")) for role, content in messages]
        chat = ffi.new("struct llama_chat_message[]", len(keep))
        owned = []
        for i, (role, content) in enumerate(keep):
            owned.append((ffi.new("char[]", role), ffi.new("char[]", content)))
            chat[i].role, chat[i].content = owned[-1]
        tmpl = ffi.NULL if template is None else ffi.new("char[]", c_string(template, "template"))
        capacity = 2 * sum(len(r) + len(c) for r, c in keep) + 256
        for _ in range(2):
            buf = ffi.new("char[]", capacity)
            n = lib.llama_chat_apply_template(tmpl, chat, len(keep), add_ass, buf, capacity)
            if n < 0:
                return None
            if n <= capacity:
                return bytes(ffi.buffer(buf, n)).decode("utf-8")
            capacity = n + 1
        raise NativeError("llama_chat_apply_template kept growing its output")


def _non_negative(code: int) -> bool:
    return code >= 0


def _check_gguf_file(path: Path) -> None:
    """Clear errors for what llama.cpp would only log: missing, unreadable, not a GGUF."""
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except FileNotFoundError:
        raise ModelLoadError(f"model file not found: {path}") from None
    except OSError as error:
        raise ModelLoadError(f"cannot read model file {path}: {error.strerror}") from None
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (magic {magic!r})")


class Batch:
    """Owns a ``llama_batch`` reused for every decode of one context."""

    def __init__(self, capacity: int) -> None:
        lib, ffi = bindings()
        self.raw = lib.llama_batch_init(capacity, 0, 1)
        self._free = weakref.finalize(self, lib.llama_batch_free, self.raw)
        self.capacity = capacity
        self.tokens = np.frombuffer(ffi.buffer(self.raw.token, 4 * capacity), dtype=np.int32)
        self.positions = np.frombuffer(ffi.buffer(self.raw.pos, 4 * capacity), dtype=np.int32)
        self.logits = np.frombuffer(ffi.buffer(self.raw.logits, capacity), dtype=np.int8)
        np.frombuffer(ffi.buffer(self.raw.n_seq_id, 4 * capacity), dtype=np.int32)[:] = 1
        for i in range(capacity):
            self.raw.seq_id[i][0] = 0

    def fill(self, tokens: Sequence[int], start: int) -> None:
        """Tokens at consecutive positions from ``start``; logits only for the last one."""
        n = len(tokens)
        self.tokens[:n] = tokens
        self.positions[:n] = np.arange(start, start + n, dtype=np.int32)
        self.logits[:n] = 0
        self.logits[n - 1] = 1
        self.raw.n_tokens = n

    def close(self) -> None:
        self._free()


class NativeContext:
    """Owns a ``llama_context`` (and its batch); decodes with an optional abort flag."""

    def __init__(
        self, model: NativeModel, *, n_ctx: int, n_batch: int, threads: int, swa_full: bool = True
    ) -> None:
        lib, ffi = bindings()
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, n_batch
        params.n_seq_max, params.n_threads, params.n_threads_batch = 1, threads, threads
        params.swa_full = swa_full
        params.no_perf = True
        self.ptr = not_null(lib.llama_init_from_model(model.ptr, params), "creating a llama context")
        self._free = weakref.finalize(self, lib.llama_free, self.ptr)
        self.memory = lib.llama_get_memory(self.ptr)
        self.n_ctx: int = lib.llama_n_ctx(self.ptr)
        self.batch = Batch(n_batch)
        self.abort = threading.Event()
        self._abort_cb = ffi.callback("bool(void *)", lambda _data: self.abort.is_set())
        self._abort_installed = False

    def close(self) -> None:
        self.batch.close()
        self._free()

    def decode(self, tokens: Sequence[int], start: int, *, abortable: bool = False) -> None:
        """Decode tokens at positions start..; raise Cancelled if the abort flag stopped it."""
        lib, ffi = bindings()
        if abortable != self._abort_installed:  # the callback costs a GIL round trip per graph node
            lib.llama_set_abort_callback(self.ptr, self._abort_cb if abortable else ffi.NULL, ffi.NULL)
            self._abort_installed = abortable
        if start + len(tokens) > self.n_ctx:
            raise ContextOverflowError(f"position {start + len(tokens)} exceeds the context size {self.n_ctx}")
        self.batch.fill(tokens, start)
        code = lib.llama_decode(self.ptr, self.batch.raw)
        if code == DECODE_ABORTED:
            raise DecodeAborted()
        check(code, "llama_decode")

    def logits(self) -> Any:
        return bindings()[0].llama_get_logits_ith(self.ptr, -1)

    # The llama_memory operations the prefix cache needs, for sequence 0.
    def seq_rm(self, p0: int) -> bool:
        return bool(bindings()[0].llama_memory_seq_rm(self.memory, 0, p0, -1))

    def clear(self) -> None:
        bindings()[0].llama_memory_clear(self.memory, True)

    def pos_min(self) -> int:
        return int(bindings()[0].llama_memory_seq_pos_min(self.memory, 0))

    def pos_max(self) -> int:
        return int(bindings()[0].llama_memory_seq_pos_max(self.memory, 0))


class DecodeAborted(Exception):
    """llama_decode stopped because the abort flag was set."""


class Sampler:
    """Owns a ``llama_sampler`` chain; sampling runs in C, never per token over the vocabulary in Python."""

    def __init__(self, links: Sequence[Callable[[Any], Any]]) -> None:
        lib, _ = bindings()
        params = lib.llama_sampler_chain_default_params()
        params.no_perf = True
        self.ptr = not_null(lib.llama_sampler_chain_init(params), "llama_sampler_chain_init")
        self._free = weakref.finalize(self, lib.llama_sampler_free, self.ptr)
        for make in links:
            lib.llama_sampler_chain_add(self.ptr, not_null(make(lib), "creating a sampler"))

    @classmethod
    def from_options(cls, o: GenerationOptions) -> Sampler:
        """The llama.cpp sampler chain for these options (penalties, then truncation, then the pick)."""
        links: list[Callable[[Any], Any]] = []
        if o.penalized:
            penalties = (o.repeat_last_n, o.repeat_penalty, o.frequency_penalty, o.presence_penalty)
            links.append(lambda lib: lib.llama_sampler_init_penalties(*penalties))
        if o.greedy:
            links.append(lambda lib: lib.llama_sampler_init_greedy())
        else:
            seed = LLAMA_DEFAULT_SEED if o.seed is None else o.seed
            links += [
                lambda lib: lib.llama_sampler_init_top_k(o.top_k),
                lambda lib: lib.llama_sampler_init_top_p(o.top_p, 1),
                lambda lib: lib.llama_sampler_init_min_p(o.min_p, 1),
                lambda lib: lib.llama_sampler_init_temp(o.temperature),
                lambda lib: lib.llama_sampler_init_dist(seed),
            ]
        return cls(links)

    def accept(self, token: int) -> None:
        bindings()[0].llama_sampler_accept(self.ptr, token)

    def sample(self, context: NativeContext) -> int:
        return int(bindings()[0].llama_sampler_sample(self.ptr, context.ptr, -1))

    def close(self) -> None:
        self._free()


def system_info() -> str:
    lib, ffi = bindings()
    return str(ffi.string(lib.llama_print_system_info()).decode())


def build_commit() -> str:
    lib, ffi = bindings()
    return str(ffi.string(lib.ggml_commit()).decode())
