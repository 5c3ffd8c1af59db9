"""Drafted tokens from the transcript (``GenerationOptions(draft="prompt_lookup")``): a drafted
greedy reply chooses what a fresh teacher-forced decode chooses at every step (token for token
equal to the plain reply where the build has no split noise), ends where the plain reply ends
with memory holding what a plain reply leaves; a verifier that keeps drafts the samples did not
confirm must be caught; the acceptance rule and the drafter's own bookkeeping, on their own."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import internals
import pytest
from test_reuse import batch_noise, check_against_fresh, tolerance_for

from llmsession import GenerationOptions, Model
from llmsession.engine.batching import Batcher
from llmsession.engine.drafting import FIRST_DRAFT, MAX_DRAFT, TRIAL, Drafter, NgramIndex
from llmsession.engine.work import Step

PARAGRAPH = (
    "The lighthouse keeper climbed the narrow stairs every evening at dusk. He cleaned the great "
    "lens, trimmed the wick and wound the clockwork that turned the light. Ships passing the rocks "
    "at night trusted that beam more than any chart, and the keeper knew it."
)
ASK = "Rewrite the following text, replacing 'evening' with 'night'. Output only the rewritten text."
COPY = f"{ASK}\n\n{PARAGRAPH}"


def drafted(**options: Any) -> GenerationOptions:
    return GenerationOptions(temperature=0, draft="prompt_lookup", **options)


def test_a_drafted_greedy_reply_chooses_what_a_fresh_decode_chooses(smollm2: Model) -> None:
    session = smollm2.session(share_prefix=False)
    reply = session.respond(COPY, drafted(max_tokens=60))
    assert reply.usage.accepted_drafts >= 20, reply.usage  # it copied, and the drafts said so
    assert check_against_fresh(session, reply, tolerance_for(batch_noise(smollm2)), final=False) == []
    plain = smollm2.session(share_prefix=False).respond(COPY, GenerationOptions(max_tokens=60, temperature=0))
    assert plain.usage.drafted_tokens == 0
    if batch_noise(smollm2) == 0:
        assert reply.text == plain.text


def test_drafted_steps_batched_beside_another_stream_choose_as_fresh_decodes_do(smollm2: Model) -> None:
    batcher = internals.local(smollm2).engine.batcher
    other, mine = smollm2.session(share_prefix=False), smollm2.session(share_prefix=False)
    replies: dict[str, Any] = {}
    start = threading.Barrier(2)

    def run(name: str, session: Any, prompt: str, options: GenerationOptions) -> None:
        start.wait()
        replies[name] = session.respond(prompt, options)

    batches, steps = batcher.batches, batcher.steps
    threads = [
        threading.Thread(
            target=run,
            args=(
                "other",
                other,
                "Describe the sea at night.",
                GenerationOptions(max_tokens=60, temperature=0),
            ),
        ),
        threading.Thread(target=run, args=("mine", mine, COPY, drafted(max_tokens=60))),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert (batcher.steps - steps) - (batcher.batches - batches) >= 5, "the drafted steps were not batched"
    assert replies["mine"].usage.accepted_drafts >= 20
    tolerance = tolerance_for(batch_noise(smollm2))
    for name, session in (("other", other), ("mine", mine)):
        assert check_against_fresh(session, replies[name], tolerance, final=False) == [], name


def test_keeping_unconfirmed_drafts_is_caught(smollm2: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """The variant that must fail: every draft kept, whatever the samples said."""

    def trusting(step: Step, row: int) -> None:
        assert step.sampler is not None
        step.accepted = len(step.drafts)
        step.token = step.target.sample_row(row, step.sampler)

    # Where the reply copies the paragraph every draft is right; a summary after SmolLM2's default
    # system line ("You are a helpful AI assistant named SmolLM...") drafts that line's words
    # after "... are a" (2026-12-03, AMD EPYC: 13 drafted, 3 tokens unlike a fresh decode).
    questions = ("Summarize the text above in one sentence.", "Name three rivers of France.")
    tolerance = tolerance_for(batch_noise(smollm2))
    caught = []
    for question in questions:
        monkeypatch.setattr(Batcher, "_verify", staticmethod(trusting))
        session = smollm2.session(share_prefix=False)
        reply = session.respond(f"{PARAGRAPH}\n\n{question}", drafted(max_tokens=40))
        monkeypatch.undo()
        assert reply.usage.drafted_tokens > 0
        caught += check_against_fresh(session, reply, tolerance, final=False, at_least=1)
    assert caught != []


def kept_per_step(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many drafts each drafted or plain step of the exchanges to come kept, in order."""
    steps: list[int] = []
    record = Drafter.record

    def recording(self: Drafter, drafted: int, accepted: Sequence[int], seconds: float) -> None:
        steps.append(len(accepted))
        record(self, drafted, accepted, seconds)

    monkeypatch.setattr(Drafter, "record", recording)
    return steps


