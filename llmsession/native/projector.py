"""libmtmd: a multimodal projector, and prompts tokenized into text runs and image chunks. Part of
the native layer (see ``native``)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmsession.errors import (
    ContextOverflowError,
    ImageError,
    ModelLoadError,
    UnsupportedFeatureError,
)
from llmsession.native.cancel import ACTIVITY
from llmsession.native.context import NativeContext, interrupted_by
from llmsession.native.llama import (
    NativeModel,
    Owner,
    bindings,
    c_string,
    check,
    not_null,
    raise_pending,
)
from llmsession.native.machine import within_cores
from llmsession.native.metadata import check_gguf_file
from llmsession.native.reports import made_reporting
from llmsession.text.images import Image


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
        check_gguf_file(path, "projector")
        params = lib.mtmd_context_params_default()
        params.use_gpu, params.n_threads, params.print_timings = use_gpu, within_cores(threads), False
        file = c_string(str(path), "projector path")
        pointer, reported = made_reporting(lambda: lib.mtmd_init_from_file(file, model.ptr, params))
        if pointer != ffi.NULL:
            self._free = weakref.finalize(self, _free_projector, lib, pointer, model)
        raise_pending()
        self._ptr = not_null(pointer, f"loading projector {path} for this model", ModelLoadError)
        model.adopt(self)
        self.buffers = reported
        self.marker = str(ffi.string(lib.mtmd_default_marker()).decode())
        self.vision = bool(lib.mtmd_support_vision(self.ptr))
        self.lock = threading.Lock()

    def tokenize(self, pieces: Sequence[tuple[str, bool]], images: Sequence[Image]) -> Chunks:
        """Split a prompt's text at its media markers into text tokens and one image chunk per
        image. The text comes in ``pieces``, each with whether it is plain (special tokens off:
        a user's spelling of a control token stays text, ``text.guard``); each piece is tokenized
        on its own, as the text between two markers always is."""
        lib, ffi = bindings()
        if images and not self.vision:
            raise UnsupportedFeatureError("this projector does not take images")
        markers = sum(text.count(self.marker) for text, _ in pieces)
        if markers != len(images):
            raise ImageError(
                f"the prompt has {markers} media markers ({self.marker!r}) for {len(images)} images; "
                "a message's text may not contain the marker itself"
            )
        bitmaps = ffi.new("mtmd_bitmap *[]", max(1, len(images)))
        with self.lock:
            try:
                for i, image in enumerate(images):
                    pixels = ffi.from_buffer(image.pixels)
                    bitmaps[i] = not_null(
                        lib.mtmd_bitmap_init(image.width, image.height, pixels), "mtmd_bitmap_init"
                    )
                    lib.mtmd_bitmap_set_id(bitmaps[i], image.digest.encode())
                parts, n_parts, _alive = self._parts(pieces, bitmaps)  # (their text read in the call)
                chunks = Chunks(not_null(lib.mtmd_input_chunks_init(), "mtmd_input_chunks_init"), [])
                code = lib.mtmd_tokenize_from_parts(self.ptr, chunks.ptr, parts, n_parts, True)
                try:
                    raise_pending()
                except BaseException:
                    chunks.close()
                    raise
                if code != 0:
                    chunks.close()
                    raise ImageError(
                        f"libmtmd could not tokenize the prompt's images (mtmd_tokenize_from_parts: {code})"
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

    def _parts(self, pieces: Sequence[tuple[str, bool]], bitmaps: Any) -> tuple[Any, int, list[Any]]:
        """``mtmd_tokenize_from_parts``' parts: each piece's text between media markers (special
        tokens parsed unless it is plain), and the next bitmap at each marker; how many, and the
        C objects the array points to (alive until the call returns)."""
        _, ffi = bindings()
        parts: list[Any] = []
        kept: list[Any] = []
        image = 0
        for text, plain in pieces:
            for i, between in enumerate(text.split(self.marker)):
                if i:
                    parts.append(ffi.new("mtmd_input_part *", {"text": ffi.NULL, "bitmap": bitmaps[image]}))
                    image += 1
                if between:
                    data = ffi.new("char[]", between.encode("utf-8"))  # (mtmd reads text_len bytes)
                    source = ffi.new("mtmd_input_text *", {"text": data, "text_len": len(data) - 1})
                    source.add_special, source.parse_special = False, not plain
                    kept += [data, source]
                    parts.append(ffi.new("mtmd_input_part *", {"text": source, "bitmap": ffi.NULL}))
        return ffi.new("mtmd_input_part *[]", parts), len(parts), kept + parts

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
        if chunk.non_causal and chunk.n_tokens > context.n_batch:  # (decoded in pieces, each would
            raise ImageError(  # attend to itself only: a silently wrong reading of the image)
                f"this projector's images take {chunk.n_tokens} tokens in one batch, more than the "
                f"batch size {context.n_batch}: give it a batch_size of {chunk.n_tokens} or more"
            )
        context.check_seq(seq)
        context.set_abortable(True)
        next_pos = ffi.new("llama_pos *", start)
        with self.lock, ACTIVITY:  # (a decode: over RPC, a stuck one is a worker's timeout)
            code = lib.mtmd_helper_eval_chunk_single(
                self.ptr, context.ptr, chunk.ptr, start, seq, context.n_batch, logits_last, next_pos
            )
        interrupted_by(code != 0 and context.abort.is_set())
        check(code, "evaluating an image chunk (mtmd_helper_eval_chunk_single)")
        return int(next_pos[0])
