"""A llama context and what decodes into it: batches, the abort flag, each sequence's memory and
state. Part of the native layer (see ``native``): every call's return code is checked."""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from llmsession.buffers import mapping
from llmsession.errors import ContextOverflowError
from llmsession.native.batch import Batch
from llmsession.native.cancel import ACTIVITY, AbortFlag, abort_callback
from llmsession.native.layout import flash_attn_type, kv_ggml_type
from llmsession.native.llama import (
    NativeModel,
    Owner,
    bindings,
    check,
    not_null,
    raise_pending,
)
from llmsession.native.machine import within_cores
from llmsession.native.reports import cell_bytes, made_logging, reported_bytes
from llmsession.native.stateblob import UNCHECKABLE, StateLayout, layout, learned, most_bytes, refusal
from llmsession.native.threadpool import POOLED, ThreadPool

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = logging.getLogger("llmsession")
DECODE_ABORTED = 2  # llama_decode's return code when the abort callback stopped it


def _free_context(lib: Any, ptr: Any, pool: ThreadPool, _model: NativeModel) -> None:
    """Frees a context, then its thread pool; holding ``_model`` keeps the model alive until then."""
    lib.llama_free(ptr)
    pool.free()


def _params(lib: Any, n_ctx: int, n_batch: int, threads: int, n_seq_max: int, rows: int) -> Any:
    threads = within_cores(threads)  # (more would spin at every barrier for a descheduled one)
    params = lib.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_outputs_max = n_ctx, n_batch, n_batch, rows
    params.n_seq_max, params.n_threads, params.n_threads_batch = n_seq_max, threads, threads
    params.no_perf = True
    return params


