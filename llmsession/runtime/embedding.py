"""Embeddings (``Model.embed``, ``/v1/embeddings``) for a model whose GGUF names a pooling (mean,
CLS, last: an embedding model; ``pooling_of``). A context of its own, made at load (``open``):
each input's tokens fill a sequence of one batch (up to ``SEQUENCES`` inputs and ``n_ctx``
tokens a batch), every token an output, and each sequence's pooled vector is read back, L2
normalized as OpenAI's and llama-server's are. An input longer than the context is refused, not
cut (``ContextOverflowError`` naming it). A chat model has no pooling: ``UnsupportedFeatureError``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np

from llmsession.errors import (
    ContextOverflowError,
    ModelClosedError,
    ModelOutputError,
    UnsupportedFeatureError,
)
from llmsession.native.context import NativeContext
from llmsession.native.llama import NativeModel
from llmsession.native.shape import architecture, meta

POOLINGS = {1: "mean", 2: "cls", 3: "last", 4: "rank"}  # llama.cpp's LLAMA_POOLING_TYPE_*
SEQUENCES = 16  # inputs a batch holds
MAX_CONTEXT = 8192  # positions an input may have, at most (the model's trained length if less)
MIN_BATCH = 512  # tokens a batch holds at least (the longest input: a non-causal one is one batch)
# llama.cpp reserves a row of logits for every token of a batch (n_vocab floats) even when only
# the pooled vectors are read: a batch holds at most this many bytes of them.
LOGITS_BYTES = 256 << 20
MAX_INPUTS = 2048  # inputs one call may have


def pooling_of(model: NativeModel) -> str | None:
    """How the GGUF says its sequences are pooled into one vector, or None (a chat model)."""
    value = meta(model, f"{architecture(model)}.pooling_type")
    return POOLINGS.get(int(value)) if value is not None and value.isdigit() else None


Inputs = str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]


EMBED_INPUTS = "embed takes a non-empty str, list of str, list of token ids, or list of those"


def wrong_item(index: int, item: object) -> ValueError:
    """What an input that is neither a str nor a list of token ids is told (in process, and by
    the worker's proxy before its pipe)."""
    return ValueError(f"input {index}: a str or a list of token ids, got {type(item).__name__}")


def is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def context_size(trained: int, n_vocab: int) -> int:
    """An embedding context's positions: the model's trained length (unknown, 0 or less: a
    file's 2**32 - 1 reads as -1, which made a context of -1 a raw OverflowError at load) up to
    ``MAX_CONTEXT``, and what a batch's logits leave room for, ``MIN_BATCH`` at least."""
    most = min(MAX_CONTEXT, trained) if trained > 0 else MAX_CONTEXT
    return min(most, max(MIN_BATCH, LOGITS_BYTES // (4 * max(1, n_vocab))))


class Embedder:
    """An embedding model's embedding context and the lock its calls take."""

    def __init__(self, model: NativeModel, threads: int) -> None:
        self.model, self.threads = model, threads
        self.pooling = pooling_of(model)
        self._context: NativeContext | None = None
        self._lock = threading.Lock()
        self._closed = False  # (its model is closing: no context is made again)

    def check(self) -> None:
        if self.pooling == "rank":
            raise UnsupportedFeatureError("this is a reranking model: it scores pairs, it has no embeddings")
        if self.pooling is None:
            raise UnsupportedFeatureError(
                "this is a chat model: its file names no pooling, so it has no embeddings "
                "(load an embedding model: BERT-style, or one whose GGUF sets pooling_type)"
            )

    def embed(
        self, inputs: Inputs, tokenize: Callable[[str], list[int]], normalize: bool = True
    ) -> np.ndarray:
        """One row an input, float32, shape (inputs, the model's embedding width)."""
        self.check()
        lists = self._token_lists(inputs, tokenize)
        with self._lock:
            context = self._context or self._made()  # (ModelClosedError once closed)
            rows = [row for group in self._groups(lists, context.n_ctx) for row in self._run(context, group)]
        out = np.stack(rows).astype(np.float32, copy=False)
        broken = np.flatnonzero(~np.isfinite(out).all(axis=1))
        if broken.size:  # (a broken or mis-converted model: never NaN handed on as a vector)
            raise ModelOutputError(
                f"the model's embedding of input {broken[0]} is not finite (NaN or infinity)"
            )
        if normalize:
            norms = np.linalg.norm(out, axis=1, keepdims=True)
            out /= np.where(norms > 0, norms, 1.0).astype(np.float32)
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._context is not None:
                self._context.close()
                self._context = None

    def open(self) -> None:
        """Make its embedding context now (at load: what the model holds shows from the start);
        a chat or reranking model has none."""
        if self.pooling in (None, "rank"):
            return
        with self._lock:
            if self._context is None:
                self._made()

    def _made(self) -> NativeContext:
        if self._closed:  # (an embed that began as its model closed: no context under its free)
            raise ModelClosedError("the model is closed")
        n_ctx = context_size(self.model.n_ctx_train, self.model.n_vocab)
        self._context = NativeContext(
            self.model, n_ctx=n_ctx, n_batch=n_ctx, threads=self.threads, n_seq_max=SEQUENCES, embeddings=True
        )
        return self._context

    def _token_lists(self, inputs: Inputs, tokenize: Callable[[str], list[int]]) -> list[list[int]]:
        """The inputs as token lists, checked: texts tokenized (with the model's special tokens,
        as llama-server does), token ids within the vocabulary, none empty."""
        items: Sequence[object] = [inputs] if isinstance(inputs, str) else inputs
        if not isinstance(items, Sequence) or not items:
            raise ValueError(EMBED_INPUTS)
        if all(is_token(x) for x in items):
            items = [items]  # (one input, as token ids)
        if len(items) > MAX_INPUTS:
            raise ValueError(f"embed takes at most {MAX_INPUTS} inputs, got {len(items)}")
        n_vocab = self.model.n_vocab
        lists = []
        for index, item in enumerate(items):
            if isinstance(item, str):
                if not item:
                    raise ValueError(f"input {index} is empty")
                tokens = tokenize(item)
            elif isinstance(item, Sequence) and all(is_token(t) for t in item):
                tokens = [int(t) for t in item]
                if any(not 0 <= t < n_vocab for t in tokens):
                    raise ValueError(f"input {index}: token ids must be in 0..{n_vocab - 1}")
            else:
                raise wrong_item(index, item)
            if not tokens:
                raise ValueError(f"input {index} has no tokens")
            lists.append(tokens)
        return lists

    @staticmethod
    def _groups(lists: list[list[int]], n_ctx: int) -> list[list[list[int]]]:
        """The inputs in batches of at most ``SEQUENCES`` inputs and ``n_ctx`` tokens, in order."""
        groups: list[list[list[int]]] = [[]]
        size = 0
        for index, tokens in enumerate(lists):
            if len(tokens) > n_ctx:
                raise ContextOverflowError(f"input {index} has {len(tokens)} tokens; at most {n_ctx} fit")
            if groups[-1] and (len(groups[-1]) == SEQUENCES or size + len(tokens) > n_ctx):
                groups.append([])
                size = 0
            groups[-1].append(tokens)
            size += len(tokens)
        return groups

    def _run(self, context: NativeContext, group: list[list[int]]) -> list[np.ndarray]:
        context.clear()  # (a causal embedding model keeps cells; a BERT one has none)
        encoder = self.model.has_encoder and not self.model.has_decoder
        context.embed_many([(tokens, 0, seq) for seq, tokens in enumerate(group)], encoder=encoder)
        return [context.pooled(seq, self.model.n_embd_out) for seq in range(len(group))]
