"""The Responses store's bounds (pure): each key keeps a share of its own and forgets only its
own responses, so nothing one key does changes what another sees; a lone key has all of it;
what is kept is counted exactly; a continuation is sized from its predecessor without
serializing the whole chain again."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.responses import JSONResponse

from llmsession.serve.rendering import rendered
from llmsession.serve.store import ResponseStore, json_size, sized_transcript


def body(ident: str, text: str = "") -> dict[str, Any]:
    return {"id": ident, "output": text}


def said(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def test_each_key_keeps_its_share_and_forgets_only_its_own() -> None:
    store = ResponseStore(count=10, size=10_000, owners=2)  # (5 responses, 5,000 bytes a key)
    for i in range(3):
        assert store.put("b", body(f"b{i}"), said("small"))
    for i in range(50):  # (over the count and, with its text, over the bytes)
        assert store.put("a", body(f"a{i}", "x" * 400), said("flood"))
    assert all(store.get(f"b{i}", "b") is not None for i in range(3))
    assert store.get("a49", "a") is not None and store.get("a0", "a") is None
    assert store.held("a")[0] <= 5 and store.held("a")[1] <= 5_000 and store.held("b")[0] == 3
    assert not store.put("a", body("big", "x" * 5_000), said("a"))  # (past the share: not kept)
    assert store.get("a49", "a") is not None  # (and nothing of its own went for it)
    lone = ResponseStore(count=10, size=10_000)
    for i in range(30):
        lone.put("a", body(f"a{i}"), said("hi"))
    assert len(lone) == 10 and lone.held("a")[0] == 10  # (one key: the whole bound is its share)


def test_a_chain_of_continuations_gives_way_itself() -> None:
    """Each continuation is sized with its predecessor: a key growing one response toward its
    share forgets its own older ones, never another key's."""
    store = ResponseStore(count=2_000, size=200_000, owners=2)
    for i in range(50):
        store.put("a", body(f"a{i}", "x" * 1_000), said("a"))
    transcript: list[dict[str, Any]] = []
    previous = None
    for turn in range(12):
        transcript = [*transcript, *said("y" * 9_000)]
        store.put("b", body(f"b{turn}"), transcript, sized=sized_transcript(transcript, previous))
        previous = store.get(f"b{turn}", "b") or previous
    assert store.held("a")[0] == 50 and store.held("b")[1] <= 100_000


def test_text_is_sized_at_least_as_it_takes_memory() -> None:
    """Counted as characters of unescaped JSON, an emoji was 1 (4 bytes held): 2M of them were
    2 MB of a 64 MiB bound and held 8 MiB."""
    assert json_size("\U0001f600" * 1000) >= 4 * 1000 and json_size("é" * 1000) >= 2 * 1000


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
        assert store.put("a", body(f"r{turn}"), transcript, sized=sized_transcript(transcript, previous))
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
def test_the_bounds_hold_and_what_a_key_sees_never_depends_on_another(
    steps: list[tuple[str | None, int, int]],
) -> None:
    """Each key's share holds, the counts are exact, and what key "a" is told and keeps is what
    it would be with no other key's step in between."""
    store, alone = ResponseStore(count=8, size=6_000, owners=2), ResponseStore(count=8, size=6_000, owners=2)
    told: list[object] = []
    for n, (owner, kind, length) in enumerate(steps):
        ident = f"r{n}"
        if kind == 3 and n:  # (a delete, of an earlier id, by this key)
            deleted = store.delete(f"r{n - 1}", owner)
            if owner == "a":
                told.append((deleted, alone.delete(f"r{n - 1}", owner)))
            continue
        kept = store.put(owner, body(ident, "x" * length), said("hi"))
        assert kept == (store.get(ident, owner) is not None)
        if owner == "a":
            told.append((kept, alone.put(owner, body(ident, "x" * length), said("hi"))))
        for o in ("a", "b", "c", None):
            assert store.held(o)[0] <= 4 and store.held(o)[1] <= 3_000
        held = [store.held(o) for o in ("a", "b", "c", None)]
        assert store.used == sum(size for _, size in held) and len(store) == sum(c for c, _ in held)
        assert store.held("a") == alone.held("a")
    assert all(mine == theirs for mine, theirs in told), told
    ids = [f"r{n}" for n in range(len(steps))]
    assert [store.get(i, "a") is None for i in ids] == [alone.get(i, "a") is None for i in ids]


def test_a_response_in_progress_is_its_owners_until_it_ends_and_deleted_it_is_not_kept() -> None:
    store = ResponseStore(count=10, size=10_000)
    store.begin("r1", "a", rendered(body("r1", "started")))
    assert store.running("r1", "a") == rendered(body("r1", "started")) and store.get("r1", "a") is None
    assert store.running("r1", "b") is None and not store.delete("r1", "b")  # (another key's: unknown)
    assert store.put("a", body("r1", "done"), said("hi"))
    store.end("r1")
    assert store.running("r1", "a") is None and store.get("r1", "a") is not None
    store.begin("r2", "a", rendered(body("r2")))
    assert store.delete("r2", "a") and store.running("r2", "a") is None
    assert not store.delete("r2", "a")
    assert not store.put("a", body("r2", "done"), said("hi"))  # (deleted while it ran)
    store.end("r2")
    assert store.get("r2", "a") is None and len(store) == 1
    store.begin("r2", "a", rendered(body("r2")))  # (ended, the id is forgotten: nothing of it lingers)
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


def test_a_kept_body_is_sent_a_piece_at_a_time() -> None:
    """A ``GET`` handed uvicorn a stored body whole, and a client that did not read had a copy
    of it all in its connection's buffer (17 MB of logprobs, as many times as connections asked).
    It is sent ``PIECE`` bytes at a time now, the server waiting for the client between pieces."""
    import asyncio

    from llmsession.serve.responding import PIECE, in_pieces

    data = rendered({"id": "r", "output": "x" * (3 * PIECE)})
    sent: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()  # (a client that never leaves)
        return {}

    scope = {"type": "http", "method": "GET", "path": "/", "headers": [], "asgi": {"spec_version": "2.3"}}
    asyncio.run(in_pieces(data)(scope, receive, send))
    bodies = [m["body"] for m in sent if m["type"] == "http.response.body"]
    assert b"".join(bodies) == data and max(len(b) for b in bodies) == PIECE and len(bodies) >= 4
    assert (b"content-length", str(len(data)).encode()) in sent[0]["headers"]
