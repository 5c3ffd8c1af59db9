"""What the Gemma 4 renderer's tests share: Google's templates (as llama.cpp copies them), the
jinja2 oracle, and text built from the pieces that matter to the template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from llmsession.text.jinja import render_jinja

TEMPLATES = Path(__file__).parent / "data" / "templates"
CANONICAL = (TEMPLATES / "google-gemma-4-31B-it.jinja").read_text(encoding="utf-8")
INTERLEAVED = (TEMPLATES / "google-gemma-4-31B-it-interleaved.jinja").read_text(encoding="utf-8")
EMPTY_THOUGHT_EMISSION = "{{- '<|channel>thought\\n<channel|>' -}}"
assert CANONICAL.count(EMPTY_THOUGHT_EMISSION) == 1
SMALL = CANONICAL.replace(EMPTY_THOUGHT_EMISSION, "")
VARIANTS = {"31B": CANONICAL, "interleaved": INTERLEAVED, "small": SMALL}


class FakeImage:
    """Stands in for llmsession.Image: any part that is neither str nor dict is an image."""


def oracle(
    template: str,
    messages: list[dict[str, Any]],
    *,
    gen: bool,
    thinking: bool,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The Jinja rendering without its leading BOS."""
    text = render_jinja(
        template,
        messages,
        add_generation_prompt=gen,
        bos_token="<bos>",
        enable_thinking=thinking,
        tools=tools,
    )
    assert text.startswith("<bos>")
    return text.removeprefix("<bos>")


# Text built from pieces that matter to the template: thinking delimiters, Gemma tokens,
# whitespace it trims (including Unicode spaces), NUL and other non-ASCII.
TOKENS = ["<|channel>", "<channel|>", "thought\n", "<|turn>", "<turn|>", "<|image|>", "{{ x }}"]
OTHERS = [" ", "\n", "\t", "\u3000", "\xa0", "\x00", "é", "😀", "\u0301", "hi", "Hello"]
PIECES = st.sampled_from(TOKENS + OTHERS)
TEXT = st.lists(st.one_of(PIECES, st.text(max_size=4)), max_size=6).map("".join)
THOUGHT = TEXT.map(lambda t: f"<|channel>thought\n{t}<channel|>")
MODEL_TEXT = st.lists(st.one_of(TEXT, THOUGHT), max_size=3).map("".join)
PART = st.one_of(
    TEXT.map(lambda t: {"type": "text", "text": t}),
    MODEL_TEXT.map(lambda t: {"type": "text", "text": t}),
    st.just({"type": "image"}),
)
CONTENT = st.one_of(MODEL_TEXT, st.lists(PART, max_size=4))
