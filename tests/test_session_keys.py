"""Session keys within the engine: a conversation named by its client (``conversation=``, or a
session header on ``llmsession serve``) keeps its main session while side requests under the
same name (titles, summaries) come and go, even when the kept sessions are full; the same flow
without names loses it (the variant that must fail)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from near_ties import assert_same_within_noise, scored
from plain_http import HTTP
from serve_helpers import KEY, OTHER_KEY, running

from llmsession import GenerationOptions, Model
from llmsession.runtime.keeping import Kept, choose, evicted, mains, owner
from llmsession.serve.app import create_app
from llmsession.serve.naming import named_conversation

GREEDY = GenerationOptions(max_tokens=8, temperature=0)
MAIN = "You are a coding assistant. " + "Follow the project's conventions and keep answers short. " * 12
OTHER = "You are a travel guide who answers in one sentence."
GREEDY_BODY = {"temperature": 0}  # (the SDK's own fields have no sampling settings any more)
TITLE = "Write a five-word title for this conversation."


def kept(label: str | None, cached: int, idle: bool = True, fitting: bool = True) -> Kept:
    return Kept(label, cached, idle, fitting)


def test_a_conversations_main_is_its_largest_session() -> None:
    sessions = [kept("a", 900), kept("a", 40), kept("b", 10), kept(None, 5000), kept("b", 10)]
    assert mains(sessions) == {0, 4}  # (ties: the most recently used)


def test_a_side_request_takes_a_spare_session_or_a_new_one_never_a_main() -> None:
    full = [kept("a", 900), kept("b", 800), kept(None, 50)]
    assert choose(full, [0, 0, 0], "a", capacity=3).index == 2  # (the unnamed spare)
    mains_only = [kept("a", 900), kept("b", 800)]
    assert choose(mains_only, [0, 0], "a", capacity=2) is None  # a side request: a new session
    elsewhere = [Kept("a", 900, True, False, "t2"), Kept("b", 800, True, True, "t1")]  # (t2's a)
    assert choose(elsewhere, [0, 0], "a", capacity=2, tenant="t1").index == 1  # (t1's first a)
    settings = [Kept("a", 900, True, False, "t1"), Kept("b", 800, True, True, "t1")]  # (other settings)
    assert choose(settings, [0, 0], "a", capacity=2, tenant="t1") is None  # (still a's side request)


def test_with_nothing_else_left_a_first_call_or_an_unnamed_one_takes_the_oldest_main() -> None:
    mains_only = [kept("a", 900), kept("b", 800)]
    assert choose(mains_only, [0, 0], "c", capacity=2).index == 0  # a new conversation's first
    assert choose(mains_only, [0, 0], None, capacity=2).index == 0  # (unnamed: as before names)


def test_a_named_call_forks_another_conversations_session_and_takes_its_own() -> None:
    sessions = [kept("a", 100), kept("b", 100)]
    assert choose(sessions, [100, 0], "a", capacity=8) == choose(sessions, [100, 0], None, 8)
    assert choose(sessions, [100, 0], "a", capacity=8).fork is False
    taken = choose(sessions, [0, 100], "a", capacity=8)
    assert taken is not None and taken.index == 1 and taken.fork  # (b's stays whole)
    own_first = choose(sessions, [100, 100], "b", capacity=8)
    assert own_first is not None and own_first.index == 1 and not own_first.fork


def test_past_capacity_spares_go_first_and_mains_wait_for_a_busy_side_request() -> None:
    sessions = [kept("a", 900), kept("a", 30), kept("b", 800)]
    assert evicted(sessions, 2) == [1]
    busy_side = [kept("a", 900), kept("b", 800), kept("a", 30, idle=False)]
    assert evicted(busy_side, 2) == []
    assert evicted([*busy_side[:2], kept("c", 30, idle=False)], 2) == [0]  # (c's first: a main)
    crowded = [kept(name, 100) for name in "abcdefg"] + [kept(None, 10, idle=False)]
    assert evicted(crowded, 2) == [0, 1, 2, 3, 4]  # (mains wait for one busy side request only)


def test_past_capacity_a_tenant_over_its_share_loses_its_own_first() -> None:
    """One tenant's many calls evicted the others' sessions, least recently used first: past
    capacity, what a tenant holds over its share (capacity over the tenants) goes first. (A
    tenant's calls reuse its own idle sessions when none is free: the pool grows past capacity
    when its sessions are all busy, concurrent calls; the choice is pure, tested so.)"""
    quiet = Kept(None, 500, True, True, "quiet")  # (the least recently used)
    flood = [Kept(None, 50, True, True, "flood") for _ in range(4)]
    assert evicted([quiet, *flood], 4) == [1]
    assert evicted([quiet, *flood, Kept(None, 50, True, True, "flood")], 4) == [1, 2]
    alone = [Kept(None, 50, True, True, "t") for _ in range(5)]
    assert evicted(alone, 3) == [0, 1]  # (one tenant: least recently used first, as before)
    under = [Kept(None, 50, True, True, t) for t in "abcde"]
    assert evicted(under, 4) == [0]  # (nobody over the share: least recently used first)
    named = [Kept("q", 500, True, True, "quiet"), *[Kept(f"f{i}", 50, True, True, "flood") for i in range(4)]]
    assert evicted(named, 4) == [1]  # (mains too: the flood's own first)
    busy = [*named, Kept(None, 5, False, True, "flood")]  # (mains wait for a busy side request)
    assert evicted(busy, 4) == [1]
    # (a reviewer's read: the flood's busy ones go once idle; the quiet tenant's stay meanwhile)
    running = [
        Kept(None, 50, True, True, "quiet"),
        Kept(None, 50, True, True, "quiet"),
        *[Kept(None, 50, False, True, "flood") for _ in range(5)],
        Kept(None, 50, True, True, "flood"),
    ]
    assert evicted(running, 4) == [7]


def test_a_key_that_names_many_users_has_one_share() -> None:
    """A server's tenant is ``owner/name`` (its key, and the user a request names): each user
    name counted as a tenant of its own, a key sending a new ``user`` with every request held
    every share but one, and the quiet key's session went first. Its owner's share is one."""
    quiet = Kept(None, 500, True, True, "quietkey/u")  # (the least recently used)
    flood = [Kept(None, 50, True, True, f"floodkey/u{i}") for i in range(4)]
    assert evicted([quiet, *flood], 4) == [1]  # (the flooding key's oldest, not the quiet one)
    flat = [quiet, *[Kept(None, 50, True, True, f"floodkey-u{i}") for i in range(4)]]
    assert evicted(flat, 4) == [0]  # (names without an owner: each its own, as before)
    assert owner("k/u/v") == "k" and owner("k") == "k" and owner(None) is None


def test_a_conversation_is_a_name_within_a_tenant() -> None:
    two = [Kept("a", 900, True, True, "t1"), Kept("a", 100, True, True, "t2")]
    assert mains(two) == {0, 1}


def converse(model: Model, named: bool) -> tuple[Any, Any, int]:
    """Conversation a's first turn, b's, a side request under a's name, then a's second turn:
    that turn's reply and its first turn's prompt length, the kept sessions full at two."""
    a: list[dict[str, Any]] = [{"role": "system", "content": MAIN}, {"role": "user", "content": "Hi."}]
    first = model.chat(a, GREEDY, conversation="a" if named else None)
    model.chat(
        [{"role": "system", "content": OTHER}, {"role": "user", "content": "Rome?"}],
        GREEDY,
        conversation="b" if named else None,
    )
    model.chat([{"role": "user", "content": TITLE}], GREEDY, conversation="a" if named else None)
    a += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And tests?"}]
    second = model.chat(copy.deepcopy(a), scored(GREEDY), conversation="a" if named else None)
    return a, second, first.usage.prompt_tokens


@pytest.mark.parametrize("named", [True, False], ids=["named", "unnamed: loses it"])
def test_a_side_request_does_not_take_a_named_conversations_session(
    smollm2_path: Path, smollm2: Model, named: bool
) -> None:
    with Model(smollm2_path, threads=2, stateless_sessions=2) as model:
        history, second, first_prompt = converse(model, named)
    if named:
        assert second.usage.reused_tokens >= first_prompt, (second.usage, first_prompt)
        assert_same_within_noise(smollm2, second, smollm2.chat(history, scored(GREEDY)))
    else:  # (the side request took the least recently used session: a's)
        assert second.usage.reused_tokens < first_prompt // 2, (second.usage, first_prompt)


def test_the_same_header_under_two_tenants_names_two_conversations() -> None:
    header = {"x-claude-code-session-id": "0b9c"}
    mine = named_conversation("tenant-1", header)
    assert mine is not None and len(mine) == 32 and "0b9c" not in mine
    assert mine == named_conversation("tenant-1", {"x-session-id": "0b9c"})
    assert mine != named_conversation("tenant-2", header)
    assert named_conversation("tenant-1", {"x-other": "0b9c"}) is None


@pytest.fixture
def served(smollm2_path: Path) -> Iterator[tuple[Model, str]]:
    model = Model(smollm2_path, threads=2, stateless_sessions=3)
    with model, running(create_app(model, api_key=[KEY, OTHER_KEY])) as url:
        yield model, url.removesuffix("/v1")


def client(url: str, key: str, session: str | None) -> anthropic.Anthropic:
    headers = {"X-Claude-Code-Session-Id": session} if session else {}
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120, default_headers=headers)


def ask(url: str, key: str, session: str | None, system: str, messages: list[Any]) -> anthropic.types.Message:
    asked = client(url, key, session)
    body = GREEDY_BODY
    return asked.messages.create(model="m", max_tokens=8, system=system, messages=messages, extra_body=body)


@pytest.mark.parametrize("named", [True, False], ids=["header", "no header: loses it"])
def test_a_claude_code_session_header_keeps_its_conversation_through_side_requests(
    served: tuple[Model, str], named: bool
) -> None:
    """Over HTTP: a's first turn, another tenant's under the same header and another
    conversation's fill the three kept sessions, a title request under a's header comes, and
    a's second turn reads its whole first turn from the cache (without headers, the title
    request takes a's session: the variant that must fail)."""
    _, url = served
    a, b = ("a-session", "b-session") if named else (None, None)
    hi = {"role": "user", "content": "Hi."}
    first = ask(url, KEY, a, MAIN, [hi])
    ask(url, OTHER_KEY, a, OTHER, [hi])  # (the same header, another tenant)
    ask(url, KEY, b, OTHER, [hi])  # (the kept sessions are full now)
    ask(url, KEY, a, TITLE, [hi])
    said = "".join(block.text for block in first.content if block.type == "text")
    turn = [hi, {"role": "assistant", "content": said}, {"role": "user", "content": "And tests?"}]
    second = ask(url, KEY, a, MAIN, turn)
    whole_first = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    kept = (second.usage.cache_read_input_tokens or 0) >= whole_first
    assert kept == named, (second.usage, first.usage)


