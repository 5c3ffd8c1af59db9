"""A prefill cancelled mid-batch or between batches (issue 39, item 9), on the real model.

Aborting a decode (``ret = 2``), the pinned llama.cpp removes the aborted ubatch's positions from
its first one on and keeps the ubatches computed before it (``llama_context::decode``); here a
batch is one ubatch (``n_ubatch = n_batch``), so llama.cpp keeps exactly the batches decoded
before the cancel, which are what the record holds (a batch is recorded once its decode returns;
``PrefixCache.recover`` then cuts memory to the record, which removes nothing more). These tests
read llama.cpp's memory (``llama_memory_seq_pos_min/max``) against the record right after
cancels at several points and once the session settled; teacher-force the rest of the prompt
after what memory holds then against a fresh context; and compare the next reply with a fresh
session's within the measured noise (``near_ties``). The must-fail variants: a record one
position ahead of memory and a batch behind it (llama.cpp would refuse the next decode, whose
positions must follow the sequence's last), and a memory whose last recorded batch holds another
token's cells (the count agrees; the teacher-forced logits show it).
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import internals
import numpy as np
import pytest
from near_ties import assert_same_within_noise, scored
from test_reuse import GREEDY, N_CTX, short_prompt_noise, tolerance_for

import llmsession.runtime.exchange as exchange
from llmsession import Model, Reply, Session, Stream
from llmsession.engine.prefill import prefill
from llmsession.engine.seat import Seat
from llmsession.native.context import DecodeAborted, NativeContext

QUESTION = "Summarize it in one line."
BATCH = 128  # the session's prefill batch: smaller than the context's (512), as a session may ask
ROWS = 32  # logits at every position are read this many at a time: what the engine's context reserves
STORY = (
    "On the northern cliff above the harbour stood a lighthouse that had guided ships for two "
    "hundred years. Its first keeper, Elias Marrow, carried oil up a hundred and twelve steps every "
    "evening. During the winter of the great storm the lamp's glass cracked, and Elias lit lanterns "
    "by hand until dawn. A fishing boat named the Grey Gull, lost in the fog, followed his lights "
    "home. Decades later his granddaughter Mara kept walking the gallery each night, long after "
    "engineers had installed an electric lamp. When the power failed during an autumn gale, she hung "
    "her grandfather's lanterns along the rail, and a ferry full of schoolchildren steered home by "
    "them. "
)  # told four times: a model copies the retelling, so each position's logits hang on the ones before


@pytest.fixture(scope="module")
def pooled(smollm2_path: Path) -> Iterator[Model]:
    """SmolLM2 with its sessions' cells in one pool (``kv_layout="shared"``)."""
    with Model(smollm2_path, threads=2, kv_layout="shared", kv_tokens=4096) as model:
        yield model


@dataclass
class Cancelled:
    """A session whose first prompt was cancelled, and what was seen of its memory meanwhile."""

    model: Model
    session: Session
    stream: Stream
    prompt: list[int] = field(default_factory=list)  # the cancelled prompt's tokens
    armed_at: int = -1  # the record's length when the cancel was armed
    kept_by_llama: list[int] = field(default_factory=list)  # positions held right after an abort
    at_return: tuple[int, int, int] = (-1, -1, -1)  # record, pos_min, pos_max once the prefill gave up
    rows: np.ndarray | None = None  # the logits of the prompt's rest decoded after memory then


def cancel_a_prefill(
    model: Model, where: str, monkeypatch: pytest.MonkeyPatch, corrupt: Callable[[Seat], None] | None = None
) -> Cancelled:
    """The session's first prompt cancelled a third into its prefill: by another thread 20 ms
    into the batch in flight (the stream iterated on a worker thread: the native abort check; on
    the main thread: the Python one), or right after a batch returned. ``corrupt`` spoils the
    seat once the prefill gave up (the must-fail variants)."""
    session = model.session(context_size=N_CTX, batch_size=BATCH, share_prefix=False)
    stream = session.stream(STORY * 4, GREEDY)
    seen = Cancelled(model, session, stream, model.prompt_tokens([{"role": "user", "content": STORY * 4}]))
    third, mid_batch = len(seen.prompt) // 3, where.startswith("mid-batch")
    decode_many = NativeContext.decode_many  # (every decode goes through it: ``batching``)

    def cancelling(context: NativeContext, runs: Any, outputs: Any = None, **kwargs: Any) -> list[int]:
        ((tokens, start, seq),) = runs  # (the session decodes alone)
        if mid_batch and seen.armed_at < 0 and start >= third:
            seen.armed_at = start
            threading.Timer(0.02, stream.cancel).start()
        try:
            rows = decode_many(context, runs, outputs, **kwargs)
        except DecodeAborted:
            seen.kept_by_llama.append(context.pos_max(seq) + 1)  # before the record touches it
            raise
        if not mid_batch and seen.armed_at < 0 and start + len(tokens) >= third:
            seen.armed_at = start + len(tokens)  # (recorded once this returns)
            stream.cancel()
        return rows

    def observed(seat: Seat, *args: Any, **kwargs: Any) -> tuple[int, int] | None:
        first = prefill(seat, *args, **kwargs)
        if first is None:
            if corrupt is not None:
                corrupt(seat)
            with seat.host.hold():
                context, seq, held = seat.context, seat.seq, len(seat.items)
                seen.at_return = (held, context.pos_min(seq), context.pos_max(seq))
                if seen.at_return[2] == held - 1:  # (else llama.cpp refuses the rest's positions)
                    seen.rows = rows_after(
                        context, seq, held, seen.prompt[held:], internals.local(model).native.n_vocab
                    )
                    context.seq_rm(held, seq)
        return first

    with monkeypatch.context() as patch:
        patch.setattr(NativeContext, "decode_many", cancelling)
        patch.setattr(exchange, "prefill", observed)
        snapshots: list[Any] = []
        if where.endswith("worker thread"):
            worker = threading.Thread(target=lambda: snapshots.extend(stream))
            worker.start()
            worker.join()
        else:
            snapshots.extend(stream)
    assert snapshots == [] and stream.reply is not None and stream.reply.finish_reason == "cancelled"
    return seen


