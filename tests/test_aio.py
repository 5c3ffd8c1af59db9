"""asyncio: astream and arespond give what the synchronous API gives, never block the event loop,
and cancel through the task within one token."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from typing import Any

import pytest
from near_ties import assert_same_within_noise, scored

from llmsession import GenerationOptions, Model, Reply, SessionBusyError
from llmsession.runtime.aio import AsyncStream

GREEDY = GenerationOptions(max_tokens=24, temperature=0)


def test_astream_and_arespond_equal_the_synchronous_replies(smollm2: Model) -> None:
    """Equal within the measured noise: each session's cells lie elsewhere in the cache."""
    options = scored(GREEDY)
    expected = smollm2.session().respond("Name three rivers.", options)

    async def main() -> tuple[Reply, list[str], Reply]:
        session = smollm2.session()
        stream = session.astream("Name three rivers.", options)
        texts = [snapshot.text async for snapshot in stream]
        assert stream.reply is not None
        other = await smollm2.session().arespond("Name three rivers.", options)
        return stream.reply, texts, other

    streamed, texts, responded = asyncio.run(main())
    assert streamed.text == texts[-1]
    for reply in (streamed, responded):
        assert_same_within_noise(smollm2, reply, expected)


def test_the_event_loop_runs_while_a_reply_decodes(smollm2: Model) -> None:
    async def main() -> tuple[int, float]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.002)
                ticks += 1

        task = asyncio.create_task(ticker())
        reply = await smollm2.session().arespond("Tell me a long story about a lighthouse.", GREEDY)
        task.cancel()
        return ticks, reply.timings.generation_s + reply.timings.prefill_s

    ticks, busy = asyncio.run(main())
    assert ticks >= 10, f"the loop ticked {ticks} times in {busy:.2f} s of decoding"


def test_cancelling_the_task_cancels_within_one_token(smollm2: Model) -> None:
    session = smollm2.session()

    async def main() -> int:
        seen = 0
        stream = session.astream(
            "Count from one to one hundred.", GenerationOptions(max_tokens=200, temperature=0)
        )

        async def consume() -> None:
            nonlocal seen
            async for _ in stream:
                seen += 1

        task = asyncio.create_task(consume())
        deadline = time.monotonic() + 60
        while seen < 3:  # (a reply that ended sooner, or failed, would keep this waiting forever)
            assert not task.done(), f"the stream ended after {seen} snapshots: {task.exception()!r}"
            assert time.monotonic() < deadline, f"{seen} snapshots in 60 s"
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert stream.reply is not None and stream.reply.finish_reason == "cancelled"
        return stream.reply.usage.completion_tokens - seen

    extra = asyncio.run(main())
    assert extra <= 1  # the token in flight when the task was cancelled, at most
    assert session.respond("Still there?", GREEDY).usage.reused_tokens > 0


@pytest.mark.parametrize("how", ["arespond", "aclose"])
def test_a_task_cancelled_twice_ends_once_its_session_is_free(smollm2: Model, how: str) -> None:
    """``asyncio.timeout`` in a cancelled ``TaskGroup`` cancels a task twice: the second cancel
    must not end the task while the step in flight still holds the session (the next call
    raised SessionBusyError)."""
    session = smollm2.session()
    long = "Summarize: " + "the quick brown fox jumps over the lazy dog. " * 70

    async def finish_by_closing() -> None:
        stream = session.astream(long, GREEDY)
        async for _ in stream:
            break
        await stream.aclose()

    async def main() -> None:
        began = asyncio.Event()
        work = session.arespond(long, GREEDY) if how == "arespond" else finish_by_closing()

        async def run() -> None:
            began.set()
            await work

        task = asyncio.create_task(run())
        await began.wait()
        await asyncio.sleep(0.3 if how == "arespond" else 0.05)  # (the prompt decoding)
        for _ in range(2):
            task.cancel()
            await asyncio.sleep(0)
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert session.respond("Hi", GenerationOptions(max_tokens=1, temperature=0)).finish_reason == "length"


def test_closed_before_its_first_step_it_never_starts(smollm2: Model) -> None:
    session = smollm2.session()

    async def main() -> None:
        async with session.astream("Hello", GREEDY) as stream:
            pass
        assert stream.reply is None

    asyncio.run(main())
    assert session.messages == [] and session.cached_tokens == 0

    async def iterated_after(end: str) -> None:  # (it began then: an exchange, cancelled, kept)
        stream = session.astream("Hello", GREEDY)
        if end == "aclose":
            await stream.aclose()
        else:
            stream.cancel()
        assert [snapshot async for snapshot in stream] == [] and stream.reply is None

    for end in ("aclose", "cancel"):
        asyncio.run(iterated_after(end))
    assert session.messages == [] and session.cached_tokens == 0 and astream_threads() == []


