"""Sessions and their shadow transcripts, and one checked call on a session: ``respond``, or a
stream taken in one of the ways a caller may take one (broken off, closed, dropped, cancelled,
superseded, interleaved with another session's call)."""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import internals
from fuzz_env import STATS, env
from fuzz_inputs import GREEDY_ONE, TYPED, Message
from fuzz_oracle import Pending, Taken, check_ended, check_reply, check_settled, copy_message, expect

from llmsession import ContextOverflowError, GenerationOptions, MemoryBudgetError, Reply, Session, Stream


def in_threads(*calls: Callable[[], object]) -> None:
    """Run each call in its own thread, all at once; re-raise the first failure here."""
    errors: list[BaseException] = []

    def run(call: Callable[[], object]) -> None:
        try:
            call()
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def check_untouched(
    session: Session, cached_before: int, context_before: tuple[str, int], *, concurrent: bool
) -> None:
    """A refused call changed nothing of its session's memory; while another session's exchange
    runs (``concurrent``), that one may have evicted it, idle as it was: parked, or cold."""
    cached, where = session.cached_tokens, internals.placement(session)
    if (cached, where) == (cached_before, context_before):
        return
    evicted = (where[0] == "parked" and cached == cached_before) or (where[0] == "cold" and cached == 0)
    assert concurrent and evicted, (cached, where, cached_before, context_before)


