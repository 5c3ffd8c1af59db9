"""A chat session: one llama context kept across exchanges, and replies streamed as they decode.

Each exchange renders the transcript, tokenizes it, keeps the longest token prefix the context
already holds (``prefix.PrefixCache``) and decodes only the rest. Generation runs inside the
stream's ``__next__`` on the consumer's thread: each token's text is yielded as soon as that
token is sampled, and nothing decodes between two ``__next__`` calls, so an abandoned stream
costs nothing. ``Stream.cancel()`` from any thread also stops a long prefill between graph nodes.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Generator, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

from .detokenize import IncrementalDetokenizer
from .errors import ContextOverflowError, SessionBusyError
from .native import DecodeAborted, ImageChunk, NativeContext, Sampler
from .options import GenerationOptions
from .prefix import PrefixCache, starts_a_chunk
from .stops import StopMatcher

if TYPE_CHECKING:
    from .model import Model, Prompt

log = logging.getLogger("llmsession")

FinishReason = Literal["stop", "length", "cancelled"]
Message = dict[str, Any]


@dataclass
class Usage:
    prompt_tokens: int = 0
    reused_tokens: int = 0
    decoded_prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Timings:
    time_to_first_token_s: float = 0.0
    prefill_s: float = 0.0
    generation_s: float = 0.0

    @property
    def generation_tokens_per_s(self) -> float:
        """Decode speed after the first token (the first one waits for the prefill)."""
        return self._tokens / self.generation_s if self.generation_s > 0 else 0.0

    _tokens: int = field(default=0, repr=False)


@dataclass(frozen=True)
class Reply:
    text: str
    finish_reason: FinishReason
    usage: Usage
    timings: Timings


@dataclass(frozen=True)
class Snapshot:
    """One step of a stream: the new text and everything so far."""

    delta: str
    text: str


class Session:
    """A conversation with its own llama context; create with ``Model.session()``."""

    def __init__(
        self,
        model: Model,
        *,
        system: str | None = None,
        context_size: int = 4096,
        batch_size: int = 512,
        thinking: bool = False,
        swa_full: bool = True,
    ) -> None:
        if context_size < 16:
            raise ValueError(f"context_size: must be at least 16, got {context_size}")
        if batch_size < 1:
            raise ValueError(f"batch_size: must be at least 1, got {batch_size}")
        self.model = model
        self.context_size = context_size
        self.batch_size = min(batch_size, context_size)
        self.thinking = thinking
        self.swa_full = swa_full
        self.messages: list[Message] = [{"role": "system", "content": system}] if system is not None else []
        self._context: NativeContext | None = None
        # A small sliding-window cache evicts old positions: check the window before rewinding.
        self._cache = PrefixCache(n_swa=0 if swa_full else max(0, model.native.n_swa))
        self._lock = threading.Lock()
        self._active: Stream | None = None

    # -- public API ---------------------------------------------------------------------------
    def respond(self, content: Any, options: GenerationOptions | None = None) -> Reply:
        """Send a user message and return the whole reply."""
        stream = self.stream(content, options)
        for _ in stream:
            pass
        assert stream.reply is not None
        return stream.reply

    def stream(self, content: Any, options: GenerationOptions | None = None) -> Stream:
        """Send a user message; iterate the result for snapshots as tokens decode."""
        options = options or GenerationOptions()
        options.validate()
        user = {"role": "user", "content": content}
        with self._busy():
            if self._active is not None:  # an abandoned stream of this thread: finish it first
                self._active._abandon()
            prompt = self.model.prompt([*self.messages, user], thinking=self.thinking)
            if prompt.n_positions >= self.context_size:
                prompt.close()
                raise ContextOverflowError(
                    f"the prompt has {prompt.n_positions} tokens; the context holds {self.context_size} "
                    "(one more is needed to reply)"
                )
            stream = Stream(self, user, prompt, options)
            self._active = stream
            return stream

    def clear_cached_context(self) -> None:
        """Free the session's llama context (the next exchange decodes from scratch)."""
        with self._busy():
            if self._active is not None:
                self._active._abandon()
            self._discard_context()

    def close(self) -> None:
        self.clear_cached_context()

    @property
    def cached_tokens(self) -> int:
        """How many positions the session's context holds."""
        return len(self._cache.items)

    # -- internals ----------------------------------------------------------------------------
    @contextmanager
    def _busy(self) -> Iterator[None]:
        if not self._lock.acquire(blocking=False):
            raise SessionBusyError("this session is already generating in another thread")
        try:
            yield
        finally:
            self._lock.release()

    def _ensure_context(self) -> NativeContext:
        if self._context is None:
            self._context = self.model._new_context(self.context_size, self.batch_size, self.swa_full)
            self._cache.reset()
        return self._context

    def _discard_context(self) -> None:
        if self._context is not None:
            self._context.close()
            self._context = None
        self._cache.reset()

    def _after_abort(self, context: NativeContext) -> None:
        """An aborted decode may leave a partial batch in memory: drop it, or everything."""
        if self.model.native.is_recurrent or not context.seq_rm(len(self._cache.items)):
            context.clear()
            self._cache.reset()

    def _generate(self, stream: Stream) -> Generator[Snapshot, None, None]:
        """The exchange itself; runs step by step inside ``Stream.__next__``."""
        started = time.perf_counter()
        prompt = stream.prompt
        usage, timings = Usage(prompt_tokens=len(prompt.items)), Timings()
        text, cancelled = "", False
        try:
            if prompt.unsafe_reuse:  # upstream's rule for such prompts: a fresh context
                log.debug("no prefix reuse for this prompt: %s", prompt.unsafe_reuse)
                self._discard_context()
            context = self._ensure_context()
            context.abort = stream.cancelled
            plan = self._cache.prepare(prompt.items, context, can_cut=partial(starts_a_chunk, prompt.items))
            usage.reused_tokens = plan.reused
            pos = self._prefill(stream, context, plan.reused, usage)
            timings.prefill_s = time.perf_counter() - started
            cancelled = pos is None
            if pos is not None:
                with closing(self._sample(stream, context, pos, usage, timings, started)) as deltas:
                    for delta in deltas:
                        text += delta
                        yield Snapshot(delta, text)
        except GeneratorExit:  # closed or dropped mid-stream: keep what was generated
            cancelled = True
        except BaseException:
            self._discard_context()  # the memory may not match the record any more
            self._active = None
            prompt.close()
            raise
        if prompt.unsafe_reuse:
            self._discard_context()
        stream._finish(Reply(text, "cancelled" if cancelled else stream.finish, usage, timings))

    def _prefill(self, stream: Stream, context: NativeContext, reused: int, usage: Usage) -> int | None:
        """Decode the prompt after its first ``reused`` items; the next position, None if cancelled."""
        items, pos, end = stream.prompt.items, reused, 0
        for piece in stream.prompt.pieces:
            size = piece.n_tokens if isinstance(piece, ImageChunk) else len(piece)
            start, end = end, end + size  # this piece holds items[start:end]
            if end <= reused:
                continue
            try:
                if isinstance(piece, ImageChunk):
                    if stream.cancelled.is_set():
                        return None
                    projector = self.model.projector
                    assert projector is not None
                    pos = projector.eval_image(context, piece, pos, logits_last=end == len(items))
                    self._cache.extend(items[start:end])
                    usage.decoded_prompt_tokens += size
                    continue
                todo = piece[max(0, reused - start) :]
                for i in range(0, len(todo), self.batch_size):
                    if stream.cancelled.is_set():
                        return None
                    chunk = todo[i : i + self.batch_size]
                    context.decode(chunk, pos, abortable=True)
                    self._cache.extend(chunk)
                    pos += len(chunk)
                    usage.decoded_prompt_tokens += len(chunk)
            except DecodeAborted:
                self._after_abort(context)
                return None
        return pos

    def _sample(
        self, stream: Stream, context: NativeContext, pos: int, usage: Usage, timings: Timings, started: float
    ) -> Generator[str, None, None]:
        native, options = self.model.native, stream.options
        sampler = Sampler.from_options(options)
        try:
            if options.penalized and options.repeat_last_n > 0:
                for token in stream.prompt.tokens()[-options.repeat_last_n :]:
                    sampler.accept(token)
            detokenizer, stops = IncrementalDetokenizer(), StopMatcher(options.stop)
            stream.finish = "length"
            first_token_at = 0.0
            for n in range(options.max_tokens):
                if stream.cancelled.is_set():
                    stream.finish = "cancelled"
                    break
                token = sampler.sample(context)
                if n == 0:
                    first_token_at = time.perf_counter()
                    timings.time_to_first_token_s = first_token_at - started
                if native.is_eog(token):
                    stream.finish = "stop"
                    break
                usage.completion_tokens += 1
                delta = stops.push(detokenizer.push(native.piece(token)))
                if delta:
                    yield delta
                if stops.stopped:
                    stream.finish = "stop"
                    break
                if n + 1 == options.max_tokens or pos + 1 >= context.n_ctx:
                    break  # "length": the last token needs no decode
                context.decode([token], pos)
                self._cache.extend([token])
                pos += 1
                timings.generation_s = time.perf_counter() - first_token_at
                timings._tokens = n + 1
            tail = "" if stops.stopped else stops.push(detokenizer.flush()) + stops.flush()
            if tail:
                yield tail
        finally:
            sampler.close()


