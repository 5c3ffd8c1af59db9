"""Per-session KV prefix reuse on the real library, proven equal to a fresh decode."""

from __future__ import annotations

import copy
import functools
import itertools
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import internals
import numpy as np
import pytest

from llmsession import (
    CheckpointConfig,
    ContextOverflowError,
    GenerationOptions,
    Model,
    NativeError,
    Session,
    SessionConfig,
)
from llmsession.engine.prefix import PrefixCache, common_prefix
from llmsession.native.context import NativeContext
from llmsession.native.llama import bindings

T = TypeVar("T")
GREEDY = GenerationOptions(max_tokens=24, temperature=0)
QUESTIONS = (
    "Tell me about the history of Paris in detail.",
    "Now describe its most famous museums, one by one.",
    "Which rivers and bridges should a visitor see, and why?",
    "Write a long poem about the city at night.",
)


def fresh_reply(
    model: Model,
    messages: list[dict[str, Any]],
    content: str,
    options: GenerationOptions = GREEDY,
    **session_args: Any,
) -> Any:
    """What a brand-new session answers given the same transcript (kept apart: it starts from
    nothing another session holds)."""
    session = model.session(config=SessionConfig(share_prefix=False, **session_args))  # (or a LocalModel)
    session.messages = copy.deepcopy(messages)
    return session.respond(content, options)


def split_noise(model: Model, n_tokens: int) -> float:
    """The largest final-logit difference between fresh decodes of one prompt of about n_tokens
    cut into batches differently: whole, 512- and 64-token batches, the last token alone (the
    batch sizes the tests use), and the last 24 tokens one at a time, as generation decodes a
    reply (on the Intel Xeon, 2026-12-02, only that variant differs: 0.57 at 300 tokens, where
    batch cuts are exact). Zero means the build is batch-split exact for this model."""
    tokens = model.prompt_tokens([{"role": "user", "content": paragraph(model, 0, n_tokens)}])
    n = len(tokens)
    one_by_one = tuple(range(n - 24, n))
    splits = {(), (n - 1,), tuple(range(64, n, 64)), tuple(range(512, n, 512)), one_by_one}
    variants = [
        fresh_logits(model, tokens, list(s)) if s else whole_logits(model, tokens) for s in sorted(splits)
    ]
    return max(float(np.abs(a - b).max()) for a, b in itertools.combinations(variants, 2))


def placement_noise(model: Model, n_tokens: int) -> float:
    """The largest final-logit difference between one prompt of about n_tokens decoded into the
    first cells of a fresh context and after another sequence's cells in a larger one: a
    session's cells lie anywhere in the shared cache. Zero where attention sums alike wherever
    the cells lie (flash attention on this build)."""
    tokens = model.prompt_tokens([{"role": "user", "content": paragraph(model, 0, n_tokens)}])
    other = model.prompt_tokens([{"role": "user", "content": paragraph(model, 1, 600)}])
    first = whole_logits(model, tokens)
    flash = model.flash_attention
    context = NativeContext(
        internals.local(model).native,
        n_ctx=2 * N_CTX,
        n_batch=N_CTX,
        threads=2,
        n_seq_max=2,
        flash_attention=flash,
    )
    try:
        context.decode(other, 0, seq=1)
        context.decode(tokens, 0, seq=0)
        return float(np.abs(first - read_logits(model, context)).max())
    finally:
        context.close()


def measured_once(*, layout: bool = False) -> Callable[[Callable[[Model], T]], Callable[[Model], T]]:
    """Cache a measurement by what it depends on, not by the Model object: the model's file,
    flash attention and how its prompts render (the fresh contexts are the measurement's own),
    and with ``layout`` its cells' layout; models loaded alike in different tests share one."""

    def decorate(measure: Callable[[Model], T]) -> Callable[[Model], T]:
        kept: dict[tuple[object, ...], T] = {}

        @functools.wraps(measure)
        def measured(model: Model) -> T:
            key: tuple[object, ...] = (str(Path(model.path).resolve()), model.flash_attention)
            key += (model.template, model.use_jinja)
            if layout:
                key += (internals.local(model).engine.own_cells(True),)
            if key not in kept:
                kept[key] = measure(model)
            return kept[key]

        return measured

    return decorate


