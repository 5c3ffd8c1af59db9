"""``logprobs`` on the real model: each reply token's score is what a fresh decode of the same
transcript gives it (within the measured split noise), alone and batched beside other streams;
the scores' strings join up to the reply's text, streamed or whole, cut by a stop string or held
to a schema."""

from __future__ import annotations

import itertools
import json
import threading
from dataclasses import replace
from typing import Any

import internals
import numpy as np
from test_reuse import batch_rows, fresh_logits, fresh_steps, measured_once, paragraph, tolerance_for

from llmsession import GenerationOptions, Model, Reply, Session

SCORED = GenerationOptions(max_tokens=12, temperature=0, logprobs=3)


def log_softmax(row: np.ndarray) -> np.ndarray:
    row = row.astype(np.float64)
    peak = row.max()
    return row - (peak + np.log(np.exp(row - peak).sum()))


@measured_once(layout=True)
def score_noise(model: Model) -> float:
    """The largest difference in the likeliest 20 tokens' log-probabilities between decodes of
    one prompt cut into batches differently (its last tokens decoded one at a time among them),
    or batched beside other sequences: the scores' share of the split noise the other
    differential tests measure."""
    tokens = model.prompt_tokens([{"role": "user", "content": paragraph(model, 0, 300)}])
    n = len(tokens)
    splits = ((), (n - 1,), tuple(range(64, n, 64)), tuple(range(n - 24, n)))  # the last: as generated
    rows = [log_softmax(fresh_logits(model, tokens, list(s))) for s in splits]
    rows += [log_softmax(row) for row in batch_rows(model)]
    top = np.argsort(-rows[0])[:20]
    return max(float(np.abs(a[top] - b[top]).max()) for a, b in itertools.combinations(rows, 2))


def scored_against_fresh(session: Session, reply: Reply, tolerance: float) -> list[str]:
    """Each step where the reply's score of its token, or of its likeliest alternative, is not
    within ``tolerance`` of a fresh teacher-forced decode's."""
    recorded = [int(t) for t in internals.record(session)]
    prompt, generated = recorded[: reply.usage.prompt_tokens], recorded[reply.usage.prompt_tokens :]
    steps = fresh_steps(session.model, tuple(prompt), tuple(generated), len(generated))
    problems = []
    for step, entry in enumerate(reply.logprobs or ()):
        fresh = log_softmax(steps[step])
        # (the reply's last token is in memory only if the next prompt's opening was decoded
        # after it: else only its likeliest alternative is compared)
        if step < len(generated) and abs(entry.logprob - fresh[generated[step]]) > tolerance:
            problems.append(f"step {step}: scored {entry.logprob:.3f}, fresh {fresh[generated[step]]:.3f}")
        if abs(entry.top[0].logprob - fresh.max()) > tolerance:
            problems.append(f"step {step}: best {entry.top[0].logprob:.3f}, fresh {fresh.max():.3f}")
    return problems


def check_shape(reply: Reply, top: int) -> None:
    entries = reply.logprobs
    assert entries is not None and len(entries) == reply.usage.completion_tokens
    assert "".join(e.token for e in entries) == reply.text
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top) == top
        assert [a.logprob for a in entry.top] == sorted((a.logprob for a in entry.top), reverse=True)
        assert entry.bytes == entry.top[0].bytes  # a greedy pick is the likeliest token
        assert sum(np.exp(a.logprob) for a in entry.top) <= 1 + 1e-6


def test_each_token_is_scored_as_a_fresh_decode_scores_it(smollm2: Model) -> None:
    session = smollm2.session("Answer briefly.")
    reply = session.respond("Name three colours.", SCORED)
    check_shape(reply, 3)
    tolerance = tolerance_for(score_noise(smollm2))
    assert scored_against_fresh(session, reply, tolerance) == []
    assert GenerationOptions(max_tokens=4, temperature=0).logprobs is None
    assert session.respond("And one more?", replace(SCORED, logprobs=None)).logprobs is None