class Stream:
    """An iterator of ``Snapshot``s; ``reply`` holds the final ``Reply`` once it ends."""

    def __init__(self, session: Session, user: Message, prompt: Prompt, options: GenerationOptions):
        self.session = session
        self.user = user
        self.prompt = prompt
        self.options = options
        self.cancelled = threading.Event()
        self.finish: FinishReason = "length"
        self.reply: Reply | None = None
        self._steps: Generator[Snapshot, None, None] = session._generate(self)

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Snapshot:
        if self.reply is not None:
            raise StopIteration
        with self.session._busy():
            return next(self._steps)

    def cancel(self) -> None:
        """Stop decoding before the next token (or mid-prefill); thread-safe and idempotent."""
        self.cancelled.set()

    def close(self) -> None:
        """Cancel and finish the reply now (what was generated is kept)."""
        self.cancel()
        with self.session._busy():
            self._abandon()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _abandon(self) -> None:
        """Finish as cancelled; the caller holds the session lock."""
        self.cancelled.set()
        if inspect.getgeneratorstate(self._steps) == inspect.GEN_CREATED:  # nothing decoded yet
            self._steps.close()
            self._finish(Reply("", "cancelled", Usage(prompt_tokens=len(self.prompt.items)), Timings()))
        self._steps.close()

    def _finish(self, reply: Reply) -> None:
        self.prompt.close()
        self.reply = reply
        assistant = {"role": "assistant", "content": reply.text}
        self.session.messages += [self.user, assistant]
        if self.session._active is self:
            self.session._active = None
