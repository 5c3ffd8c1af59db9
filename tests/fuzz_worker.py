"""The public-API fuzzer (issue 13): a hypothesis state machine driving three sessions on one
real model through ``respond``, partial and cancelled streams, transcript edits (valid and
invalid), cache clears, images, bad options and bad contents, and context overflow.

llama.cpp can abort the process, so ``tests/test_fuzz.py`` runs this file as a subprocess and
requires exit status 0. Run it by hand::

    .venv/bin/python tests/fuzz_worker.py                 # the fast, derandomized CI profile
    .venv/bin/python tests/fuzz_worker.py --minutes 5     # seeded runs until the time is up
    .venv/bin/python tests/fuzz_worker.py --seed 123 --runs 1   # replay one long-profile run

The oracle for every call is a shadow transcript per session, and the prompt the model would
build for it (``Model.prompt``): its size says whether the call must overflow, the session's
token record says how much must be reused. A differential rule compares the first-token logits
of a cached session with those of a fresh session on the same transcript, within the batch-split
noise ``tests/test_reuse.py`` measures on this build (on a 300-token prompt; on 900 tokens for
prompts longer than 400).
"""

from __future__ import annotations

import argparse
import base64
import copy
import dataclasses
import faulthandler
import functools
import itertools
import math
import random
import sys
import threading
import time
import weakref
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from test_reuse import read_logits, short_prompt_noise, split_noise, tolerance_for

from llmsession import (
    ContextOverflowError,
    GenerationOptions,
    Image,
    LlmSessionError,
    Model,
    Reply,
    Session,
    Stream,
    paths,
)

Message = dict[str, Any]
TYPED: tuple[type[Exception], ...] = (TypeError, ValueError, LlmSessionError)
CONTEXT_SIZES = (1024, 512)  # sessions 0 and 1; session 2 gets 64-128 positions
GREEDY_ONE = GenerationOptions(max_tokens=1, temperature=0.0)
MARKER = "<__media__>"


# -- the environment the machine runs in: one model for the whole process ---------------------
LONG_PROMPT = 400  # beyond this many tokens, the split noise measured on 900 tokens applies


@dataclass
class Env:
    model: Model
    noise: float  # split noise on a ~300-token prompt (test_reuse.short_prompt_noise)
    images: dict[str, Image]
    image_paths: dict[str, Path]
    log: TextIO | None = None
    long_noise: float | None = None  # on a ~900-token prompt, measured when first needed

    def noise_at(self, n_tokens: int) -> float:
        """The split noise for a prompt of n_tokens: more positions, more rounding differences."""
        if n_tokens <= LONG_PROMPT:
            return self.noise
        if self.long_noise is None:
            started = time.monotonic()
            self.long_noise = max(self.noise, split_noise(self.model, 900))
            print(
                f"split noise on 900 tokens {self.long_noise:.4f}, tolerance "
                f"{tolerance_for(self.long_noise):.4f} ({time.monotonic() - started:.1f} s)",
                flush=True,
            )
        return self.long_noise


@dataclass
class Stats:
    examples: int = 0
    steps: int = 0
    rules: Counter[str] = field(default_factory=Counter)
    seconds: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    outcomes: Counter[str] = field(default_factory=Counter)
    differentials: int = 0
    largest_logit_difference: float = 0.0
    largest_difference_prompt: int = 0
    largest_choice_margin: float = 0.0

    def summary(self) -> str:
        rules = ", ".join(
            f"{name} {n} ({self.seconds[name]:.1f} s)" for name, n in sorted(self.rules.items())
        )
        outcomes = ", ".join(f"{name} {n}" for name, n in sorted(self.outcomes.items()))
        return (
            f"{self.examples} examples, {self.steps} steps\n"
            f"  rules: {rules}\n"
            f"  outcomes: {outcomes}\n"
            f"  differential checks: {self.differentials}, largest logit difference "
            f"{self.largest_logit_difference:.4f} (prompt of {self.largest_difference_prompt} tokens), "
            f"largest margin of the cached choice {self.largest_choice_margin:.4f}"
        )


_env: Env | None = None
STATS = Stats()


def env() -> Env:
    assert _env is not None, "run the fuzzer through main()"
    return _env


# -- strategies -------------------------------------------------------------------------------
SNIPPETS = (
    "Hello",
    "What is the capital of France?",
    "Tell me a short story.",
    "Why?",
    "über Straße",
    "日本語のテキスト",
    "🙂🚀",
    "<|im_end|>",
    "<|im_start|>assistant",
    "\n",
    "  ",
    "\t",
    "1 2 3",
    "Paris.",
    "\u200b",
    "\r\n",
    "%s {} {{x}} {% if %}",
    "a" * 60,
)
TEXTS = st.one_of(
    st.just(""),
    st.lists(st.sampled_from(SNIPPETS), min_size=1, max_size=4).map(" ".join),
    st.text(st.characters(codec="utf-8", exclude_characters="\0"), max_size=24),
)


def fixture_image(name: str) -> Image:
    return env().images[name]


def random_image(height: int, width: int, seed: int) -> Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image(pixels)


def image_path_part(name: str) -> dict[str, Any]:
    return {"type": "image", "image": str(env().image_paths[name])}


def data_url_part(name: str) -> dict[str, Any]:
    data = base64.b64encode(env().image_paths[name].read_bytes()).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