def test_alternatives_are_spelled_as_the_chosen_token_is_inside_a_character(smollm2: Model) -> None:
    """SmolLM2 writes Japanese in tokens that end inside a character: the chosen one says ""
    there (the next completes it), and so do its alternatives, which after it name the whole
    character they would have finished; a greedy pick reads exactly as its likeliest one."""
    reply = smollm2.session("Answer briefly.").respond("Say hello in Japanese.", SCORED)
    check_shape(reply, 3)
    entries = reply.logprobs or ()
    inside = [i for i, e in enumerate(entries) if e.token == "" and e.bytes]
    assert inside and inside[0] + 1 < len(entries), reply  # (the test needs such a token)
    for entry in entries:
        assert entry.token == entry.top[0].token  # (before: the alternative said "\ufffd")
        assert all("\ufffd" not in a.token for a in entry.top), entry
    finished = entries[inside[0] + 1].top
    assert all(len(a.token) >= 1 and ord(a.token[0]) > 0x7F for a in finished if a.bytes[0] >= 0x80)


def test_scores_one_step_off_are_caught(smollm2: Model) -> None:
    session = smollm2.session("Answer briefly.")
    reply = session.respond("Name three colours.", SCORED)
    entries = reply.logprobs or ()
    shifted = replace(reply, logprobs=(*entries[1:], entries[0]))  # each step given the next one's
    assert scored_against_fresh(session, shifted, tolerance_for(score_noise(smollm2)))


def test_streams_batched_together_each_score_their_own_rows(smollm2: Model) -> None:
    questions = ("Describe the sea.", "Explain rain.", "Write about winter.")
    sessions = [smollm2.session() for _ in questions]
    replies: list[Any] = [None] * len(sessions)
    start = threading.Barrier(len(sessions))
    batcher = internals.local(smollm2).engine.batcher
    batches, steps = batcher.batches, batcher.steps

    def one(i: int) -> None:
        start.wait()
        replies[i] = sessions[i].respond(questions[i], replace(SCORED, max_tokens=16))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(sessions))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert batcher.steps - steps > batcher.batches - batches, "the steps were not batched"
    tolerance = tolerance_for(score_noise(smollm2))
    for session, reply in zip(sessions, replies, strict=True):
        check_shape(reply, 3)
        assert scored_against_fresh(session, reply, tolerance) == []


def test_a_stream_hands_out_the_scores_of_its_text(smollm2: Model) -> None:
    with smollm2.session().stream(
        "Count from one to ten in words.", replace(SCORED, max_tokens=24)
    ) as stream:
        streamed = [entry for snapshot in stream for entry in snapshot.logprobs]
    reply = stream.reply
    assert reply is not None and tuple(streamed) == reply.logprobs
    check_shape(reply, 3)


def test_a_stop_string_cuts_the_scores_where_it_cuts_the_text(smollm2: Model) -> None:
    question = "Describe a lighthouse in one sentence."
    whole = smollm2.session().respond(question, replace(SCORED, max_tokens=16))
    stop = whole.text[6:9]  # (ends inside a token, most likely)
    cut = smollm2.session().respond(question, replace(SCORED, max_tokens=16, stop=(stop,)))
    assert cut.finish_reason == "stop" and cut.text == whole.text[: whole.text.index(stop)]
    entries, full = cut.logprobs or (), whole.logprobs or ()
    assert "".join(e.token for e in entries) == cut.text
    assert entries[:-1] == full[: len(entries) - 1]
    assert full[len(entries) - 1].token.startswith(entries[-1].token)
    assert entries[-1].logprob == full[len(entries) - 1].logprob


def test_tokens_a_schema_forces_score_zero(smollm2: Model) -> None:
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}}, "required": ["colour"]}
    reply = smollm2.session().respond("Pick a colour.", replace(SCORED, max_tokens=40, json_schema=schema))
    entries = reply.logprobs or ()
    assert reply.finish_reason == "complete" and json.loads(reply.text)["colour"] in ("red", "green")
    assert "".join(e.token for e in entries) == reply.text
    assert any(e.logprob == 0.0 and e.top[0].logprob == 0.0 for e in entries)  # forced: the only choice
    assert all(e.logprob <= 0 for e in entries)
