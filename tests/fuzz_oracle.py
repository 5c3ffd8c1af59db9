"""The oracle: what each call must do, worked out apart from the library's own reuse logic.

Each session has a shadow transcript. The prompt the model builds for it (``Model.prompt``) says
whether a call must overflow, and with the session's token record, how much it must reuse. The
differential check compares the first-token logits of a cached session with those of a fresh one
on the same transcript, within the batch-split noise ``tests/test_reuse.py`` measures on this
build (on a 300-token prompt; on 900 tokens for prompts longer than 400).
"""

from __future__ import annotations

import copy
import itertools
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import internals
import numpy as np
from fuzz_env import STATS, env
from fuzz_inputs import GREEDY_ONE, TYPED, Message
from test_reuse import tolerance_for

from llmsession import GenerationOptions, Reply, Session, SessionBusyError, Stream


def copy_message(message: Message) -> Message:
    """A shadow copy: its own dict (and list) holding the same parts."""
    out = dict(message)
    if isinstance(out.get("content"), list):
        out["content"] = list(out["content"])
    return out


def common_prefix(a: Sequence[object], b: Sequence[object]) -> int:
    """Written out here rather than imported, so that a defect in the library's cannot hide."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Expectation:
    """What a call must do, from the prompt the model builds for the shadow transcript."""

    error: type[Exception] | None  # the prompt cannot be built: this error
    overflow: bool = False
    prompt_items: int = 0
    reused: int = 0  # of its own record
    shareable: int = 0  # at most this much of another session's, when its own is empty


def kept(record: Sequence[object], items: Sequence[object]) -> int:
    """What a prompt of ``items`` keeps of a record: the common prefix, the last item left to
    decode, never resuming inside an image."""
    keep = min(common_prefix(record, items), len(items) - 1)
    while keep > 0 and getattr(items[keep], "offset", 0) > 0:
        keep -= 1
    return keep


def expect(
    session: Session,
    shadow: list[Message],
    user: Message,
    alongside: Sequence[object] = (),
    record: Sequence[object] | None = None,
) -> Expectation:
    """Build the prompt the session will build (for the shadow transcript plus ``user``).
    ``alongside``: the prompt another session decodes meanwhile (a concurrent call), which may
    be held, with a reply of its own after it, by the time this one starts from it. ``record``:
    the session's record as the call found it (else as it is now)."""
    try:
        prompt = internals.local(env().model).prompt(
            [*shadow, user],
            thinking=session.thinking,
            own=internals.own_replies(session),
            shared=session.share_prefix,
        )
    except TYPED as error:
        return Expectation(error=type(error))
    try:
        items = list(prompt.items)
        overflow = prompt.n_positions >= session.context_size
        unsafe = bool(prompt.unsafe_reuse)
    finally:
        prompt.close()
    record = internals.record(session) if record is None else record
    keep = 0 if unsafe else kept(record, items)
    shareable = 0
    if not (unsafe or record) and session.share_prefix:
        shareable = max((kept(other, items) for other in internals.donor_records(session)), default=0)
        if alongside:  # a prefix of ours: its reply may go on matching
            whole = common_prefix(alongside, items) == len(alongside)
            shareable = max(shareable, len(items) - 1 if whole else kept(alongside, items))
    return Expectation(
        error=None, overflow=overflow, prompt_items=len(items), reused=keep, shareable=shareable
    )


