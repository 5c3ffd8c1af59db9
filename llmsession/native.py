"""The thin layer over the cffi bindings: every native call llmsession makes goes through here.

Each native object (model, context, batch, sampler) has exactly one owner object here, freed by a
``weakref.finalize`` on every path: ``close()``, garbage collection or interpreter exit. A child's
finalizer holds its parent (a context its model), so a parent is never freed under a child, and no
owner sits in a reference cycle: dropping it frees the native memory at once, not at the next
cyclic GC. Return codes are checked by ``check`` and ``not_null``; token ids from callers are
range-checked before llama.cpp sees them; nothing else in llmsession touches ``lib``.

An exception that a native callback raised (Ctrl-C during a decode) is re-raised here once the
native call returns; a decode it interrupted raises ``DecodeAborted`` carrying it.
"""

from __future__ import annotations

import operator
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import (
    ContextOverflowError,
    ImageError,
    ModelClosedError,
    ModelLoadError,
    NativeError,
    UnsupportedFeatureError,
)
from .image import Image
from .options import LLAMA_DEFAULT_SEED, GenerationOptions
from .parking import mapping

if TYPE_CHECKING:
    from typing_extensions import Buffer

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


def raise_pending() -> None:
    """Re-raise an exception a native callback raised on this thread during the last call."""
    from llama_cffi import take_pending_error

    error = take_pending_error()
    if error is not None:
        raise error


def _free_model(lib: Any, ptr: Any) -> None:
    lib.llama_model_free(ptr)


class Owner:
    """One native object's owner: ``ptr`` while it lives, ``ModelClosedError`` after ``close()``
    (a freed pointer handed to llama.cpp would crash the process)."""

    _free: weakref.finalize[Any, Any]
    _ptr: Any = None

    @property
    def ptr(self) -> Any:
        if self._ptr is None or not self._free.alive:
            raise ModelClosedError(f"this {type(self).__name__} is closed (its model was closed)")
        return self._ptr

    @property
    def closed(self) -> bool:
        return self._ptr is None or not self._free.alive

    def close(self) -> None:
        if self._ptr is not None:
            self._free()


class NativeModel(Owner):
    """Owns a ``llama_model``; ``close()`` closes its contexts and projector first."""

    def __init__(self, path: str | Path, *, gpu_layers: int = 0) -> None:
        lib, ffi = bindings()
        path = Path(path)
        _check_gguf_file(path)
        params = lib.llama_model_default_params()
        params.n_gpu_layers = gpu_layers
        pointer = lib.llama_model_load_from_file(c_string(str(path), "model path"), params)
        if pointer != ffi.NULL:
            self._free = weakref.finalize(self, _free_model, lib, pointer)
        raise_pending()  # Ctrl-C while loading: the finalizer above frees what was loaded
        self._ptr = not_null(pointer, f"loading model {path}", ModelLoadError)
        self._vocab = lib.llama_model_get_vocab(self.ptr)
        self._children: weakref.WeakSet[Owner] = weakref.WeakSet()
        self.n_vocab: int = lib.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train: int = lib.llama_model_n_ctx_train(self.ptr)
        self.n_swa: int = lib.llama_model_n_swa(self.ptr)
        self.is_recurrent = bool(
            lib.llama_model_is_recurrent(self.ptr) or lib.llama_model_is_hybrid(self.ptr)
        )
        self.has_encoder = bool(lib.llama_model_has_encoder(self.ptr))
        self.add_bos = bool(lib.llama_vocab_get_add_bos(self.vocab))

    @property
    def vocab(self) -> Any:
        self.ptr  # noqa: B018  (raises once the model is closed)
        return self._vocab

    def adopt(self, child: Owner) -> None:
        """Register a context or projector made from this model, to be closed before it."""
        self._children.add(child)

    def close(self) -> None:
        for child in list(self._children):
            child.close()
        super().close()

    def chat_template(self) -> str | None:
        lib, ffi = bindings()
        text = lib.llama_model_chat_template(self.ptr, ffi.NULL)
        return None if text == ffi.NULL else ffi.string(text).decode("utf-8", "replace")

    def meta(self, key: str) -> str | None:
        lib, ffi = bindings()
        buf = ffi.new("char[4096]")
        n = lib.llama_model_meta_val_str(self.ptr, c_string(key, "key"), buf, len(buf))
        return None if n < 0 else ffi.string(buf).decode("utf-8", "replace")

    def check_token(self, token: object) -> int:
        """A caller's token id as an int in range; llama.cpp aborts the process on a bad one."""
        try:
            value = operator.index(token)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(f"a token id must be an int, got {type(token).__name__}") from None
        if not 0 <= value < self.n_vocab:
            raise ValueError(f"token id {value} is out of range: the vocabulary has {self.n_vocab} tokens")
        return value

    def token_text(self, token: int) -> str:
        """The special-token spelling of a token (for BOS/EOS text in templates)."""
        lib, ffi = bindings()
        if token < 0:
            return ""
        token = self.check_token(token)
        return str(ffi.string(lib.llama_vocab_get_text(self.vocab, token)).decode("utf-8", "replace"))

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
        token = self.check_token(token)
        buf = ffi.new("char[64]")  # per call: the GIL is released while llama.cpp writes it
        n = lib.llama_token_to_piece(self.vocab, token, buf, 64, 0, False)
        if n < 0:
            buf = ffi.new("char[]", -n)
            n = check(
                lib.llama_token_to_piece(self.vocab, token, buf, -n, 0, False),
                "token_to_piece",
                _non_negative,
            )
        return bytes(ffi.buffer(buf, n))

    def detokenize(self, tokens: Sequence[int], *, special: bool = False) -> str:
        lib, ffi = bindings()
        if isinstance(tokens, str | bytes):
            raise TypeError("tokens must be a sequence of token ids")
        tokens = [self.check_token(token) for token in tokens]
        ids = ffi.new("llama_token[]", tokens)
        capacity = max(64, 8 * len(tokens))
        for _ in range(2):
            buf = ffi.new("char[]", capacity)
            n = lib.llama_detokenize(self.vocab, ids, len(tokens), buf, capacity, False, special)
            if n >= 0:
                return bytes(ffi.buffer(buf, n)).decode("utf-8", "replace")
            capacity = -n
        raise NativeError("llama_detokenize failed")

    def is_eog(self, token: int) -> bool:
        return bool(bindings()[0].llama_vocab_is_eog(self.vocab, self.check_token(token)))

    def apply_template(
        self, template: str | None, messages: Sequence[tuple[str, str]], add_ass: bool
    ) -> str | None:
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


