"""A prompt that arrives while other streams generate is decoded in chunks beside their steps
(chunked prefill), and every sequence still answers what a fresh decode answers (within the
measured split noise); a batch that hands a sequence another's chunk must be caught, and a
sequence llama.cpp refuses fails alone."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import internals
import pytest
from test_reuse import batch_noise, check_against_fresh, paragraph, tolerance_for

from llmsession import GenerationOptions, Model, Reply, Session, Stream
from llmsession.engine.batching import Batcher
from llmsession.engine.chunking import FIRST_CHUNK, MIN_CHUNK, SLOWDOWN, ChunkSizer
from llmsession.engine.work import Step
from llmsession.errors import NativeError
from llmsession.native.context import NativeContext

STREAMING = GenerationOptions(max_tokens=48, temperature=0, stop=["\n\n\n"])
ARRIVING = GenerationOptions(max_tokens=24, temperature=0)
QUESTIONS = ("Tell me a story about a lighthouse.", "Describe the sea at night.")
NEXT = "Now tell me a story about a harbour."  # after a cancelled prompt


def streams_and_a_long_prompt(model: Model, prompt: str) -> list[tuple[Session, Reply]]:
    """Two streams generating; once both have replied a few tokens, a long prompt arrives in
    a third session. Each session with its reply."""
    sessions = [internals.without_look_ahead(model.session()) for _ in range(3)]  # (counted: prompts only)
    replies = streams_and_an_arrival(sessions, lambda session: session.respond(prompt, ARRIVING))
    return list(zip(sessions, replies, strict=True))


def streams_and_an_arrival(sessions: list[Session], arrive: Callable[[Session], Any]) -> list[Any]:
    """The first two sessions stream; once both have replied a few tokens, ``arrive`` runs on
    the third. Their replies, and what ``arrive`` returned."""
    replies: list[Any] = [None] * 3
    started = threading.Barrier(3, timeout=120)  # (a stream that ends early fails, never hangs)

    def stream(i: int) -> None:
        chunks = sessions[i].stream(QUESTIONS[i], STREAMING)
        for count, _ in enumerate(chunks):
            if count == 3:
                started.wait()
        replies[i] = chunks.reply

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    started.wait()
    try:
        replies[2] = arrive(sessions[2])
    finally:
        for thread in threads:
            thread.join()
    return replies


def test_a_prompt_arriving_mid_stream_is_fed_in_chunks_and_equals_fresh(smollm2: Model) -> None:
    batcher = internals.local(smollm2).engine.batcher
    before, batches, mixed = batcher.prompt_tokens, batcher.batches, batcher.mixed
    answered = streams_and_a_long_prompt(smollm2, paragraph(smollm2, 7, 600))
    (_, arriving) = answered[2]
    fed = batcher.prompt_tokens - before
    assert fed >= arriving.usage.prompt_tokens // 2, "the prompt was not decoded beside the streams"
    assert batcher.batches - batches > fed / internals.local(smollm2).engine.config.batch_size + 4, (
        "not in chunks"
    )
    assert batcher.mixed - mixed >= 3, "no slice rode beside the streams' steps"
    tolerance = tolerance_for(batch_noise(smollm2))
    for session, reply in answered:
        assert check_against_fresh(session, reply, tolerance, final=False) == []


def test_cancelling_a_prompt_fed_beside_streams_stops_it_within_a_slice(smollm2: Model) -> None:
    """Cancelled while its slices ride beside two streams, a prompt stops at the slice being
    decoded; the session's next turn answers as a fresh decode does. (That turn asks something
    short: its prompt still holds the whole cancelled one, whose rest it decodes after what the
    cancel left in memory; sending the long prompt again only doubled what both decode.)"""
    batcher, prompt = internals.local(smollm2).engine.batcher, paragraph(smollm2, 9, 600)
    sessions = [internals.without_look_ahead(smollm2.session()) for _ in range(3)]  # (as above)

    def arrive(session: Session) -> tuple[Stream, int]:
        """Once both streams are past their prompts (so every prompt token the batcher counts
        from here is this one's), feed the prompt and cancel it a few slices in."""
        before = batcher.prompt_tokens
        arriving = session.stream(prompt, ARRIVING)
        feeding = threading.Thread(target=lambda: list(arriving))
        feeding.start()
        deadline = time.perf_counter() + 60
        while batcher.prompt_tokens - before < 16 and time.perf_counter() < deadline:
            time.sleep(0.001)
        fed_at_cancel = batcher.prompt_tokens - before
        arriving.cancel()
        feeding.join()
        return arriving, fed_at_cancel

    arriving, fed_at_cancel = streams_and_an_arrival(sessions, arrive)[2]
    assert fed_at_cancel >= 16, "the prompt never went through the batcher"
    reply = arriving.reply
    assert reply is not None and reply.finish_reason == "cancelled"
    decoded = reply.usage.decoded_prompt_tokens
    assert fed_at_cancel <= decoded <= fed_at_cancel + internals.local(smollm2).engine.config.batch_size
    assert decoded < reply.usage.prompt_tokens // 2
    again = sessions[2].respond(NEXT, ARRIVING)
    assert again.usage.prompt_tokens > reply.usage.prompt_tokens  # (it holds the cancelled one)
    assert again.usage.reused_tokens >= decoded  # what the cancel left in memory, built on
    assert check_against_fresh(sessions[2], again, tolerance_for(batch_noise(smollm2)), final=False) == []


def test_a_batch_that_hands_a_sequence_another_s_chunk_is_caught(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The variant that must fail: each prompt chunk beside the streams decoded as another chunk
    (its first token repeated) while the record says it holds its own."""
    decode_many = NativeContext.decode_many

    def swapped(context: NativeContext, runs: Any, outputs: Any = None, **flags: Any) -> list[int]:
        runs = [([t[0]] * len(t) if len(t) > 1 else t, p, q) for t, p, q in runs]
        return decode_many(context, runs, outputs, **flags)

    monkeypatch.setattr(NativeContext, "decode_many", swapped)
    answered = streams_and_a_long_prompt(smollm2, paragraph(smollm2, 8, 600))
    monkeypatch.undo()
    session, reply = answered[2]
    tolerance = tolerance_for(batch_noise(smollm2))
    assert check_against_fresh(session, reply, tolerance, final=False, at_least=1) != []


def test_a_sequence_llama_cpp_refuses_fails_alone(smollm2: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """One stream's step with a position llama.cpp refuses (not its sequence's next) fails the
    batch; the others are decoded again one at a time and answer as a fresh decode does; the
    failed session answers correctly next turn."""
    sessions = [smollm2.session() for _ in range(3)]
    take, victim, spoiled = Batcher._take, sessions[0], threading.Event()

    def spoiling(batcher: Batcher, context: Any) -> list[Step]:
        steps = take(batcher, context)
        mine = [s for s in steps if getattr(s.target, "lease", None) is victim.lease]
        if len(steps) == 3 and mine and not spoiled.is_set():
            mine[0].pos += 5
            spoiled.set()
        return steps

    monkeypatch.setattr(Batcher, "_take", spoiling)
    outcomes: list[Any] = [None] * 3
    start = threading.Barrier(3)

    def one(i: int) -> None:
        start.wait()
        try:
            outcomes[i] = sessions[i].respond(("Hi.", *QUESTIONS)[i], STREAMING)
        except NativeError as error:
            outcomes[i] = error

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    monkeypatch.undo()
    assert spoiled.is_set()
    assert isinstance(outcomes[0], NativeError)
    tolerance = tolerance_for(batch_noise(smollm2))
    for session, reply in zip(sessions[1:], outcomes[1:], strict=True):
        assert isinstance(reply, Reply)
        assert check_against_fresh(session, reply, tolerance, final=False) == []
    again = victim.respond("Hi.", STREAMING)
    assert check_against_fresh(victim, again, tolerance, final=False) == []


def test_the_chunk_keeps_a_mixed_step_near_its_budget() -> None:
    sizer = ChunkSizer()
    assert sizer.allowance(512) == FIRST_CHUNK  # nothing measured yet
    sizer.observe(0, 3, 0.030)  # a generation step: 30 ms
    sizer.observe(32, 3, 0.030 + 32 * 0.001)  # each prompt token added 1 ms
    assert sizer.allowance(512) == int((SLOWDOWN - 1) * 30)
    assert sizer.allowance(20) == 20  # never more than the batch holds
    sizer.observe(8, 3, 10.0)  # a model far slower per token: the chunk shrinks, not below the floor
    for _ in range(20):
        sizer.observe(8, 3, 10.0)
    assert sizer.allowance(512) == MIN_CHUNK
    sizer.observe(16, 0, 0.5)  # a prompt alone says nothing about the streams' steps
    assert sizer.allowance(512) == MIN_CHUNK
    # Mixed steps no slower than a plain one (a GPU, or noise) add nothing: after ~2,000 in a
    # row the added time was a denormal, the allowance's int() of infinity an OverflowError in
    # the loop's every later batch (every stream beside another failed until the model closed).
    allowances = []
    for _ in range(2200):
        sizer.observe(32, 3, 0.001)
        allowances.append(sizer.allowance(512))  # (each step's: it raised from ~1,970 on)
    assert allowances == sorted(allowances) and allowances[-1000:] == [512] * 1000
    assert sizer.token_s is not None and sizer.token_s < 1e-300  # (a denormal, for good)
