"""Turn chat messages into prompt text, trying renderers in a fixed order.

1. ``use_jinja=True``: the model's template through jinja2, exactly as Hugging Face renders it.
2. llama.cpp's built-in templates (``llama_chat_apply_template``, through the caller's
   ``native``), as llama.cpp itself would format the chat; a model without an embedded
   template gets llama.cpp's chatml default.
3. Our Gemma 4 renderer: llama.cpp recognises templates by marker strings, and Gemma 4's
   ``<|turn>`` has none it knows (it looks for Gemma 1-3's ``<start_of_turn>``).
4. Otherwise a TemplateError naming the template family, so the user knows to try jinja.

Messages and their parts are described in ``messages``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from llmsession.errors import TemplateError
from llmsession.text.gemma4 import gemma4_prompt, is_gemma4_template
from llmsession.text.generic_prompt import generic_messages
from llmsession.text.jinja import render_jinja
from llmsession.text.messages import Message, check_messages, filled, flatten_content, is_image_part
from llmsession.text.tool_formats import GENERIC, ToolFormat
from llmsession.text.tools import Tools

NativeApply = Callable[[str | None, Sequence[tuple[str, str]], bool], str | None]
"""llama_chat_apply_template: (template or None for chatml, [(role, content)], add
generation prompt) -> the prompt, or None when llama.cpp cannot format it."""


def template_family(template: str | None) -> str:
    """A rough guess of a template's family, for error messages only."""
    if template is None:
        return "none (llama.cpp's chatml default)"
    for marker, family in (
        ("<|im_start|>", "chatml"),
        ("<start_of_turn>", "gemma"),
        ("<|turn>", "gemma4"),
        ("<|start_header_id|>", "llama3"),
        ("[INST]", "mistral"),
    ):
        if marker in template:
            return family
    return "unknown"


def reads_effort(template: str | None) -> bool:
    """Whether a template reads a ``reasoning_effort`` (gpt-oss's writes it in its system message)."""
    return template is not None and "reasoning_effort" in template


def _hf_part(part: object, media_marker: str | None) -> object:
    """A part as Hugging Face templates expect it: dicts as they are, a str as a text dict, an
    image as ``{"type": "image"}`` (so jinja never sees an ``llmsession.Image``), or, given a
    ``media_marker``, as a text part of it: the marker is where libmtmd puts the image, and a
    template's own image token is not (llama-server passes images to jinja the same way)."""
    if media_marker is not None and is_image_part(part):
        return {"type": "text", "text": media_marker}
    if isinstance(part, Mapping):
        return part
    if isinstance(part, str):
        return {"type": "text", "text": part}
    return {"type": "image"}


def _hf_message(message: Message, media_marker: str | None = None) -> dict[str, Any]:
    """A message as ``apply_chat_template`` takes it: parts as dicts (images as ``_hf_part``
    says), and a call's arguments as an object (templates write them with ``tojson``)."""
    content = message.get("content")
    if not isinstance(content, str | None):
        content = [_hf_part(part, media_marker) for part in content]
    out = {**message, "content": content}
    if message.get("reasoning_content") and "thinking" not in message:
        out["thinking"] = message["reasoning_content"]  # (gpt-oss's templates read it there)
    out.pop("tool_calls", None)  # (None or [] would read as calls to some templates)
    if message.get("tool_calls"):
        out["tool_calls"] = [_hf_call(call) for call in message["tool_calls"]]
    return out