def _check_gguf_file(path: Path, kind: str = "model") -> None:
    """Clear errors for what llama.cpp would only log: missing, unreadable, not a GGUF."""
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except FileNotFoundError:
        raise ModelLoadError(f"{kind} file not found: {path}") from None
    except OSError as error:
        raise ModelLoadError(f"cannot read {kind} file {path}: {error.strerror or error}") from None
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
        self._seqs = np.full(capacity, -1, dtype=np.int32)  # what each slot's seq_id holds

    def fill(self, tokens: Sequence[int], start: int, seq: int = 0) -> None:
        """Tokens of sequence ``seq`` at consecutive positions from ``start``; logits only for
        the last one."""
        n = len(tokens)
        for i in np.flatnonzero(self._seqs[:n] != seq):
            self.raw.seq_id[i][0] = seq
        self._seqs[:n] = seq
        self.tokens[:n] = tokens
        self.positions[:n] = np.arange(start, start + n, dtype=np.int32)
        self.logits[:n] = 0
        self.logits[n - 1] = 1
        self.raw.n_tokens = n

    def close(self) -> None:
        self._free()


class AbortFlag:
    """What the prefill abort callback reads. The callback closes over this, never over the
    context, so the context is in no reference cycle."""

    def __init__(self) -> None:
        self.event = threading.Event()


def _abort_callback(flag: AbortFlag) -> Any:
    """``bool(void *)`` for llama_set_abort_callback: stop when the flag is set, or when a
    signal handler raised inside a callback (the exception is kept for the caller to raise)."""
    from llama_cffi import has_pending_error, stash_error

    _, ffi = bindings()

    def on_error(kind: Any, error: BaseException | None, traceback: Any) -> bool:
        stash_error(kind, error, traceback)
        return True

    def should_abort(_data: Any) -> bool:
        return flag.event.is_set() or has_pending_error()

    return ffi.callback("bool(void *)", should_abort, onerror=on_error)


def _free_context(lib: Any, ptr: Any, _model: NativeModel) -> None:
    """Frees a context; holding ``_model`` keeps the model alive until then."""
    lib.llama_free(ptr)