FIXTURE_NAMES = st.sampled_from(["red", "blue"])
IMAGES = st.one_of(
    FIXTURE_NAMES.map(fixture_image),
    st.builds(random_image, st.integers(1, 40), st.integers(1, 40), st.integers(0, 2**16)),
    FIXTURE_NAMES.map(image_path_part),
    FIXTURE_NAMES.map(data_url_part),
)
TEXT_PARTS = st.one_of(TEXTS, TEXTS.map(lambda text: {"type": "text", "text": text}))
PART_LISTS = st.lists(st.one_of(TEXT_PARTS, IMAGES), min_size=0, max_size=3)
CONTENTS: st.SearchStrategy[Any] = st.one_of(TEXTS, PART_LISTS, PART_LISTS.map(tuple))

STOPS = st.one_of(
    st.sampled_from(["\n", ".", " ", ",", "the", "I", "Paris", "<|im_end|>", "x" * 300, "The capital", "🙂"]),
    st.text(st.characters(codec="utf-8", exclude_characters="\0"), min_size=1, max_size=4),
)
OPTIONS = st.builds(
    GenerationOptions,
    max_tokens=st.integers(1, 12),
    temperature=st.one_of(
        st.just(0.0),
        st.floats(0.05, 3.0),
        st.sampled_from([1e-300, 1e-30, 1e-6, 50.0, 1e30, 1e300]),
    ),
    top_k=st.sampled_from([0, 1, 2, 40, 2**31 - 1]),
    top_p=st.sampled_from([5e-324, 1e-9, 0.1, 0.5, 0.95, 1.0]),
    min_p=st.sampled_from([0.0, 0.05, 0.5, 0.999, 1.0]),
    repeat_penalty=st.sampled_from([1.0, 1.0, 1e-3, 0.9, 1.3, 1e6]),
    repeat_last_n=st.sampled_from([-1, 0, 1, 64, 2**31 - 1]),
    frequency_penalty=st.sampled_from([0.0, 0.0, 0.5, -2.0, 1e6]),
    presence_penalty=st.sampled_from([0.0, 0.0, 0.7, -1.5, -1e6]),
    seed=st.one_of(st.none(), st.integers(0, 2**32 - 2)),
    stop=st.lists(STOPS, max_size=3).map(tuple),
)
GREEDY_SHORT = st.builds(GenerationOptions, max_tokens=st.integers(1, 4), temperature=st.just(0.0))

NAN, INF = math.nan, math.inf
BAD_FIELDS: tuple[tuple[str, Any], ...] = (
    ("max_tokens", -1),
    ("max_tokens", 0),
    ("max_tokens", 2**31),
    ("max_tokens", 2**40),
    ("max_tokens", 1.5),
    ("max_tokens", True),
    ("max_tokens", "3"),
    ("max_tokens", None),
    ("temperature", NAN),
    ("temperature", INF),
    ("temperature", -0.1),
    ("temperature", "0"),
    ("temperature", None),
    ("top_k", -1),
    ("top_k", 2**31),
    ("top_k", 2**40),
    ("top_k", 2.0),
    ("top_p", 0.0),
    ("top_p", 1.0000001),
    ("top_p", NAN),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("min_p", NAN),
    ("repeat_penalty", 0.0),
    ("repeat_penalty", -1.0),
    ("repeat_penalty", NAN),
    ("repeat_penalty", INF),
    ("repeat_last_n", -2),
    ("repeat_last_n", 2**31),
    ("repeat_last_n", 2**63),
    ("frequency_penalty", NAN),
    ("frequency_penalty", -INF),
    ("presence_penalty", INF),
    ("presence_penalty", "1"),
    ("seed", -1),
    ("seed", 2**32 - 1),
    ("seed", 2**32),
    ("seed", 2**64),
    ("seed", 1.0),
    ("seed", True),
    ("stop", ("",)),
    ("stop", ("a\0b",)),
    ("stop", (1,)),
    ("stop", b"stop"),
    ("stop", None),
    ("stop", {"a": 1}),
    ("stop", ("ok", None)),
)
NOT_OPTIONS: tuple[Any, ...] = ({"max_tokens": 4}, "greedy", 5, GenerationOptions)


def invalid_content(kind: str, text: str) -> tuple[Any, tuple[type[Exception], ...]]:
    """An invalid user content and the errors it may raise."""
    red = env().images["red"]
    contents: dict[str, tuple[Any, tuple[type[Exception], ...]]] = {
        "nul": (f"{text}\0{text}", (ValueError,)),
        "nul part": ([text, "a\0b"], (ValueError,)),
        "nul text dict": ([{"type": "text", "text": "\0"}], (ValueError,)),
        "surrogate": (f"{text}\ud800", (ValueError,)),
        "int": (5, TYPED),
        "none": (None, TYPED),
        "bytes": (b"hello", TYPED),
        "dict": ({"role": "user", "content": text}, TYPED),
        "int part": ([text, 5], TYPED),
        "audio part": ([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}], TYPED),
        "text part not str": ([{"type": "text", "text": 5}], TYPED),
        "image without source": ([{"type": "image"}], TYPED),
        "image over http": (
            [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}],
            TYPED,
        ),
        "bad data url": ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!"}}], TYPED),
        "bytes part": ([text, b"not an image"], TYPED),
        "flat array part": ([np.zeros((2, 2), dtype=np.uint8)], TYPED),
        "marker with image": ([f"{text} {MARKER}", red], TYPED),
    }
    return contents[kind]


