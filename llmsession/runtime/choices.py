"""``n`` choices of one prompt (OpenAI's ``n``) that share its prefill: the prompt is decoded
once by a stateless call of one greedy token, then its session is forked ``n`` times (a copy of
the state, not a re-decode) and choice ``i`` answers on fork ``i``, sampling with the options'
seed moved on by ``i`` so the choices differ. Nothing decodes until a choice is first iterated;
the first one prepares, the others wait for it. A choice cancelled before it began ends at
once with a "cancelled" reply; the prefill stops when every choice was cancelled."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from functools import partial

from llmsession.errors import MemoryBudgetError, ModelClosedError
from llmsession.options import GenerationOptions
from llmsession.replies import Reply, Snapshot, Usage
from llmsession.runtime.face import Session, Stream
from llmsession.runtime.session import LocalSession

MAX_CHOICES = 128  # choices of one call (OpenAI's ``n`` is at most 128)
# A choice's answer: on its fork (in this process), from its index and seeded options.
Answer = Callable[[LocalSession, int, GenerationOptions], Stream]


def seeded(options: GenerationOptions, index: int) -> GenerationOptions:
    """Choice ``index``'s options: the seed moved on by the index, so the choices differ."""
    if not index or options.seed is None:
        return options
    return dataclasses.replace(options, seed=(options.seed + index) % 0xFFFFFFFF)


def prefill_options(options: GenerationOptions) -> GenerationOptions:
    """The shared prefill's: one greedy token, no stop (its reply is not kept)."""
    return dataclasses.replace(options, max_tokens=1, temperature=0.0, stop=(), logprobs=None, draft=None)


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
        """Cancel and finish every choice."""
        for stream in self._streams:
            stream.close()


class Lazy(Stream):
    """A choice's stream, made by ``start`` when first iterated (or closed); a cancel before
    that is passed on once it exists, and told to ``cancelled``. ``ended`` runs once, when the
    stream is closed."""

    def __init__(
        self,
        start: Callable[[], Stream],
        ended: Callable[[], None] | None = None,
        cancelled: Callable[[], None] | None = None,
    ) -> None:
        self.session: Session | None = None
        self._start, self._ended, self._told = start, ended, cancelled
        self._stream: Stream | None = None
        self._lock = threading.Lock()
        self._cancelled = self._failed = False

    def _begun(self) -> Stream:
        with self._lock:
            if self._stream is None:
                try:
                    self._stream = self._start()
                except BaseException:
                    self._failed = True
                    raise
                self.session = self._stream.session
                if self._cancelled:
                    self._stream.cancel()
            return self._stream

    @property
    def reply(self) -> Reply | None:
        return self._stream.reply if self._stream is not None else None

    def __next__(self) -> Snapshot:
        return next(self._begun())

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
        try:
            if not self._failed:
                self._begun().close()  # (a choice closed unstarted still ends with a reply)
        finally:
            ended, self._ended = self._ended, None
            if ended is not None:
                ended()


class Forks:
    """The forks of one prefill: ``prefill`` (a stateless call of one token, routed and decoded
    under ``lock``, its tenant's, so that no other call of the tenant takes the session before
    it is forked), then ``n`` forks; choice ``i`` answers on fork ``i`` (``answer``)."""

    def __init__(
        self,
        n: int,
        prefill: Callable[[], Stream],
        answer: Answer,
        options: GenerationOptions,
        lock: threading.RLock,
    ) -> None:
        self.n = n
        self.prompt: Usage | None = None
        self._prefill, self._answer, self._options, self._tenant = prefill, answer, options, lock
        self._once = threading.Lock()  # the first choice prepares; the others wait for it
        self._guard = threading.Lock()  # for cancels, from any thread
        self._stream: Stream | None = None
        self._cancelled: set[int] = set()
        self._sessions: list[LocalSession] | None = None
        self._error: BaseException | None = None

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
        assert self._sessions is not None
        return self._answer(self._sessions[index], index, seeded(self._options, index))

    def _close(self, index: int) -> None:
        with self._once:
            sessions = self._sessions
        if sessions is not None:
            sessions[index].close()

    def _cancel(self, index: int) -> None:
        """Choice ``index`` was cancelled; the prefill stops once every choice was."""
        with self._guard:
            self._cancelled.add(index)
            stream = self._stream if len(self._cancelled) == self.n else None
        if stream is not None:
            stream.cancel()

    def _prepare(self) -> list[LocalSession]:
        with self._tenant:
            stream = self._prefill()
            with self._guard:
                self._stream = stream
                if len(self._cancelled) == self.n:
                    stream.cancel()
            try:
                for _ in stream:
                    pass
            finally:
                stream.close()
            base = stream.session
            assert isinstance(base, LocalSession) and stream.reply is not None
            forks: list[LocalSession] = []
            try:
                while len(forks) < self.n:
                    forks.append(base.fork())
            except BaseException as error:
                for fork in forks:
                    fork.close()
                if isinstance(error, ModelClosedError) and not base.model.closed:  # evicted
                    raise MemoryBudgetError("the prompt's session was evicted before its forks") from None
                raise
        for fork in forks:
            fork.looks_ahead = False  # (closed after its reply: nothing will follow it)
        self.prompt = stream.reply.usage
        return forks