@measured_once()
def short_prompt_noise(model: Model) -> float:
    """What a fresh decode of a prompt may differ by from a cached one: its batch splits, and
    where its cells lie, counted half: ``tolerance_for`` doubles the noise (a cached decode
    crosses more batch boundaries than any fresh split variant) but a decode lies in one
    placement."""
    return split_noise(model, 300) + placement_noise(model, 300) / 2


@measured_once(layout=True)
def batch_noise(model: Model) -> float:
    """The largest final-logit difference between a prompt's last token decoded alone and in one
    batch with three other sequences' steps (concurrent streams are decoded that way), added to
    the split noise: what two streams' replies may differ by when one ran beside others."""
    alone, together = batch_rows(model)
    return short_prompt_noise(model) + float(np.abs(alone - together).max())


@measured_once(layout=True)
def batch_rows(model: Model) -> tuple[np.ndarray, np.ndarray]:
    """A prompt's final logits, its last token decoded alone and batched with three others', in
    the model's layout (with cells of their own, each sequence N_CTX)."""
    tokens = model.prompt_tokens([{"role": "user", "content": paragraph(model, 0, 300)}])
    n = len(tokens)
    own = internals.local(model).engine.own_cells(True)
    context = NativeContext(
        internals.local(model).native,
        n_ctx=4 * N_CTX if own else N_CTX,
        n_batch=512,
        threads=2,
        n_seq_max=4,
        flash_attention=model.flash_attention,
        own_cells=own,
    )
    try:
        for seq in range(4):
            context.decode(tokens[: n - 1 - 7 * seq], 0, seq=seq)
        context.decode(tokens[n - 1 :], n - 1, seq=0)
        alone = read_logits(model, context)
        context.seq_rm(n - 1, 0)
        runs = [
            (tokens[n - 1 :], n - 1, 0),
            *((tokens[n - 1 - 7 * s : n - 7 * s], n - 1 - 7 * s, s) for s in (1, 2, 3)),
        ]
        row = context.decode_many(runs)[0]
        together = context.last_logits(internals.local(model).native.n_vocab, row).copy()
    finally:
        context.close()
    return alone, together


def assert_same_as_fresh(session: Session, content: str, **session_args: Any) -> Any:
    """Token for token equal to a fresh session where the build is batch-split exact; elsewhere
    each cached choice within the measured split noise of a fresh decode's (see Gemma 3 below)."""
    before = copy.deepcopy(session.messages)
    internals.settle_others(session)  # (another's anticipation decoding after the reply would
    reply = session.respond(content, GREEDY)  # overwrite the logits the final check reads)
    noise = short_prompt_noise(session.model)  # in contexts of its own
    # First: the fresh session below decodes into the same shared context.
    problems = check_against_fresh(session, reply, tolerance_for(noise)) if noise else []
    # Its text is the reference only where the build is exact; elsewhere the teacher-forced
    # check above is, and the fresh session's one reply token shows it reused nothing.
    options = GREEDY if noise == 0 else GenerationOptions(max_tokens=1, temperature=0)
    fresh = fresh_reply(session.model, before, content, options, **session_args)
    assert reply.usage.completion_tokens >= 16, "compare at least 16 generated tokens"
    assert fresh.usage.reused_tokens == 0
    assert reply.usage.decoded_prompt_tokens == reply.usage.prompt_tokens - reply.usage.reused_tokens
    if noise == 0:
        assert reply.text == fresh.text
    else:
        assert problems == [], f"split noise {noise:.3f}"
    return reply


N_CTX = 2048


