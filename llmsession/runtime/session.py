"""A chat session: a transcript whose KV state the model's engine keeps across exchanges, and
replies streamed as they decode.

Each exchange (``exchange.Exchange``) takes the transcript's prompt, a sequence of the model's
shared context holding the session's state (restored if it was parked), keeps the longest token
prefix it shares with the prompt and decodes only the rest. Generation runs inside the stream's
``__next__`` on the consumer's thread; ``Stream.cancel()`` from any thread also stops a long
prefill between graph nodes. After a reply, the next prompt's opening is decoded ahead in the
background (``engine.anticipate``).
"""

from __future__ import annotations

import copy
import dataclasses
import time
import weakref
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, cast

from llmsession.config import SessionConfig
from llmsession.engine import anticipate
from llmsession.engine.budget import MemoryPlan
from llmsession.engine.prompt import Prompt
from llmsession.engine.sessionfile import target_file
from llmsession.errors import ContextOverflowError, ModelClosedError, SessionBusyError
from llmsession.options import GenerationOptions, checked_options
from llmsession.replies import Message, Reply, assistant_message
from llmsession.runtime import persistence
from llmsession.runtime.calling import Calling
from llmsession.runtime.continuing import Prefill
from llmsession.runtime.core import ModelCore
from llmsession.runtime.exchange import Exchange
from llmsession.runtime.exiting import STEPPING_HERE
from llmsession.runtime.face import Session
from llmsession.runtime.place import Carry, Place
from llmsession.runtime.readers import Reader
from llmsession.runtime.said import editable, said_messages
from llmsession.runtime.stream import CLOSE_WAIT_S, Finishing, Guard, LocalStream
from llmsession.runtime.thinking import thinking
from llmsession.text.messages import check_messages
from llmsession.text.splice import ReplyTokens
from llmsession.text.templates import reads_effort
from llmsession.text.tool_formats import CallIds
from llmsession.text.tools import Tools, options_tools

MAX_CALLS = 8  # calls in one reply, where the format writes their ids


def too_many(config: MemoryPlan, most: int) -> str:
    """What a session's positions exceed, and what to load the model with instead."""
    if most == config.kv_tokens:
        return f"the model's kv_tokens ({most}); load the model with a larger kv_tokens"
    return (
        f"the {most} cells a live session holds (kv_tokens {config.kv_tokens} / max_live_sessions "
        f"{config.max_live_sessions}); load the model with a larger kv_tokens, fewer "
        "max_live_sessions, or kv_layout='shared'"
    )


def resolved_config(model: ModelCore, config: SessionConfig) -> SessionConfig:
    """``config`` as a session of ``model`` has it: its context and batch resolved against the
    model's memory (a ``context_size`` of None is the model's default, or what a live session may
    hold if less), a reasoning effort its template does not read as plain thinking (so calls
    that differ only there share kept sessions); ValueError if the context is larger than a
    live session may hold."""
    memory = model.engine.config
    most = model.engine.session_cells(config.swa_full)
    context_size = config.context_size
    if context_size is None:  # the model's default (``engine.sizing``), or what a live session may hold
        context_size = min(model.sizing.context_size, most)
    if context_size > most:
        raise ValueError(f"context_size: {context_size} positions exceed {too_many(memory, most)}")
    batch_size = min(config.batch_size, context_size, memory.batch_size)
    thinking = config.thinking  # (an effort its template reads no effort from is thinking: the same prompt)
    if isinstance(thinking, str) and not (model.use_jinja and reads_effort(model.template)):
        thinking = True
    return dataclasses.replace(config, context_size=context_size, batch_size=batch_size, thinking=thinking)


