"""StopMatcher: any split of the text cuts at the earliest stop, holding back only what must."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmsession.stops import StopMatcher

# Small alphabets so stops overlap, nest and occur often; one includes multi-code-unit
# and combining characters.
ALPHABETS = ["ab", "abc", "a<>/s", "aé😀\u0301"]


@st.composite
def case(draw: st.DrawFn) -> tuple[list[str], list[str]]:
    """A stop list and pushes whose alphabet makes matches likely."""
    alphabet = draw(st.sampled_from(ALPHABETS))
    stops = draw(st.lists(st.text(alphabet, min_size=1, max_size=5), max_size=4))
    text = draw(st.text(alphabet, max_size=30))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=len(text) + 2)))
    bounds = [0, *cuts, len(text)]
    return stops, [text[a:b] for a, b in pairwise(bounds)]


def first_stop(text: str, stops: list[str]) -> int | None:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found, default=None)


def longest_partial(text: str, stops: list[str]) -> str:
    """The longest suffix of text that is a proper prefix of some stop (brute force)."""
    for start in range(len(text) + 1):
        tail = text[start:]
        if any(len(tail) < len(s) and s.startswith(tail) for s in stops):
            return tail
    return ""


@given(case())
def test_output_is_text_up_to_earliest_stop(args: tuple[list[str], list[str]]) -> None:
    stops, pushes = args
    full = "".join(pushes)
    cut = first_stop(full, stops)
    matcher = StopMatcher(stops)
    out = "".join(matcher.push(p) for p in pushes) + matcher.flush()
    assert out == (full if cut is None else full[:cut])
    assert matcher.stopped == (cut is not None)


@given(case())
def test_holds_back_exactly_what_may_start_a_stop(args: tuple[list[str], list[str]]) -> None:
    stops, pushes = args
    matcher = StopMatcher(stops)
    seen = emitted = ""
    for piece in pushes:
        was_stopped = matcher.stopped
        seen += piece
        out = matcher.push(piece)
        if was_stopped:
            assert out == ""
        emitted += out
        cut = first_stop(seen, stops)
        if matcher.stopped:
            assert cut is not None
            assert emitted == seen[:cut]
            continue
        assert seen.startswith(emitted)
        held = seen[len(emitted) :]
        assert held == longest_partial(seen, stops)
        # Stop as soon as no earlier partial match could still complete.
        assert cut is None or len(emitted) < cut


@given(st.text(max_size=50), st.lists(st.text(max_size=50), max_size=5))
def test_no_stops_passes_everything_through(text: str, pushes: list[str]) -> None:
    matcher = StopMatcher([])
    assert [matcher.push(p) for p in [text, *pushes]] == [text, *pushes]
    assert matcher.flush() == ""
    assert not matcher.stopped


def test_stop_arriving_in_pieces() -> None:
    matcher = StopMatcher(["</s>"])
    assert matcher.push("Hi<") == "Hi"
    assert matcher.push("/") == ""
    assert not matcher.stopped
    assert matcher.push("s>tail") == ""
    assert matcher.stopped
    assert matcher.push("more") == ""
    assert matcher.flush() == ""


def test_false_start_is_released() -> None:
    matcher = StopMatcher(["</s>"])
    assert matcher.push("a</") == "a"
    assert matcher.push("b") == "</b"
    assert matcher.push("<") == ""
    assert matcher.flush() == "<"
    assert not matcher.stopped


def test_overlapping_stops_cut_at_earliest_start() -> None:
    matcher = StopMatcher(["b", "ab"])
    assert matcher.push("xa") == "x"
    assert matcher.push("b") == ""
    assert matcher.stopped


def test_nested_stop_waits_for_longer_one() -> None:
    matcher = StopMatcher(["abcd", "bc"])
    assert matcher.push("xabc") == "x"
    assert not matcher.stopped
    assert matcher.push("d") == ""
    assert matcher.stopped


def test_nested_stop_fires_when_longer_one_fails() -> None:
    matcher = StopMatcher(["abcd", "bc"])
    assert matcher.push("abc") == ""
    assert matcher.push("x") == "a"
    assert matcher.stopped


def test_flush_cuts_at_pending_stop() -> None:
    matcher = StopMatcher(["abcd", "bc"])
    assert matcher.push("abc") == ""
    assert matcher.flush() == "a"
    assert matcher.stopped


def test_rejects_empty_stop() -> None:
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        StopMatcher(["ok", ""])


def test_rejects_bare_string() -> None:
    with pytest.raises(TypeError):
        StopMatcher("</s>")
