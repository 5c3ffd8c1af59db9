"""``n`` choices of one prompt (OpenAI's ``n``) that share its prefill: the prompt is decoded
once by a stateless call of one greedy token, then its session is forked ``n`` times (a copy of
the state, not a re-decode) and choice ``i`` answers on fork ``i``, sampling with the options'
seed moved on by ``i`` so the choices differ. Nothing decodes until a choice is first iterated;
the first one prepares, the others wait for it. The prefill's session joins the kept ones only
once it is forked, so no other call takes it first. A choice cancelled before it began ends at
once with a "cancelled" reply; the prefill stops when every choice was cancelled, and then no
fork is made (each choice's reply is "cancelled" and empty). A choice closed before it began
never begins (its ``reply`` stays None)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from functools import partial

from llmsession.errors import MemoryBudgetError, ModelClosedError
from llmsession.options import GenerationOptions, check_int
from llmsession.replies import Reply, Snapshot, Timings, Usage
from llmsession.runtime.face import Session, Stream
from llmsession.runtime.session import LocalSession
from llmsession.text.tools import replaced_options

MAX_CHOICES = 128  # choices of one call (OpenAI's ``n`` is at most 128)
# A choice's answer: on its fork (in this process), from its index and seeded options.
Answer = Callable[[LocalSession, int, GenerationOptions], Stream]


def seeded(options: GenerationOptions, index: int) -> GenerationOptions:
    """Choice ``index``'s options: the seed moved on by the index, so the choices differ."""
    if not index or options.seed is None:
        return options
    return replaced_options(options, seed=(options.seed + index) % 0xFFFFFFFF)


def prefill_options(options: GenerationOptions) -> GenerationOptions:
    """The shared prefill's: one greedy token, no stop (its reply is not kept)."""
    return replaced_options(options, max_tokens=1, temperature=0.0, stop=(), logprobs=None, draft=None)


class Choices(Sequence[Stream]):
    """``n`` streams of one prompt (``Model.chat_choices``): index it or iterate it for each
    choice's ``Stream``; ``prompt`` is the prompt's usage once it was decoded (the choices'
    own usages count it as reused), None before, and for a model in a worker process, whose
    choices are ``n`` separate stateless calls."""

    def __init__(self, streams: list[Stream], prepared: Callable[[], Usage | None]) -> None:
        self._streams, self._prepared = streams, prepared

    def __len__(self) -> int:
        return len(self._streams)

    def __getitem__(self, index: int) -> Stream:  # type: ignore[override]
        return self._streams[index]

    def __iter__(self) -> Iterator[Stream]:
        return iter(self._streams)

    @property
    def prompt(self) -> Usage | None:
        return self._prepared()

    def cancel(self) -> None:
        """Cancel every choice (thread-safe)."""
        for stream in self._streams:
            stream.cancel()

    def close(self) -> None:
        """Cancel every choice, then finish each (one not begun never begins); the first error
        is raised once all are closed."""
        self.cancel()
        failed: BaseException | None = None
        for stream in self._streams:
            try:
                stream.close()
            except Exception as error:
                failed = failed or error
        if failed is not None:
            raise failed

    def __enter__(self) -> Choices:
        return self

    def __exit__(self, *exc: object) -> None:
        """``close``: every choice cancelled and finished, on any way out of the block."""
        self.close()


def separate(n: int, options: GenerationOptions, call: Callable[[GenerationOptions], Stream]) -> Choices:
    """``n`` choices as ``n`` calls of ``call`` (each seeded, started when first iterated):
    where no session here can be forked (a model in a worker process)."""
    check_int("n", n, 1, MAX_CHOICES)
    return Choices([Lazy(partial(call, seeded(options, i))) for i in range(n)], lambda: None)


class Ended(Stream):
    """A choice whose prefill was cancelled (every choice was): no fork, an empty reply."""

    def __init__(self, usage: Usage) -> None:
        self.session = None
        self._reply = Reply("", "cancelled", usage, Timings())

    @property
    def reply(self) -> Reply | None:
        return self._reply

    def __next__(self) -> Snapshot:
        raise StopIteration

    def cancel(self) -> None:
        pass

    def close(self) -> None:
        pass


class Lazy(Stream):
    """A choice's stream, made by ``start`` when first iterated; a cancel before that is
    passed on once it exists, and told to ``cancelled`` (never blocking: a start may take a
    whole prefill). ``ended`` runs once, when the stream is closed. Closed before it began, it
    never begins."""

    def __init__(
        self,
        start: Callable[[], Stream],
        ended: Callable[[], None] | None = None,
        cancelled: Callable[[], None] | None = None,
    ) -> None:
        self.session: Session | None = None
        self._start, self._ended, self._told = start, ended, cancelled
        self._stream: Stream | None = None
        self._lock = threading.Lock()  # the fields below, briefly
        self._starting = threading.Lock()  # one start at a time
        self._cancelled = self._closed = False
        self._failed: BaseException | None = None  # (raised again by a later call)

    def _begun(self) -> Stream | None:
        with self._starting:
            with self._lock:
                if self._failed is not None:
                    raise self._failed
                if self._stream is not None or self._closed:
                    return self._stream
            try:
                stream = self._start()
            except BaseException as error:
                with self._lock:
                    self._failed = error
                raise
            with self._lock:
                self._stream, cancelled = stream, self._cancelled
            self.session = stream.session
            if cancelled:
                stream.cancel()
            return stream

    @property
    def reply(self) -> Reply | None:
        stream = self._stream
        return stream.reply if stream is not None else None

    def __next__(self) -> Snapshot:
        stream = self._begun()
        if stream is None:
            raise StopIteration
        return next(stream)

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            stream = self._stream
        if stream is not None:
            stream.cancel()
        if self._told is not None:
            self._told()

    def close(self) -> None:
        self.cancel()
        with self._starting, self._lock:  # (a start in flight in another thread ends first)
            stream = self._stream
            self._closed = stream is None  # (not begun: it never will)
        try:
            if stream is not None:
                stream.close()
        finally:
            ended, self._ended = self._ended, None
            if ended is not None:
                ended()