def check_reply(
    session: Session,
    reply: Reply,
    options: GenerationOptions,
    expectation: Expectation,
    *,
    text: str | None,
    finishes: tuple[str, ...],
    cached_before: int,
    check_cache: bool = True,
) -> None:
    """Everything a finished (or cancelled) exchange must satisfy."""
    usage = reply.usage
    STATS.outcomes[f"reply {reply.finish_reason}"] += 1
    assert reply.finish_reason in finishes, (reply.finish_reason, finishes)
    if text is not None:
        assert reply.text == text, (reply.text, text)
    assert usage.prompt_tokens == expectation.prompt_items, (usage, expectation)
    never_started = reply.finish_reason == "cancelled" and usage == type(usage)(
        prompt_tokens=usage.prompt_tokens
    )
    if not never_started:  # its own reuse, and what another session's cells gave an empty one
        assert usage.reused_tokens == expectation.reused + usage.shared_tokens, (usage, expectation)
        assert usage.shared_tokens <= expectation.shareable, (usage, expectation, cached_before)
    assert 0 <= usage.reused_tokens <= usage.prompt_tokens, usage
    if reply.finish_reason == "cancelled":
        assert usage.decoded_prompt_tokens <= usage.prompt_tokens - usage.reused_tokens, usage
    else:
        assert usage.decoded_prompt_tokens == usage.prompt_tokens - usage.reused_tokens, usage
    assert 0 <= usage.completion_tokens <= options.max_tokens, (usage, options.max_tokens)
    assert usage.prompt_tokens + usage.completion_tokens <= session.context_size, (
        f"the reply outgrew the context: {usage}, context_size {session.context_size}"
    )
    if reply.text:
        assert usage.completion_tokens >= 1, (reply, usage)
    if reply.finish_reason == "length":
        assert (
            usage.completion_tokens == options.max_tokens
            or usage.prompt_tokens + usage.completion_tokens == session.context_size
        ), (usage, options.max_tokens, session.context_size)
    for stop in options.stop:
        assert stop not in reply.text, f"stop string {stop!r} in the reply {reply.text!r}"
    cached = session.cached_tokens
    if check_cache and never_started:  # cancelled before its first batch, after a plan that kept nothing
        assert cached in (cached_before, expectation.reused), (cached, cached_before, expectation)
    elif check_cache:  # (past the reply: what its anticipatory prefill decoded, once it settled)
        cached, ahead = internals.settled(session).cached_tokens, internals.decoded_ahead(session)
        assert cached - ahead <= usage.prompt_tokens + usage.completion_tokens, (cached, ahead, usage)
        assert cached >= usage.reused_tokens, (cached, usage)
        if reply.finish_reason != "cancelled":
            assert cached >= usage.prompt_tokens + usage.completion_tokens - 1, (cached, usage)
    timings = reply.timings
    assert timings.time_to_first_token_s >= 0 and timings.prefill_s >= 0 and timings.generation_s >= 0
    assert math.isfinite(timings.generation_tokens_per_s) and timings.generation_tokens_per_s >= 0


@dataclass
class Pending:
    """A stream left mid-way (after ``break``): the session finishes it at its next call."""

    stream: Stream
    user: Message
    text: str
    options: GenerationOptions
    expectation: Expectation
    cached_before: int
    reader: threading.Thread = field(default_factory=threading.current_thread)  # (its steps' thread)


def check_settled(pending: Pending | None, *, closed: bool = False) -> None:
    """A call that finished a pending stream first finished it as cancelled, as far as it got;
    its next step ends it, or, for a call from another thread than the one that read it, says
    so (``SessionBusyError``); ``closed``: its reader closed it instead."""
    if pending is None:
        return
    reply = pending.stream.reply
    assert reply is not None, "the session did not finish the stream its new call superseded"
    assert reply.finish_reason == "cancelled", reply
    assert reply.text == pending.text, (reply.text, pending.text)
    check_ended(pending.stream, told=not closed and threading.current_thread() is not pending.reader)


def check_ended(stream: Stream, *, told: bool) -> None:
    """A finished stream yields nothing more: it ends, or (``told``: finished for another
    thread's call) raises ``SessionBusyError`` at each step."""
    try:
        rest = list(stream)
    except SessionBusyError:
        assert told, "a stream finished for its own thread's call said it was another's"
        return
    assert not told, "a stream finished for another thread's call ended as if the reply were over"
    assert rest == [], "a finished stream yielded more"