def test_a_plain_server_takes_no_conversation_key_from_a_client(served: tuple[Model, str]) -> None:
    """Only a cluster's front names a request's conversation by ``x-llmsession-conversation``
    (it drops the client's own): a server no front stands before ignores the header, so two
    tenants sending one key name no shared label, and a response id does not carry it."""
    model, url = served
    forged = {"x-llmsession-conversation": "0" * 32, "x-llmsession-replica": "replica-x"}
    hi = [{"role": "user", "content": "Hi."}]
    for key in (KEY, OTHER_KEY):
        asked = anthropic.Anthropic(
            base_url=url, api_key=key, max_retries=0, timeout=120, default_headers=forged
        )
        asked.messages.create(model="m", max_tokens=4, system=MAIN, messages=hi, extra_body=GREEDY_BODY)  # type: ignore[arg-type]
    assert "0" * 32 not in model.conversations()
    body = {"model": "m", "input": "Hi.", "max_output_tokens": 4, "temperature": 0}
    response = HTTP.post(
        f"{url}/v1/responses", json=body, headers={**forged, "Authorization": f"Bearer {KEY}"}, timeout=120
    )
    assert response.status_code == 200, response.text
    ident = response.json()["id"]
    assert "0" * 32 not in ident and "replica-x" not in ident, ident
    assert "0" * 32 not in model.conversations()


def test_a_key_naming_many_users_pushes_out_its_own_reply_records_first() -> None:
    """The replies kept apart for splicing, past ``RECORDS`` tenants: a key sending a new user
    with every call pushed every other key's record out (its next prompt tokenized otherwise
    than generated: a cache miss). Now the flooding owner's own go first; without an owner in
    the names, the least recently used, as before."""
    from llmsession.runtime.stateless_calls import RECORDS, TenantReplies

    replies = TenantReplies()
    quiet = replies.of("quietkey/alice")
    for i in range(3 * RECORDS):
        replies.of(f"floodkey/u{i}")
    assert replies.of("quietkey/alice", peek=True) is quiet
    flat = TenantReplies()
    first = flat.of("alice")
    for i in range(RECORDS):
        flat.of(f"u{i}")
    assert flat.of("alice", peek=True) is not first  # (forgotten: each name its own owner)
