"""A request checked once: ``Transcript``'s own guarantees, the layers below (the stateless
routing, the prompt, the renderers, the server after its schema) reading one without checking it
again, and an options object's tools checked once however many layers ask for them."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from serve_helpers import running
from tool_helpers import WEATHER

from llmsession import GenerationOptions, Model, TemplateError, Transcript, UnsupportedFeatureError
from llmsession.serve.app import create_app
from llmsession.text import messages as messages_module
from llmsession.text import tools as tools_module
from llmsession.text.tools import options_tools, replaced_options

CALL = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "Sunny, 21 C"},
]
GREEDY = GenerationOptions(max_tokens=4, temperature=0)


def test_a_transcript_is_a_read_only_copy_of_what_it_was_given() -> None:
    given = copy.deepcopy(CHAT)
    transcript = Transcript(given)
    given[1]["content"][0]["text"] = "changed"  # (the caller's later edits do not reach it)
    given.append({"role": "user", "content": "more"})
    assert transcript == CHAT and len(transcript) == 4
    with pytest.raises(TypeError):
        transcript[0]["content"] = "edited"  # type: ignore[index]
    with pytest.raises(TypeError):
        transcript[1]["content"][0]["text"] = "edited"
    editable = transcript.messages()
    editable[1]["content"][0]["text"] = "edited"
    assert editable != CHAT and transcript == CHAT  # (the copy is the caller's own)
    assert pickle.loads(pickle.dumps(transcript)) == transcript
    assert Transcript(transcript) == transcript


def test_data_nested_past_pythons_recursion_is_a_template_error() -> None:
    deep: Any = "x"
    for _ in range(5000):
        deep = {"d": deep}
    with pytest.raises(TemplateError, match="nested too deep"):
        Transcript([{"role": "user", "content": "Hi", "metadata": deep}])


def test_an_options_objects_tools_are_its_own_copy() -> None:
    spec = copy.deepcopy(WEATHER)
    options = GenerationOptions(
        tools=[spec], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    checked = options_tools(options)
    spec["function"]["name"] = "renamed"  # (the caller's dict: the options hold their own)
    assert options.tools == (WEATHER,) and options_tools(options) is checked
    assert checked is not None and checked.tools[0].name == "get_weather"


def test_a_bad_message_is_refused_when_the_transcript_is_made() -> None:
    with pytest.raises(TemplateError, match="message 1"):
        Transcript([{"role": "user", "content": "a"}, {"role": "tool", "tool_call_id": "c9", "content": "r"}])
    with pytest.raises(TemplateError, match="message 0"):
        Transcript([{"role": "user", "content": 5}])


@pytest.fixture
def checked(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many messages each ``check_messages`` call checks, wherever the library calls it."""
    original = messages_module.check_messages
    sizes: list[int] = []

    def counting(messages: Sequence[Any], **kw: Any) -> frozenset[str]:
        sizes.append(len(messages))
        return original(messages, **kw)

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("llmsession") and (
            getattr(module, "check_messages", None) is original
        ):
            monkeypatch.setattr(module, "check_messages", counting)
    yield sizes


def test_extending_checks_only_what_is_added(checked: list[int]) -> None:
    base = Transcript(CHAT[:3])
    assert checked == [3]
    joined = base.extended([CHAT[3]])  # (a result answering a call the base made)
    assert checked == [3, 1] and joined == CHAT
    with pytest.raises(TemplateError, match=r"message 3 .*answers no earlier call"):
        base.extended([{"role": "tool", "tool_call_id": "c2", "content": "r"}])  # (named in the whole)


def test_an_edit_keeps_what_answers_what() -> None:
    transcript = Transcript(CHAT)
    last = transcript.edited(-1, {"role": "tool", "tool_call_id": "c1", "content": "Rain"})
    assert len(last) == 4 and last[3]["content"] == "Rain" and last[:3] == transcript[:3]
    with pytest.raises(IndexError):
        transcript.edited(4, {"role": "user", "content": "x"})
    edited = transcript.edited(0, {"role": "system", "content": "Be terse."})
    assert edited[0]["content"] == "Be terse." and transcript[0]["content"] == "Be brief."
    with pytest.raises(TemplateError, match="keep its tool_calls"):
        transcript.edited(2, {"role": "assistant", "content": "no call"})
    with pytest.raises(TemplateError, match="keep its role"):
        transcript.edited(0, {"role": "user", "content": "x"})
    with pytest.raises(TemplateError, match="message 0"):
        transcript.edited(0, {"role": "system", "content": 7})


@pytest.fixture(scope="module")
def quiet(smollm2_path: Path) -> Iterator[Model]:
    """The model without anticipatory prefill: a kept session's next opening is rendered in the
    background after a reply (its own transcript and a probe: checked, as a new transcript), which
    the counts below would catch at a moment no test chooses."""
    with Model(smollm2_path, threads=1, anticipate=False) as model:
        yield model


