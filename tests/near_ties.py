"""Two greedy replies to one transcript made where the build's sums differ (the session's cells
elsewhere in the shared cache, other batches) compared within the measured noise: equal, or
parting at a near tie. Each reply is scored (``logprobs``): where they part, each reply's token
and the other's must be within the tolerance in both replies' scores. A reply the cache got
wrong parts where a fresh decode clearly prefers its own token, and fails."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from test_reuse import short_prompt_noise, tolerance_for

from llmsession import GenerationOptions, Model
from llmsession.replies import Alternative, TokenLogprob

TOP = 5  # alternatives scored per token


def scored(options: GenerationOptions) -> GenerationOptions:
    return replace(options, logprobs=TOP)


def parting_problems(a: Sequence[Any], b: Sequence[Any], tolerance: float) -> list[str]:
    """Where two scored replies (``TokenLogprob`` entries, or the OpenAI client's) part, what is
    not a near tie; nothing if they do not part."""
    parted = [i for i, (x, y) in enumerate(zip(a, b, strict=False)) if bytes(x.bytes) != bytes(y.bytes)]
    if not parted:
        shorter = min(len(a), len(b))
        return [] if len(a) == len(b) else [f"one reply ends after {shorter} tokens, the other does not"]
    index = parted[0]
    x, y = a[index], b[index]
    problems = []
    for mine, theirs in ((x, y), (y, x)):
        alternative = next((t for t in top_of(mine) if bytes(t.bytes) == bytes(theirs.bytes)), None)
        if alternative is None:
            problems.append(f"token {index}: {theirs.token!r} is not among {mine.token!r}'s alternatives")
        elif mine.logprob - alternative.logprob > tolerance:
            gap = mine.logprob - alternative.logprob
            problems.append(f"token {index}: {mine.token!r} beats {theirs.token!r} by {gap:.3f}")
    return problems


def top_of(entry: Any) -> Sequence[Any]:
    return entry.top if isinstance(entry, TokenLogprob) else entry.top_logprobs


def assert_same_within_noise(model: Model, a: Any, b: Any) -> None:
    """Replies (with ``logprobs``) equal where the build has no noise, else parting only at a
    near tie."""
    noise = short_prompt_noise(model)
    if noise == 0:
        assert a.text == b.text
        return
    assert a.logprobs and b.logprobs, "score both replies (``scored``)"
    problems = parting_problems(a.logprobs, b.logprobs, tolerance_for(noise))
    assert problems == [], (a.text, b.text, f"noise {noise:.3f}")


# For a script run in a subprocess (one line, as it is put into indented code): replies' scores.
DUMP = (
    "scored_entries = lambda reply: [[e.token, list(e.bytes), e.logprob, "
    "[[t.token, list(t.bytes), t.logprob] for t in e.top]] for e in reply.logprobs]"
)


def loaded(dumped: Sequence[Any]) -> list[TokenLogprob]:
    """Scored entries from ``DUMP``'s JSON."""
    return [
        TokenLogprob(token, bytes(data), logprob, tuple(Alternative(t, bytes(b), p) for t, b, p in top))
        for token, data, logprob, top in dumped
    ]


def assert_entries_within_noise(model: Model, a: Sequence[TokenLogprob], b: Sequence[TokenLogprob]) -> None:
    noise = short_prompt_noise(model)
    assert a and b, "score both replies"
    if noise == 0:
        assert [e.bytes for e in a] == [e.bytes for e in b]
        return
    assert parting_problems(a, b, tolerance_for(noise)) == [], f"noise {noise:.3f}"
