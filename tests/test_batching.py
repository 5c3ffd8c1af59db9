"""Concurrent streams of one model decode their steps in one batch, and each still answers what it
answers alone (teacher-forced against a fresh decode, within the measured split noise); a batch
that hands a stream another's logits must be caught."""

from __future__ import annotations

import threading
from typing import Any

import internals
import pytest
from test_reuse import batch_noise, check_against_fresh, tolerance_for

from llmsession import GenerationOptions, Model, Reply, Session
from llmsession.native.context import NativeContext

QUESTIONS = (
    "Tell me a story about a lighthouse.",
    "Describe the sea at night.",
    "Write a poem about winter.",
    "Explain how bridges are built.",
)
OPTIONS = GenerationOptions(max_tokens=18, temperature=0, stop=["\n\n\n"])


def run_concurrently(model: Model) -> list[tuple[Session, Reply]]:
    sessions = [model.session() for _ in QUESTIONS]
    replies: list[Any] = [None] * len(sessions)
    start = threading.Barrier(len(sessions))

    def one(i: int) -> None:
        start.wait()
        replies[i] = sessions[i].respond(QUESTIONS[i], OPTIONS)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(sessions))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return list(zip(sessions, replies, strict=True))


def test_concurrent_streams_share_batches_and_each_equals_its_solo_run(smollm2: Model) -> None:
    batcher = internals.local(smollm2).engine.batcher
    batches, steps = batcher.batches, batcher.steps
    answered = run_concurrently(smollm2)
    assert (batcher.steps - steps) / (batcher.batches - batches) > 1.5, "the steps were not batched"
    noise = batch_noise(smollm2)
    for i, (session, reply) in enumerate(answered):
        assert reply.usage.completion_tokens >= 16
        assert check_against_fresh(session, reply, tolerance_for(noise), final=False) == []
        if noise == 0:  # batched with the others, each decodes exactly what it decodes alone
            assert reply.text == smollm2.session().respond(QUESTIONS[i], OPTIONS).text


def test_a_batch_that_mixes_up_the_rows_is_caught(smollm2: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    decode_many = NativeContext.decode_many

    def neighbours_rows(context: NativeContext, runs: Any, outputs: Any = None, **flags: Any) -> list[int]:
        rows = decode_many(context, runs, outputs, **flags)
        return [rows[-1], *rows[:-1]]  # each run sampled from the row of the run before its own

    monkeypatch.setattr(NativeContext, "decode_many", neighbours_rows)
    answered = run_concurrently(smollm2)
    monkeypatch.undo()
    noise = batch_noise(smollm2)
    # A reply that ended at once (its first token, an end, sampled from another's row) is caught
    # too: unmixed, each of these prompts answers at least 16 tokens (the test above).
    problems = [
        check_against_fresh(s, r, tolerance_for(noise), final=False, at_least=1)
        if r.usage.completion_tokens
        else ["ended at once"]
        for s, r in answered
    ]
    assert any(problems)