class After(Stream):
    """A fork's stream, its reply's timings counting the prefill before it (``before``): a
    choice's time to first token runs from the choices' call, as an exchange's does from its
    own (it was the fork's alone, the prompt's decode left out)."""

    def __init__(self, stream: Stream, before: Timings) -> None:
        self.session = stream.session
        self._stream, self._before = stream, before
        self._reply: Reply | None = None

    @property
    def reply(self) -> Reply | None:
        if self._reply is None and (reply := self._stream.reply) is not None:
            own, before = reply.timings, self._before
            timings = replace(
                own,
                time_to_first_token_s=before.time_to_first_token_s + own.time_to_first_token_s,
                render_s=before.render_s + own.render_s,
                tokenize_s=before.tokenize_s + own.tokenize_s,
                plan_s=before.plan_s + own.plan_s,
                prefill_s=before.prefill_s + own.prefill_s,
            )
            self._reply = replace(reply, timings=timings)
        return self._reply

    def __next__(self) -> Snapshot:
        return next(self._stream)

    def cancel(self) -> None:
        self._stream.cancel()

    def close(self) -> None:
        self._stream.close()


class Forks:
    """The forks of one prefill: ``prefill`` (a stateless call of one token whose session is
    left out of the kept ones), then ``n`` forks, then ``settle`` (the session kept, or closed);
    choice ``i`` answers on fork ``i`` (``answer``)."""

    def __init__(
        self,
        n: int,
        prefill: Callable[[], Stream],
        answer: Answer,
        options: GenerationOptions,
        settle: Callable[[LocalSession], None],
    ) -> None:
        self.n = n
        self.prompt: Usage | None = None
        self._prefill, self._answer, self._options, self._settle = prefill, answer, options, settle
        self._once = threading.Lock()  # the first choice prepares; the others wait for it
        self._guard = threading.Lock()  # for cancels, from any thread
        self._stream: Stream | None = None
        self._cancelled: set[int] = set()
        self._sessions: list[LocalSession] | None = None
        self._dropped: set[int] = set()  # choices closed before the forks were made
        self._error: BaseException | None = None
        self._before: Timings | None = None  # the prefill's, from the first choice's start

    def choices(self) -> Choices:
        streams: list[Stream] = [
            Lazy(partial(self._start, i), partial(self._close, i), partial(self._cancel, i))
            for i in range(self.n)
        ]
        return Choices(streams, lambda: self.prompt)

    def _start(self, index: int) -> Stream:
        with self._once:
            if self._sessions is None and self._error is None:
                try:
                    self._sessions = self._prepare()
                except BaseException as error:
                    self._error = error
        if self._error is not None:
            raise self._error
        assert self._sessions is not None and self.prompt is not None
        if not self._sessions:  # the prefill was cancelled: no forks
            return Ended(self.prompt)
        stream = self._answer(self._sessions[index], index, seeded(self._options, index))
        return stream if self._before is None else After(stream, self._before)

    def _close(self, index: int) -> None:
        with self._once:
            sessions = self._sessions
            if sessions is None:
                self._dropped.add(index)  # (its fork is closed as soon as it is made)
        if sessions:
            sessions[index].close()

    def _cancel(self, index: int) -> None:
        """Choice ``index`` was cancelled; the prefill stops once every choice was."""
        with self._guard:
            self._cancelled.add(index)
            stream = self._stream if len(self._cancelled) == self.n else None
        if stream is not None:
            stream.cancel()

    def _prepare(self) -> list[LocalSession]:
        """The prefill decoded, then the forks made (none if it was cancelled); its session is
        settled on every path, errors included."""
        begun = time.perf_counter()
        stream = self._prefill()
        base = stream.session
        assert isinstance(base, LocalSession)
        forks: list[LocalSession] = []
        try:
            with self._guard:
                self._stream = stream
                cancelled = len(self._cancelled) == self.n
            if cancelled:
                stream.cancel()
            try:
                for _ in stream:
                    pass
            finally:
                stream.close()
            reply = stream.reply
            assert reply is not None
            while len(forks) < self.n and reply.finish_reason != "cancelled":
                forks.append(base.fork())
        except BaseException as error:
            for fork in forks:
                fork.close()
            forks.clear()
            if isinstance(error, ModelClosedError) and not base.model.closed:  # evicted
                raise MemoryBudgetError("the prompt's session was evicted before its forks") from None
            raise
        finally:
            try:
                self._settle(base)
            except BaseException:
                for fork in forks:
                    fork.close()
                raise
        for index, fork in enumerate(forks):
            fork.looks_ahead = False  # (closed after its reply: nothing will follow it)
            if index in self._dropped:
                fork.close()
        self.prompt, own = reply.usage, reply.timings
        self._before = replace(own, time_to_first_token_s=time.perf_counter() - begun, first_sample_s=0.0)
        return forks
