"""render_prompt's renderer order, content flattening, and the jinja environment."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from llmsession.errors import TemplateError
from llmsession.text.jinja import render_jinja
from llmsession.text.messages import check_messages, flatten_content
from llmsession.text.templates import render_prompt, template_family

TEMPLATES = Path(__file__).parent / "data" / "templates"
GEMMA4 = (TEMPLATES / "google-gemma-4-31B-it.jinja").read_text(encoding="utf-8")
CHATML = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = "{{ '<|start_header_id|>' + messages[0]['role'] + '<|end_header_id|>' }}"
USER = [{"role": "user", "content": "Hi"}]
Chat = Sequence[tuple[str, str]]


class FakeImage:
    """Stands in for llmsession.Image."""


class FakeNative:
    """Records its calls; returns ``reply`` (None: llama.cpp cannot format the template)."""

    def __init__(self, reply: str | None) -> None:
        self.reply = reply
        self.calls: list[tuple[str | None, list[tuple[str, str]], bool]] = []

    def __call__(self, template: str | None, chat: Chat, gen: bool) -> str | None:
        self.calls.append((template, list(chat), gen))
        return self.reply


def never(template: str | None, chat: Chat, gen: bool) -> str | None:
    raise AssertionError("native must not be called")


# render_prompt: the order of renderers


def test_native_text_is_used_first() -> None:
    native = FakeNative("NATIVE")
    messages = [{"role": "user", "content": ["a", FakeImage(), {"type": "text", "text": "b"}]}]
    text = render_prompt(messages, template=GEMMA4, native=native, add_generation_prompt=False)
    assert text == "NATIVE"
    assert native.calls == [(GEMMA4, [("user", "a<__media__>b")], False)]


def test_no_template_means_llama_cpp_default() -> None:
    native = FakeNative("<|im_start|>user\nHi<|im_end|>\n")
    assert render_prompt(USER, template=None, native=native) == native.reply
    assert native.calls == [(None, [("user", "Hi")], True)]


def test_gemma4_renderer_when_llama_cpp_cannot() -> None:
    messages = [{"role": "user", "content": [" Look ", {"type": "image"}]}]
    text = render_prompt(messages, template=GEMMA4, native=FakeNative(None), media_marker="<M>")
    assert text == "<|turn>user\nLook<M><turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
    thinking = render_prompt(USER, template=GEMMA4, native=FakeNative(None), thinking=True)
    assert thinking.startswith("<|turn>system\n<|think|>\n<turn|>\n")


@pytest.mark.parametrize(
    ("template", "family"),
    [
        (LLAMA3, "llama3"),
        ("{{ '<start_of_turn>' }}", "gemma"),
        ("[INST] {{ messages }}", "mistral"),
        ("{{ '<|im_start|>' }}", "chatml"),
        ("{{ messages }}", "unknown"),
    ],
)
def test_unformattable_template_names_its_family(template: str, family: str) -> None:
    with pytest.raises(TemplateError, match=f"family: {family}") as error:
        render_prompt(USER, template=template, native=FakeNative(None))
    assert repr(template[:60]) in str(error.value)
    assert "use_jinja=True" in str(error.value)


def test_default_template_failure_is_reported() -> None:
    with pytest.raises(TemplateError, match="chatml default"):
        render_prompt(USER, template=None, native=FakeNative(None))


def test_use_jinja_renders_the_template() -> None:
    text = render_prompt(USER, template=CHATML, native=never, use_jinja=True)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(TemplateError, match="no"):
        render_prompt(USER, template=None, native=never, use_jinja=True)


def test_use_jinja_passes_tokens_thinking_and_images() -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": ["Look", FakeImage()]}]
    text = render_prompt(
        messages, template=GEMMA4, native=never, use_jinja=True, thinking=True, bos_token="<bos>"
    )
    system = "<|turn>system\n<|think|>\n<turn|>\n"
    assert text == f"<bos>{system}<|turn>user\nLook<__media__><turn|>\n<|turn>model\n"  # (libmtmd's marker)


@pytest.mark.parametrize("use_jinja", [False, True])
@pytest.mark.parametrize("native_reply", [None, "native"])
def test_nul_survives(use_jinja: bool, native_reply: str | None) -> None:
    native = FakeNative(native_reply)
    messages = [{"role": "user", "content": "a\x00b"}]
    text = render_prompt(messages, template=GEMMA4, native=native, use_jinja=use_jinja)
    if use_jinja or native_reply is None:
        assert "<|turn>user\na\x00b<turn|>\n" in text
    else:
        assert native.calls[0][1] == [("user", "a\x00b")]


@pytest.mark.parametrize(
    "messages",
    [
        ["not a mapping"],
        [{"role": None, "content": "x"}],
        [{"content": "x"}],
        [{"role": "user"}],
        [{"role": "user", "content": 3}],
        [{"role": "user", "content": [{"type": "audio"}]}],
        [{"role": "user", "content": [{"type": "text", "text": 3}]}],
    ],
)
def test_bad_messages_are_refused(messages: Any) -> None:
    with pytest.raises(TemplateError):
        render_prompt(messages, template=CHATML, native=FakeNative("x"))


# flatten_content


def test_flatten_content_joins_like_llama_cpp() -> None:
    """Text parts on separate lines, never a newline next to a media marker."""
    image, image_url = {"type": "image"}, {"type": "image_url"}
    parts = ["a", {"type": "text", "text": "b"}, image, "c", FakeImage(), image_url]
    assert flatten_content(parts, "<M>") == "a\nb<M>c<M><M>"
    assert flatten_content(["", "x"], "<M>") == "x"
    assert flatten_content("  as is\n", "<M>") == "  as is\n"
    assert flatten_content([" a ", " b "], "<M>", clean=str.strip, separator="") == "ab"


def test_check_messages_names_the_message() -> None:
    check_messages([{"role": "user", "content": []}, {"role": "x", "content": ("tuple",)}])
    with pytest.raises(TemplateError, match="message 1"):
        check_messages([{"role": "user", "content": "ok"}, {"role": "user", "content": None}])


def test_template_family() -> None:
    assert template_family(GEMMA4) == "gemma4"
    assert template_family(CHATML) == "chatml"
    assert "chatml" in template_family(None)


# render_jinja: the Hugging Face environment


def test_jinja_globals_and_filters() -> None:
    template = (
        "{{ bos_token }}{{ messages[0]['content'] | tojson }}|{{ {'a': [1]} | tojson(indent=2) }}"
        "|{{ strftime_now('%Y') | length }}|{{ eos_token }}{{ add_generation_prompt }}"
    )
    messages = [{"role": "user", "content": "é<&>"}]
    text = render_jinja(
        template,
        messages,
        bos_token="<s>",
        eos_token="</s>",
        add_generation_prompt=False,
    )
    assert text == '<s>"é<&>"|{\n  "a": [\n    1\n  ]\n}|4|</s>False'


def test_jinja_blocks_are_trimmed_and_loops_can_break() -> None:
    template = (
        "{% for m in messages %}\n  {% if loop.index > 1 %}{% break %}{% endif %}\n"
        "{{ m.content }}\n{% endfor %}"
    )
    assert render_jinja(template, USER * 3) == "Hi\n"


def test_jinja_variables_and_defaults() -> None:
    template = "{{ tools is none }} {{ documents is none }} {{ enable_thinking }}"
    assert render_jinja(template, USER, enable_thinking=True) == "True True True"


def test_raise_exception_becomes_template_error() -> None:
    with pytest.raises(TemplateError, match=r"^Roles must alternate$"):
        render_jinja("{{ raise_exception('Roles must alternate') }}", USER)


@pytest.mark.parametrize(
    "template",
    [
        "{% for %}",  # syntax
        "{{ messages[5]['role'].x }}",  # undefined
        "{{ messages.append(1) }}",  # the sandbox forbids mutation
        "{{ 1 / 0 }}",
        "{{ messages[0]['content'] + 1 }}",
    ],
)
def test_jinja_failures_are_template_errors(template: str) -> None:
    with pytest.raises(TemplateError):
        render_jinja(template, USER)


def test_missing_jinja2_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "jinja2", None)
    with pytest.raises(TemplateError, match=r"needs jinja2: pip install jinja2"):
        render_jinja("{{ 'never compiled before' }}", USER)


def test_jinja2_stays_optional() -> None:
    """The modules import, and the non-jinja renderers work, without jinja2."""
    code = (
        "import sys; sys.modules['jinja2'] = None\n"
        "from llmsession.text.templates import render_prompt\n"
        "text = render_prompt([{'role': 'user', 'content': 'Hi'}], template='<|turn>',"
        " native=lambda t, c, g: None)\n"
        "assert text == '<|turn>user\\nHi<turn|>\\n<|turn>model\\n', repr(text)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)