def paragraph(model: Model, seed: int, n_tokens: int) -> str:
    """A user message of about n_tokens tokens."""
    words = [
        "river",
        "bridge",
        "lantern",
        "harbour",
        "meadow",
        "orchard",
        "tower",
        "valley",
        "garden",
        "winter",
    ]
    rng = np.random.default_rng(seed)
    text = ""
    while len(model.tokenize(text, add_special=False)) < n_tokens:
        text += " ".join(rng.choice(words, 16)) + ". "
    return text.strip()


def read_logits(model: Model, context: NativeContext) -> np.ndarray:
    _, ffi = bindings()
    buffer = ffi.buffer(internals.raw_logits(context), 4 * internals.local(model).native.n_vocab)
    return np.frombuffer(buffer, dtype=np.float32).copy()


def fresh_logits(model: Model, tokens: list[int], splits: list[int]) -> np.ndarray:
    """Final logits of a fresh decode of tokens, cut into batches at the given positions."""
    context = NativeContext(
        internals.local(model).native,
        n_ctx=N_CTX,
        n_batch=len(tokens),
        threads=2,
        flash_attention=model.flash_attention,
    )
    try:
        for a, b in itertools.pairwise([0, *splits, len(tokens)]):
            context.decode(tokens[a:b], a)
        return read_logits(model, context)
    finally:
        context.close()


WHOLE: weakref.WeakKeyDictionary[Model, tuple[tuple[int, ...], np.ndarray]]
WHOLE = weakref.WeakKeyDictionary()  # per model (held weakly), its latest whole-prompt decode


def whole_logits(model: Model, tokens: list[int]) -> np.ndarray:
    """``fresh_logits(model, tokens, [])``, kept for the same model object and tokens: the split
    noise and the placement noise of one measurement both start from this decode (the same
    computation in a context of the same shape: decoded once, it is the same logits)."""
    kept = WHOLE.get(model)
    if kept is None or kept[0] != tuple(tokens):
        logits = fresh_logits(model, tokens, [])
        logits.flags.writeable = False
        kept = WHOLE[model] = (tuple(tokens), logits)
    return kept[1]


def tolerance_for(noise: float) -> float:
    """Twice the measured split noise: a cached decode crosses more batch boundaries (earlier
    turns, one-token generation steps) than any single fresh split variant does."""
    return 2 * noise + 0.05


def check_against_fresh(
    session: Session,
    reply: Any,
    tolerance: float,
    *,
    final: bool = True,
    at_least: int = 16,
    reference: Model | None = None,
) -> list[str]:
    """Teacher-force a fresh context (of ``reference``, else of the session's model) through the
    session's prompt and reply tokens; report each step where the cached choice is not within
    tolerance of the fresh top logit, and a final logit difference above tolerance."""
    model = reference or session.model
    recorded = [int(t) for t in internals.record(session)]
    prompt, generated = recorded[: reply.usage.prompt_tokens], recorded[reply.usage.prompt_tokens :]
    assert len(generated) >= at_least, f"compare at least {at_least} generated tokens"
    ahead = internals.decoded_ahead(session)  # the next prompt's opening, decoded after the reply
    problems = []
    steps = fresh_steps(model, tuple(prompt), tuple(generated), len(generated) - ahead)
    # The reply's own tokens; after them the record may hold the next prompt's opening, decoded
    # ahead (not sampled: only the final logits say whether it went in right).
    for step, token in enumerate(generated[: reply.usage.completion_tokens]):
        margin = float(steps[step].max() - steps[step][token])
        if margin > tolerance:
            problems.append(f"step {step}: fresh prefers another token by {margin:.2f}")
    if final:  # the session's own logits: only while nothing else decoded since its reply
        difference = float(np.abs(steps[-1] - internals.last_logits(session)).max())
        if difference > tolerance:
            problems.append(f"final logits differ by {difference:.2f}")
    return problems


FRESH: weakref.WeakKeyDictionary[Model, dict[tuple[object, ...], tuple[np.ndarray, ...]]]
FRESH = weakref.WeakKeyDictionary()  # per model (held weakly), the last few fresh decodes
FRESH_KEPT = 12