class LocalSession(Session):
    """A conversation with a model in this process (``face.Session`` says what it offers); its
    KV state lives in the model's engine. Below the face: its ``lease`` of that memory, the
    ``carry`` its next exchange reports, its own ``replies``, ``start`` for an exchange whose
    prompt a stateless call made, and ``shut`` and ``idle`` for its model and the stateless
    calls."""

    def __init__(self, model: ModelCore, config: SessionConfig) -> None:
        """``config`` as asked (checked when made); its context and batch are resolved here
        against the model's memory (``config`` then says what they are)."""
        if model.closed:
            raise ModelClosedError("this model is closed")
        self._config = resolved_config(model, config)  # (compared on every stateless call)
        self.asked = config  # (what a stateless call that may take this session asks for)
        self.model = model
        system = config.system
        self.messages: list[Message] = [{"role": "system", "content": system}] if system is not None else []
        self.lease = model.engine.lease(
            swa_full=self.swa_full, batch_size=self.batch_size, shares=self.share_prefix
        )
        self._bury = weakref.finalize(self, model.engine.bury, self.lease)  # a dropped one frees its memory
        self.replies = ReplyTokens(capacity=256)  # its own replies, as generated
        self.carry = Carry()  # what its next exchange reports of before it
        self.looks_ahead = True  # decode the next prompt's opening after a reply (stateless: no)
        self._guard = Guard()  # one thread at a time; none once closed
        self._latest: Exchange | None = None  # the latest stream's exchange
        self._ended = Finishing()  # its stream's finishing (``LocalStream.ended``)
        self._abandon: Callable[[], object] | None = None  # finishes it, once (not holding its stream)
        self._stream: weakref.ref[LocalStream] | None = None  # (to tell its reader it was cut)
        self._superseded = False  # the latest stream is being finished for a new call
        self._ahead: anticipate.Ahead | None = None  # the next prompt's opening, decoding now
        self._tools: tuple[Tools | None, str | None] = (None, None)  # the latest exchange's, for its prompts
        model.sessions.add(self)  # its model's close() ends it

    # -- the face ------------------------------------------------------------------------------
    def stream(self, content: Any, options: GenerationOptions | None = None) -> LocalStream:
        return self.start(said_messages(content), checked_options(options))

    def start(
        self,
        said: list[Message],
        options: GenerationOptions,
        prompt: Prompt | None = None,
        tools: Tools | None = None,
        prefill: Prefill | None = None,
    ) -> LocalStream:
        """``stream`` for the messages an exchange answers and checked options, with its prompt
        if the caller already tokenized the transcript plus ``said`` (a stateless call does, to
        choose the session), made with ``tools`` (the options', checked); owns ``prompt``.
        ``prefill``: the assistant's text the prompt ends with, which the reply continues."""
        began = time.perf_counter()
        latest = self._latest  # (cancelled, a stream dropped in another thread ends its step: waited)
        cancelled = latest is not None and not latest.done and latest.cancelled.is_set()
        with self._guard.waiting(CLOSE_WAIT_S if cancelled else 0):
            if self._abandon is not None:  # an unfinished stream: finished first (another reader is told)
                self._supersede()
                began = time.perf_counter()
            checked = options_tools(options) if prompt is None else tools
            self._tools = (checked, options.tool_format)
            self.messages = editable(self.messages)
            if prompt is None:
                prompt = self._prompter()([*self.messages, *said])
            else:  # made by the caller just before
                began -= prompt.render_s + prompt.tokenize_s
            self._settle(prompt)
            try:
                exchange = self._exchange(said, options, prompt, began, prefill)
            except BaseException:
                prompt.close()
                raise
            stream = LocalStream(self, exchange, self._guard)
            self._latest, self._abandon, self._ended = exchange, stream.abandon, stream.ended
            self._stream = weakref.ref(stream)
            return stream

    def clear_cached_context(self) -> None:
        with self._guard:
            self._quiesce()
            self.model.engine.discard(self.lease)

    def fork(self) -> LocalSession:
        with self._guard:
            self._quiesce()
            twin = LocalSession(self.model, self.asked)
            twin.messages = copy.deepcopy(self.messages)
            twin.replies = self.replies.copy()
            self.model.engine.fork(self.lease, twin.lease)
            return twin

    def save(self, path: str | Path) -> None:
        target = target_file(path)  # a path that cannot be written is refused before any work
        self.messages = editable(self.messages)
        check_messages(self.messages)  # (a message no file can hold, before the state is read)
        with self._guard:
            self._quiesce()
            persistence.save(self.model, self.lease, self.messages, self.settings, target, self.replies)

    def close(self) -> None:
        if self._guard.closed:
            return
        self.shut(model_closing=False)
        if not self.model.closed:
            self.model.engine.release(self.lease)  # (its state, and a small window's context)

    def hand_over(self) -> LocalSession:
        """This conversation and its state in a new session object, this one closed without
        freeing them (``keep_conversation``: the model keeps the new one; this handle, the
        caller's, refuses any later use). An unfinished stream of it is finished first."""
        with self._guard:
            self._quiesce()
            heir = copy.copy(self)
            heir.messages = copy.deepcopy(self.messages)  # (this handle's stays as it is, readable)
            heir._guard, heir._ended, heir._abandon = Guard(), Finishing(), None
            heir._bury = weakref.finalize(heir, self.model.engine.bury, self.lease)
            self._bury.detach()  # (the state is the heir's: dropping this handle frees nothing)
            self.model.sessions.add(heir)
            self._guard.closed = True
            self._guard.refusal = (
                "this session was handed to its model (keep_conversation): the model keeps it"
            )
            return heir

    @property
    def config(self) -> SessionConfig:
        return self._config

    @property
    def settings(self) -> dict[str, Any]:
        """What a saved file keeps of ``config`` (``persistence.SETTINGS``)."""
        return {name: getattr(self, name) for name in persistence.SETTINGS}

    @property
    def cached_tokens(self) -> int:
        return 0 if self.closed else len(self.lease.cache.items)  # (``face``)

    @property
    def idle(self) -> bool:
        """Open, and no stream of it is running (a stateless call may take it): its latest
        exchange done, and the step that finished it over (that step still holds the guard while
        it records the reply and decodes the next prompt's opening ahead)."""
        latest = self._latest
        done = latest is None or latest.done  # (read first: once done, only a new call takes the guard)
        finishing = self._ended.under_way  # (a stream dropped in another thread: finishing there)
        return done and not finishing and not self._guard.closed and not self._guard.lock.locked()

    @property
    def closed(self) -> bool:
        return self._guard.closed

    @property
    def stepping_here(self) -> bool:
        """This thread is inside one of its steps (``shut`` would refuse)."""
        return self._guard.held_here

    def shut(self, *, model_closing: bool = True) -> None:
        """Its model is closing (or, not ``model_closing``, it is): stop the running stream
        (waiting out its current step) and refuse any later use. The transcript stays readable.
        From inside its own step (this thread's), a SessionBusyError: nothing is shut."""
        if self._guard.held_here:
            raise SessionBusyError(STEPPING_HERE)
        self._stop_latest(model_closing)  # (a prefill in another thread stops within a graph node)
        with self._guard.lock:
            self._stop_latest(model_closing)  # (one another thread started meanwhile: it says so too)
            self._quiesce()
            self._guard.closed = True

    def _stop_latest(self, model_closing: bool) -> None:
        latest = self._latest
        if latest is not None and not latest.done:
            latest.model_closed = model_closing  # (its stream then says the model was closed)
            latest.cancelled.set()

    # -- internals ----------------------------------------------------------------------------
    def _prompter(self) -> Callable[[list[Message]], Prompt]:
        """How this session's prompts are made (with its latest exchange's tools): its own
        replies spliced, and other sessions' unless it is kept apart."""
        tools, tool_format = self._tools
        return partial(
            self.model.prompt,
            thinking=self.asked.thinking,  # (as asked: an effort its template reads is rendered)
            own=self.replies,
            shared=self.share_prefix,
            tools=tools,
            tool_format=tool_format,
        )

    def _exchange(
        self,
        said: list[Message],
        options: GenerationOptions,
        prompt: Prompt,
        began: float,
        prefill: Prefill | None = None,
    ) -> Exchange:
        """The exchange for a prompt that fits, with its constraint compiled."""
        if prompt.n_positions >= self.context_size:
            raise ContextOverflowError(
                f"the prompt has {prompt.n_positions} tokens; the context holds {self.context_size} "
                "(one more is needed to reply): a larger context_size, within what kv_tokens gives "
                "a live session, holds it",
                tokens=prompt.n_positions,
                limit=self.context_size - 1,
            )
        model = self.model
        place = Place(model.engine, model.native, self.lease, self.context_size, self.batch_size, self.carry)
        tools = self._tools[0]
        calling = None
        if tools is not None and tools.mode != "none":
            fmt = model.tool_format(options.tool_format)
            calling = Calling(tools, fmt, CallIds(fmt), frozenset(model.special_markers(fmt).values()))
        ids = [calling.ids(k) for k in range(MAX_CALLS)] if calling is not None else []
        held = options.constrained and calling is None
        budget = options.reasoning_budget
        reasoning = thinking(model.native, model.reasoning, prompt, budget, held, calling is not None)
        markup = model.reasoning
        thinks = markup is not None and (self.asked.thinking or markup.markers.always)
        opens = reasoning is not None and not reasoning.prompted and thinks
        thought = markup.grammar_markers if markup and opens else None  # (it may reason, then call)
        after = reasoning is not None and reasoning.prompted  # (the calls' grammar begins after it)
        constraint = model.constraint(options, tools, ids, thought, after_block=after)
        if reasoning is not None and constraint is not None and constraint.opened:
            reasoning.splitter.keep_spaces = True  # (it holds the answer after the reply's block)
        record = weakref.WeakMethod(self._record)  # (the exchange never keeps its session alive)

        def finished(exchange: Exchange, reply: Reply) -> None:
            method = record()
            if method is not None:
                method(exchange, reply, prefill)

        return Exchange(
            place,
            said,
            prompt,
            options,
            constraint,
            finished,
            began=began,
            calling=calling,
            thinking=reasoning,
        )

    def _record(self, exchange: Exchange, reply: Reply, prefill: Prefill | None = None) -> None:
        """A finished exchange: the user message and the reply, as far as it got (after the
        text it continued, if it continued one)."""
        text, tokens = exchange.text, exchange.tokens
        if prefill is not None:
            text, tokens, reply = prefill.text + text, [*prefill.tokens, *tokens], prefill.whole(reply)
        self.model.remember_reply(text, tokens, self.replies, self.share_prefix, exchange.block)
        self.messages = editable(self.messages)  # (a Transcript or tuple set while it ran)
        self.messages += [*exchange.said, cast(Message, assistant_message(reply))]
        if not (self._superseded or exchange.model_closed or not self.looks_ahead):
            self._look_ahead()

    def _supersede(self) -> None:
        """Finish the latest stream for a new call (so no anticipation starts after it); one
        another reader reads is told so at its next step (``readers``)."""
        assert self._abandon is not None and self._latest is not None
        stream = self._stream() if self._stream is not None else None
        if stream is not None and not (self._latest.done or self._latest.cancelled.is_set()):
            stream.cut = not Reader().same(stream.reader)
        abandon, self._abandon, self._superseded = self._abandon, None, True
        try:
            abandon()  # (or, dropped in another thread, it finishes there: waited for)
            self._ended.wait()
        finally:
            self._superseded = False

    def _quiesce(self) -> None:
        """Before the session's memory is used other than by an exchange: finish the latest
        stream and stop any anticipatory prefill."""
        if self._abandon is not None:
            self._supersede()
        self._settle(None)

    def _settle(self, prompt: Prompt | None) -> None:
        """Let a running anticipatory prefill finish if ``prompt`` (the next) begins with what it
        decodes, else stop it; the exchange reports what it reuses of it."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.settle(None if prompt is None else prompt.items)
            self.carry.anticipated = ahead

    def _look_ahead(self) -> None:
        """Start decoding the next prompt's opening in the background (``anticipate``)."""
        model = self.model
        if self._guard.closed or model.closed:
            return
        guess = anticipate.Guess(
            prompt=self._prompter(),
            native=model.native,
            enabled=model.anticipate,
            lease=self.lease,
            messages=[m.copy() for m in self.messages],
            context_size=self.context_size,
            batch_size=self.batch_size,
        )
        alive = weakref.ref(self)
        self._ahead = anticipate.start(model.engine, guess, lambda: alive() is not None)
