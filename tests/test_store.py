"""The Responses store's bounds (pure): a key that floods it evicts its own responses, never a
smaller key's; a lone key may use all of it; what is kept is counted exactly; a continuation is
sized from its predecessor without serializing the whole chain again."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.responses import JSONResponse

from llmsession.serve.store import ResponseStore, json_size


def body(ident: str, text: str = "") -> dict[str, Any]:
    return {"id": ident, "output": text}


def said(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def test_a_flooding_key_evicts_its_own_and_a_lone_key_uses_it_all() -> None:
    store = ResponseStore(count=10, size=10_000)
    for i in range(3):
        assert store.put("b", body(f"b{i}"), said("small"))
    for i in range(50):  # (over the count and, with its text, over the bytes)
        assert store.put("a", body(f"a{i}", "x" * 400), said("flood"))
    assert all(store.get(f"b{i}", "b") is not None for i in range(3))
    assert store.get("a49", "a") is not None and store.get("a0", "a") is None
    assert len(store) <= 10 and store.used <= 10_000
    lone = ResponseStore(count=10, size=10_000)
    for i in range(30):
        lone.put("a", body(f"a{i}"), said("hi"))
    assert len(lone) == 10 and lone.held("a")[0] == 10  # (the whole count: nobody else needs it)


def test_a_response_that_would_make_its_key_the_largest_evicts_nobody_smaller() -> None:
    store = ResponseStore(count=100, size=5_000)
    for i in range(4):
        store.put("b", body(f"b{i}", "y" * 800), said("b"))  # (about 3,400 bytes)
    assert store.put("a", body("big", "x" * 1_700), said("a"))  # (b holds the most: b gives way)
    assert store.get("big", "a") is not None and store.used <= 5_000 and store.held("b")[0] < 4
    kept_b = store.held("b")
    assert not store.put("a", body("bigger", "x" * 4_000), said("a"))  # (a would hold the most)
    assert store.held("b") == kept_b and store.get("bigger", "a") is None
    assert store.get("big", "a") is not None  # (a refused response changes nothing)
    assert not store.put("a", body("huge", "x" * 6_000), said("a"))  # (over the whole bound)


def test_a_refused_response_evicts_nothing_on_its_way() -> None:
    """The smaller key gives way first, then the putter's key would be the largest with only
    the new response: refused, and the smaller key keeps everything it had."""
    store = ResponseStore(count=100, size=5_000)
    for i in range(4):
        store.put("b", body(f"b{i}", "y" * 800), said("b"))  # (about 3,440 bytes)
    before = store.held("b")
    assert not store.put("a", body("big", "x" * 3_000), said("a"))
    assert store.held("b") == before and store.held("a") == (0, 0)
    assert all(store.get(f"b{i}", "b") is not None for i in range(4))


def test_a_chain_of_continuations_never_evicts_a_smaller_key() -> None:
    """Each continuation is sized with its predecessor: a key growing one response toward the
    whole bound gives way itself."""
    store = ResponseStore(count=1_000, size=100_000)
    for i in range(50):
        store.put("a", body(f"a{i}", "x" * 1_000), said("a"))
    transcript: list[dict[str, Any]] = []
    previous = None
    for turn in range(12):
        transcript = [*transcript, *said("y" * 9_000)]
        store.put("b", body(f"b{turn}"), transcript, after=previous)
        previous = store.get(f"b{turn}", "b") or previous
    assert store.held("a")[0] == 50 and store.used <= 100_000


def test_another_keys_ids_are_unknown() -> None:
    store = ResponseStore()
    store.put("a", body("r1"), said("hi"))
    assert store.get("r1", "b") is None and not store.delete("r1", "b")
    assert store.get("r1", "a") is not None and store.delete("r1", "a") and store.get("r1", "a") is None
    assert store.held("a") == (0, 0) and store.used == 0


def test_a_chain_is_sized_from_its_predecessor() -> None:
    store = ResponseStore()
    transcript: list[dict[str, Any]] = []
    previous = None
    for turn in range(6):
        transcript = [*transcript, *said(f"turn {turn} " * 50), {"role": "assistant", "content": "ok"}]
        assert store.put("a", body(f"r{turn}"), transcript, after=previous)
        previous = store.get(f"r{turn}", "a")
        assert previous is not None
        whole = json_size(transcript)  # (what sizing it whole gives: within a few bytes a link)
        assert abs(previous.transcript_size - whole) <= 4 * (turn + 1)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b", "c", None]), st.integers(0, 3), st.integers(0, 2_000)),
        max_size=60,
    )
)
def test_the_bounds_and_the_counts_hold_and_smaller_keys_are_spared(
    steps: list[tuple[str | None, int, int]],
) -> None:
    store = ResponseStore(count=8, size=6_000)
    for n, (owner, kind, length) in enumerate(steps):
        ident = f"r{n}"
        if kind == 3 and n:  # (a delete, of an earlier id, by this key)
            store.delete(f"r{n - 1}", owner)
            continue
        before = {o: store.held(o) for o in ("a", "b", "c", None)}
        kept = store.put(owner, body(ident, "x" * length), said("hi"))
        assert kept == (store.get(ident, owner) is not None)
        assert len(store) <= 8 and store.used <= 6_000
        held = [store.held(o) for o in ("a", "b", "c", None)]
        assert store.used == sum(size for _, size in held) and len(store) == sum(c for c, _ in held)
        mine = store.held(owner)
        for other, (count, size) in before.items():  # a key that lost one held at least as much
            if other != owner and store.held(other)[0] < count:
                assert kept and (size >= mine[1] or count >= mine[0]), (other, before, owner, mine)


def test_a_response_in_progress_is_its_owners_until_it_ends_and_deleted_it_is_not_kept() -> None:
    store = ResponseStore(count=10, size=10_000)
    store.begin("r1", "a", body("r1", "started"))
    assert store.running("r1", "a") == body("r1", "started") and store.get("r1", "a") is None
    assert store.running("r1", "b") is None and not store.delete("r1", "b")  # (another key's: unknown)
    assert store.put("a", body("r1", "done"), said("hi"))
    store.end("r1")
    assert store.running("r1", "a") is None and store.get("r1", "a") is not None
    store.begin("r2", "a", body("r2"))
    assert store.delete("r2", "a") and store.running("r2", "a") is None
    assert not store.delete("r2", "a")
    assert not store.put("a", body("r2", "done"), said("hi"))  # (deleted while it ran)
    store.end("r2")
    assert store.get("r2", "a") is None and len(store) == 1
    store.begin("r2", "a", body("r2"))  # (ended, the id is forgotten: nothing of it lingers)
    assert store.put("a", body("r2", "again"), said("hi"))
    assert store.delete("r2", "a")  # (kept, its stream not closed yet: deleted, it goes)
    store.end("r2")
    assert store.get("r2", "a") is None and store.running("r2", "a") is None and len(store) == 1


def test_a_kept_body_is_rendered_once_as_it_was_when_kept() -> None:
    store = ResponseStore()
    kept = {"id": "r", "output": [{"text": "é \u2028 ok"}], "store": True}
    assert store.put("a", kept, said("hi"))
    kept["output"] = "changed later"
    stored = store.get("r", "a")
    assert stored is not None and json.loads(stored.rendered) == {
        "id": "r",
        "output": [{"text": "é \u2028 ok"}],
        "store": True,
    }
    assert stored.rendered == JSONResponse({**json.loads(stored.rendered)}).body
