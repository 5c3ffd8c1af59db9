"""asyncio: astream and arespond give what the synchronous API gives, never block the event loop,
and cancel through the task within one token."""

from __future__ import annotations

import asyncio

import pytest
from near_ties import assert_same_within_noise, scored

from llmsession import GenerationOptions, Model, Reply

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
        stream = session.astream("Count from one to one hundred.", GenerationOptions(max_tokens=200))

        async def consume() -> None:
            nonlocal seen
            async for _ in stream:
                seen += 1

        task = asyncio.create_task(consume())
        while seen < 3:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert stream.reply is not None and stream.reply.finish_reason == "cancelled"
        return stream.reply.usage.completion_tokens - seen

    extra = asyncio.run(main())
    assert extra <= 1  # the token in flight when the task was cancelled, at most
    assert session.respond("Still there?", GREEDY).usage.reused_tokens > 0


def test_closed_before_its_first_step_it_never_starts(smollm2: Model) -> None:
    session = smollm2.session()

    async def main() -> None:
        async with session.astream("Hello", GREEDY) as stream:
            pass
        assert stream.reply is None

    asyncio.run(main())
    assert session.messages == [] and session.cached_tokens == 0


def test_bad_options_fail_at_once(smollm2: Model) -> None:
    with pytest.raises(TypeError):
        smollm2.session().astream("Hello", {"max_tokens": 3})  # type: ignore[arg-type]