def fresh_steps(
    model: Model, prompt: tuple[int, ...], generated: tuple[int, ...], reply_end: int
) -> tuple[np.ndarray, ...]:
    """What a fresh context chooses from at each step of a teacher-forced reply: the prompt in
    batches of 512, the reply in one batch, then what was decoded ahead in another. Kept for the
    same model object and tokens, since it is the same computation (the Gemma 3 variants below
    reach the same transcripts through different caches)."""
    kept = FRESH.setdefault(model, {})
    key = (prompt, generated, reply_end)
    if key not in kept:
        if len(kept) >= FRESH_KEPT:
            del kept[next(iter(kept))]
        kept[key] = decode_fresh(model, prompt, generated, reply_end)
    return kept[key]


def decode_fresh(
    model: Model, prompt: tuple[int, ...], generated: tuple[int, ...], reply_end: int
) -> tuple[np.ndarray, ...]:
    context = NativeContext(
        internals.local(model).native,
        n_ctx=N_CTX,
        n_batch=512,
        threads=2,
        flash_attention=model.flash_attention,
    )
    try:
        for start in range(0, len(prompt), 512):
            context.decode(prompt[start : start + 512], start)
        steps = [read_logits(model, context)]  # what step 0 chose from, then each step's own
        n_vocab = internals.local(model).native.n_vocab
        for start, end in ((0, reply_end), (reply_end, len(generated))):
            if end > start:
                context.decode(generated[start:end], len(prompt) + start, outputs=True)
                steps += [context.last_logits(n_vocab, row).copy() for row in range(end - start)]
    finally:
        context.close()
    for step in steps:
        step.flags.writeable = False
    return tuple(steps)


def test_turn_two_reuses_all_of_turn_one(smollm2: Model) -> None:
    session = smollm2.session(system="You are a helpful assistant.")
    first = session.respond(QUESTIONS[0], GREEDY)
    assert first.usage.reused_tokens == 0
    assert first.usage.decoded_prompt_tokens == first.usage.prompt_tokens
    second = session.respond(QUESTIONS[1], GREEDY)
    assert second.usage.reused_tokens > first.usage.prompt_tokens
    assert second.usage.decoded_prompt_tokens == second.usage.prompt_tokens - second.usage.reused_tokens
    session.clear_cached_context()
    third = session.respond(QUESTIONS[2], GREEDY)
    assert third.usage.reused_tokens == 0
    assert third.usage.decoded_prompt_tokens == third.usage.prompt_tokens


def test_differential_turns_edits_deletes_and_regeneration_smollm2(smollm2: Model) -> None:
    """Equal to a fresh session at every step: token for token where the build is batch-split
    exact for SmolLM2 (as measured on the pinned build's reference machine), else within noise."""
    session = smollm2.session(system="You are a helpful assistant.")
    first_turn_tokens = assert_same_as_fresh(session, QUESTIONS[0]).usage.prompt_tokens
    for question in QUESTIONS[1:3]:
        assert_same_as_fresh(session, question)
    session.messages[1]["content"] = "Tell me about the history of Rome in detail."  # edit an early turn
    recorded = internals.record(session)
    prompt = smollm2.prompt_tokens([*session.messages, {"role": "user", "content": QUESTIONS[3]}])
    edited = assert_same_as_fresh(session, QUESTIONS[3])
    assert edited.usage.reused_tokens == common_prefix(recorded, prompt)  # up to "Paris", no further
    assert 0 < edited.usage.reused_tokens < first_turn_tokens
    del session.messages[3:5]  # delete the second exchange
    assert_same_as_fresh(session, "And what about its food?")
    last_user = session.messages[-2]["content"]
    del session.messages[-2:]  # regenerate the last reply
    regenerated = assert_same_as_fresh(session, last_user)
    assert regenerated.usage.decoded_prompt_tokens <= 20