class NativeContext(Owner):
    """Owns a ``llama_context`` (and its batch); decodes with an optional abort flag.

    ``n_ctx`` is the size asked for: llama.cpp pads its own up (to a multiple of 256), and a
    session must not use positions its caller did not give it.
    """

    def __init__(
        self,
        model: NativeModel,
        *,
        n_ctx: int,
        n_batch: int,
        threads: int,
        swa_full: bool = True,
        n_seq_max: int = 1,
    ) -> None:
        lib, ffi = bindings()
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, n_batch
        params.n_seq_max, params.n_threads, params.n_threads_batch = n_seq_max, threads, threads
        params.swa_full, params.kv_unified = swa_full, n_seq_max > 1  # sequences share the cells
        params.no_perf = True
        pointer = lib.llama_init_from_model(model.ptr, params)
        if pointer != ffi.NULL:
            self._free = weakref.finalize(self, _free_context, lib, pointer, model)
        raise_pending()
        self._ptr = not_null(pointer, "creating a llama context")
        model.adopt(self)
        self._memory = lib.llama_get_memory(self.ptr)
        self.n_ctx: int = min(n_ctx, lib.llama_n_ctx(self.ptr))
        self.n_batch, self.n_seq_max = n_batch, n_seq_max
        self.batch = Batch(n_batch)
        self._flag = AbortFlag()
        self._abort_cb = _abort_callback(self._flag)
        self._abort_installed = False

    @property
    def abort(self) -> threading.Event:
        """The event that stops an abortable decode (a stream's cancel flag)."""
        return self._flag.event

    @abort.setter
    def abort(self, event: threading.Event) -> None:
        self._flag.event = event

    @property
    def memory(self) -> Any:
        self.ptr  # noqa: B018  (raises once the context is closed)
        return self._memory

    def close(self) -> None:
        self.batch.close()
        super().close()

    def decode(self, tokens: Sequence[int], start: int, *, seq: int = 0, abortable: bool = False) -> None:
        """Decode tokens of sequence ``seq`` at positions start..; raise DecodeAborted if the
        abort flag or an exception raised in a callback (Ctrl-C) stopped it: the batch may be
        partly in memory."""
        lib, _ = bindings()
        ptr = self.ptr  # first: once closed, the batch's memory is gone too
        self.set_abortable(abortable)
        if start + len(tokens) > self.n_ctx:
            raise ContextOverflowError(
                f"position {start + len(tokens)} exceeds the context size {self.n_ctx}"
            )
        self._check_seq(seq)
        self.batch.fill(tokens, start, seq)
        code = lib.llama_decode(ptr, self.batch.raw)
        interrupted_by(code == DECODE_ABORTED)
        check(code, "llama_decode")

    def set_abortable(self, abortable: bool) -> None:
        """Install the abort callback for prefill; it costs a GIL round trip per graph node."""
        lib, ffi = bindings()
        if abortable != self._abort_installed:
            lib.llama_set_abort_callback(self.ptr, self._abort_cb if abortable else ffi.NULL, ffi.NULL)
            self._abort_installed = abortable

    def logits(self) -> Any:
        return bindings()[0].llama_get_logits_ith(self.ptr, -1)

    # The llama_memory operations the prefix cache and the engine need, per sequence.
    def _check_seq(self, seq: int) -> None:
        if not 0 <= seq < self.n_seq_max:
            raise ValueError(f"sequence {seq} is outside this context's 0..{self.n_seq_max - 1}")

    def seq_rm(self, p0: int, seq: int = 0) -> bool:
        """Remove positions >= p0 of ``seq`` (p0 = -1: all of them); False when refused."""
        self._check_seq(seq)
        return bool(bindings()[0].llama_memory_seq_rm(self.memory, seq, p0, -1))

    def seq_cp(self, src: int, dst: int) -> None:
        """Make ``dst`` hold what ``src`` holds (the cells are shared, not copied)."""
        self._check_seq(src)
        self._check_seq(dst)
        bindings()[0].llama_memory_seq_cp(self.memory, src, dst, -1, -1)

    def clear(self) -> None:
        """Empty the whole memory (every sequence)."""
        bindings()[0].llama_memory_clear(self.memory, True)

    def pos_min(self, seq: int = 0) -> int:
        self._check_seq(seq)
        return int(bindings()[0].llama_memory_seq_pos_min(self.memory, seq))

    def pos_max(self, seq: int = 0) -> int:
        self._check_seq(seq)
        return int(bindings()[0].llama_memory_seq_pos_max(self.memory, seq))

    # A sequence's KV state as bytes (llama_state_seq_*): for parking and saving a session.
    def state_size(self, seq: int = 0) -> int:
        self._check_seq(seq)
        size = int(bindings()[0].llama_state_seq_get_size(self.ptr, seq))
        return check(size, "llama_state_seq_get_size", (0).__lt__)  # a state has a header

    def state_get(self, seq: int = 0) -> Buffer:
        """The state, in an anonymous mapping of its exact size made for it: freed whole when the
        last reference goes (a heap block of tens of MiB would stay in the process once freed),
        and prefaulted (MAP_POPULATE), which costs a quarter of faulting it page by page."""
        lib, ffi = bindings()
        size = self.state_size(seq)
        blob = mapping(size)
        with ffi.from_buffer("uint8_t[]", blob) as buf:
            written = lib.llama_state_seq_get_data(self.ptr, buf, size, seq)
        check(written, "llama_state_seq_get_data", size.__eq__)
        return blob

    def state_set(self, blob: Buffer, seq: int = 0) -> bool:
        """Load a state this build wrote for the same model and layout into ``seq`` (never
        anything else: llama.cpp's loaders abort on malformed input); False if llama.cpp
        refused it (then ``seq`` is empty)."""
        lib, ffi = bindings()
        self._check_seq(seq)
        with ffi.from_buffer("uint8_t[]", blob) as source:
            size = len(source)
            if lib.llama_state_seq_set_data(self.ptr, source, size, seq) == size:
                return True
        lib.llama_memory_seq_rm(self.memory, seq, -1, -1)
        return False


