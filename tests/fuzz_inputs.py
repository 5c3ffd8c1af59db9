"""What the fuzzer feeds the API: strategies for contents, options and rule choices, and
catalogues of invalid input (each one must raise a typed error and change nothing)."""

from __future__ import annotations

import base64
import copy
import math
from collections.abc import Callable
from typing import Any

import numpy as np
from fuzz_env import env
from hypothesis import strategies as st

from llmsession import GenerationOptions, Image, LlmSessionError, TemplateError

Message = dict[str, Any]
Errors = tuple[type[Exception], ...]
TYPED: Errors = (TypeError, ValueError, LlmSessionError)
GREEDY_ONE = GenerationOptions(max_tokens=1, temperature=0.0)
MARKER = "<__media__>"

# -- valid input ------------------------------------------------------------------------------
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
        st.sampled_from([1e-30, 1e-6, 50.0, 1e30]),  # (the edges float32 samplers take: ``REAL_RANGE``)
    ),
    top_k=st.sampled_from([0, 1, 2, 40, 2**31 - 1]),
    top_p=st.sampled_from([1e-30, 1e-9, 0.1, 0.5, 0.95, 1.0]),
    min_p=st.sampled_from([0.0, 0.05, 0.5, 0.999, 1.0]),
    repeat_penalty=st.sampled_from([1.0, 1.0, 1e-3, 0.9, 1.3, 1e6]),
    repeat_last_n=st.sampled_from([-1, 0, 1, 64, 2**31 - 1]),
    frequency_penalty=st.sampled_from([0.0, 0.0, 0.5, -2.0, 1e6]),
    presence_penalty=st.sampled_from([0.0, 0.0, 0.7, -1.5, -1e6]),
    seed=st.one_of(st.none(), st.integers(0, 2**32 - 2)),
    stop=st.lists(STOPS, max_size=3).map(tuple),
)
GREEDY_SHORT = st.builds(GenerationOptions, max_tokens=st.integers(1, 4), temperature=st.just(0.0))

# -- rule choices -----------------------------------------------------------------------------
SESSION = st.integers(0, 2)
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
MISUSES = st.sampled_from(
    ["bad content", "bad options", "bad transcript", "bad token ids", "bad session arguments"]
)

# -- invalid input ----------------------------------------------------------------------------
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
    ("temperature", 1e-300),  # (0 in float32: a division by zero; 1e300 is infinite there)
    ("temperature", 1e300),
    ("temperature", "0"),
    ("temperature", None),
    ("top_k", -1),
    ("top_k", 2**31),
    ("top_k", 2**40),
    ("top_k", 2.0),
    ("top_p", 0.0),
    ("top_p", 1.0000001),
    ("top_p", NAN),
    ("top_p", 5e-324),
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
    ("presence_penalty", -1e39),
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
BAD_TOKEN_IDS = st.lists(st.one_of(st.integers(0, 49151), st.integers(-(2**40), 2**40)), max_size=6)
SESSION_ARGUMENTS = st.sampled_from(["context_size", "batch_size"])
BAD_SESSION_VALUES = st.sampled_from([0, 15, -1, 2**24 + 1, 2**40, 1.5, "64", None, True])

# Each invalid user content, built from a valid text, and the errors it may raise.
INVALID_CONTENTS: dict[str, tuple[Callable[[str], Any], Errors]] = {
    "nul": (lambda text: f"{text}\0{text}", (TemplateError,)),
    "nul part": (lambda text: [text, "a\0b"], (TemplateError,)),
    "nul text dict": (lambda _: [{"type": "text", "text": "\0"}], (TemplateError,)),
    "surrogate": (lambda text: f"{text}\ud800", (TemplateError,)),
    "int": (lambda _: 5, TYPED),
    "none": (lambda _: None, TYPED),
    "bytes": (lambda _: b"hello", TYPED),
    "dict": (lambda text: {"content": text}, TYPED),  # (with a role it is a message: sent as one)
    "int part": (lambda text: [text, 5], TYPED),
    "audio part": (lambda _: [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}], TYPED),
    "text part not str": (lambda _: [{"type": "text", "text": 5}], TYPED),
    "image without source": (lambda _: [{"type": "image"}], TYPED),
    "image over http": (
        lambda _: [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}],
        TYPED,
    ),
    "bad data url": (
        lambda _: [{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!"}}],
        TYPED,
    ),
    "bytes part": (lambda text: [text, b"not an image"], TYPED),
    "flat array part": (lambda _: [np.zeros((2, 2), dtype=np.uint8)], TYPED),
    "marker with image": (lambda text: [f"{text} {MARKER}", env().images["red"]], TYPED),
}
BAD_CONTENT_KINDS = st.sampled_from(list(INVALID_CONTENTS))


def invalid_content(kind: str, text: str) -> tuple[Any, Errors]:
    build, errors = INVALID_CONTENTS[kind]
    return build(text), errors


# An invalid ``session.messages``: a valid prefix then one of these items, or not a list at all.
BAD_TRANSCRIPT_TAILS: dict[str, Any] = {
    "str item": "x",
    "no role": {"content": "hi"},
    "int content": {"role": "user", "content": 5},
    "none content": {"role": "user", "content": None},
    "int role": {"role": 1, "content": "hi"},
    "none role": {"role": None, "content": "hi"},
    "nested list": [{"role": "user", "content": "hi"}],
    "int part": {"role": "user", "content": ["hi", 5]},
    "nul in an old message": {"role": "assistant", "content": "a\0b"},
}
NOT_TRANSCRIPTS: dict[str, Any] = {
    "none": None,
    "a string": "not a list",
    "a dict": {"role": "user", "content": "hi"},
}
BAD_TRANSCRIPT_KINDS = st.sampled_from([*BAD_TRANSCRIPT_TAILS, *NOT_TRANSCRIPTS])


def invalid_transcript(kind: str, valid: list[Message]) -> Any:
    if kind in NOT_TRANSCRIPTS:
        return copy.deepcopy(NOT_TRANSCRIPTS[kind])
    return [*copy.deepcopy(valid), copy.deepcopy(BAD_TRANSCRIPT_TAILS[kind])]
