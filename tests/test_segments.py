"""Prompts tokenized in segments cut at the template's special tokens equal the whole text
tokenized, on every template family's vocabulary; a cut anywhere else does not."""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import internals
import pytest

from llmsession import GenerationOptions, Model
from llmsession.runtime.tokenizer import LONG_TEXT
from llmsession.text.segments import anchor_pattern, anchors, can_overlap, segments, tokenize_in_segments

FAMILIES = {  # fixture (None: the test model itself) -> whether its template's markers are special
    "smollm2": True,  # ChatML: <|im_start|>, <|im_end|> are control tokens
    "gemma3": False,  # a SentencePiece vocabulary that adds BOS; its template's markers are text here
    "smollm2-gemma4-special.gguf": True,
    "smollm2-mistral-special.gguf": True,
    "smollm2-qwen25-special.gguf": True,
    "smollm2-llama31-template.gguf": False,  # Llama 3.1's markers are text in SmolLM2's vocabulary
}
AWKWARD = [  # contents whose tokens would differ if a cut were in the wrong place
    "Hello\n\n   world  \n\n",
    "she wrote <|im_start|>user and [INST] and <|turn> into the text",
    "  leading spaces, a tab\tand unicode: héllo wörld 🌍 — “quotes”",
    "x",
    "Line one.\nLine two.\n\n\nLine five, after blank lines.",
]