def context_layout(swa_full: bool) -> dict[str, int | bool]:
    """The context parameters a saved sequence state depends on, as NativeContext sets them
    (a sequence's state does not depend on how many sequences share the context)."""
    params = bindings()[0].llama_context_default_params()
    return {
        "type_k": int(params.type_k),
        "type_v": int(params.type_v),
        "flash_attn_type": int(params.flash_attn_type),
        "swa_full": swa_full,
    }


def state_seq_version() -> int:
    return int(bindings()[0].LLAMA_STATE_SEQ_VERSION)


class DecodeAborted(Exception):
    """A decode stopped early: the abort flag was set (``cause`` None), or a callback raised
    ``cause`` (the caller re-raises it once its memory matches its record again)."""

    def __init__(self, cause: BaseException | None = None) -> None:
        super().__init__()
        self.cause = cause


def interrupted_by(aborted: bool) -> None:
    """After a decode: raise DecodeAborted if it was aborted, or if a callback raised meanwhile
    (then the decode may have finished, but the caller must treat its batch as not recorded)."""
    from llama_cffi import take_pending_error

    cause = take_pending_error()
    if aborted or cause is not None:
        raise DecodeAborted(cause)


@dataclass(frozen=True)
class ImageChunk:
    """One image's chunk of a tokenized prompt; ``ptr`` is borrowed from its ``Chunks``."""

    ptr: Any
    n_tokens: int
    n_pos: int
    digest: str
    non_causal: bool


Piece = list[int] | ImageChunk
"""A run of text tokens, or one image chunk."""


class Chunks:
    """Owns an ``mtmd_input_chunks``: a prompt as text-token runs and image chunks, in order."""

    def __init__(self, ptr: Any, pieces: list[Piece]) -> None:
        self.ptr = ptr
        self._free = weakref.finalize(self, bindings()[0].mtmd_input_chunks_free, ptr)
        self.pieces = pieces

    def close(self) -> None:
        self._free()


def _free_projector(lib: Any, ptr: Any, _model: NativeModel) -> None:
    lib.mtmd_free(ptr)