def test_prompt_tokens_refuses_images_it_cannot_count(quiet: Model) -> None:
    """An image's marker was tokenized as text (a handful of tokens, not its positions), and on
    a model without a projector, where ``chat`` refuses the same messages."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    said = [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}]
    for tenant in (None, "t"):
        with pytest.raises(UnsupportedFeatureError, match="text-only"):
            quiet.prompt_tokens(said, tenant=tenant)


def test_render_and_prompt_tokens_take_the_tool_formats_a_reply_takes(quiet: Model) -> None:
    """A bogus one raised a bare KeyError; "harmony" rendered a prompt no exchange decodes."""
    for bad in ("bogus", "harmony"):
        with pytest.raises(ValueError, match="tool_format must be one of"):
            quiet.render(CHAT, tool_format=bad)
        with pytest.raises(ValueError, match="tool_format must be one of"):
            quiet.prompt_tokens(CHAT, tool_format=bad)
    assert quiet.render(CHAT, tools=[WEATHER], tool_format="hermes")


def test_the_library_reads_a_transcript_without_checking_it_again(quiet: Model, checked: list[int]) -> None:
    smollm2 = quiet
    transcript = Transcript(CHAT)
    checked.clear()
    smollm2.chat(transcript, GREEDY)  # the two replies compared below both read its prompt from the
    assert checked == []  # cache (a fresh decode and a cached one part at a near-tie here on AVX2)
    tokens = smollm2.prompt_tokens(transcript)
    text = smollm2.render(transcript)
    reply = smollm2.chat(transcript, GREEDY)
    assert checked == []  # (routing, prompt, splice and renderers all trusted it)
    # The same calls with a plain list: checked once each, and the same prompt and reply.
    assert smollm2.prompt_tokens(CHAT) == tokens and smollm2.render(CHAT) == text
    assert smollm2.chat(CHAT, GREEDY).text == reply.text
    assert checked == [4, 4, 4]
    with smollm2.session() as session:  # (a session takes a transcript's messages as sent)
        session.respond(Transcript([{"role": "user", "content": "Hi"}]), GREEDY)
        assert [m["role"] for m in session.messages] == ["user", "assistant"]


@pytest.fixture
def tools_checked(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many tools each ``checked_tools`` call checks."""
    original = tools_module.checked_tools
    sizes: list[int] = []

    def counting(specs: Any, *args: Any) -> Any:
        sizes.append(len(specs or ()))
        return original(specs, *args)

    monkeypatch.setattr(tools_module, "checked_tools", counting)
    return sizes


def test_an_options_objects_tools_are_checked_once(quiet: Model, tools_checked: list[int]) -> None:
    smollm2 = quiet
    options = GenerationOptions(max_tokens=4, temperature=0, tools=(WEATHER,), tool_choice="none")
    asked = [{"role": "user", "content": "Hi"}]
    smollm2.chat(asked, options)
    smollm2.chat(asked, options)
    choices = smollm2.chat_choices(asked, options, n=2)
    try:
        assert all("".join(snapshot.delta for snapshot in choice) for choice in choices)
    finally:
        choices.close()
    assert tools_checked == [1]  # (the routing, the session and both choices read what was checked)
    assert options_tools(replaced_options(options, seed=3)) == options_tools(options)
    assert tools_checked == [1]
    # What changes the tools, or a copy made without saying what changed, is checked again.
    options_tools(replaced_options(options, tool_choice="auto"))
    options_tools(dataclasses.replace(options, seed=3))
    assert tools_checked == [1, 1, 1]


def test_a_server_request_is_checked_once(
    smollm2_path: Path, checked: list[int], tools_checked: list[int]
) -> None:
    import anthropic
    import openai

    with Model(smollm2_path, threads=1, anticipate=False) as model, running(create_app(model)) as url:
        client = openai.OpenAI(base_url=url, api_key="-", max_retries=0, timeout=60)
        checked.clear()
        client.chat.completions.create(model="m", messages=CHAT, max_tokens=4, temperature=0, tools=[WEATHER])  # type: ignore[arg-type, list-item]
        assert checked == [4] and tools_checked == [1]  # (the schema's: the library trusts them)
        claude = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="-", max_retries=0)
        tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}  # type: ignore[index]
        said = [{"role": "user", "content": "Weather in Oslo?"}]
        claude.messages.create(
            model="m", max_tokens=4, messages=said, tools=[tool], extra_body={"top_k": 5}, system="Be brief."
        )  # type: ignore[arg-type, list-item]
        assert checked == [4, 2] and tools_checked == [1, 1]
