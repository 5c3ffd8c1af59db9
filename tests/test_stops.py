"""StopMatcher: any split of the text cuts at the earliest stop, holding back only what must."""

from __future__ import annotations

import time
import tracemalloc
from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmsession.text.stops import StopMatcher

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


def fibonacci_word(n: int) -> str:
    """The first n characters of "abaababaabaab…", whose borders nest as deep as KMP's can."""
    a, b = "a", "ab"
    while len(b) < n:
        a, b = b, b + a
    return b[:n]


@st.composite
def long_stop(draw: st.DrawFn, alphabet: str) -> str:
    """A stop of up to ~80 characters whose prefixes recur: head + unit * n + tail ("ab" * n + "c",
    "aaaa…b"), a Fibonacci word, or a string grown by appending its own prefixes. A wrong KMP
    failure value only shows up on such borders."""
    chars = st.text(alphabet, max_size=3)
    kind = draw(st.sampled_from(["periodic", "fibonacci", "nested"]))
    if kind == "periodic":
        unit = draw(st.text(alphabet, min_size=1, max_size=3))
        return draw(chars) + unit * draw(st.integers(2, 25)) + draw(chars)
    if kind == "fibonacci":
        return fibonacci_word(draw(st.integers(2, 60))) + draw(st.text(alphabet, max_size=1))
    stop = draw(st.text(alphabet, min_size=1, max_size=3))
    for _ in range(draw(st.integers(1, 5))):
        stop += stop[: draw(st.integers(0, len(stop)))] + draw(st.text(alphabet, max_size=1))
    return stop[:80]


@st.composite
def periodic_case(draw: st.DrawFn) -> tuple[list[str], list[str]]:
    """Long periodic stops and text made of their prefixes, each followed by a character that may
    break the match, split at random."""
    alphabet = draw(st.sampled_from(["ab", "abc"]))
    stops = draw(st.lists(long_stop(alphabet), min_size=1, max_size=3))
    prefix = st.sampled_from(stops).flatmap(lambda s: st.integers(1, len(s)).map(lambda n: s[:n]))
    fragment = st.tuples(prefix, st.text(alphabet, max_size=1)).map("".join)
    text = "".join(draw(st.lists(fragment | st.text(alphabet, max_size=3), max_size=6)))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=10)))
    bounds = [0, *cuts, len(text)]
    return stops, [text[a:b] for a, b in pairwise(bounds)]


def first_stop(text: str, stops: list[str]) -> int | None:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found, default=None)


def longest_partial(text: str, stops: list[str]) -> str:
    """The longest suffix of text that is a proper prefix of some stop (brute force)."""
    longest = max(map(len, stops), default=0)
    for start in range(max(0, len(text) - longest), len(text) + 1):
        tail = text[start:]
        if any(len(tail) < len(s) and s.startswith(tail) for s in stops):
            return tail
    return ""


@given(st.one_of(case(), periodic_case()))
def test_output_is_text_up_to_earliest_stop(args: tuple[list[str], list[str]]) -> None:
    stops, pushes = args
    full = "".join(pushes)
    cut = first_stop(full, stops)
    matcher = StopMatcher(stops)
    out = "".join(matcher.push(p) for p in pushes) + matcher.flush()
    assert out == (full if cut is None else full[:cut])
    assert matcher.stopped == (cut is not None)
    # the stop it names starts there, and is the first to complete of those that do
    starting = [s for s in stops if cut is not None and full.startswith(s, cut)]
    assert matcher.matched == (min(starting, key=len) if starting else None)


@given(st.one_of(case(), periodic_case()))
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