def test_two_sessions_keep_their_own_caches(smollm2: Model) -> None:
    a, b = smollm2.session(system="You are A."), smollm2.session(system="You are B.")
    a1 = a.respond(QUESTIONS[0], GREEDY)
    b1 = b.respond(QUESTIONS[1], GREEDY)
    a2 = a.respond(QUESTIONS[2], GREEDY)
    b2 = b.respond(QUESTIONS[3], GREEDY)
    assert a2.usage.reused_tokens > a1.usage.prompt_tokens
    assert b2.usage.reused_tokens > b1.usage.prompt_tokens


def test_overflow_leaves_the_cache_intact(smollm2: Model) -> None:
    session = smollm2.session(context_size=512)
    first = session.respond(QUESTIONS[0], GREEDY)
    held = internals.record(session)  # settled: with the next prompt's opening decoded ahead
    with pytest.raises(ContextOverflowError):
        session.respond("word " * 600, GREEDY)
    assert internals.record(session) == held
    second = session.respond(QUESTIONS[1], GREEDY)
    assert second.usage.reused_tokens > first.usage.prompt_tokens


def test_a_decode_error_discards_the_cache_and_the_next_turn_is_correct(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = smollm2.session(system="You are a helpful assistant.")
    session.respond(QUESTIONS[0], GREEDY)
    real_decode = NativeContext.decode_many
    calls = {"n": 0}

    def failing_decode(self: NativeContext, runs: Any, outputs: Any = None, **flags: Any) -> list[int]:
        calls["n"] += 1  # the prompt's decode, then the generation steps'
        if calls["n"] == 5:
            raise NativeError("llama_decode failed (injected)")
        return real_decode(self, runs, outputs, **flags)

    monkeypatch.setattr(NativeContext, "decode_many", failing_decode)
    messages = copy.deepcopy(session.messages)
    with pytest.raises(NativeError, match="injected"):
        session.respond(QUESTIONS[1], GREEDY)
    assert session.cached_tokens == 0
    assert session.messages == messages
    monkeypatch.undo()
    after = assert_same_as_fresh(session, QUESTIONS[1])
    assert after.usage.reused_tokens == 0


def test_a_cancelled_turn_then_a_normal_one_equals_fresh(smollm2: Model) -> None:
    session = smollm2.session(system="You are a helpful assistant.")
    session.respond(QUESTIONS[0], GREEDY)
    stream = session.stream(QUESTIONS[1], GenerationOptions(max_tokens=40, temperature=0))
    for i, _ in enumerate(stream):
        if i == 5:
            stream.cancel()
    assert stream.reply is not None and stream.reply.finish_reason == "cancelled"
    reply = assert_same_as_fresh(session, QUESTIONS[3])
    assert reply.usage.reused_tokens > 0


# -- recurrent memory: seq_rm refuses partial removals, checkpoints resume below the cut ---------
@pytest.mark.parametrize("kept", [8, 0], ids=["checkpoints", "no-checkpoints"])
def test_recurrent_model_rewinds_to_a_checkpoint_or_decodes_everything(
    fixture_path: Callable[[str], Path], kept: int
) -> None:
    config = CheckpointConfig(max_count=kept)
    with Model(fixture_path("mamba-tiny.gguf"), threads=2, checkpoints=config) as model:
        assert internals.local(model).native.is_recurrent
        session = model.session(system="You are a helpful assistant.", context_size=1024)
        for question in QUESTIONS[:2]:
            assert_same_as_fresh(session, question)
        session.messages[1]["content"] = "An edited first question."
        edited = assert_same_as_fresh(session, QUESTIONS[2])
        assert edited.usage.reused_tokens == 0, "no checkpoint lies below an edit of the first message"
        last_user = session.messages[-2]["content"]
        del session.messages[-2:]
        regenerated = assert_same_as_fresh(session, last_user)
        if kept:  # the checkpoint before the prompt's last token
            assert regenerated.usage.from_checkpoint
            assert regenerated.usage.decoded_prompt_tokens == 1
        else:
            assert (regenerated.usage.reused_tokens, regenerated.usage.from_checkpoint) == (0, False)


def test_mamba_fixture_refuses_partial_removal(fixture_path: Callable[[str], Path]) -> None:
    from llmsession.native.llama import NativeModel

    model = NativeModel(fixture_path("mamba-tiny.gguf"))
    context = NativeContext(model, n_ctx=64, n_batch=16, threads=2)
    context.decode(list(range(100, 108)), 0)
    assert context.seq_rm(4) is False
    assert context.seq_rm(7) is False
    assert context.seq_rm(0) is True
    context.close()
    model.close()


# -- Gemma 3: sliding window, batch-split noise ------------------------------------------------
# Gemma 3 Q4_K_M logits depend (slightly) on how a prompt is split into batches, so cached and
# fresh decodes are compared within the measured split noise, not exactly.
@pytest.fixture(scope="module")
def gemma3_noise(gemma3: Model) -> float:
    """Gemma 3's split noise on a ~900-token prompt; the tolerance is built on it."""
    noise = split_noise(gemma3, 900) + placement_noise(gemma3, 900) / 2  # (as short_prompt_noise)
    assert noise < 3.0, f"batch-split noise {noise:.2f} is larger than expected"
    return noise


def drive_gemma3(session: Session, tolerance: float, *, until: str = "") -> list[str]:
    """Turns long enough to pass the 512-token window; an edit near the start that rewinds more
    than 512 positions; a deleted long exchange, after which the next question resumes right
    after the first reply (on a small cache, long evicted); a regenerated reply. Returns the
    problems found against a fresh decode at every step."""
    model, problems = session.model, []
    options = GenerationOptions(max_tokens=24, temperature=0)

    def step(content: str, label: str) -> Any:
        reply = session.respond(content, options)
        if not until or label == until:  # drive up to ``until`` unchecked, then check it alone
            problems.extend(f"{label}: {p}" for p in check_against_fresh(session, reply, tolerance))
        return reply

    step(paragraph(model, 1, 220), "turn 1")
    step(paragraph(model, 2, 700), "turn 2")
    held = session.cached_tokens
    step("Summarize all of that in one line.", "turn 3")
    session.messages[0]["content"] = session.messages[0]["content"][:-40] + " lighthouse."
    edited = step("What changed?", "after an edit")
    assert held - edited.usage.reused_tokens > 512 or edited.usage.reused_tokens == 0
    del session.messages[2:]
    step("Which word came first?", "after a deleted exchange")
    if until == "after a deleted exchange":
        return problems
    last_user = session.messages[-2]["content"]
    del session.messages[-2:]
    step(last_user, "regenerated")
    return problems


@pytest.mark.parametrize(
    ("swa_full", "batch_size"),
    [(True, 512), (False, 64)],  # 64: the small cache (window + one batch) really evicts
    ids=["full-window-cache", "small-cache-pos-min-check"],
)
def test_differential_gemma3_within_batch_split_noise(
    gemma3: Model, gemma3_noise: float, swa_full: bool, batch_size: int
) -> None:
    tolerance = tolerance_for(gemma3_noise)
    session = gemma3.session(context_size=N_CTX, batch_size=batch_size, swa_full=swa_full)
    problems = drive_gemma3(session, tolerance)
    assert problems == [], f"batch-split noise {gemma3_noise:.3f}, tolerance {tolerance:.3f}: {problems}"


def test_gemma3_differential_has_teeth(
    gemma3: Model, gemma3_noise: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The small sliding-window cache without llama-server's pos_min check decodes a deep rewind
    over an evicted window: the same differential must catch it."""
    monkeypatch.setattr(PrefixCache, "_holds_context", lambda self, memory, reused: True)
    # The small cache holds the window plus one batch (n_ubatch) of cells: small batches make the
    # conversation outgrow it, so the positions the edit rewinds to are really evicted.
    session = gemma3.session(context_size=N_CTX, batch_size=64, swa_full=False)
    problems = drive_gemma3(session, tolerance_for(gemma3_noise), until="after a deleted exchange")
    assert any(p.startswith("after a deleted exchange") for p in problems), problems
