"""A chat session: a transcript whose KV state the model's engine keeps across exchanges, and
replies streamed as they decode.

Each exchange renders the transcript, tokenizes it, takes a sequence of the model's shared
context holding the session's state (``engine.Engine.seat``: restored if it was parked), keeps
the longest token prefix it shares with the prompt (``prefix.PrefixCache``) and decodes only the
rest. Generation runs inside the stream's ``__next__`` on the consumer's thread: each token's
text is yielded as soon as that token is sampled, and nothing decodes between two ``__next__``
calls, so an abandoned stream costs nothing. ``Stream.cancel()`` from any thread also stops a
long prefill between graph nodes.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import closing, contextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmsession.engine import anticipate
from llmsession.engine.prefill import prefill
from llmsession.engine.prefix import Item, starts_a_chunk
from llmsession.engine.seat import GROWTH, Seat
from llmsession.engine.sessionfile import target_file
from llmsession.errors import (
    ContextOverflowError,
    GrammarError,
    MemoryBudgetError,
    ModelClosedError,
    NativeError,
    SessionBusyError,
)
from llmsession.native.context import DecodeAborted
from llmsession.native.sampler import Sampler, TokenSampler
from llmsession.options import MAX_POSITIONS, GenerationOptions, check_int
from llmsession.replies import Message, Reply, Snapshot, Timings, Usage
from llmsession.runtime.aio import AsyncStream
from llmsession.runtime.stream import Stream, Turn
from llmsession.text.detokenize import IncrementalDetokenizer
from llmsession.text.splice import ReplyTokens
from llmsession.text.stops import StopMatcher

if TYPE_CHECKING:
    from llmsession.engine.anticipate import Ahead
    from llmsession.engine.prompt import Prompt
    from llmsession.runtime.model import Model

log = logging.getLogger("llmsession")
DEFAULT_CONTEXT_SIZE = 4096


def checked(options: GenerationOptions | None) -> GenerationOptions:
    if options is None:
        return GenerationOptions()
    if not isinstance(options, GenerationOptions):
        raise TypeError(
            f"options must be a GenerationOptions, got {type(options).__name__} "
            "(write GenerationOptions(**values) for a dict)"
        )
    options.validate()
    return options


class Session:
    """A conversation; create with ``Model.session()``. Its KV state lives in the model's engine."""

    def __init__(
        self,
        model: Model,
        *,
        system: str | None = None,
        context_size: int | None = None,
        batch_size: int = 512,
        thinking: bool = False,
        swa_full: bool = True,
        share_prefix: bool = True,
    ) -> None:
        engine = model._engine
        if context_size is None:  # 4,096 positions, or the whole budget if it is smaller
            context_size = min(DEFAULT_CONTEXT_SIZE, engine.config.kv_tokens)
        check_int("context_size", context_size, 16, MAX_POSITIONS)
        check_int("batch_size", batch_size, 1, MAX_POSITIONS)
        for name, flag in (("thinking", thinking), ("swa_full", swa_full), ("share_prefix", share_prefix)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        if context_size > engine.config.kv_tokens:
            raise ValueError(
                f"context_size: {context_size} positions exceed the model's kv_tokens "
                f"({engine.config.kv_tokens}); load the model with a larger kv_tokens"
            )
        self.model = model
        self.context_size = context_size
        self.batch_size = min(batch_size, context_size, engine.config.batch_size)
        self.thinking = thinking
        self.swa_full = swa_full
        self.share_prefix = share_prefix
        self.messages: list[Message] = [{"role": "system", "content": system}] if system is not None else []
        self._lease = engine.lease(swa_full=swa_full, batch_size=self.batch_size, shares=share_prefix)
        weakref.finalize(self, engine.bury, self._lease)  # a dropped session frees its memory
        self._lock = threading.Lock()
        self._replies = ReplyTokens(capacity=256)  # its own replies, as generated
        self._active: Callable[[], object] | None = None  # finishes the latest stream, once
        self._superseded = False  # the latest stream is being finished for a new call
        self._ahead: Ahead | None = None  # the next prompt's opening, decoding in the background
        self._anticipated: Ahead | None = None  # the last one, settled: what it decoded ahead
        self._turn: Turn | None = None  # the latest stream's exchange
        self._closed = False
        self._disposable = False  # a stateless call's alone: no exchange follows its reply
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
        return self._stream({"role": "user", "content": content}, checked(options), None)

    def astream(self, content: Any, options: GenerationOptions | None = None) -> AsyncStream:
        """``stream`` for asyncio: ``async for snapshot in session.astream(...)``. Every step runs
        in a worker thread; cancelling the task cancels the exchange within one token."""
        options = checked(options)
        return AsyncStream(lambda: self._stream({"role": "user", "content": content}, options, None))

    async def arespond(self, content: Any, options: GenerationOptions | None = None) -> Reply:
        """``respond`` for asyncio; the event loop runs on while the reply decodes."""
        stream = self.astream(content, options)
        async for _ in stream:
            pass
        assert stream.reply is not None
        return stream.reply

    def _stream(self, user: Message, options: GenerationOptions, prompt: Prompt | None) -> Stream:
        """``stream`` for a user message, with its prompt if the caller already tokenized the
        transcript plus ``user`` (``Model.chat`` does, to choose the session); owns ``prompt``."""
        began = time.perf_counter()
        with self._busy():
            if self._active is not None:  # an unfinished stream of this thread: finish it first
                self._supersede()
                began = time.perf_counter()
            if prompt is None:
                prompt = self.model.prompt(
                    [*self.messages, user],
                    thinking=self.thinking,
                    own=self._replies,
                    shared=self.share_prefix,
                )
            else:  # made by the caller just before
                began -= prompt.render_s + prompt.tokenize_s
            self._settle(prompt.items)
            if prompt.n_positions >= self.context_size:
                prompt.close()
                raise ContextOverflowError(
                    f"the prompt has {prompt.n_positions} tokens; the context holds {self.context_size} "
                    "(one more is needed to reply)"
                )
            try:
                constraint = self.model.constraint(options)
            except BaseException:
                prompt.close()
                raise
            self._turn = Turn(user, prompt, options, constraint, began=began)
            stream = Stream(self, self._turn)
            self._active = stream._abandon
            return stream

    def clear_cached_context(self) -> None:
        """Forget the session's KV state (the next exchange decodes from scratch, but for what it
        may start from of another session's: ``share_prefix``)."""
        with self._busy():
            self._quiesce()
            self.model._engine.discard(self._lease)

    def fork(self) -> Session:
        """A new session with a copy of this transcript and of its KV cache (a copy of the
        state, not a re-decode): for alternatives and regenerations."""
        with self._busy():
            self._quiesce()
            twin = self.model.session(
                context_size=self.context_size,
                batch_size=self.batch_size,
                thinking=self.thinking,
                swa_full=self.swa_full,
                share_prefix=self.share_prefix,
            )
            twin.messages = copy.deepcopy(self.messages)
            twin._replies = self._replies.copy()
            self.model._engine.fork(self._lease, twin._lease)
            return twin

    def save(self, path: str | Path) -> None:
        """Write the transcript and the KV cache to one file (atomically); ``Model.load_session``
        reads it back, here or in another process. An unfinished stream is finished first."""
        from llmsession.runtime.persistence import save

        target = target_file(path)  # a path that cannot be written is refused before any work
        with self._busy():
            self._quiesce()
            save(self, target)

    def close(self) -> None:
        """Forget the KV state; the session stays usable (its model's ``close()`` ends it)."""
        if not self._closed:
            self.clear_cached_context()

    @property
    def cached_tokens(self) -> int:
        """How many positions the session's KV state holds (live or parked)."""
        return len(self._lease.cache.items)

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
        """Its model is closing: stop the running stream (waiting out its current step) and
        refuse any later use. The transcript stays readable."""
        turn = self._turn
        if turn is not None and not turn.done:
            turn.closed = True
            turn.cancelled.set()  # a prefill in another thread stops within a graph node
        with self._lock:
            self._quiesce()
            self._closed = True

    def _supersede(self) -> None:
        """Finish the latest stream for a new call (so no anticipation starts after it)."""
        assert self._active is not None
        self._superseded = True
        try:
            self._active()
        finally:
            self._superseded = False

    def _quiesce(self) -> None:
        """Before the session's memory is used other than by an exchange: finish the latest
        stream and stop any anticipatory prefill."""
        if self._active is not None:
            self._supersede()
        self._settle(None)

    def _settle(self, prompt: Sequence[Item] | None) -> None:
        """Let a running anticipatory prefill finish if ``prompt`` (the next) begins with what it
        decodes, else stop it; note what the exchange will reuse of it."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.settle(prompt)
            self._anticipated = ahead

    def _generate(self, turn: Turn) -> Generator[Snapshot, None, None]:
        """The exchange itself; runs step by step inside ``Stream.__next__``."""
        started = time.perf_counter()
        prompt, options = turn.prompt, turn.options
        usage = Usage(prompt_tokens=len(prompt.items))
        timings = Timings(render_s=prompt.render_s, tokenize_s=prompt.tokenize_s)
        if self._load_note is not None:
            (usage.restored_tokens, usage.cache_note), self._load_note = self._load_note, None
        text, cancelled = "", False
        held = max(self.cached_tokens, len(prompt.items))
        cells = min(self.context_size, held + min(options.max_tokens, GROWTH))
        engine = self.model._engine
        if self.model.native.has_encoder:
            seating = engine.single_use(self._lease, self.context_size, turn.cancelled)
        else:
            seating = engine.seat(self._lease, cells, turn.cancelled)
        try:
            with closing(self._sampler(turn)) as sampler, seating as seat:
                try:
                    if prompt.unsafe_reuse:  # upstream's rule for such prompts: from scratch
                        log.debug("no prefix reuse for this prompt: %s", prompt.unsafe_reuse)
                        seat.clear()
                    can_cut = partial(starts_a_chunk, prompt.items)
                    plan = seat.prepare(prompt.items, can_cut, share=not prompt.unsafe_reuse)
                    usage.reused_tokens, usage.from_checkpoint = plan.reused, plan.from_checkpoint
                    usage.restored_tokens = min(usage.restored_tokens, plan.reused)  # what was used
                    usage.shared_tokens = min(seat.shared, plan.reused)
                    ahead, self._anticipated = self._anticipated, None
                    usage.anticipated_tokens = ahead.reused_of(plan.reused) if ahead else 0
                    timings.plan_s = time.perf_counter() - started
                    first = prefill(turn, seat, plan.reused, usage, sampler, self.batch_size)
                    timings.prefill_s, timings.first_sample_s = seat.decode_s, seat.sample_s
                    cancelled = first is None
                    if first is not None:
                        steps = self._sample(turn, seat, *first, sampler, usage, timings, turn.began)
                        with closing(steps) as deltas:
                            for delta in deltas:
                                text += delta
                                yield Snapshot(delta, text)
                except GeneratorExit:  # closed or dropped mid-stream: keep what was generated
                    cancelled = True
                except DecodeAborted as aborted:  # a callback raised (Ctrl-C): memory can be kept
                    seat.after_abort()
                    raise (aborted.cause or NativeError("a decode was aborted")) from None
                except GrammarError:  # raised after a decode was recorded: memory matches
                    raise
                except BaseException:
                    seat.clear()  # the memory may not match the record any more
                    raise
                finally:
                    if prompt.unsafe_reuse:
                        seat.clear()
        except BaseException:
            turn.done = True  # failed: the transcript stays as it was
            prompt.close()
            raise
        finish = "cancelled" if cancelled else turn.finish
        parsed, error = None, None
        if turn.constraint is not None and finish == "complete":
            try:
                parsed = turn.constraint.parse(text)
            except ValueError as problem:  # the matcher let through what does not parse: say so
                error = GrammarError(f"the reply does not match its schema: {problem}")
        self._finish_turn(turn, Reply(text, finish, usage, timings, parsed))
        if error is not None:
            raise error

    def _sampler(self, turn: Turn) -> TokenSampler:
        """The exchange's sampler chain, its penalty window primed with the prompt's tokens,
        held to the exchange's constraint if it has one."""
        options = turn.options
        # -1 is "the whole context"; llama.cpp sizes a ring buffer by it, so never more than that
        window = options.repeat_last_n
        last_n = self.context_size if window == -1 else min(window, self.context_size)
        sampler = Sampler.from_options(options, n_vocab=self.model.native.n_vocab, last_n=last_n)
        if options.penalized and last_n > 0:
            for token in turn.prompt.tokens()[-last_n:]:
                sampler.accept(token)
        if turn.constraint is not None:
            return turn.constraint.sampler(sampler, self.model.native.n_vocab)
        return sampler

    def _finish_turn(self, turn: Turn, reply: Reply) -> None:
        """Record a finished exchange: the user message and the reply, as far as it got."""
        turn.prompt.close()
        turn.reply, turn.done = reply, True
        self.model.remember_reply(reply.text, turn.tokens, self._replies, shared=self.share_prefix)
        self.messages += [turn.user, {"role": "assistant", "content": reply.text}]
        if not (self._superseded or turn.closed or self._disposable):
            self._look_ahead()

    def _keep_forced(self, seat: Seat, tokens: list[int], pos: int) -> None:
        """Decode the tokens of a reply that ended inside a forced run, all but its last, so the
        next exchange keeps them; a bonus, skipped when memory is short."""
        try:
            for i in range(0, len(tokens), self.batch_size):
                seat.decode(tokens[i : i + self.batch_size], pos + i)
        except MemoryBudgetError:
            log.debug("the reply's forced tokens were left undecoded: no room")

    def _look_ahead(self) -> None:
        """Start decoding the next prompt's opening in the background (``anticipate``)."""
        self._ahead = anticipate.start(self)

    def _abandon_turn(self, turn: Turn, steps: Generator[Snapshot, None, None]) -> None:
        """Finish an exchange its stream gave up on (closed, dropped, or superseded)."""
        turn.cancelled.set()
        steps.close()  # a started exchange finishes itself, as cancelled, on GeneratorExit
        if not turn.done:  # never started: nothing was decoded
            self._finish_turn(
                turn, Reply("", "cancelled", Usage(prompt_tokens=len(turn.prompt.items)), Timings())
            )

    def _sample(
        self,
        turn: Turn,
        seat: Seat,
        pos: int,
        token: int,
        sampler: TokenSampler,
        usage: Usage,
        timings: Timings,
        started: float,
    ) -> Generator[str, None, None]:
        """The reply from its first sampled ``token`` on: each token's text, then the tokens
        since the last decode (the sampled one and any a constraint forces after it) decoded,
        and the next one sampled, in one step, batched with other streams' (``batching``)."""
        turn.finish = "length"
        first_token_at = time.perf_counter()
        timings.time_to_first_token_s = first_token_at - started
        with self.model._engine.batcher.generating(seat.context) as tracker:
            native, options = self.model.native, turn.options
            detokenizer, stops = IncrementalDetokenizer(), StopMatcher(options.stop)
            pending, n = [token, *sampler.forced()], 0
            while pending:
                batch: list[int] = []
                for index, token in enumerate(pending):
                    if turn.cancelled.is_set():
                        turn.finish = "cancelled"
                    elif native.is_eog(token):
                        turn.finish = "complete" if sampler.complete else "stop"
                    else:
                        usage.completion_tokens += 1
                        n += 1
                        delta = stops.push(detokenizer.push(native.piece(token)))
                        if delta:
                            yield delta
                        batch.append(token)
                        turn.tokens.append(token)
                        if stops.stopped:
                            turn.finish = "stop"
                        elif n < options.max_tokens and pos + len(batch) < self.context_size:
                            continue
                        elif sampler.finished and all(native.is_eog(t) for t in pending[index + 1 :]):
                            turn.finish = "complete"  # finished by the last token it was allowed
                        # else "length": the last token needs no decode; forced ones before it do
                        self._keep_forced(seat, batch[:-1], pos)
                    pending = []
                    break
                else:
                    for i in range(0, len(batch), self.batch_size):  # forced tokens may be many
                        chunk, last = batch[i : i + self.batch_size], i + self.batch_size >= len(batch)
                        token = seat.step(chunk, pos, sampler, tracker) if last else seat.decode(chunk, pos)
                        pos += len(chunk)
                    pending = [token, *sampler.forced()]
                    timings.generation_s = time.perf_counter() - first_token_at
                    timings._tokens = n
            # The detokenizer may still hold the first bytes of a character the reply was cut
            # inside of (max_tokens, cancel): they stay in the token record, not in the text.
            tail = "" if stops.stopped else stops.flush()
            if tail:
                yield tail