class ShadowedSessions:
    """Sessions on one model, a shadow transcript for each, and the stream each may have left
    pending. The state machine's base: its rules act through these methods."""

    def __init__(self) -> None:
        super().__init__()
        self.sessions: list[Session] = []
        self.expected: list[list[Message]] = []
        self.pending: list[Pending | None] = []
        self.timed: tuple[str, float] | None = None

    def note(self, rule_name: str, /, **details: Any) -> None:
        """Count a step (its time runs to the next invariant check) and log it."""
        self.timed = (rule_name, time.perf_counter())
        STATS.steps += 1
        STATS.rules[rule_name] += 1
        log = env().log
        if log is not None:
            shown = ", ".join(f"{k}={v!r}"[:160] for k, v in details.items())
            log.write(f"example {STATS.examples} step {STATS.steps}: {rule_name}({shown})\n")
            log.flush()

    def end_step(self) -> None:
        """Charge the time since the last ``note`` to its rule (the invariant runs after each step)."""
        if self.timed is not None:
            name, started = self.timed
            STATS.seconds[name] += time.perf_counter() - started
            self.timed = None

    def every_sequence_held(self, i: int, beside: int | None, error: MemoryBudgetError) -> None:
        """A valid call refused for memory: only when exchanges hold every sequence, a started
        stream left pending on a third session and the call running beside (the fuzzer's model
        has two sequences)."""
        third = [
            k
            for k, p in enumerate(self.pending)
            if p is not None and k not in (i, beside) and internals.started(p.stream)
        ]
        assert beside is not None and third, f"a valid call raised {error!r}"
        assert "2 sequences" in str(error), error

    def settle(self, i: int) -> Pending | None:
        """The next valid call on session i finishes its pending stream first: shadow that."""
        pending = self.pending[i]
        if pending is not None:
            self.pending[i] = None
            self.expected[i] += [pending.user, {"role": "assistant", "content": pending.text}]
        return pending

    def close_pending(self, i: int) -> None:
        pending = self.settle(i)
        if pending is not None:
            pending.stream.close()
            check_settled(pending, closed=True)

    def exchange(
        self,
        i: int,
        content: Any,
        options: GenerationOptions,
        mode: str = "respond",
        k: int = 0,
        delay: float = 0.0,
        other: int = 0,
        alongside: Sequence[object] = (),
        beside: int | None = None,
    ) -> Reply | None:
        """One call on session i in the given mode, checked against the expectation
        (``alongside``: the prompt of a call on session ``beside`` running meanwhile)."""
        session = self.sessions[i]
        pending = self.settle(i)  # a valid call finishes a pending stream first
        user = {"role": "user", "content": content}
        record = internals.record(session)
        expectation = expect(session, self.expected[i], user, alongside)
        cached_before, context_before = session.cached_tokens, internals.placement(session)
        stream: Stream | None = None
        reply: Reply | None = None
        try:
            if mode == "respond":
                reply = session.respond(content, options)
            else:
                stream = session.stream(content, options)
        except TYPED as error:
            check_settled(pending)
            STATS.outcomes[f"error {type(error).__name__}"] += 1
            if expectation.error is not None:
                assert isinstance(error, expectation.error), (error, expectation)
            elif isinstance(error, MemoryBudgetError):
                self.every_sequence_held(i, beside, error)
            else:
                assert expectation.overflow, f"a valid call raised {error!r}"
                assert isinstance(error, ContextOverflowError), error
            check_untouched(session, cached_before, context_before, concurrent=bool(alongside))
            return None
        check_settled(pending)
        if pending is not None:  # the call finished it: its reply's tokens splice as they were decoded
            expectation = expect(session, self.expected[i], user, alongside, record)
        assert expectation.error is None, f"expected {expectation.error}, the call succeeded"
        assert not expectation.overflow, f"the prompt does not fit, yet no error: {expectation}"
        user = copy_message(user)
        natural = ("stop", "length", "complete") if options.constrained else ("stop", "length")
        if stream is None:
            assert reply is not None
            check_reply(
                session, reply, options, expectation, text=None, finishes=natural, cached_before=cached_before
            )
            self.expected[i] += [user, {"role": "assistant", "content": reply.text}]
            return reply

        taken = Taken(stream)
        finishes: tuple[str, ...]
        cancelled_or_natural = ("cancelled", "stop", "length")
        if mode in ("exhaust", "timer"):
            timer = threading.Timer(delay, stream.cancel) if mode == "timer" else None
            if timer is not None:
                timer.start()
            try:
                taken.take(None)
            except MemoryBudgetError as error:  # (a stream takes its sequence at its first step)
                assert not taken.text and stream.reply is None, (error, taken.text)
                self.every_sequence_held(i, beside, error)
                STATS.outcomes[f"error {type(error).__name__}"] += 1
                check_untouched(session, cached_before, context_before, concurrent=bool(alongside))
                return None
            finally:
                if timer is not None:
                    timer.cancel()
                    timer.join()
            finishes = natural if timer is None else cancelled_or_natural
        else:
            taken.take(k)
            # A stream that ran out before k snapshots finished by itself; else it is cut short.
            finishes = natural if taken.ended else ("cancelled",)
            if mode == "break":
                if stream.reply is None:
                    self.pending[i] = Pending(stream, user, taken.text, options, expectation, cached_before)
                    return None
            elif mode == "close":
                stream.close()
            elif mode == "drop":
                turn = stream.exchange
                gone = weakref.ref(stream)
                del stream, taken.stream
                assert gone() is None, "something still holds the dropped stream"
                finished = turn.reply
                assert finished is not None, "dropping the stream did not finish the exchange"
                check_reply(
                    session,
                    finished,
                    options,
                    expectation,
                    text=taken.text,
                    finishes=finishes,
                    cached_before=cached_before,
                )
                self.expected[i] += [user, {"role": "assistant", "content": finished.text}]
                return finished
            elif mode == "with":
                with stream:
                    pass
            elif mode == "cancel":
                stream.cancel()
                stream.cancel()  # idempotent
                taken.take(None)  # the tail the stop matcher held back may still come
                finishes = cancelled_or_natural
            elif mode == "interleave":
                j = (i + 1 + other % 2) % len(self.sessions)
                self.exchange(j, "Meanwhile, a short question.", GREEDY_ONE)
                if not internals.started(stream):  # (its prompt is planned at its first step, when
                    expectation = expect(session, self.expected[i], user, record=record)  # j's cells are)
                taken.take(None)
                finishes = natural
            elif mode in ("supersede", "supersede from a thread"):
                if stream.reply is None:  # a new call finishes it first, from any thread
                    self.pending[i] = Pending(stream, user, taken.text, options, expectation, cached_before)
                    call = functools.partial(self.exchange, i, "And then?", GREEDY_ONE)
                    if mode == "supersede":
                        call()
                    else:
                        in_threads(call)
                    check_ended(stream, told=mode != "supersede")
                    return None
            elif mode == "clear mid-stream":
                session.clear_cached_context()
                assert session.cached_tokens == 0 and internals.placement(session)[0] == "cold"
                taken.take(None)
            else:
                raise AssertionError(mode)
        reply_or_none = stream.reply
        assert reply_or_none is not None, f"the stream ({mode}) did not finish its exchange"
        assert list(stream) == [], "a finished stream yielded more"
        check_reply(
            session,
            reply_or_none,
            options,
            expectation,
            text=taken.text,
            finishes=finishes,
            cached_before=cached_before,
            check_cache=mode != "clear mid-stream",
        )
        self.expected[i] += [user, {"role": "assistant", "content": reply_or_none.text}]
        return reply_or_none