def rows_after(
    context: NativeContext, seq: int, start: int, tokens: Sequence[int], n_vocab: int
) -> np.ndarray:
    """The logits at each of ``tokens`` decoded from ``start`` in batches of ``ROWS`` (the rows of
    logits the engine's shared context reserves: 8 for each of its 4 sequences)."""
    assert context.batch.max_outputs >= ROWS
    rows = []
    for at in range(0, len(tokens), ROWS):
        chunk = tokens[at : at + ROWS]
        context.decode(chunk, start + at, seq=seq, outputs=True)
        rows += [context.last_logits(n_vocab, row).copy() for row in range(len(chunk))]
    return np.stack(rows)


FRESH_ROWS: dict[tuple[object, ...], np.ndarray] = {}  # fresh_rows' references, by what they depend on


def fresh_rows(model: Model, prompt: Sequence[int], held: int) -> np.ndarray:
    """What a fresh context's logits are at each prompt position from ``held`` on, decoded in the
    session's batches. Computed once for the model's file and flash attention, the prompt and
    ``held`` (in a context of its own: nothing a test did changes it); the cancels of every test
    here stop the one prompt at the same batch, so they compare against one reference."""
    key = (str(Path(model.path).resolve()), model.flash_attention, tuple(prompt), held)
    if key not in FRESH_ROWS:
        rows = decode_fresh_rows(model, prompt, held)
        rows.flags.writeable = False
        FRESH_ROWS[key] = rows
    return FRESH_ROWS[key]


def decode_fresh_rows(model: Model, prompt: Sequence[int], held: int) -> np.ndarray:
    context = NativeContext(
        internals.local(model).native,
        n_ctx=N_CTX,
        n_batch=512,
        threads=2,
        flash_attention=model.flash_attention,
    )
    try:
        for start, end in itertools.pairwise([*range(0, held, BATCH), held]):
            context.decode(prompt[start:end], start)
        return rows_after(context, 0, held, prompt[held:], internals.local(model).native.n_vocab)
    finally:
        context.close()


def assert_memory_as_recorded(seen: Cancelled, where: str) -> None:
    """llama.cpp's memory holds exactly the record's positions: right after an abort, once the
    prefill gave up, and once the session settled (any anticipation decoded the prompt's rest);
    and the record is the beginning of the next prompt."""
    session, (recorded, low, high) = seen.session, seen.at_return
    if where.startswith("mid-batch"):
        assert seen.kept_by_llama == [seen.armed_at], "llama.cpp kept other than the batches decoded"
    else:
        assert seen.kept_by_llama == [], "a batch was aborted"
    assert (recorded, low, high) == (seen.armed_at, 0, seen.armed_at - 1)
    assert seen.stream.reply is not None
    assert seen.stream.reply.usage.decoded_prompt_tokens == seen.armed_at
    record = internals.record(session)  # (settled)
    context = internals.live_context(session)
    assert context is not None
    _, seq = internals.placement(session)
    assert (context.pos_min(seq), context.pos_max(seq)) == (0, len(record) - 1)
    following = [*session.messages, {"role": "user", "content": QUESTION}]
    prompt = internals.local(seen.model).prompt(following, own=session.replies)
    assert len(record) >= seen.armed_at and list(record) == list(prompt.items[: len(record)])


def assert_rest_as_fresh(seen: Cancelled) -> None:
    """The prompt's rest, teacher-forced after what memory held once the prefill gave up: at each
    position the token memory's logits prefer is within the measured noise of a fresh context's
    top choice."""
    assert seen.rows is not None
    fresh = fresh_rows(seen.model, seen.prompt, seen.at_return[0])
    margins = fresh.max(axis=1) - fresh[np.arange(len(fresh)), seen.rows.argmax(axis=1)]
    tolerance = tolerance_for(short_prompt_noise(seen.model))
    worst = int(margins.argmax())
    at, difference = seen.at_return[0] + worst, float(np.abs(fresh - seen.rows).max())
    message = f"position {at}: fresh prefers another token by {margins[worst]:.2f}"
    assert margins[worst] <= tolerance, f"{message} (logits differ by up to {difference:.2f})"