BAD_CONTENT_KINDS = st.sampled_from(
    [
        "nul",
        "nul part",
        "nul text dict",
        "surrogate",
        "int",
        "none",
        "bytes",
        "dict",
        "int part",
        "audio part",
        "text part not str",
        "image without source",
        "image over http",
        "bad data url",
        "bytes part",
        "flat array part",
        "marker with image",
    ]
)


def invalid_transcript(kind: str, valid: list[Message]) -> Any:
    """An invalid ``session.messages``: a valid prefix then a bad item, or not a list at all."""
    tails: dict[str, list[Any]] = {
        "str item": ["x"],
        "no role": [{"content": "hi"}],
        "int content": [{"role": "user", "content": 5}],
        "none content": [{"role": "user", "content": None}],
        "int role": [{"role": 1, "content": "hi"}],
        "none role": [{"role": None, "content": "hi"}],
        "nested list": [[{"role": "user", "content": "hi"}]],
        "int part": [{"role": "user", "content": ["hi", 5]}],
        "nul in an old message": [{"role": "assistant", "content": "a\0b"}],
    }
    if kind == "none":
        return None
    if kind == "a string":
        return "not a list"
    if kind == "a dict":
        return {"role": "user", "content": "hi"}
    return copy.deepcopy(valid) + tails[kind]


BAD_TRANSCRIPT_KINDS = st.sampled_from(
    [
        "str item",
        "no role",
        "int content",
        "none content",
        "int role",
        "none role",
        "nested list",
        "int part",
        "nul in an old message",
        "none",
        "a string",
        "a dict",
    ]
)
STREAM_MODES = st.sampled_from(
    [
        "exhaust",
        "break",
        "close",
        "drop",
        "with",
        "interleave",
        "clear mid-stream",
        "supersede",
        "supersede from a thread",
    ]
)
EDITS = st.sampled_from(
    [
        "clear cached context",
        "pop exchange",
        "pop last",
        "edit text in place",
        "replace message",
        "truncate",
        "clear",
        "append pair",
        "append assistant",
        "odd role",
        "system",
        "transplant",
        "image in an old message",
        "extra key",
    ]
)
SESSION = st.integers(0, 2)
MISUSES = st.sampled_from(
    ["bad content", "bad options", "bad transcript", "bad token ids", "bad session arguments"]
)


# -- helpers ----------------------------------------------------------------------------------
def copy_message(message: Message) -> Message:
    """A shadow copy: its own dict (and list) holding the same parts."""
    out = dict(message)
    if isinstance(out.get("content"), list):
        out["content"] = list(out["content"])
    return out


def in_threads(*calls: Callable[[], object]) -> None:
    """Run each call in its own thread, all at once; re-raise the first failure here."""
    errors: list[BaseException] = []

    def run(call: Callable[[], object]) -> None:
        try:
            call()
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def fresh_first_logits(
    like: Session, messages: list[Message], content: Any, batch_size: int
) -> tuple[Reply, np.ndarray | None] | BaseException:
    """A fresh session's one-token greedy reply on a copy of ``messages`` and the logits it
    sampled from (None if its context was discarded), or the typed error it raised."""
    fresh = env().model.session(context_size=like.context_size, batch_size=batch_size, thinking=like.thinking)
    fresh.messages = copy.deepcopy(messages)
    try:
        reply = fresh.respond(content, GREEDY_ONE)
        logits = None if fresh._context is None else read_logits(env().model, fresh._context)
        return reply, logits
    except TYPED as error:
        return error
    finally:
        fresh.close()


def common_prefix(a: Sequence[object], b: Sequence[object]) -> int:
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
    reused: int = 0


@dataclass
class Pending:
    """A stream left mid-way (after ``break``): the session finishes it at its next call."""

    stream: Stream
    user: Message
    text: str
    options: GenerationOptions
    expectation: Expectation
    cached_before: int