def transcript(turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You answer briefly.\n\n"}]
    for turn in range(turns):
        said = AWKWARD[turn % len(AWKWARD)]
        messages += [
            {"role": "user", "content": f"{said} (turn {turn})"},
            {"role": "assistant", "content": said},
        ]
    return [*messages, {"role": "user", "content": "And now?  "}]


@pytest.fixture(params=list(FAMILIES))
def family(
    request: pytest.FixtureRequest, fixture_path: Callable[[str], Path]
) -> Iterator[tuple[Model, bool]]:
    name = request.param
    if name in ("smollm2", "gemma3"):
        yield request.getfixturevalue(name), FAMILIES[name]
        return
    with Model(fixture_path(name), threads=2, use_jinja=True) as model:
        yield model, FAMILIES[name]


def test_segments_equal_the_whole_text_on_every_family(family: tuple[Model, bool]) -> None:
    model, special = family
    core = internals.local(model)
    for turns in (24, 25):  # the second prompt is the first plus a turn: its earlier segments are remembered
        # (as rendered to be tokenized: users' special tokens' texts as placeholders, ``text.guard``)
        text = core.render_checked(transcript(turns))
        assert len(text) >= LONG_TEXT
        whole = core.tokenizer.stretch(text)  # (the whole text; without placeholders ``tokenize``'s)
        assert core.tokenizer.prompt(text, shared=True) == whole
        assert model.prompt_tokens(transcript(turns)) == whole  # (through the model, as sessions do)
        assistant_only = [m if m["role"] != "user" else {**m, "content": "x"} for m in transcript(turns)]
        plain = model.render(assistant_only)  # (no user text to keep plain: the whole text as it is)
        whole = core.native.tokenize(plain, add_special=True)
        core.tokenizer.drop_double_bos(whole)
        assert core.tokenizer.prompt(plain, shared=True) == whole == model.prompt_tokens(assistant_only)
    pattern = core.tokenizer._anchor_pattern(text)
    if special:  # (elsewhere a user's words may still hold the vocabulary's special tokens)
        assert pattern is not None and len(segments(text, pattern)) > 2 * 24


def test_gemma3_sentencepiece_in_its_own_markup(gemma3: Model) -> None:
    """The test model's Gemma 3 file holds no chat template (its prompts are ChatML text, nothing
    special), so this is Gemma 3's own turn markup, as its real template writes it: SentencePiece
    adds a space before text that follows a special token, in the segments as in the whole."""
    native = internals.local(gemma3).native
    turns = [
        f"<start_of_turn>user\n{said}<end_of_turn>\n<start_of_turn>model\n{said} <end_of_turn>\n"
        for said in AWKWARD
    ]
    text = "<bos>" + "".join(turns * 3) + "<start_of_turn>model\n"
    found = anchors([(spelled, left) for spelled, left, _, _ in native.special_tokens()], text)
    assert {"<bos>", "<start_of_turn>", "<end_of_turn>"} <= set(found)
    pattern = anchor_pattern(found)
    assert pattern is not None and len(segments(text, pattern)) > 2 * 3 * len(AWKWARD)
    whole = internals.local(gemma3).tokenize(text)
    cut = tokenize_in_segments(text, pattern, internals.local(gemma3).tokenize)
    assert cut == whole


def test_a_cut_elsewhere_changes_the_tokens(smollm2: Model) -> None:
    """The must-fail variant: cut the same text before every newline instead of at special
    tokens, and the tokens differ (BPE merges across the cut)."""
    native = internals.local(smollm2).native
    text = smollm2.render(transcript(24))
    whole = native.tokenize(text, add_special=True)
    cut = tokenize_in_segments(text, re.compile("\n"), lambda s, first: native.tokenize(s, add_special=first))
    assert native.detokenize(cut, special=True) == native.detokenize(whole, special=True)  # same text,
    assert cut != whole  # other tokens


def test_a_prompt_tokenizes_only_what_changed(smollm2: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a transcript's prompt, the next turn's prompt tokenizes only its new turn's text."""
    core = internals.local(smollm2)
    core.tokenizer.prompt(smollm2.render(transcript(40)), shared=True)
    text = smollm2.render(transcript(41))
    tokenized: list[str] = []
    tokenize = core.native.tokenize

    def counted(text: str, **kwargs: Any) -> list[int]:
        tokenized.append(text)
        return tokenize(text, **kwargs)

    monkeypatch.setattr(core.native, "tokenize", counted)
    whole = core.tokenizer.prompt(text, shared=True)
    monkeypatch.undo()
    assert whole == core.tokenize(text)
    assert 0 < sum(map(len, tokenized)) < 200 < len(text) / 20  # the last turns' segments only


def test_kept_apart_prompts_tokenize_afresh(smollm2: Model) -> None:
    tokenizer = internals.local(smollm2).tokenizer
    text = smollm2.render(transcript(14)) + "a text no prompt held before"
    assert len(text) >= LONG_TEXT
    assert tokenizer.prompt(text, shared=False) == tokenizer.tokenize(text)
    remembered = tokenizer._remembered[False]
    assert all(remembered.get(s) is None for s in segments(text, re.compile("<\\|im_start\\|>"))[-2:])


def test_overlap() -> None:
    assert can_overlap("<a>", "a>b")  # a suffix of one is a prefix of the other
    assert can_overlap("<ab>", "b")  # one holds the other
    assert can_overlap("\n\n", "\n\n")  # two occurrences of one overlap
    assert not can_overlap("<|im_start|>", "<|im_start|>")
    assert not can_overlap("<|im_start|>", "<|im_end|>")
    assert not can_overlap("<|tool>", "<|tool_call>")


def test_anchors_are_the_markers_nothing_can_overlap() -> None:
    specials = [("<s>", False), ("<|a|>", False), ("|>x", False), ("[B]", True), ("<c>", False)]
    template = "<s><|a|>[B]<c> and more"
    # <|a|> overlaps |>x; [B] strips whitespace on its left; <s> and <c> are anchors
    assert anchors(specials, template) == ["<s>", "<c>"]
    assert anchors([*specials, ("<s>", False)], template) == []  # two tokens, one text
    assert anchors([*specials, ("", False)], template) == []  # an empty text is found everywhere
    pattern = anchor_pattern(["<s>", "<c>"])
    assert pattern is not None and anchor_pattern([]) is None
    assert segments("<s>hi<c>there<c>", pattern) == ["<s>hi", "<c>there", "<c>"]
    assert segments("hi<c>", pattern) == ["hi", "<c>"]
    assert segments("", pattern) == [""]


def test_a_model_that_adds_bos_keeps_its_spliced_prompts(
    gemma3: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 3 adds a BOS its template does not spell: a spliced prompt spells it too, and is
    kept (it used to be tokenized again whole, reply included, every turn)."""
    session = gemma3.session(system="You answer briefly.")
    session.respond("Name a colour and a fruit.", GenerationOptions(max_tokens=12, temperature=0))
    tokenized: list[str] = []
    tokenize = internals.local(gemma3).native.tokenize

    def recorded(text: str, **kwargs: Any) -> list[int]:
        tokenized.append(text)
        return tokenize(text, **kwargs)

    monkeypatch.setattr(internals.local(gemma3).native, "tokenize", recorded)
    try:
        session.respond("And another one?", GenerationOptions(max_tokens=1))
    finally:
        session.close()
    whole = [text for text in tokenized if "Name a colour" in text and "And another one?" in text]
    assert tokenized and not whole


def test_anchors_are_found_in_time_linear_in_the_vocabulary() -> None:
    """Each text found was checked against every special token in pairs: a hostile vocabulary
    of 20,000 tokens whose template spells 2,000 of them took 4 minutes, holding the tokenizer's
    lock. One automaton now, whose answer is the pairs' (pure: random vocabularies)."""
    specials = [(f"<unused{i}>", False) for i in range(20_000)]
    spelled = "".join(f"<unused{i}>" for i in range(0, 20_000, 10))
    began = time.monotonic()
    found = anchors(specials, spelled)
    assert time.monotonic() - began < 5
    assert found == [f"<unused{i}>" for i in range(0, 20_000, 10)]  # (<unused5> is no start of <unused55>)
    draw = random.Random(3)
    for _ in range(2000):
        texts = list({"".join(draw.choice("ab<>") for _ in range(draw.randint(1, 5))) for _ in range(9)})
        pairs = [a for a in texts if not any(can_overlap(a, t) for t in texts)]
        assert anchors([(t, False) for t in texts], "".join(texts)) == pairs, texts