def _hf_call(call: Mapping[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function", {}))
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = json.loads(function["arguments"])
        except ValueError:
            raise TemplateError(
                f"a tool call's arguments are not JSON: {function['arguments']!r:.80}"
            ) from None
    return {**call, "function": function}


def _flat(message: Message, media_marker: str) -> Message:
    """A message whose content parts are joined into one string (images as the marker)."""
    content = message.get("content")
    if content is None or isinstance(content, str):
        return message
    return {**message, "content": flatten_content(content, media_marker)}


def _has_tools(message: Message) -> bool:
    return message.get("role") == "tool" or bool(message.get("tool_calls"))


def render_prompt(
    messages: Sequence[Message],
    *,
    template: str | None,
    native: NativeApply,
    add_generation_prompt: bool = True,
    thinking: bool | str = False,
    use_jinja: bool = False,
    bos_token: str = "",
    eos_token: str = "",
    media_marker: str = "<__media__>",
    tools: Tools | None = None,
    tool_format: ToolFormat = GENERIC,
    stand_ins: bool = False,
    typed_content: bool = True,
) -> str:
    """The prompt text for ``messages``, from the first renderer in the order above.

    With ``use_jinja`` an image reaches the template as a text part holding ``media_marker``
    (where libmtmd puts it), and a template that reads no content parts (not
    ``typed_content``) gets each message's parts joined into its text; ``thinking`` is passed as
    ``enable_thinking``; elsewhere images become ``media_marker``, and ``thinking`` reaches
    only the Gemma 4 renderer (llama.cpp's built-in templates have no switch for it). BOS is
    left to tokenization unless a jinja template writes it. ``tools`` and tool messages reach a
    jinja template as Hugging Face passes them, for a native ``tool_format``; the generic one
    writes them into the messages (``generic_prompt.generic_messages``), for any renderer.
    The messages are checked first (``check_messages``; ``render_checked`` trusts its caller's).
    """
    check_messages(messages, answers=not stand_ins)  # (stand-ins hide the calls results answer)
    return render_checked(
        messages,
        template=template,
        native=native,
        add_generation_prompt=add_generation_prompt,
        thinking=thinking,
        use_jinja=use_jinja,
        bos_token=bos_token,
        eos_token=eos_token,
        media_marker=media_marker,
        tools=tools,
        tool_format=tool_format,
        typed_content=typed_content,
    )


def render_checked(
    messages: Sequence[Message],
    *,
    template: str | None,
    native: NativeApply,
    add_generation_prompt: bool = True,
    thinking: bool | str = False,
    use_jinja: bool = False,
    bos_token: str = "",
    eos_token: str = "",
    media_marker: str = "<__media__>",
    tools: Tools | None = None,
    tool_format: ToolFormat = GENERIC,
    typed_content: bool = True,
) -> str:
    """``render_prompt`` for messages already checked: a ``Transcript``'s editable copy (or
    one with stand-ins for its replies, derived from it). Nothing is checked again."""
    messages = filled(messages)
    gemma4 = template is not None and is_gemma4_template(template)
    native_tools = (use_jinja or gemma4) and tool_format is not GENERIC
    if not native_tools and (tools is not None or any(_has_tools(m) for m in messages)):
        messages = generic_messages(messages, tools)
    if use_jinja:
        if template is None:
            raise TemplateError("use_jinja needs a chat template, and the model has none")
        hf = [_hf_message(m if typed_content else _flat(m, media_marker), media_marker) for m in messages]
        return render_jinja(
            template,
            hf,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            enable_thinking=bool(thinking),
            tools=tools.specs() if native_tools and tools is not None else None,  # ("none" too: same prefix)
            **({"reasoning_effort": thinking} if isinstance(thinking, str) else {}),
        )

    specs = tools.specs() if native_tools and tools is not None else None
    how = (add_generation_prompt, bool(thinking), media_marker)  # (built-in templates take no effort)
    return _without_jinja(messages, template, native, how, native_tools, specs)


def _without_jinja(
    messages: Sequence[Message],
    template: str | None,
    native: NativeApply,
    how: tuple[bool, bool, str],
    native_tools: bool,
    specs: list[dict[str, Any]] | None,
) -> str:
    """llama.cpp's built-in templates (unless the tools are Gemma 4's own), else our Gemma 4
    renderer, else a TemplateError; ``how``: add the generation prompt, thinking, the media
    marker."""
    add_generation_prompt, thinking, media_marker = how
    gemma4 = template is not None and is_gemma4_template(template)
    flat = [(m["role"], flatten_content(m["content"], media_marker)) for m in messages]
    text = None if native_tools else native(template, flat, add_generation_prompt)
    if text is not None:
        return text
    if template is not None and gemma4:
        return gemma4_prompt(
            [_hf_message(m) for m in messages] if native_tools else messages,
            template=template,
            add_generation_prompt=add_generation_prompt,
            thinking=thinking,
            media_marker=media_marker,
            tools=specs,
        )
    raise _unformattable(template)


def _unformattable(template: str | None) -> TemplateError:
    start = "" if template is None else f", starting {template[:60]!r}"
    return TemplateError(
        f"llama.cpp cannot format this chat template (family: {template_family(template)}"
        f"{start}); pass use_jinja=True to render it with jinja2"
    )