class Projector(Owner):
    """Owns an ``mtmd_context`` (a multimodal projector loaded beside a model).

    libmtmd's context is not thread-safe: ``lock`` serializes tokenizing and image evaluation.
    """

    def __init__(self, path: str | Path, model: NativeModel, *, threads: int, use_gpu: bool) -> None:
        lib, ffi = bindings()
        path = Path(path)
        _check_gguf_file(path, "projector")
        params = lib.mtmd_context_params_default()
        params.use_gpu, params.n_threads, params.print_timings = use_gpu, threads, False
        pointer = lib.mtmd_init_from_file(c_string(str(path), "projector path"), model.ptr, params)
        if pointer != ffi.NULL:
            self._free = weakref.finalize(self, _free_projector, lib, pointer, model)
        raise_pending()
        self._ptr = not_null(pointer, f"loading projector {path} for this model", ModelLoadError)
        model.adopt(self)
        self.marker = str(ffi.string(lib.mtmd_default_marker()).decode())
        self.vision = bool(lib.mtmd_support_vision(self.ptr))
        self.lock = threading.Lock()

    def tokenize(self, text: str, images: Sequence[Image]) -> Chunks:
        """Split ``text`` at its media markers into text tokens and one image chunk per image."""
        lib, ffi = bindings()
        if images and not self.vision:
            raise UnsupportedFeatureError("this projector does not take images")
        markers = text.count(self.marker)
        if markers != len(images):
            raise ImageError(
                f"the prompt has {markers} media markers ({self.marker!r}) for {len(images)} images; "
                "a message's text may not contain the marker itself"
            )
        data = ffi.new("char[]", text.encode("utf-8"))  # mtmd reads text_len bytes: NULs survive
        source = ffi.new("mtmd_input_text *", {"text": data, "text_len": len(data) - 1})
        source.add_special, source.parse_special = True, True
        bitmaps = ffi.new("mtmd_bitmap *[]", max(1, len(images)))
        with self.lock:
            try:
                for i, image in enumerate(images):
                    pixels = ffi.from_buffer(image.pixels)
                    bitmaps[i] = not_null(
                        lib.mtmd_bitmap_init(image.width, image.height, pixels), "mtmd_bitmap_init"
                    )
                    lib.mtmd_bitmap_set_id(bitmaps[i], image.digest.encode())
                chunks = Chunks(not_null(lib.mtmd_input_chunks_init(), "mtmd_input_chunks_init"), [])
                code = lib.mtmd_tokenize(self.ptr, chunks.ptr, source, bitmaps, len(images))
                try:
                    raise_pending()
                except BaseException:
                    chunks.close()
                    raise
                if code != 0:
                    chunks.close()
                    raise ImageError(
                        f"libmtmd could not tokenize the prompt's images (mtmd_tokenize: {code})"
                    )
                try:
                    chunks.pieces.extend(self._pieces(chunks.ptr))
                except BaseException:
                    chunks.close()
                    raise
                return chunks
            finally:
                for i in range(len(images)):
                    if bitmaps[i] != ffi.NULL:
                        lib.mtmd_bitmap_free(bitmaps[i])

    def _pieces(self, chunks: Any) -> list[Piece]:
        lib, ffi = bindings()
        pieces: list[Piece] = []
        n_tokens = ffi.new("size_t *")
        for i in range(lib.mtmd_input_chunks_size(chunks)):
            chunk = lib.mtmd_input_chunks_get(chunks, i)
            kind = lib.mtmd_input_chunk_get_type(chunk)
            if kind == lib.MTMD_INPUT_CHUNK_TYPE_TEXT:
                tokens = lib.mtmd_input_chunk_get_tokens_text(chunk, n_tokens)
                pieces.append(list(ffi.unpack(tokens, n_tokens[0])))
            elif kind == lib.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                pieces.append(
                    ImageChunk(
                        ptr=chunk,
                        n_tokens=int(lib.mtmd_input_chunk_get_n_tokens(chunk)),
                        n_pos=int(lib.mtmd_input_chunk_get_n_pos(chunk)),
                        digest=str(ffi.string(lib.mtmd_input_chunk_get_id(chunk)).decode()),
                        non_causal=bool(lib.mtmd_decode_use_non_causal(self.ptr, chunk)),
                    )
                )
            else:
                raise UnsupportedFeatureError("only text and image chunks are supported")
        return pieces

    def eval_image(
        self, context: NativeContext, chunk: ImageChunk, start: int, *, seq: int = 0, logits_last: bool
    ) -> int:
        """Encode an image chunk and decode its embeddings into ``seq`` from ``start``; return the
        next position."""
        lib, ffi = bindings()
        if start + chunk.n_pos > context.n_ctx:
            raise ContextOverflowError(
                f"position {start + chunk.n_pos} exceeds the context size {context.n_ctx}"
            )
        context._check_seq(seq)
        context.set_abortable(True)
        next_pos = ffi.new("llama_pos *", start)
        with self.lock:
            code = lib.mtmd_helper_eval_chunk_single(
                self.ptr, context.ptr, chunk.ptr, start, seq, context.n_batch, logits_last, next_pos
            )
        interrupted_by(code != 0 and context.abort.is_set())
        check(code, "evaluating an image chunk (mtmd_helper_eval_chunk_single)")
        return int(next_pos[0])


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
    def from_options(cls, o: GenerationOptions, *, n_vocab: int, last_n: int) -> Sampler:
        """The llama.cpp sampler chain for these options (penalties over the ``last_n`` latest
        tokens, then truncation, then the pick)."""
        links: list[Callable[[Any], Any]] = []
        if o.penalized:
            penalties = (n_vocab, last_n, o.repeat_penalty, o.frequency_penalty, o.presence_penalty)
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
