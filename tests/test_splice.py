"""Replies held as their generated tokens: each spliced exactly where its message sits (a user
who typed the same words keeps the tokenizer's split), and only when the text is unchanged."""

from __future__ import annotations

from typing import Any

import internals

from llmsession import GenerationOptions, Model, Session
from llmsession.text.splice import ReplyTokens, found_in_order, marker, splice, stretches


def test_stretches_find_each_stand_in_once_in_order() -> None:
    marked = f"<user>OK</user><bot>{marker(1)}</bot><user>Hi</user><bot>{marker(3)}</bot>"
    assert stretches(marked, [1, 3]) == ["<user>OK</user><bot>", "</bot><user>Hi</user><bot>", "</bot>"]
    assert stretches(marked, [3, 1]) is None  # out of order
    assert stretches(marked + marker(3), [1, 3]) is None  # a template that repeats a content
    assert stretches("<bot></bot>", [1]) is None  # a template that dropped it


def test_a_users_digits_between_the_markers_are_text() -> None:
    """A user's or a tool's text of the markers' private-use characters around 5,000 digits
    raised ValueError (Python's int() refuses more than 4,300 digits) on every later turn of the
    conversation: a 500. Only a marker's own few ASCII digits are one; the rest is text."""
    forged = "\ue000" + "1" * 5000 + "\ue001"
    assert stretches(f"a{forged}b{marker(0)}c", [0]) == [f"a{forged}b", "c"]
    assert stretches(f"a\ue000\u0663\ue001b{marker(0)}", [0]) == ["a\ue000\u0663\ue001b", ""]  # (Arabic 3)
    assert stretches(f"{marker(0)}x\ue0001\ue001", [0]) is None  # (a forged small one: not spliced)


def test_splice_tokenizes_around_the_replies() -> None:
    def tokenize(text: str, first: bool) -> list[int]:
        return ([0] if first else []) + [ord(c) for c in text]

    assert splice(["ab", "c", ""], [[7, 8], [9]], tokenize) == [0, 97, 98, 7, 8, 99, 9]


def test_the_lru_forgets_the_oldest() -> None:
    replies = ReplyTokens(capacity=2)
    for text in ("a", "b", "c"):
        replies.remember(text, [1])
    assert replies.get("a") is None and replies.get("c") == (1,)


def test_the_lru_holds_at_most_its_token_budget() -> None:
    cache = ReplyTokens(capacity=8, max_held=10)
    for text in ("a", "b", "c"):
        cache.remember(text, [1, 2, 3, 4])
    assert cache.get("a") is None and cache.get("b") == cache.get("c") == (1, 2, 3, 4)
    cache.remember("b", [5])  # (said again: both splits kept, and counted)
    assert cache.get("b") == (5,) and cache.get("b", 1) == cache.get("b", 9) == (1, 2, 3, 4)
    cache.remember("d", [6, 7, 8, 9])  # (13 tokens: the least recently used text goes)
    assert cache.get("c") is None and cache.get("b") == (5,) and cache.get("d") == (6, 7, 8, 9)
    cache.remember("huge", list(range(11)))  # more than the whole budget: not kept
    assert cache.get("huge") is None and cache.copy().get("d") == (6, 7, 8, 9)


def test_a_text_said_again_keeps_its_last_splits() -> None:
    cache = ReplyTokens()
    for n in range(ReplyTokens.VARIANTS + 2):
        cache.remember("ls", [n])
    kept = [cache.get("ls", back) for back in range(ReplyTokens.VARIANTS + 1)]
    assert kept == [(5,), (4,), (3,), (2,), (2,)]  # (latest first; past the kept, the earliest)


def test_a_text_said_again_keeps_its_own_latest_split_within_the_budget() -> None:
    cache = ReplyTokens(capacity=10, max_held=10)
    cache.remember("a", [1, 2])
    cache.remember("b", [1] * 6)
    cache.remember("b", [2] * 6)  # (12 held: a goes, then b's older split)
    assert cache.get("b") == cache.get("b", 1) == (2,) * 6 and cache.get("a") is None
    for _ in range(3):
        cache.remember("c", [7])  # (the same split again: kept once)
    assert cache.get("c", 1) == (7,) and cache.get("b") == (2,) * 6


def test_replies_are_found_in_order_once_each_or_as_often_as_said() -> None:
    assert found_in_order("xAyBz", ["A", "B"]) == ["x", "y", "z"]
    assert found_in_order("xAyAz", ["A", "A"]) == ["x", "y", "z"]  # (a call made twice)
    assert found_in_order("A said, xAy", ["A"]) is None  # (a user quoting a reply: not spliced)
    assert found_in_order("xAyAzA", ["A", "A"]) is None
    assert found_in_order("xBy", ["A"]) is None