@pytest.mark.parametrize("end", [{"max_tokens": 13}, {"max_tokens": 80, "stop": ["clockwork"]}])
def test_a_reply_ending_inside_kept_drafts_leaves_memory_as_a_plain_one(
    smollm2: Model, end: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cut by max_tokens or a stop string inside drafts a step kept: the same text and reason as
    the plain reply, memory holding the prompt and every reply token but the last, and the next
    turn right."""
    session = smollm2.session(share_prefix=False)
    steps = kept_per_step(monkeypatch)
    reply = session.respond(COPY, drafted(**end))
    plain = smollm2.session(share_prefix=False).respond(COPY, GenerationOptions(temperature=0, **end))
    assert reply.usage.accepted_drafts > 0
    # The reply's tokens: its first, then each step's kept drafts and its sample; drafts past its
    # end are not accepted ones. (Where it ends inside them depends on how long drafts grew: the
    # drafter judges by time.)
    kinds = [False, *(kind for kept in steps for kind in [True] * kept + [False])]
    assert reply.usage.accepted_drafts == sum(kinds[: reply.usage.completion_tokens]), (steps, reply.usage)
    assert reply.finish_reason == plain.finish_reason and reply.usage.completion_tokens > 5
    if batch_noise(smollm2) == 0:
        assert reply.text == plain.text
    held = len(internals.record(session)) - reply.usage.prompt_tokens - internals.decoded_ahead(session)
    assert held == reply.usage.completion_tokens - 1
    again = session.respond("Now say it in one short sentence.", drafted(max_tokens=24))
    assert (
        check_against_fresh(session, again, tolerance_for(batch_noise(smollm2)), final=False, at_least=8)
        == []
    )


def test_a_stream_closed_mid_reply_says_what_it_drafted(smollm2: Model) -> None:
    """The drafted and accepted counts are the reply's as it goes: a stream closed after a few
    deltas said none (they were copied once the reply ended)."""
    stream = smollm2.session(share_prefix=False).stream(COPY, drafted(max_tokens=60))
    for count, _ in enumerate(stream, 1):
        if count == 12:
            break
    stream.close()
    usage = stream.reply.usage if stream.reply is not None else None
    assert usage is not None and usage.completion_tokens < 60, usage
    assert usage.accepted_drafts > 0 and usage.drafted_tokens >= usage.accepted_drafts, usage


class ScriptedTarget:
    """A sequence whose rows sample as scripted (pure logic: the acceptance rule alone)."""

    def __init__(self, samples: Sequence[int]) -> None:
        self.samples, self.rows, self.dropped = list(samples), list[int](), 0

    def sample_row(self, row: int, sampler: object) -> int:
        self.rows.append(row)
        return self.samples[len(self.rows) - 1]

    def drop_last(self, n_items: int) -> None:
        self.dropped += n_items


@pytest.mark.parametrize(
    ("samples", "accepted", "token"),
    [([5, 6, 7, 8], 3, 8), ([5, 9], 1, 9), ([4], 0, 4), ([5, 6, 1], 2, 1)],
)
def test_drafts_are_kept_while_the_samples_equal_them(samples: list[int], accepted: int, token: int) -> None:
    target = ScriptedTarget(samples)
    step = Step(target, [3], 10, sampler=object(), drafts=[5, 6, 7])  # type: ignore[arg-type]
    Batcher._verify(step, row=20)
    assert (step.accepted, step.token) == (accepted, token)
    assert target.rows == list(range(17, 17 + accepted + 1))  # the sampled token's row, then each draft's
    assert target.dropped == 3 - accepted


def test_the_index_proposes_what_followed_the_longest_earlier_match() -> None:
    index = NgramIndex([1, 2, 3, 4, 5, 9, 2, 3, 7, 8])
    index.extend([1, 2, 3])
    assert index.propose(3) == [4, 5, 9]  # "1 2 3" (not "2 3", which 7 followed later)
    index.extend([6])
    assert index.propose(3) == []  # "3 6" and longer never occurred
    assert NgramIndex([4, 4, 4]).propose(5) == [4]  # the match's own continuation, up to the end


def test_the_drafter_grows_drafts_that_pass_and_stops_when_they_do_not_pay() -> None:
    drafter = Drafter([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2])
    drafter.record(0, [], 0.010)  # a plain step: 10 ms
    assert drafter.propose([3], 99) == [4, 5][:FIRST_DRAFT]
    drafter.record(2, [4, 5], 0.015)
    assert drafter.length == 2 * FIRST_DRAFT
    for _ in range(3):
        drafter.record(drafter.length, [0] * drafter.length, 0.020)
    assert drafter.length == MAX_DRAFT and drafter.on
    slow = Drafter([1, 2, 1])
    slow.record(0, [], 0.010)
    for _ in range(TRIAL):
        slow.record(2, [], 0.025)  # one token for 2.5 plain steps' time
    assert not slow.on and slow.propose([2], 9) == []
