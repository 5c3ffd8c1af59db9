"""A chat session: one llama context kept across exchanges, and replies streamed as they decode.

Each exchange renders the transcript, tokenizes it, keeps the longest token prefix the context
already holds (``prefix.PrefixCache``) and decodes only the rest. Generation runs inside the
stream's ``__next__`` on the consumer's thread: each token's text is yielded as soon as that
token is sampled, and nothing decodes between two ``__next__`` calls, so an abandoned stream
costs nothing. ``Stream.cancel()`` from any thread also stops a long prefill between graph nodes.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .detokenize import IncrementalDetokenizer
from .errors import ContextOverflowError, ModelClosedError, NativeError, SessionBusyError
from .native import DecodeAborted, ImageChunk, NativeContext, Sampler
from .options import MAX_POSITIONS, GenerationOptions, check_int
from .prefix import PrefixCache, starts_a_chunk
from .replies import FinishReason, Message, Reply, Snapshot, Timings, Usage
from .stops import StopMatcher

if TYPE_CHECKING:
    from .model import Model, Prompt

log = logging.getLogger("llmsession")


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
        check_int("context_size", context_size, 16, MAX_POSITIONS)
        check_int("batch_size", batch_size, 1, MAX_POSITIONS)
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
        self._active: Callable[[], object] | None = None  # finishes the latest stream, once
        self._turn: Turn | None = None  # the latest stream's exchange
        self._closed = False
        self._load_note: tuple[int, str] | None = None  # from Model.load_session, for one reply

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
        if options is None:
            options = GenerationOptions()
        if not isinstance(options, GenerationOptions):
            raise TypeError(
                f"options must be a GenerationOptions, got {type(options).__name__} "
                "(write GenerationOptions(**values) for a dict)"
            )
        options.validate()
        user = {"role": "user", "content": content}
        return self._stream(user, options, None)

    def _stream(self, user: Message, options: GenerationOptions, prompt: Prompt | None) -> Stream:
        """``stream`` for a user message, with its prompt if the caller already tokenized the
        transcript plus ``user`` (``Model.chat`` does, to choose the session); owns ``prompt``."""
        with self._busy():
            if self._active is not None:  # an unfinished stream of this thread: finish it first
                self._active()
            if prompt is None:
                prompt = self.model.prompt([*self.messages, user], thinking=self.thinking)
            if prompt.n_positions >= self.context_size:
                prompt.close()
                raise ContextOverflowError(
                    f"the prompt has {prompt.n_positions} tokens; the context holds {self.context_size} "
                    "(one more is needed to reply)"
                )
            self._turn = Turn(user, prompt, options)
            stream = Stream(self, self._turn)
            self._active = stream._abandon
            return stream

    def clear_cached_context(self) -> None:
        """Free the session's llama context (the next exchange decodes from scratch)."""
        with self._busy():
            if self._active is not None:
                self._active()
            self._discard_context()

    def fork(self) -> Session:
        """A new session with a copy of this transcript and of its KV cache (a copy of the
        state, not a re-decode): for alternatives and regenerations."""
        from .persistence import copy_into

        with self._busy():
            if self._active is not None:
                self._active()
            twin = self.model.session(
                context_size=self.context_size,
                batch_size=self.batch_size,
                thinking=self.thinking,
                swa_full=self.swa_full,
            )
            twin.messages = copy.deepcopy(self.messages)
            copy_into(self, twin)
            return twin

    def save(self, path: str | Path) -> None:
        """Write the transcript and the KV cache to one file (atomically); ``Model.load_session``
        reads it back, here or in another process. An unfinished stream is finished first."""
        from .persistence import save

        with self._busy():
            if self._active is not None:
                self._active()
            save(self, path)

    def close(self) -> None:
        """Free the cached context; the session stays usable (its model's ``close()`` ends it)."""
        if not self._closed:
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
            if self._closed:
                raise ModelClosedError("this session's model was closed")
            yield
        finally:
            self._lock.release()

    def _shut(self) -> None:
        """Its model is closing: stop the running stream (waiting out its current step), free
        the context, and refuse any later use. The transcript stays readable."""
        turn = self._turn
        if turn is not None and not turn.done:
            turn.closed = True
            turn.cancelled.set()  # a prefill in another thread stops within a graph node
        with self._lock:
            if self._active is not None:
                self._active()
            self._discard_context()
            self._closed = True

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

    def _generate(self, turn: Turn) -> Generator[Snapshot, None, None]:
        """The exchange itself; runs step by step inside ``Stream.__next__``."""
        started = time.perf_counter()
        prompt = turn.prompt
        usage, timings = Usage(prompt_tokens=len(prompt.items)), Timings()
        if self._load_note is not None:
            (usage.restored_tokens, usage.cache_note), self._load_note = self._load_note, None
        text, cancelled = "", False
        try:
            if prompt.unsafe_reuse:  # upstream's rule for such prompts: a fresh context
                log.debug("no prefix reuse for this prompt: %s", prompt.unsafe_reuse)
                self._discard_context()
            context = self._ensure_context()
            context.abort = turn.cancelled
            plan = self._cache.prepare(prompt.items, context, can_cut=partial(starts_a_chunk, prompt.items))
            usage.reused_tokens = plan.reused
            pos = self._prefill(turn, context, plan.reused, usage)
            timings.prefill_s = time.perf_counter() - started
            cancelled = pos is None
            if pos is not None:
                with closing(self._sample(turn, context, pos, usage, timings, started)) as deltas:
                    for delta in deltas:
                        text += delta
                        yield Snapshot(delta, text)
        except GeneratorExit:  # closed or dropped mid-stream: keep what was generated
            cancelled = True
        except DecodeAborted as aborted:  # a callback raised (Ctrl-C): memory can be kept
            self._after_abort(context)
            if prompt.unsafe_reuse:
                self._discard_context()
            turn.done = True  # failed: the transcript stays as it was
            prompt.close()
            raise (aborted.cause or NativeError("a decode was aborted")) from None
        except BaseException:
            self._discard_context()  # the memory may not match the record any more
            turn.done = True  # failed: the transcript stays as it was
            prompt.close()
            raise
        if prompt.unsafe_reuse:
            self._discard_context()
        self._finish_turn(turn, Reply(text, "cancelled" if cancelled else turn.finish, usage, timings))

    def _finish_turn(self, turn: Turn, reply: Reply) -> None:
        """Record a finished exchange: the user message and the reply, as far as it got."""
        turn.prompt.close()
        turn.reply, turn.done = reply, True
        self.messages += [turn.user, {"role": "assistant", "content": reply.text}]

    def _abandon_turn(self, turn: Turn, steps: Generator[Snapshot, None, None]) -> None:
        """Finish an exchange its stream gave up on (closed, dropped, or superseded)."""
        turn.cancelled.set()
        steps.close()  # a started exchange finishes itself, as cancelled, on GeneratorExit
        if not turn.done:  # never started: nothing was decoded
            self._finish_turn(
                turn, Reply("", "cancelled", Usage(prompt_tokens=len(turn.prompt.items)), Timings())
            )

    def _prefill(self, turn: Turn, context: NativeContext, reused: int, usage: Usage) -> int | None:
        """Decode the prompt after its first ``reused`` items; the next position, None if cancelled."""
        items, pos, end = turn.prompt.items, reused, 0
        for piece in turn.prompt.pieces:
            size = piece.n_tokens if isinstance(piece, ImageChunk) else len(piece)
            start, end = end, end + size  # this piece holds items[start:end]
            if end <= reused:
                continue
            try:
                if isinstance(piece, ImageChunk):
                    if turn.cancelled.is_set():
                        return None
                    projector = self.model.projector
                    assert projector is not None
                    pos = projector.eval_image(context, piece, pos, logits_last=end == len(items))
                    self._cache.extend(items[start:end])
                    usage.decoded_prompt_tokens += size
                    continue
                todo = piece[max(0, reused - start) :]
                for i in range(0, len(todo), self.batch_size):
                    if turn.cancelled.is_set():
                        return None
                    chunk = todo[i : i + self.batch_size]
                    context.decode(chunk, pos, abortable=True)
                    self._cache.extend(chunk)
                    pos += len(chunk)
                    usage.decoded_prompt_tokens += len(chunk)
            except DecodeAborted as aborted:
                if aborted.cause is not None:
                    raise  # _generate restores memory to the record and raises the cause
                self._after_abort(context)
                return None
        return pos

    def _sample(
        self, turn: Turn, context: NativeContext, pos: int, usage: Usage, timings: Timings, started: float
    ) -> Generator[str, None, None]:
        native, options = self.model.native, turn.options
        # -1 is "the whole context"; llama.cpp sizes a ring buffer by it, so never more than that
        window = options.repeat_last_n
        last_n = self.context_size if window == -1 else min(window, self.context_size)
        sampler = Sampler.from_options(options, n_vocab=native.n_vocab, last_n=last_n)
        try:
            if options.penalized and last_n > 0:
                for token in turn.prompt.tokens()[-last_n:]:
                    sampler.accept(token)
            detokenizer, stops = IncrementalDetokenizer(), StopMatcher(options.stop)
            turn.finish = "length"
            first_token_at = 0.0
            for n in range(options.max_tokens):
                if turn.cancelled.is_set():
                    turn.finish = "cancelled"
                    break
                token = sampler.sample(context)
                if n == 0:
                    first_token_at = time.perf_counter()
                    timings.time_to_first_token_s = first_token_at - started
                if native.is_eog(token):
                    turn.finish = "stop"
                    break
                usage.completion_tokens += 1
                delta = stops.push(detokenizer.push(native.piece(token)))
                if delta:
                    yield delta
                if stops.stopped:
                    turn.finish = "stop"
                    break
                if n + 1 == options.max_tokens or pos + 1 >= context.n_ctx:
                    break  # "length": the last token needs no decode
                context.decode([token], pos)
                self._cache.extend([token])
                pos += 1
                timings.generation_s = time.perf_counter() - first_token_at
                timings._tokens = n + 1
            # The detokenizer may still hold the first bytes of a character the reply was cut
            # inside of (max_tokens, cancel): they stay in the token record, not in the text.
            tail = "" if stops.stopped else stops.flush()
            if tail:
                yield tail
        finally:
            sampler.close()