class Taken:
    """Snapshots taken from a stream, checked as they come."""

    def __init__(self, stream: Stream, text: str = "") -> None:
        self.stream = stream
        self.text = text
        self.ended = False  # the stream ran out by itself

    def take(self, n: int | None) -> None:
        """Up to n more snapshots (all with None), then stop iterating without closing."""
        if n == 0:
            return
        for taken, snapshot in enumerate(self.stream, start=1):
            assert snapshot.text == self.text + snapshot.delta, (snapshot, self.text)
            self.text = snapshot.text
            if n is not None and taken >= n:
                return
        self.ended = True


def fresh_first_logits(
    like: Session, messages: list[Message], content: Any, batch_size: int
) -> tuple[Reply, np.ndarray | None] | BaseException:
    """A fresh session's one-token greedy reply on a copy of ``messages`` and the logits it
    sampled from (None if its context was discarded), or the typed error it raised."""
    fresh = env().model.session(
        context_size=like.context_size, batch_size=batch_size, thinking=like.thinking, share_prefix=False
    )
    internals.without_look_ahead(fresh)  # (its last logits are then those it sampled from)
    fresh.messages = copy.deepcopy(messages)
    internals.tokenize_like(fresh, like)  # its prompt tokenized as ``like``'s is
    try:
        reply = fresh.respond(content, GREEDY_ONE)
        logits = internals.last_logits(fresh) if internals.record(fresh) else None
        return reply, logits
    except TYPED as error:
        return error
    finally:
        fresh.close()


def check_first_logits(
    session: Session, before: list[Message], content: Any, cached: Reply | None, fresh_batch: int | None
) -> None:
    """The session just answered ``content`` after ``before`` (greedy, one token): a fresh session
    decoding that transcript in batches of ``fresh_batch`` (or the session's own) must agree."""
    # Read first: the fresh session decodes into the same shared context.
    ours = internals.last_logits(session) if cached is not None and internals.record(session) else None
    outcome = fresh_first_logits(session, before, content, fresh_batch or session.batch_size)
    if isinstance(outcome, BaseException):
        assert cached is None, f"the fresh session raised {outcome!r}, the cached one replied"
        return
    assert cached is not None, "the cached session failed where a fresh one replied"
    expected, theirs = outcome
    assert expected.usage.reused_tokens == 0
    assert expected.usage.prompt_tokens == cached.usage.prompt_tokens
    if ours is None or theirs is None:
        return  # a prompt that may not be reused starts from scratch and keeps nothing
    assert np.all(np.isfinite(ours)) and np.all(np.isfinite(theirs))
    difference = float(np.abs(ours - theirs).max())
    margin = float(theirs.max() - theirs[int(np.argmax(ours))])
    STATS.differentials += 1
    if difference > STATS.largest_logit_difference:
        STATS.largest_logit_difference = difference
        STATS.largest_difference_prompt = cached.usage.prompt_tokens
    STATS.largest_choice_margin = max(STATS.largest_choice_margin, margin)
    noise = env().noise_at(cached.usage.prompt_tokens)
    if max(difference, margin) > tolerance_for(noise):
        # Split noise varies with the text: measure it on this very transcript (fresh decodes
        # one token at a time and in batches of 7, 64 and 512) before calling it a defect.
        variants = [theirs]
        for batch in (1, 7, 64, 512):
            other = fresh_first_logits(session, before, content, batch)
            assert not isinstance(other, BaseException) and other[1] is not None, other
            variants.append(other[1])
        local = max(float(np.abs(a - b).max()) for a, b in itertools.combinations(variants, 2))
        STATS.outcomes["differential: noise measured on the transcript"] += 1
        noise = max(noise, local)
    tolerance = tolerance_for(noise)
    log = env().log
    if log is not None:
        log.write(
            f"    difference {difference:.4f}, margin {margin:.4f}, tolerance {tolerance:.4f}, "
            f"{cached.usage}, batch {session.batch_size} vs {fresh_batch or session.batch_size}\n"
        )
    assert difference <= tolerance, (
        f"cached and fresh first-token logits differ by {difference:.4f} > {tolerance:.4f} "
        f"(split noise {noise:.4f}); prompt {cached.usage}"
    )
    assert margin <= tolerance, f"the fresh decode prefers another token by {margin:.4f}"
    if difference == 0:
        assert cached.text == expected.text