def test_bad_options_fail_at_once(smollm2: Model) -> None:
    """A bad option is refused where the stream is made, not in its thread at the first step
    (``achat_stream`` and ``acomplete_stream`` refused it there, as no astream did)."""
    messages = [{"role": "user", "content": "Hello"}]
    with pytest.raises(TypeError):
        smollm2.session().astream("Hello", {"max_tokens": 3})  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        smollm2.achat_stream(messages, {"max_tokens": 3})  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        smollm2.acomplete_stream("Hello", {"max_tokens": 3})  # type: ignore[arg-type]
    assert astream_threads() == []


def astream_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "llmsession-astream"]


def test_a_dropped_stream_is_cancelled_and_its_thread_ends(smollm2: Model) -> None:
    """The bridge's thread waits for the loop to ask for each step; a stream left unfinished
    (a ``break``, then dropped) must not leave it waiting forever, holding the session."""
    session = smollm2.session()

    async def main() -> None:
        stream = session.astream("Count from one to fifty.", GenerationOptions(max_tokens=100))
        async for _ in stream:
            break
        assert len(astream_threads()) == 1  # waiting for the loop to ask for the next step
        del stream

    asyncio.run(main())
    gc.collect()
    deadline = time.monotonic() + 10
    while astream_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert astream_threads() == []
    reply = session.respond("Still there?", GREEDY)
    assert reply.usage.reused_tokens > 0 and session.messages[1]["content"]  # what it said is kept


def test_a_dropped_stream_gives_way_to_the_next_call_at_once(smollm2: Model) -> None:
    """Dropped mid-reply, its thread finishes the step in flight (cancelled); the next call,
    made at once, waits for that step instead of finding the session busy (as a stream
    dropped in the caller's own thread gives way), and the cancelled exchange is kept."""
    session = smollm2.session()

    async def main() -> list[str]:
        replies: list[str] = []
        for _ in range(3):
            stream = session.astream("Count from one to fifty.", GenerationOptions(max_tokens=60))
            await stream.__anext__()
            del stream
            gc.collect()  # (its finalizer cancels it; its thread is still in a step)
            replies.append((await session.arespond("Hi", GREEDY)).finish_reason)
        return replies

    assert len(asyncio.run(main())) == 3  # (SessionBusyError, 3 times in 3, before)
    roles = [m["role"] for m in session.messages]
    assert roles.count("user") == roles.count("assistant") >= 6  # (the cancelled ones, kept)


def test_a_stream_broken_out_of_leaves_the_next_streams_steps_free(smollm2: Model) -> None:
    """``async for ... : break`` leaves the stream to its pump thread, which steps it once more
    or closes it while the next call moves the session on: neither may hold the guard then for
    the next stream's first step (it was SessionBusyError in 11 to 13 of 30 rounds here)."""
    session = smollm2.session()
    options = GenerationOptions(max_tokens=6, temperature=0)

    async def main() -> list[str]:
        ends = []
        for _ in range(20):
            async for _snapshot in session.astream("Tell me a story.", options):
                break
            stream = session.stream("Another one.", options)
            for _snapshot in stream:
                pass
            assert stream.reply is not None
            ends.append(stream.reply.finish_reason)
            del session.messages[:]
        return ends

    ends = asyncio.run(main())
    assert len(ends) == 20 and set(ends) <= {"stop", "length"}, ends