class Taken:
    """Snapshots taken from a stream, checked as they come."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.text = ""
        self.snapshots = 0
        self.ended = False  # the stream ran out by itself

    def take(self, n: int | None) -> None:
        """Up to n more snapshots (all with None), then stop iterating without closing."""
        if n == 0:
            return
        for taken, snapshot in enumerate(self.stream, start=1):
            assert snapshot.text == self.text + snapshot.delta, (snapshot, self.text)
            self.text = snapshot.text
            self.snapshots += 1
            if n is not None and taken >= n:
                return
        self.ended = True


# -- the machine ------------------------------------------------------------------------------
class SessionFuzzer(RuleBasedStateMachine):
    """Three sessions on one model (of 1024, 512 and 64-128 positions), a shadow transcript for
    each, and the stream each may have left pending."""

    def __init__(self) -> None:
        super().__init__()
        self.sessions: list[Session] = []
        self.expected: list[list[Message]] = []
        self.pending: list[Pending | None] = []
        self.timed: tuple[str, float] | None = None
        STATS.examples += 1

    # -- bookkeeping ----------------------------------------------------------------------
    def note(self, rule_name: str, /, **details: Any) -> None:
        """Count a step (its time runs to the next invariant check) and log it."""
        self.timed = (rule_name, time.perf_counter())
        STATS.steps += 1
        STATS.rules[rule_name] += 1
        log = env().log
        if log is not None:
            shown = ", ".join(f"{k}={v!r}"[:160] for k, v in details.items())
            log.write(f"example {STATS.examples} step {STATS.steps}: {rule_name}({shown})\n")
            log.flush()

    def settle(self, i: int) -> Pending | None:
        """The next valid call on session i finishes its pending stream first: shadow that."""
        pending = self.pending[i]
        if pending is not None:
            self.pending[i] = None
            self.expected[i] += [pending.user, {"role": "assistant", "content": pending.text}]
        return pending

    @staticmethod
    def check_settled(pending: Pending | None) -> None:
        if pending is None:
            return
        reply = pending.stream.reply
        assert reply is not None, "the session did not finish the stream its new call superseded"
        assert reply.finish_reason == "cancelled", reply
        assert reply.text == pending.text, (reply.text, pending.text)
        assert list(pending.stream) == [], "a finished stream yielded more"

    def close_pending(self, i: int) -> None:
        pending = self.settle(i)
        if pending is not None:
            pending.stream.close()
            self.check_settled(pending)

    def expect(self, i: int, user: Message) -> Expectation:
        """Build the prompt the session will build (for the shadow transcript plus ``user``)."""
        session, model = self.sessions[i], env().model
        try:
            prompt = model.prompt([*self.expected[i], user], thinking=session.thinking)
        except TYPED as error:
            return Expectation(error=type(error))
        try:
            items = list(prompt.items)
            overflow = prompt.n_positions >= session.context_size
            unsafe = bool(prompt.unsafe_reuse)
        finally:
            prompt.close()
        keep = 0 if unsafe else min(common_prefix(session._cache.items, items), len(items) - 1)
        while keep > 0 and getattr(items[keep], "offset", 0) > 0:  # never resume inside an image
            keep -= 1
        return Expectation(error=None, overflow=overflow, prompt_items=len(items), reused=keep)

    def check_reply(
        self,
        i: int,
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
        session = self.sessions[i]
        usage = reply.usage
        STATS.outcomes[f"reply {reply.finish_reason}"] += 1
        assert reply.finish_reason in finishes, (reply.finish_reason, finishes)
        if text is not None:
            assert reply.text == text, (reply.text, text)
        assert usage.prompt_tokens == expectation.prompt_items, (usage, expectation)
        never_started = reply.finish_reason == "cancelled" and usage == type(usage)(
            prompt_tokens=usage.prompt_tokens
        )
        if not never_started:
            assert usage.reused_tokens == expectation.reused, (usage, expectation, cached_before)
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
        if not check_cache:
            pass
        elif not never_started:
            assert cached <= usage.prompt_tokens + usage.completion_tokens, (cached, usage)
            assert cached >= usage.reused_tokens, (cached, usage)
            if reply.finish_reason != "cancelled":
                assert cached >= usage.prompt_tokens + usage.completion_tokens - 1, (cached, usage)
        else:  # or cancelled before its first batch, after a plan that kept nothing
            assert cached in (cached_before, expectation.reused), (cached, cached_before, expectation)
        timings = reply.timings
        assert timings.time_to_first_token_s >= 0 and timings.prefill_s >= 0 and timings.generation_s >= 0
        assert math.isfinite(timings.generation_tokens_per_s) and timings.generation_tokens_per_s >= 0

    def exchange(
        self,
        i: int,
        content: Any,
        options: GenerationOptions,
        mode: str = "respond",
        k: int = 0,
        delay: float = 0.0,
        other: int = 0,
    ) -> Reply | None:
        """One call on session i in the given mode, checked against the expectation."""
        session = self.sessions[i]
        pending = self.settle(i)  # a valid call finishes a pending stream first
        user = {"role": "user", "content": content}
        expectation = self.expect(i, user)
        cached_before, context_before = session.cached_tokens, session._context
        stream: Stream | None = None
        reply: Reply | None = None
        try:
            if mode == "respond":
                reply = session.respond(content, options)
            else:
                stream = session.stream(content, options)
        except TYPED as error:
            self.check_settled(pending)
            STATS.outcomes[f"error {type(error).__name__}"] += 1
            if expectation.error is not None:
                assert isinstance(error, expectation.error), (error, expectation)
            else:
                assert expectation.overflow, f"a valid call raised {error!r}"
                assert isinstance(error, ContextOverflowError), error
            assert session.cached_tokens == cached_before and session._context is context_before
            return None
        self.check_settled(pending)
        assert expectation.error is None, f"expected {expectation.error}, the call succeeded"
        assert not expectation.overflow, f"the prompt does not fit, yet no error: {expectation}"
        user = copy_message(user)
        natural = ("stop", "length")
        if stream is None:
            assert reply is not None
            self.check_reply(
                i, reply, options, expectation, text=None, finishes=natural, cached_before=cached_before
            )
            self.expected[i] += [user, {"role": "assistant", "content": reply.text}]
            return reply

        taken = Taken(stream)
        finishes: tuple[str, ...]
        cancelled_or_natural = ("cancelled", "stop", "length")
        if mode in ("exhaust", "timer"):
            timer = threading.Timer(delay, stream.cancel) if mode == "timer" else None
            if timer is not None:
                timer.start()
            try:
                taken.take(None)
            finally:
                if timer is not None:
                    timer.cancel()
                    timer.join()
            finishes = natural if timer is None else cancelled_or_natural
        else:
            taken.take(k)
            # A stream that ran out before k snapshots finished by itself; else it is cut short.
            finishes = natural if taken.ended else ("cancelled",)
            if mode == "break":
                if stream.reply is None:
                    self.pending[i] = Pending(stream, user, taken.text, options, expectation, cached_before)
                    return None
            elif mode == "close":
                stream.close()
            elif mode == "drop":
                turn = stream._turn
                gone = weakref.ref(stream)
                del stream, taken.stream
                assert gone() is None, "something still holds the dropped stream"
                finished = turn.reply
                assert finished is not None, "dropping the stream did not finish the exchange"
                self.check_reply(
                    i,
                    finished,
                    options,
                    expectation,
                    text=taken.text,
                    finishes=finishes,
                    cached_before=cached_before,
                )
                self.expected[i] += [user, {"role": "assistant", "content": finished.text}]
                return finished
            elif mode == "with":
                with stream:
                    pass
            elif mode == "cancel":
                stream.cancel()
                stream.cancel()  # idempotent
                taken.take(None)  # the tail the stop matcher held back may still come
                finishes = cancelled_or_natural
            elif mode == "interleave":
                j = (i + 1 + other % 2) % len(self.sessions)
                self.exchange(j, "Meanwhile, a short question.", GREEDY_ONE)
                taken.take(None)
                finishes = natural
            elif mode in ("supersede", "supersede from a thread"):
                if stream.reply is None:  # a new call finishes it first, from any thread
                    self.pending[i] = Pending(stream, user, taken.text, options, expectation, cached_before)
                    call = functools.partial(self.exchange, i, "And then?", GREEDY_ONE)
                    if mode == "supersede":
                        call()
                    else:
                        in_threads(call)
                    assert list(stream) == [], "a superseded stream yielded more"
                    return None
            elif mode == "clear mid-stream":
                session.clear_cached_context()
                assert session.cached_tokens == 0 and session._context is None
                taken.take(None)
            else:
                raise AssertionError(mode)
        reply_or_none = stream.reply
        assert reply_or_none is not None, f"the stream ({mode}) did not finish its exchange"
        assert list(stream) == [], "a finished stream yielded more"
        self.check_reply(
            i,
            reply_or_none,
            options,
            expectation,
            text=taken.text,
            finishes=finishes,
            cached_before=cached_before,
            check_cache=mode != "clear mid-stream",
        )
        self.expected[i] += [user, {"role": "assistant", "content": reply_or_none.text}]
        return reply_or_none

    # -- setup and teardown ---------------------------------------------------------------
    @initialize(
        systems=st.lists(
            st.sampled_from([None, "You are terse.", "", "Réponds en français 🙂"]), min_size=3, max_size=3
        ),
        batches=st.tuples(
            st.sampled_from([16, 64, 512]), st.sampled_from([16, 64, 512]), st.sampled_from([1, 7, 16, 512])
        ),
        small=st.integers(64, 128),
        thinking=st.booleans(),
    )
    def open_sessions(
        self, systems: list[str | None], batches: tuple[int, int, int], small: int, thinking: bool
    ) -> None:
        self.note("open_sessions", systems=systems, batches=batches, small=small, thinking=thinking)
        for system, batch, size in zip(systems, batches, [*CONTEXT_SIZES, small], strict=True):
            session = env().model.session(system, context_size=size, batch_size=batch, thinking=thinking)
            self.sessions.append(session)
            self.expected.append([] if system is None else [{"role": "system", "content": system}])
            self.pending.append(None)

    def teardown(self) -> None:
        for i, session in enumerate(self.sessions):
            pending = self.pending[i]
            if pending is not None:
                pending.stream.close()
            session.close()

    @invariant()
    def consistent(self) -> None:
        if self.timed is not None:
            name, started = self.timed
            STATS.seconds[name] += time.perf_counter() - started
            self.timed = None
        for i, session in enumerate(self.sessions):
            assert session.messages == self.expected[i], (
                f"session {i}: transcript {session.messages!r} != expected {self.expected[i]!r}"
            )
            pending = self.pending[i]
            if pending is not None:
                assert pending.stream.reply is None
            assert 0 <= session.cached_tokens <= session.context_size
            context = session._context
            if context is not None:
                assert context.n_ctx <= session.context_size, (context.n_ctx, session.context_size)
                assert context.pos_max() == session.cached_tokens - 1, (
                    f"session {i}: memory holds up to position {context.pos_max()}, "
                    f"the record {session.cached_tokens} positions"
                )

    # -- rules ----------------------------------------------------------------------------
    @rule(i=SESSION, content=CONTENTS, options=OPTIONS)
    def respond(self, i: int, content: Any, options: GenerationOptions) -> None:
        self.note("respond", i=i, content=content, options=options)
        self.exchange(i, content, options)

    @rule(i=SESSION, content=CONTENTS, options=OPTIONS, mode=STREAM_MODES, k=st.integers(0, 6))
    def stream(self, i: int, content: Any, options: GenerationOptions, mode: str, k: int) -> None:
        """Take k snapshots, then break (left pending), close, drop, exit a with block, clear
        the session's cache, or answer on another session meanwhile; or take them all."""
        self.note("stream", i=i, content=content, options=options, mode=mode, k=k)
        self.exchange(i, content, options, mode=mode, k=k, other=k)

    @rule(
        i=SESSION,
        content=CONTENTS,
        options=OPTIONS,
        k=st.integers(0, 6),
        delay=st.one_of(st.none(), st.sampled_from([0.0, 0.001, 0.005, 0.02, 0.05])),
    )
    def cancel(self, i: int, content: Any, options: GenerationOptions, k: int, delay: float | None) -> None:
        """``cancel()`` after k snapshots, or from a timer thread (prefill included) at ``delay``."""
        self.note("cancel", i=i, content=content, options=options, k=k, delay=delay)
        if delay is None:
            self.exchange(i, content, options, mode="cancel", k=k)
        else:
            self.exchange(i, content, options, mode="timer", delay=delay)

    @rule(i=SESSION, other=st.integers(1, 2), first=CONTENTS, second=CONTENTS, options=OPTIONS)
    def concurrent(self, i: int, other: int, first: Any, second: Any, options: GenerationOptions) -> None:
        """Two sessions of the one model answer at the same time, from two threads."""
        j = (i + other) % len(self.sessions)
        self.note("concurrent", i=i, j=j, first=first, second=second, options=options)
        in_threads(
            functools.partial(self.exchange, i, first, options),
            functools.partial(self.exchange, j, second, options, mode="exhaust"),
        )

    @precondition(lambda self: any(p is not None for p in self.pending))
    @rule(how=st.sampled_from(["close", "drop", "resume"]))
    def finish_pending(self, how: str) -> None:
        i = next(j for j, p in enumerate(self.pending) if p is not None)
        pending = self.pending[i]
        assert pending is not None
        self.note("finish_pending", i=i, how=how)
        if how == "close":
            self.close_pending(i)
            return
        self.pending[i] = None
        user, options, expectation, cached_before = (
            pending.user,
            pending.options,
            pending.expectation,
            pending.cached_before,
        )
        text: str | None = pending.text
        if how == "drop":
            turn = pending.stream._turn
            gone = weakref.ref(pending.stream)
            del pending
            assert gone() is None, "something still holds the dropped stream"
            reply = turn.reply
            assert reply is not None, "dropping a pending stream did not finish its exchange"
            finishes: tuple[str, ...] = ("cancelled",)
        else:
            taken = Taken(pending.stream)
            taken.text = pending.text
            taken.take(None)
            reply = pending.stream.reply
            assert reply is not None, "a resumed stream ran out without a reply"
            text, finishes = taken.text, ("stop", "length")
        self.check_reply(
            i, reply, options, expectation, text=text, finishes=finishes, cached_before=cached_before
        )
        self.expected[i] += [user, {"role": "assistant", "content": reply.text}]

    @rule(i=SESSION, kind=MISUSES, data=st.data())
    def misuse(self, i: int, kind: str, data: st.DataObject) -> None:
        """Invalid input of every kind: each must raise a typed error and change nothing."""
        if kind == "bad content":
            self.bad_content(i, data.draw(BAD_CONTENT_KINDS), data.draw(TEXTS), data.draw(OPTIONS))
        elif kind == "bad options":
            how = data.draw(st.sampled_from(["mutated", "not options"]))
            which = data.draw(st.integers(0, len(NOT_OPTIONS) - 1))
            self.bad_options(i, data.draw(st.sampled_from(BAD_FIELDS)), how, which)
        elif kind == "bad transcript":
            self.bad_transcript(i, data.draw(BAD_TRANSCRIPT_KINDS), data.draw(TEXTS))
        elif kind == "bad token ids":
            ids = st.lists(st.one_of(st.integers(0, 49151), st.integers(-(2**40), 2**40)), max_size=6)
            self.detokenize(data.draw(ids))
        else:
            name = data.draw(st.sampled_from(["context_size", "batch_size"]))
            value = data.draw(st.sampled_from([0, 15, -1, 2**24 + 1, 2**40, 1.5, "64", None, True]))
            self.bad_session_arguments(name, value)

    def bad_content(self, i: int, kind: str, text: str, options: GenerationOptions) -> None:
        content, errors = invalid_content(kind, text)
        self.note("misuse: bad content", i=i, kind=kind, text=text)
        session = self.sessions[i]
        pending = self.settle(i)
        cached_before, context_before = session.cached_tokens, session._context
        try:
            session.respond(content, options)
        except TYPED as error:
            STATS.outcomes[f"error {type(error).__name__}"] += 1
            assert isinstance(error, errors), f"{kind}: {error!r} is not one of {errors}"
        else:
            raise AssertionError(f"an invalid content ({kind}: {content!r}) was accepted")
        self.check_settled(pending)
        assert session.cached_tokens == cached_before and session._context is context_before

    def bad_options(self, i: int, bad: tuple[str, Any], how: str, which: int) -> None:
        name, value = bad
        self.note("misuse: bad options", i=i, name=name, value=value, how=how, which=which)
        try:
            GenerationOptions(**{name: value})
        except (TypeError, ValueError):
            pass
        else:
            raise AssertionError(f"GenerationOptions({name}={value!r}) was accepted")
        options: Any
        if how == "mutated":  # a frozen dataclass forced: respond validates again
            options = GenerationOptions(max_tokens=3)
            object.__setattr__(options, name, value)
        else:
            options = NOT_OPTIONS[which]
        session = self.sessions[i]
        cached_before, context_before = session.cached_tokens, session._context
        pending = self.pending[i]
        try:
            session.respond("Hello", options)
        except (TypeError, ValueError) as error:
            STATS.outcomes[f"error {type(error).__name__}"] += 1
        else:
            raise AssertionError(f"respond accepted bad options {options!r}")
        # Nothing happened: not even the pending stream was finished.
        assert session.cached_tokens == cached_before and session._context is context_before
        if pending is not None:
            assert pending.stream.reply is None

    @rule(i=SESSION, edit=EDITS, m=st.integers(0, 50), text=TEXTS, other=st.integers(0, 2))
    def edit_transcript(self, i: int, edit: str, m: int, text: str, other: int) -> None:
        self.note("edit_transcript", i=i, edit=edit, m=m, text=text, other=other)
        session = self.sessions[i]
        real, shadow = session.messages, self.expected[i]
        assert real is not shadow
        if edit == "clear cached context":
            self.clear_cached_context(i)
        elif edit == "pop exchange":
            del real[-2:], shadow[-2:]
        elif edit == "pop last":
            del real[-1:], shadow[-1:]
        elif edit in ("edit text in place", "replace message") and shadow:
            j = m % len(shadow)
            if edit == "edit text in place":
                real[j]["content"] = text
                shadow[j]["content"] = text
            else:
                real[j] = {"role": real[j]["role"], "content": [text]}
                shadow[j] = {"role": shadow[j]["role"], "content": [text]}
        elif edit == "truncate":
            n = m % (len(shadow) + 1)
            session.messages = real[:n]
            self.expected[i] = shadow[:n]
        elif edit == "clear":
            session.messages = []
            self.expected[i] = []
        elif edit == "append pair":
            for messages in (real, shadow):
                messages += [{"role": "user", "content": text}, {"role": "assistant", "content": text[::-1]}]
        elif edit == "append assistant":
            real.append({"role": "assistant", "content": text})
            shadow.append({"role": "assistant", "content": text})
        elif edit == "odd role":
            real.append({"role": "tool", "content": text})
            shadow.append({"role": "tool", "content": text})
        elif edit == "system":
            if shadow and shadow[0]["role"] == "system":
                real[0]["content"] = text
                shadow[0]["content"] = text
            else:
                real.insert(0, {"role": "system", "content": text})
                shadow.insert(0, {"role": "system", "content": text})
        elif edit == "image in an old message" and shadow:
            j = m % len(shadow)
            parts = [text, env().images["blue" if m % 2 else "red"]]
            real[j] = {"role": real[j]["role"], "content": list(parts)}
            shadow[j] = {"role": shadow[j]["role"], "content": list(parts)}
        elif edit == "extra key" and shadow:
            j = m % len(shadow)
            real[j]["name"] = text
            shadow[j]["name"] = text
        elif edit == "transplant":
            source = self.expected[other]
            session.messages = copy.deepcopy(source)
            self.expected[i] = [copy_message(message) for message in source]

    def bad_transcript(self, i: int, kind: str, text: str) -> None:
        self.note("misuse: bad transcript", i=i, kind=kind)
        session = self.sessions[i]
        self.close_pending(i)
        valid = session.messages
        bad = invalid_transcript(kind, valid)
        shown = copy.deepcopy(bad)
        cached_before, context_before = session.cached_tokens, session._context
        session.messages = bad
        try:
            session.respond(text or "Hello", GREEDY_ONE)
        except TYPED as error:
            STATS.outcomes[f"error {type(error).__name__}"] += 1
        else:
            raise AssertionError(f"an invalid transcript ({kind}) was accepted")
        finally:
            after = session.messages
            session.messages = valid  # restore a valid transcript whatever happened
        assert after is bad and after == shown, f"a failed call changed the transcript: {after!r}"
        assert session.cached_tokens == cached_before and session._context is context_before

    def clear_cached_context(self, i: int) -> None:
        session = self.sessions[i]
        pending = self.settle(i)
        session.clear_cached_context()
        self.check_settled(pending)
        assert session.cached_tokens == 0 and session._context is None

    @rule(i=SESSION, images=st.integers(0, 40), options=GREEDY_SHORT)
    def overflow(self, i: int, images: int, options: GenerationOptions) -> None:
        """A prompt beyond the context (words, or many images on the small session)."""
        session = self.sessions[i]
        content: Any = "lantern " * (session.context_size + 8)
        if i == 2 and images:
            content = ["Look:", *[env().images["red"]] * images]
        self.note("overflow", i=i, images=images)
        self.exchange(i, content, options)

    @rule(content=TEXTS, options=OPTIONS, clear=st.booleans())
    def fill_small_context(self, content: str, options: GenerationOptions, clear: bool) -> None:
        """No max_tokens limit on the 64-128 position session: the context bounds the reply."""
        self.note("fill_small_context", content=content, options=options, clear=clear)
        if clear:
            self.expected[2] = []
            self.sessions[2].messages = []
        unbounded = dataclasses.replace(options, max_tokens=2**31 - 1)
        self.exchange(2, content, unbounded)

    @rule(i=SESSION, content=CONTENTS, fresh_batch=st.sampled_from([None, 64, 512]))
    def differential(self, i: int, content: Any, fresh_batch: int | None) -> None:
        """The first-token logits of the cached session equal a fresh session's (decoding the
        transcript in batches of ``fresh_batch``, or the session's own), within split noise."""
        self.note("differential", i=i, content=content, fresh_batch=fresh_batch)
        session = self.sessions[i]
        self.close_pending(i)
        before = copy.deepcopy(self.expected[i])
        cached = self.exchange(i, content, GREEDY_ONE)
        outcome = fresh_first_logits(session, before, content, fresh_batch or session.batch_size)
        if isinstance(outcome, BaseException):
            assert cached is None, f"the fresh session raised {outcome!r}, the cached one replied"
            return
        assert cached is not None, "the cached session failed where a fresh one replied"
        expected, theirs = outcome
        assert expected.usage.reused_tokens == 0
        assert expected.usage.prompt_tokens == cached.usage.prompt_tokens
        if session._context is None or theirs is None:
            return  # a prompt that may not be reused discards its context
        ours = read_logits(env().model, session._context)
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

    def detokenize(self, ids: list[int]) -> None:
        self.note("misuse: bad token ids", ids=ids)
        model = env().model
        valid = all(0 <= t < model.native.n_vocab for t in ids)
        try:
            text = model.detokenize(ids)
        except ValueError:
            assert not valid, f"detokenize refused valid ids {ids}"
        else:
            assert valid and isinstance(text, str), f"detokenize accepted {ids}"

    def bad_session_arguments(self, name: str, value: Any) -> None:
        self.note("misuse: bad session arguments", name=name, value=value)
        if name == "batch_size" and value == 15:
            value = 0
        try:
            env().model.session(**{name: value})
        except (TypeError, ValueError):
            pass
        else:
            raise AssertionError(f"Model.session({name}={value!r}) was accepted")