def assert_next_reply_as_fresh(seen: Cancelled) -> None:
    """The next turn's reply, against a fresh session given the same transcript: equal, or
    parting at a near tie."""
    session, model = seen.session, seen.model
    before = copy.deepcopy(session.messages)
    reply = session.respond(QUESTION, scored(GREEDY))
    assert reply.usage.reused_tokens >= seen.armed_at
    fresh = fresh_reply(model, before)
    assert fresh.usage.reused_tokens == 0
    assert_same_within_noise(model, reply, fresh)


FRESH_REPLIES: weakref.WeakKeyDictionary[Model, dict[str, Reply]] = weakref.WeakKeyDictionary()


def fresh_reply(model: Model, before: list[dict[str, Any]]) -> Reply:
    """A fresh session's scored greedy reply to ``QUESTION`` after the transcript ``before``, in
    ``model`` (its layout: another model's cells lie elsewhere). Kept per model and transcript:
    every cancel here leaves the same transcript (the prompt, an empty reply), so the three
    cancels' next replies compare against one fresh reply."""
    kept = FRESH_REPLIES.setdefault(model, {})
    key = json.dumps(before, sort_keys=True)
    if key not in kept:
        fresh_session = model.session(share_prefix=False)
        fresh_session.messages = copy.deepcopy(before)
        kept[key] = fresh_session.respond(QUESTION, scored(GREEDY))
    return kept[key]


WHERE = ("mid-batch, worker thread", "mid-batch, main thread", "between batches")


@pytest.mark.parametrize("where", WHERE)
def test_a_cancelled_prefill_leaves_memory_as_recorded_and_the_next_reply_as_fresh(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    """... and what llama.cpp logs about a decode stopped on purpose is debug, not an error
    (on a worker thread the native check stops it, which cannot tell Python: an embedding app
    logged 3 errors and a warning for every client that left during a prefill)."""
    with caplog.at_level(logging.DEBUG, logger="llmsession.native"):
        seen = cancel_a_prefill(smollm2, where, monkeypatch)
    native = [r for r in caplog.records if r.name.startswith("llmsession.native")]
    assert [r.getMessage() for r in native if r.levelno >= logging.WARNING] == []
    assert any("ret = 2" in r.getMessage() for r in native) == where.startswith("mid-batch")
    assert_memory_as_recorded(seen, where)
    assert_rest_as_fresh(seen)
    assert_next_reply_as_fresh(seen)


def test_in_one_pool_of_cells_too(pooled: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """kv_layout="shared": other sessions' cells lie in the stream the cancelled one's lie in."""
    for i in range(2):
        pooled.session(share_prefix=False).respond(f"Hello number {i}!", GREEDY)
    seen = cancel_a_prefill(pooled, WHERE[0], monkeypatch)
    assert_memory_as_recorded(seen, WHERE[0])
    assert_rest_as_fresh(seen)
    assert_next_reply_as_fresh(seen)


# -- the variants that must fail ------------------------------------------------------------------
def one_ahead(seat: Seat) -> None:
    """The record claims the aborted batch's first position, which llama.cpp removed."""
    seat.lease.cache.extend([seat.items[-1]])


def a_batch_behind(seat: Seat) -> None:
    """The record forgets its last batch, which llama.cpp kept."""
    kept = seat.lease.cache.items[:-BATCH]
    seat.lease.cache.reset()
    seat.lease.cache.extend(kept)


def other_tokens(seat: Seat) -> None:
    """The record's count is right but its last batch's positions hold another token's cells."""
    held, first = len(seat.items), int(seat.items[-BATCH])  # type: ignore[call-overload]
    with seat.host.hold():
        seat.context.seq_rm(held - BATCH, seat.seq)
        seat.context.decode([first] * BATCH, held - BATCH, seq=seat.seq)


@pytest.mark.parametrize("corrupt", [one_ahead, a_batch_behind], ids=["one-ahead", "a-batch-behind"])
def test_a_record_that_miscounts_memory_is_caught(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch, corrupt: Callable[[Seat], None]
) -> None:
    seen = cancel_a_prefill(smollm2, WHERE[0], monkeypatch, corrupt)
    with pytest.raises(AssertionError, match=r"assert \(\d+, 0, \d+\) == \(\d+, 0, \d+\)"):
        assert_memory_as_recorded(seen, WHERE[0])


def test_a_memory_holding_other_tokens_than_recorded_is_caught(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = cancel_a_prefill(smollm2, WHERE[0], monkeypatch, other_tokens)
    assert_memory_as_recorded(seen, WHERE[0])  # the count agrees
    with pytest.raises(AssertionError, match="fresh prefers another token"):
        assert_rest_as_fresh(seen)