def test_a_user_who_typed_the_reply_keeps_the_canonical_split(smollm2: Model) -> None:
    (ok,) = smollm2.tokenize(" OK", add_special=False)[-1:]
    odd = smollm2.tokenize(" O", add_special=False) + smollm2.tokenize("K", add_special=False)
    assert smollm2.detokenize(odd) == " OK" and odd != [ok]
    internals.local(smollm2).remember_reply(" OK", odd)
    messages = [
        {"role": "user", "content": "Please answer OK or not: OK"},
        {"role": "assistant", "content": " OK"},
        {"role": "user", "content": "Thanks."},
    ]
    tokens = smollm2.prompt_tokens(messages)
    plain = smollm2.tokenize(smollm2.render(messages))
    assert tokens != plain and smollm2.detokenize(tokens) == smollm2.detokenize(plain)
    first_difference = next(i for i, (a, b) in enumerate(zip(tokens, plain, strict=False)) if a != b)
    user_end = len(smollm2.tokenize(smollm2.render(messages[:1], add_generation_prompt=True)))
    assert first_difference >= user_end, "the user's words were tokenized as the reply's tokens"
    assert tokens[first_difference : first_difference + len(odd)] == odd


def test_a_session_holds_its_own_reply_even_when_another_said_the_same(smollm2: Model) -> None:
    """Two sessions that generated the same text as different tokens: each next prompt holds
    its own, so its cache still matches and its input does not depend on the other's traffic."""
    mine, theirs = smollm2.session(), smollm2.session()
    text = " Sure"
    canonical = smollm2.tokenize(text, add_special=False)
    other = smollm2.tokenize(" S", add_special=False) + smollm2.tokenize("ure", add_special=False)
    assert canonical != other and smollm2.detokenize(other) == text
    mine.messages = [{"role": "user", "content": "Help?"}, {"role": "assistant", "content": text}]
    theirs.messages = [dict(m) for m in mine.messages]
    internals.local(smollm2).remember_reply(text, canonical, mine.replies)
    internals.local(smollm2).remember_reply(
        text, other, theirs.replies
    )  # the model's shared record now says `other`
    ask = [{"role": "user", "content": "Go on."}]
    held = internals.local(smollm2).prompt([*mine.messages, *ask], own=mine.replies).tokens()
    assert held == smollm2.tokenize(smollm2.render([*mine.messages, *ask]))  # its own: canonical
    assert internals.local(smollm2).prompt([*theirs.messages, *ask], own=theirs.replies).tokens() != held
    assert mine.fork().replies.get(text) == tuple(canonical)


def test_remembered_stretches_give_the_prompt_a_cold_tokenizer_gives(smollm2: Model) -> None:
    """The text between spliced replies is tokenized once and remembered; a prompt built from
    remembered stretches equals one built with none remembered, and a caller that changes the
    tokens it got back changes nothing remembered."""
    session, messages = conversation_with_a_non_canonical_reply(smollm2)
    warm = internals.local(smollm2).prompt(messages, own=session.replies).items
    internals.local(smollm2).prompt(messages, own=session.replies).items.clear()  # a caller's own copy
    internals.local(smollm2)._stretches = (ReplyTokens(), ReplyTokens())  # none remembered
    cold = internals.local(smollm2).prompt(messages, own=session.replies).items
    assert warm == cold
    tokens = [int(t) for t in cold]
    assert internals.local(smollm2).native.detokenize(tokens, special=True) == smollm2.render(messages)
    assert tokens != smollm2.tokenize(smollm2.render(messages))


def conversation_with_a_non_canonical_reply(model: Model) -> tuple[Session, list[dict[str, Any]]]:
    """A sampled conversation one of whose replies the tokenizer would split otherwise (which
    seed gives one depends on the CPU's kernels: seed 13 at temperature 0.9 did on AVX-512, not
    on AVX2)."""
    for seed in range(13, 45):
        session = model.session(share_prefix=False)  # sampled from its own decodes alone
        for question in ("Name a colour.", "And a fruit?", "And an animal?"):
            # wide sampling (no top-k, min-p): odd splits such as "bl" + "ue" come up
            options = GenerationOptions(max_tokens=12, temperature=1.2, top_k=0, min_p=0.0, seed=seed)
            session.respond(question, options)
        messages = [*session.messages, {"role": "user", "content": "Thanks!"}]
        spliced = internals.local(model).prompt(messages, own=session.replies).tokens()
        if spliced != model.tokenize(model.render(messages)):
            return session, messages
    raise AssertionError("no seed in 13..44 sampled a reply the tokenizer splits otherwise")