@given(st.sampled_from(["ab", "abc"]).flatmap(lambda a: st.lists(long_stop(a), min_size=1, max_size=2)))
def test_every_transition_of_long_periodic_stops(stops: list[str]) -> None:
    """After any proper prefix of a stop and then any one character, the held tail and the cut
    match brute force: every state and transition of each KMP automaton, failure values included."""
    alphabet = sorted(set("".join(stops)))
    for stop in stops:
        for k in range(len(stop)):
            for ch in alphabet:
                matcher = StopMatcher(stops)
                text = stop[:k] + ch
                emitted = matcher.push(stop[:k]) + matcher.push(ch)
                cut = first_stop(text, stops)
                if matcher.stopped:
                    assert cut is not None
                    assert emitted == text[:cut]
                else:
                    assert text.startswith(emitted)
                    assert text[len(emitted) :] == longest_partial(text, stops)
                    assert cut is None or len(emitted) < cut
                    emitted += matcher.flush()
                    assert emitted == (text if cut is None else text[:cut])


def test_long_stop_costs_linear_memory_and_time() -> None:
    """Storing every prefix of a 60,000-character stop took ~1.8 GB and seconds to build."""
    stop = "<" + "ab" * 29_999 + "/>"
    deltas = ["Hello", ",", " how", " are", " you", " today", "?", " "]
    partial = stop[:20_001]
    start = time.perf_counter()
    tracemalloc.start()
    try:
        matcher = StopMatcher([stop])
        assert [matcher.push(d) for d in deltas] == deltas
        assert all(matcher.push(partial[i : i + 4]) == "" for i in range(0, len(partial), 4))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * len(stop)
    assert matcher.push("X") == partial + "X"
    text = "a" + stop + " tail"
    pieces = [text[i : i + 7] for i in range(0, len(text), 7)]
    out, seen = [], 0
    for piece in pieces:
        out.append(matcher.push(piece))
        seen += len(piece)
        assert matcher.stopped == (seen >= len("a" + stop))
    assert "".join(out) == "a"
    assert time.perf_counter() - start < 3.0


def test_push_after_flush_starts_afresh() -> None:
    matcher = StopMatcher(["ab"])
    assert matcher.push("a") == ""
    assert matcher.flush() == "a"
    assert matcher.push("b") == "b"
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
    assert matcher.stopped and matcher.matched == "ab"


def test_nested_stop_waits_for_longer_one() -> None:
    matcher = StopMatcher(["abcd", "bc"])
    assert matcher.push("xabc") == "x"
    assert not matcher.stopped
    assert matcher.matched is None
    assert matcher.push("d") == ""
    assert matcher.stopped and matcher.matched == "abcd"


def test_nested_stop_fires_when_longer_one_fails() -> None:
    matcher = StopMatcher(["abcd", "bc"])
    assert matcher.push("abc") == ""
    assert matcher.push("x") == "a"
    assert matcher.stopped and matcher.matched == "bc"


def test_flush_cuts_at_pending_stop() -> None:
    matcher = StopMatcher(["abcd", "bc"])
    assert matcher.push("abc") == ""
    assert matcher.flush() == "a"
    assert matcher.stopped and matcher.matched == "bc"


def test_rejects_empty_stop() -> None:
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        StopMatcher(["ok", ""])


def test_rejects_bare_string() -> None:
    with pytest.raises(TypeError):
        StopMatcher("</s>")


@given(st.one_of(case(), periodic_case()), st.integers(0, 40))
def test_disarmed_the_text_comes_through_whole(args: tuple[list[str], list[str]], at: int) -> None:
    """Disarmed as a stop is found (by a push or the flush, or at any push before), what was
    released, what ``disarm`` gives back and every later push make the whole text, with no
    stop reported."""
    stops, pushes = args
    matcher, out = StopMatcher(stops), []
    for i, piece in enumerate(pushes):
        out.append(matcher.push(piece))
        if matcher.stopped or i == at:
            out.append(matcher.disarm())
    out.append(matcher.flush())
    if matcher.stopped:  # (the flush decided a stop a longer one had kept open)
        out.append(matcher.disarm())
    assert "".join(out) == "".join(pushes) and not matcher.stopped and matcher.matched is None