# -- profiles and the driver --------------------------------------------------------------------
COMMON = {
    "deadline": None,
    "database": None,
    "print_blob": True,
    "suppress_health_check": list(HealthCheck),
}
FAST = settings(max_examples=24, stateful_step_count=12, derandomize=True, **COMMON)  # type: ignore[arg-type]
LONG = settings(max_examples=4, stateful_step_count=30, derandomize=False, **COMMON)  # type: ignore[arg-type]


def run_long(minutes: float, base_seed: int, runs: int | None) -> None:
    deadline = time.monotonic() + 60 * minutes
    run = 0
    while (runs is None and time.monotonic() < deadline) or (runs is not None and run < runs):
        run_seed = base_seed + run
        started, examples, steps = time.monotonic(), STATS.examples, STATS.steps

        def factory() -> SessionFuzzer:
            return SessionFuzzer()

        print(
            f"run {run}: seed {run_seed} (replay: tests/fuzz_worker.py --seed {run_seed} --runs 1)",
            flush=True,
        )
        seeded = hypothesis_seed(run_seed)(factory)
        run_state_machine_as_test(seeded, settings=LONG)  # type: ignore[arg-type]  # a factory is fine
        print(
            f"run {run}: {STATS.examples - examples} examples, {STATS.steps - steps} steps, "
            f"{time.monotonic() - started:.1f} s",
            flush=True,
        )
        run += 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=paths.default_model_path())
    parser.add_argument("--fixtures", type=Path, default=paths.fixtures_dir())
    parser.add_argument("--minutes", type=float, default=0.0, help="seeded runs until the time is up")
    parser.add_argument("--seed", type=int, default=None, help="the first run's seed (long profile)")
    parser.add_argument("--runs", type=int, default=None, help="this many long-profile runs")
    parser.add_argument("--log", type=Path, default=None, help="append every step here (for crashes)")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default 2)")
    parser.add_argument(
        "--noise", type=float, default=None, help="use this split noise (all prompt sizes), do not measure it"
    )
    args = parser.parse_args(argv)
    faulthandler.enable()
    global _env
    started = time.monotonic()
    log = args.log.open("a", encoding="utf-8") if args.log else None
    image_paths = {name: args.fixtures / f"image-{name}.png" for name in ("red", "blue")}
    with Model(args.model, mmproj_path=args.fixtures / "mmproj-tiny.gguf", threads=args.threads) as model:
        noise = short_prompt_noise(model) if args.noise is None else args.noise
        _env = Env(
            model=model,
            noise=noise,
            images={name: Image(path) for name, path in image_paths.items()},
            image_paths=image_paths,
            log=log,
            long_noise=args.noise,
        )
        print(
            f"model loaded, split noise {noise:.4f}, tolerance {tolerance_for(noise):.4f} "
            f"({time.monotonic() - started:.1f} s)",
            flush=True,
        )
        try:
            if args.minutes > 0 or args.seed is not None or args.runs is not None:
                base = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
                run_long(args.minutes, base, args.runs)
            else:
                run_state_machine_as_test(SessionFuzzer, settings=FAST)
        finally:
            print(f"fuzzer: {STATS.summary()}\n  total {time.monotonic() - started:.1f} s", flush=True)
            if log is not None:
                log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
