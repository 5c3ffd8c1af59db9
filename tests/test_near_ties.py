"""The comparison of two replies within noise: equal replies pass; replies that part at a near
tie pass; replies that part where one token clearly wins, or end apart, fail."""

from __future__ import annotations

from near_ties import loaded, parting_problems

from llmsession.replies import Alternative, TokenLogprob


def entry(token: str, logprob: float, *others: tuple[str, float]) -> TokenLogprob:
    top = ((token, logprob), *others)
    return TokenLogprob(token, token.encode(), logprob, tuple(Alternative(t, t.encode(), p) for t, p in top))


def test_equal_replies_pass() -> None:
    reply = [entry("The", -0.1, ("A", -2.0)), entry(" sea", -0.2)]
    assert parting_problems(reply, list(reply), 0.5) == []


def test_replies_that_part_at_a_near_tie_pass() -> None:
    a = [entry("The", -0.1), entry(" sea", -1.00, (" ocean", -1.10)), entry(" is", -0.1)]
    b = [entry("The", -0.1), entry(" ocean", -1.02, (" sea", -1.05)), entry(" was", -0.3)]
    assert parting_problems(a, b, 0.5) == []  # (after the parting they answer other texts)


def test_a_clear_winner_fails() -> None:
    a = [entry("The", -0.1), entry(" sea", -0.2, (" ocean", -3.0))]
    b = [entry("The", -0.1), entry(" ocean", -1.0, (" sea", -1.2))]
    assert parting_problems(a, b, 0.5) == ["token 1: ' sea' beats ' ocean' by 2.800"]


def test_a_token_missing_from_the_alternatives_fails() -> None:
    a = [entry(" sea", -0.2, (" lake", -0.3))]
    b = [entry(" ocean", -1.0, (" sea", -1.2))]
    assert parting_problems(a, b, 0.5) == ["token 0: ' ocean' is not among ' sea''s alternatives"]


def test_replies_that_end_apart_fail() -> None:
    a = [entry("The", -0.1)]
    problems = parting_problems(a, [*a, entry(" sea", -0.2)], 0.5)
    assert problems == ["one reply ends after 1 tokens, the other does not"]


def test_scores_from_a_subprocess_load_back() -> None:
    dumped = [["The", list(b"The"), -0.1, [["The", list(b"The"), -0.1], ["A", list(b"A"), -2.0]]]]
    assert loaded(dumped) == [entry("The", -0.1, ("A", -2.0))]