def test_a_close_from_another_thread_returns_once_the_reply_is_recorded(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream closed from another thread while its own step finishes the reply: close returns
    once the transcript holds the turn (its step is waited for), not as soon as the reply is
    done (the variant that returned then read the transcript without it)."""
    from llmsession.runtime.session import LocalSession

    recording = threading.Event()
    real = LocalSession._record

    def slow(self: LocalSession, *args: Any, **kwargs: Any) -> None:
        recording.set()
        time.sleep(0.3)  # (the window between the reply done and the turn in the transcript)
        real(self, *args, **kwargs)

    monkeypatch.setattr(LocalSession, "_record", slow)
    session = smollm2.session()
    stream = session.stream("Name a colour.", GenerationOptions(max_tokens=2, temperature=0))
    reader = threading.Thread(target=lambda: [None for _ in stream])
    reader.start()
    assert recording.wait(30)
    stream.close()
    assert [m["role"] for m in session.messages] == ["user", "assistant"]
    reader.join(30)


def test_the_server_side_of_the_bridge_decodes_on_without_asking(smollm2: Model) -> None:
    """``ahead=None``: the thread decodes to the end while the loop has asked for one snapshot
    only (the server forwards snapshots as they come); ``ahead=0`` waits (the variant)."""
    from llmsession import AsyncStream

    async def taken(ahead: int | None) -> int:
        session = smollm2.session()
        stream = AsyncStream(lambda: session.stream("Name three colours.", GREEDY), ahead=ahead)
        await stream.__anext__()
        await asyncio.sleep(1.0)
        decoded = session.cached_tokens
        await stream.aclose()
        return decoded - len(smollm2.prompt_tokens([{"role": "user", "content": "Name three colours."}]))

    assert asyncio.run(taken(None)) > 2
    assert asyncio.run(taken(0)) <= 1


def test_a_stream_whose_thread_cannot_start_fails_and_closes_at_once(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No thread for the pump (the system's limit reached): the first step raises that error,
    the next ends the stream, and leaving ``async with`` returns (it waited, through every
    cancel, for an end nothing would ever signal). Run on a loop of its own thread, so a hang
    fails the test instead of hanging it."""
    session, outcome = smollm2.session(), list[object]()

    def refused(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    async def main() -> None:
        async with session.astream("Hi", GREEDY) as stream:
            with monkeypatch.context() as patched:
                patched.setattr(threading.Thread, "start", refused)
                with pytest.raises(RuntimeError, match="can't start"):
                    await stream.__anext__()
            with pytest.raises(StopAsyncIteration):
                await stream.__anext__()
        outcome.append("closed")

    runner = threading.Thread(target=lambda: outcome.append(asyncio.run(main())), daemon=True)
    runner.start()
    runner.join(20)
    assert not runner.is_alive() and outcome[0] == "closed", outcome
    assert session.respond("Hi", GenerationOptions(max_tokens=2)).text is not None  # (the session is free)


def test_another_tasks_stream_finished_for_a_call_tells_its_reader(smollm2: Model) -> None:
    """Two tasks on one session: a call from the second while the first reads its stream
    between two steps finishes that stream (as always); the first's ``async for`` ended as if
    the reply were over, and now raises ``SessionBusyError``. A task's own stream left
    unfinished (a ``break``, the stream kept) ends quietly for its next call, as in a thread."""
    session = smollm2.session()
    options = GenerationOptions(max_tokens=6, temperature=0)

    async def main() -> None:
        stream = session.astream("Tell me about Paris.", options)
        await cut_while_read(session, stream, options)
        assert stream.reply is not None and stream.reply.finish_reason == "cancelled"
        kept = session.astream("Again.", options)
        async for _ in kept:
            break
        assert (await session.arespond("More.", options)).text
        assert [snapshot async for snapshot in kept] == []  # (its own: ended quietly)
        assert kept.reply is not None and kept.reply.finish_reason == "cancelled"

    asyncio.run(main())
    said = [m["content"] for m in session.messages if m["role"] == "user"]
    assert said == ["Tell me about Paris.", "Hi", "Again.", "More."], said


def test_a_stream_handed_to_another_task_is_that_tasks(smollm2: Model) -> None:
    """A stream one task began and another reads on: its steps are the reader's (the task that
    asks for them), so the first task's call tells the reader, whose stream it cut; it was
    taken for the first task's own and ended quietly."""
    session = smollm2.session()
    options = GenerationOptions(max_tokens=6, temperature=0)

    async def main() -> None:
        stream = session.astream("Tell me about Paris.", options)
        await stream.__anext__()  # (this task's step)
        await cut_while_read(session, stream, options)

    asyncio.run(main())


async def cut_while_read(session: Any, stream: AsyncStream, options: GenerationOptions) -> None:
    """``stream`` read on by a task of its own, which waits between two steps while this task's
    call finishes the stream: the reader's next step raises ``SessionBusyError``."""
    stepped, go = asyncio.Event(), asyncio.Event()

    async def read() -> None:
        async for _ in stream:
            stepped.set()
            await go.wait()

    reading = asyncio.create_task(read())
    await stepped.wait()
    try:
        assert (await session.arespond("Hi", options)).text
    finally:
        go.set()
    with pytest.raises(SessionBusyError, match="finished by another call"):
        await reading