def _made(lib: Any, ffi: Any, model: NativeModel, params: Any, *, cells: bool) -> tuple[Any, int, int, int]:
    """A new llama context (or NULL), the compute buffers llama.cpp reported making for it
    (``cells``: and its KV cells), its cells' buffers (``reports.cell_bytes``) and the rows of
    logits it reserves. A model without cells (BERT's kind) decodes through its encoder, every
    token an output: llama.cpp would abort past fewer rows, so such a context is made again
    reserving a batch of them."""
    while True:
        pointer, lines = made_logging(lambda: lib.llama_init_from_model(model.ptr, params))
        whole = params.n_outputs_max >= params.n_batch
        if pointer == ffi.NULL or whole or lib.llama_get_memory(pointer) != ffi.NULL:
            return pointer, reported_bytes(lines, cells=cells), cell_bytes(lines), int(params.n_outputs_max)
        lib.llama_free(pointer)
        params.n_outputs_max = params.n_batch


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
        flash_attention: bool | None = None,
        kv_type: str = "f16",
        own_cells: bool = False,
        embeddings: bool = False,
        outputs_per_seq: int | None = None,
    ) -> None:
        """``flash_attention`` None leaves llama.cpp's choice (AUTO: on wherever supported).
        ``kv_type``: the cells' type for K and V (``options.KV_TYPES``). ``own_cells``: each
        sequence gets a stream of ``n_ctx / n_seq_max`` cells of its own (``kv_unified`` off), so
        its attention runs over its own cells only; else sequences share one pool of cells.
        ``embeddings``: each sequence's pooled embedding is kept (the pooling its GGUF names:
        ``pooled``), not logits. ``outputs_per_seq``: the most rows of logits a decode asks of
        one sequence (None: every token's); llama.cpp reserves its compute and output buffers
        for that many (``buffers``), and a batch asking for more is refused (ValueError)."""
        lib, ffi = bindings()
        # Every decode reserves one output row per sequence, and llama.cpp holds at most n_batch
        # rows (it asserts, aborting the process): a batch holds at least one token a sequence.
        n_batch = max(n_batch, n_seq_max)
        # (an encoder-decoder model's contexts reserve a batch of outputs whatever is asked)
        whole_batch = outputs_per_seq is None or model.has_encoder
        rows = n_batch if whole_batch else min(n_batch, n_seq_max * (outputs_per_seq or 1))
        params = _params(lib, n_ctx, n_batch, threads, n_seq_max, rows)
        params.flash_attn_type = flash_attn_type(flash_attention)
        params.type_k = params.type_v = kv_ggml_type(kv_type)
        params.swa_full, params.kv_unified = swa_full, n_seq_max > 1 and not own_cells
        if embeddings:
            params.embeddings, params.pooling_type = True, lib.LLAMA_POOLING_TYPE_UNSPECIFIED
        pool = ThreadPool(params.n_threads)
        try:
            pointer, reported, cells_made, rows = _made(lib, ffi, model, params, cells=embeddings)
        except BaseException:
            pool.free()  # (its worker threads: no context holds it)
            raise
        if pointer == ffi.NULL:
            pool.free()
        else:
            self._free = weakref.finalize(self, _free_context, lib, pointer, pool, model)
        try:  # (half-built, it is freed here and no model's child: its close would fail)
            self._built(model, pointer, pool, params, reported, rows, embeddings, own_cells, n_ctx)
        except BaseException:
            if pointer != ffi.NULL:
                self._free()
            raise
        self.most_state_bytes = most_bytes(self.state_layout, cells_made)  # (a file's state: ``sessionread``)
        model.adopt(self)
        self._flag = AbortFlag()
        self._abort_cb = abort_callback(self._flag)
        self._abort_installed: tuple[Any, Any] | None = None  # (callback, data)

    def _built(
        self,
        model: NativeModel,
        pointer: Any,
        pool: ThreadPool,
        params: Any,
        reported: int,
        rows: int,
        embeddings: bool,
        own_cells: bool,
        n_ctx: int,
    ) -> None:
        """The context's pointer checked, its thread pool attached, what it is read."""
        lib, _ = bindings()
        raise_pending()
        self._ptr = not_null(pointer, "creating a llama context")
        lib.llama_attach_threadpool(self._ptr, pool.ptr, pool.ptr)
        POOLED.add(self)
        # What llama.cpp reported making (its compute buffers; an embedding context's cells too),
        # and its output buffer, which grows (never shrinks) to the rows a decode asks for.
        row = model.n_vocab + (model.n_embd_out if embeddings or model.has_encoder else 0)
        self.reported, self.buffers = reported, reported + rows * row * 4
        self._memory = lib.llama_get_memory(self.ptr)
        n_seq_max = params.n_seq_max
        self.own_cells, self.n_seq_max = own_cells and n_seq_max > 1, n_seq_max
        whole = lib.llama_n_ctx_seq(self.ptr) if self.own_cells else lib.llama_n_ctx(self.ptr)
        self.n_ctx: int = min(n_ctx // n_seq_max if self.own_cells else n_ctx, whole)  # a sequence's
        self.state_layout = self._expected_state(model, whole, params.type_k)
        self.n_batch, self.batch = params.n_batch, Batch(params.n_batch, rows)

    def _expected_state(self, model: NativeModel, cells: int, kv_type: int) -> StateLayout | None:
        """What a sequence's state holds (``stateblob``): the model's parts, each recurrent part's
        rows as an empty state has them (sequence 0's: every sequence is empty now)."""
        streams, memory = self.n_seq_max if self.own_cells else 1, self._memory != bindings()[1].NULL
        expected = layout(model.memory_shape(), cells=cells, streams=streams, kv_type=kv_type, memory=memory)
        return expected and learned(expected, self.state_get(0))

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

    def decode(
        self,
        tokens: Sequence[int],
        start: int,
        *,
        seq: int = 0,
        abortable: bool = False,
        outputs: bool = False,
    ) -> None:
        """Decode tokens of sequence ``seq`` at positions start.. (logits for the last one, or for
        each with ``outputs``: ``last_logits(n_vocab, i)``); raise DecodeAborted if the abort flag
        or an exception raised in a callback (Ctrl-C) stopped it: the batch may be partly in
        memory."""
        lib, _ = bindings()
        ptr = self.ptr  # first: once closed, the batch's memory is gone too
        self.check_run(tokens, start, seq)
        self.batch.fill(tokens, start, seq, outputs=outputs)
        self.set_abortable(abortable)  # (last: what it watches, the next decode clears)
        with ACTIVITY:
            code = lib.llama_decode(ptr, self.batch.raw)
        interrupted_by(code == DECODE_ABORTED)
        check(code, "llama_decode")

    def encode(self, tokens: Sequence[int], *, abortable: bool = False) -> None:
        """Run an encoder-decoder model's encoder over the whole prompt in one batch (its
        attention is not causal: it cannot be split) into a context whose memory is empty."""
        lib, _ = bindings()
        ptr = self.ptr
        if not 0 < len(tokens) <= self.n_batch:  # past n_ubatch llama_encode aborts the process
            raise ContextOverflowError(f"the encoder takes 1 to {self.n_batch} tokens, got {len(tokens)}")
        if self.pos_max(0) >= 0:  # llama_encode refuses to run over decoder state
            raise ValueError("encode needs an empty context")
        self.batch.fill(tokens, 0, outputs=True)
        self.set_abortable(abortable)
        with ACTIVITY:
            code = lib.llama_encode(ptr, self.batch.raw)
        interrupted_by(code == DECODE_ABORTED)
        check(code, "llama_encode")

    def set_abortable(self, abortable: bool) -> None:
        """Install the abort callback for prefill: the native check of the flag's word where it
        can be used, else the Python one (a GIL round trip per graph node)."""
        from llama_cffi import abort_check, watch_abort

        lib, ffi = bindings()
        word = self._flag.native_word() if abortable else None
        check = abort_check() if word is not None else None
        watch_abort(word if check is not None else None)  # (its stop's errors: expected, then)
        wanted = (check, word) if check is not None else (self._abort_cb, ffi.NULL) if abortable else None
        if wanted != self._abort_installed:
            callback, data = wanted or (ffi.NULL, ffi.NULL)
            lib.llama_set_abort_callback(self.ptr, callback, data)
            self._abort_installed = wanted

    def last_logits(self, n_vocab: int, index: int = -1) -> np.ndarray:
        """The logits of the last decode's token at batch ``index`` (-1: its last), as a writable
        view of llama.cpp's own buffer: the sampler chain reads them from there, so masking them
        here constrains the next sample."""
        lib, ffi = bindings()
        pointer = not_null(lib.llama_get_logits_ith(self.ptr, index), "llama_get_logits_ith")
        return np.frombuffer(ffi.buffer(pointer, 4 * n_vocab), dtype=np.float32)

    def decode_many(
        self,
        runs: Sequence[tuple[Sequence[int], int, int]],
        outputs: Sequence[int] | None = None,
        *,
        abortable: bool = False,
    ) -> list[int]:
        """Decode several sequences' tokens in one batch: ``(tokens, start, seq)`` each, logits
        for each run's last token (last ``outputs[i]``); their batch indices, in order (for
        sampling each: a run's earlier rows come right before its last). ``abortable`` as for
        ``decode``."""
        lib, _ = bindings()
        ptr = self.ptr
        for run in runs:
            self.check_run(*run)
        indices = self.batch.fill_many(runs, outputs)
        self.set_abortable(abortable)
        with ACTIVITY:
            code = lib.llama_decode(ptr, self.batch.raw)
        interrupted_by(code == DECODE_ABORTED)
        check(code, "llama_decode")
        return indices

    def embed_many(self, runs: Sequence[tuple[Sequence[int], int, int]], *, encoder: bool) -> None:
        """Decode (``encoder``: encode) several sequences' whole inputs in one batch into an
        ``embeddings`` context, every token an output (pooling reads them all)."""
        lib, _ = bindings()
        ptr = self.ptr  # (raises once the context is closed)
        for run in runs:
            self.check_run(*run)
        self.batch.fill_many(runs, [len(tokens) for tokens, _, _ in runs])
        with ACTIVITY:
            code = (lib.llama_encode if encoder else lib.llama_decode)(ptr, self.batch.raw)
        check(code, "llama_encode" if encoder else "llama_decode")

    def pooled(self, seq: int, n_embd: int) -> np.ndarray:
        """Sequence ``seq``'s pooled embedding from the last ``embed_many``, copied."""
        lib, ffi = bindings()
        pointer = not_null(lib.llama_get_embeddings_seq(self.ptr, seq), "llama_get_embeddings_seq")
        pooled: np.ndarray = np.frombuffer(ffi.buffer(pointer, 4 * n_embd), dtype=np.float32).copy()
        return pooled

    def check_run(self, tokens: Sequence[int], start: int, seq: int) -> None:
        """A run llama.cpp would refuse, refused first (ContextOverflowError, ValueError)."""
        if start + len(tokens) > self.n_ctx:
            raise ContextOverflowError(
                f"position {start + len(tokens)} exceeds the context size {self.n_ctx}"
            )
        self.check_seq(seq)

    # The llama_memory operations the prefix cache and the engine need, per sequence.
    def check_seq(self, seq: int) -> None:
        if not 0 <= seq < self.n_seq_max:
            raise ValueError(f"sequence {seq} is outside this context's 0..{self.n_seq_max - 1}")

    def seq_rm(self, p0: int, seq: int = 0) -> bool:
        """Remove positions >= p0 of ``seq`` (p0 = -1: all of them); False when refused."""
        self.check_seq(seq)
        return bool(bindings()[0].llama_memory_seq_rm(self.memory, seq, p0, -1))

    def seq_cp(self, src: int, dst: int) -> bool:
        """Make ``dst`` hold what ``src`` holds: the cells are shared, or, where each sequence
        has cells of its own, copied through the state now (llama.cpp's own copy between
        streams waits for the next decode: a state read or loaded before it would be stale or
        overwritten). False if llama.cpp refused the copied state (then ``dst`` is empty)."""
        self.check_seq(src)
        self.check_seq(dst)
        if self.own_cells:
            return self.state_set(self.state_get(src), dst)
        with ACTIVITY:
            bindings()[0].llama_memory_seq_cp(self.memory, src, dst, -1, -1)
        return True

    def clear(self) -> None:
        """Empty the whole memory (every sequence)."""
        with ACTIVITY:
            bindings()[0].llama_memory_clear(self.memory, True)

    def pos_min(self, seq: int = 0) -> int:
        self.check_seq(seq)
        return int(bindings()[0].llama_memory_seq_pos_min(self.memory, seq))

    def pos_max(self, seq: int = 0) -> int:
        self.check_seq(seq)
        return int(bindings()[0].llama_memory_seq_pos_max(self.memory, seq))

    # A sequence's KV state as bytes (llama_state_seq_*): for parking and saving a session, and
    # (``partial``: a hybrid memory's recurrent part alone) for checkpoints.
    def state_size(self, seq: int = 0, *, partial: bool = False) -> int:
        self.check_seq(seq)
        size = int(bindings()[0].llama_state_seq_get_size_ext(self.ptr, seq, _flags(partial)))
        return check(size, "llama_state_seq_get_size", (0).__lt__)  # a state has a header

    def state_get(self, seq: int = 0, *, partial: bool = False) -> Buffer:
        """The state, in an anonymous mapping of its exact size made for it: freed whole when the
        last reference goes (a heap block of tens of MiB would stay in the process once freed),
        and prefaulted (MAP_POPULATE), which costs a quarter of faulting it page by page."""
        lib, ffi = bindings()
        size = self.state_size(seq, partial=partial)
        blob = mapping(size)
        with ACTIVITY.moving(size), ffi.from_buffer("uint8_t[]", blob) as buf:  # (over RPC: may hang)
            written = lib.llama_state_seq_get_data_ext(self.ptr, buf, size, seq, _flags(partial))
        check(written, "llama_state_seq_get_data", size.__eq__)
        return blob

    def state_set(self, blob: Buffer, seq: int = 0, *, partial: bool = False, values: bool = False) -> bool:
        """Load a state this build wrote for the same model and layout into ``seq``; False (``seq``
        empty) if ``stateblob`` refused it first (llama.cpp's loaders abort on some malformed
        input; ``values``: a file's state, its values checked finite too) or llama.cpp did; a
        memory ``stateblob`` cannot read loads unchecked (a file's never). Callers check positions."""
        lib, ffi = bindings()
        self.check_seq(seq)
        expected = self.state_layout.partial() if partial and self.state_layout else self.state_layout
        why = refusal(blob, expected, values=values) if expected else UNCHECKABLE if values else None
        if why is not None:
            log.info("a saved sequence state was not loaded: %s", why)
        else:
            with ACTIVITY.moving(memoryview(blob).nbytes), ffi.from_buffer("uint8_t[]", blob) as source:
                size = len(source)
                if lib.llama_state_seq_set_data_ext(self.ptr, source, size, seq, _flags(partial)) == size:
                    return True
        lib.llama_memory_seq_rm(self.memory, seq, -1, -1)
        return False


def _flags(partial: bool) -> int:
    lib, _ = bindings()
    return int(lib.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) if partial else int(lib.LLAMA_STATE_SEQ_FLAGS_NONE)


class DecodeAborted(Exception):
    """A decode stopped early: the abort flag was set (``cause`` None), or a callback raised
    ``cause`` (the caller re-raises it once its memory matches its record again). ``clean``: it
    stopped between two batches, so memory holds just what was recorded."""

    def __init__(self, cause: BaseException | None = None, *, clean: bool = False) -> None:
        super().__init__()
        self.cause, self.clean = cause, clean


def interrupted_by(aborted: bool) -> None:
    """After a decode: raise DecodeAborted if it was aborted, or if a callback raised meanwhile
    (then the decode may have finished, but the caller must treat its batch as not recorded)."""
    from llama_cffi import take_pending_error

    cause = take_pending_error()
    if aborted or cause is not None:
        raise DecodeAborted(cause)