@dataclass
class Turn:
    """One exchange's state, shared by its ``Stream`` and the generator that runs it. The
    generator never holds the ``Stream``, so dropping the stream finishes the exchange at once."""

    user: Message
    prompt: Prompt
    options: GenerationOptions
    cancelled: threading.Event = field(default_factory=threading.Event)
    finish: FinishReason = "length"
    reply: Reply | None = None
    done: bool = False
    closed: bool = False  # its model was closed before it finished


class Stream:
    """An iterator of ``Snapshot``s; ``reply`` holds the final ``Reply`` once it ends."""

    def __init__(self, session: Session, turn: Turn) -> None:
        self.session = session
        self._turn = turn
        self._steps = session._generate(turn)
        # Runs once: on close(), when the session moves on, or when the stream is dropped.
        self._abandon = weakref.finalize(self, session._abandon_turn, turn, self._steps)

    @property
    def reply(self) -> Reply | None:
        return self._turn.reply

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Snapshot:
        if self._turn.closed:
            raise ModelClosedError("the model was closed while this stream was open")
        if self._turn.done:
            raise StopIteration
        with self.session._busy():
            try:
                return next(self._steps)
            except StopIteration:
                if self._turn.closed:  # cancelled by the model's close()
                    raise ModelClosedError("the model was closed while this stream was open") from None
                raise

    def cancel(self) -> None:
        """Stop decoding before the next token (or mid-prefill); thread-safe and idempotent."""
        self._turn.cancelled.set()

    def close(self) -> None:
        """Cancel and finish the reply now (what was generated is kept)."""
        self.cancel()
        if self._turn.done:
            return  # finished, or ended by its model's close()
        with self.session._busy():
            self._abandon()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
