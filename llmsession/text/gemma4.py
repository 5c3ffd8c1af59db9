"""Gemma 4 prompts in pure Python, because llama.cpp's built-in templates cannot make them.

``llama_chat_apply_template`` recognises a template by marker strings; Gemma 4 writes turns
as ``<|turn>role\\n ... <turn|>\\n`` and has none of them (Gemma 1-3 had ``<start_of_turn>``),
so llama.cpp reports an unknown template. This module reproduces Google's template
(llama.cpp ``models/templates/google-gemma-4-31B-it.jinja``), tools included:

- a first ``system`` or ``developer`` message becomes the leading ``system`` turn, trimmed;
- ``thinking=True`` writes ``<|think|>\\n`` at the top of that turn, opening one if needed;
- ``tools`` (OpenAI function specs) are declared at the end of that turn, opening one if
  needed, each ``<|tool>declaration:NAME{...}<tool|>`` (the syntax is in ``gemma4_tools``);
- ``assistant`` is written ``model``; other roles are written as given;
- user and system texts are trimmed; model texts lose their ``<|channel>...<channel|>``
  thinking spans and are then trimmed; each text part separately, parts joined directly;
- an image part becomes ``media_marker`` (the template writes ``<|image|>``);
- an assistant message's ``tool_calls`` (OpenAI's shape) are written
  ``<|tool_call>call:NAME{...}<tool_call|>`` before its text, preceded by its ``reasoning``
  (or ``reasoning_content``) as a thought channel when it comes after the last user message.
  The ``tool`` messages right after it are written next, in its turn, each
  ``<|tool_response>response:NAME{...}<tool_response|>`` (NAME from the call its
  ``tool_call_id`` answers); ``tool`` messages are never turns of their own, and one that
  does not follow a call message is not written at all. Gemma's own ``tool_responses``
  field on a message is written the same way (and then the ``tool`` messages are not);
- a message whose calls have no results ends with ``<|tool_response>`` instead of
  ``<turn|>``, for the model to write them; one with results and no text is left open for
  the model's answer; after either, no generation prompt is written;
- the generation prompt opens a model turn. With thinking off, the 26B/31B templates then
  close an empty thought channel ``<|channel>thought\\n<channel|>``; the E2B/E4B templates do
  not. We write it exactly when the template text contains that emission;
- in the current template an ``assistant`` (or ``model``) message right after an
  ``assistant`` message (``tool`` messages between them aside) continues that turn (no
  second ``<|turn>model``, though the first may have been closed); older ones, such as
  llama.cpp's "interleaved" variant, open a new turn. We follow whichever the template
  text does.

Deliberate differences from the Jinja output:

- no BOS: it is added when the prompt is tokenized;
- a first system message whose content is a list of parts is rendered like any other
  message (the template writes the Python repr of the list);
- str parts count as text, and ``image_url`` dicts and non-dict objects as images (the
  template writes nothing for them, and does not fail on str parts of tool results);
- refused with TemplateError instead of rendered: tools, tool calls and tool results with
  an older template without the current tool handling (the "interleaved" one writes them
  differently; use ``use_jinja=True`` for those), images and other non-text parts in tool
  results (which the template drops), a ``tool_responses`` entry without a ``response``
  (the template writes ``[]``), values in calls and results that are not JSON, non-text
  non-image parts (audio, video, unknown types, which the template writes as
  ``<|audio|>``/``<|video|>`` or drops), malformed messages, and an empty message list (on
  which the template fails too). Where the template fails (a tool result that answers none
  of the calls before it and has no ``name``; a non-str ``reasoning`` it would write), so
  do we, with a TemplateError.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from llmsession.errors import TemplateError
from llmsession.text.gemma4_tools import (
    format_function_declaration,
    format_tool_call,
    legacy_responses,
    responses_after,
)
from llmsession.text.messages import Message, check_messages, flatten_content, is_image_part

TURN_START = "<|turn>"
TURN_END = "<turn|>\n"
THINK = "<|think|>\n"
EMPTY_THOUGHT = "<|channel>thought\n<channel|>"
IMAGE_TOKEN = "<|image|>"
SYSTEM_ROLES = ("system", "developer")
TOOL_KEYS = ("tool_calls", "tool_responses")


def is_gemma4_template(template: str | None) -> bool:
    """Gemma 4 templates, and only they, write ``<|turn>``."""
    return template is not None and TURN_START in template


def primes_empty_thought(template: str) -> bool:
    """Whether the template closes an empty thought channel after the generation prompt
    when thinking is off (26B/31B do, E2B/E4B do not). The template source spells the
    newline as ``\\n`` inside a string literal; a raw newline is accepted too."""
    return EMPTY_THOUGHT.replace("\n", "\\n") in template or EMPTY_THOUGHT in template


def merges_model_turns(template: str) -> bool:
    """Whether a model message right after an ``assistant`` message continues its turn;
    recognised by the name the current Google template gives that rule."""
    return "continue_same_model_turn" in template


def strip_thinking(text: str) -> str:
    """The template's ``strip_thinking``: drop every ``<|channel>`` up to the next
    ``<channel|>`` (or to the end, if unclosed), then trim."""
    return "".join(piece.split("<|channel>")[0] for piece in text.split("<channel|>")).strip()


def scans_tool_messages(template: str) -> bool:
    """Whether the template has the current tool handling (``role: "tool"`` messages read
    forward from the call they answer), recognised by the macro that writes them."""
    return "format_tool_response_block" in template


def _uses_tools(message: Message) -> bool:
    return message["role"] == "tool" or any(message.get(key) for key in TOOL_KEYS)


def _refuse_old_tools(
    template: str, tools: Sequence[Mapping[str, Any]] | None, messages: Sequence[Message]
) -> None:
    if scans_tool_messages(template) or not (tools or any(_uses_tools(m) for m in messages)):
        return
    raise TemplateError(
        "the built-in Gemma 4 renderer writes tools only as the current Google template does, "
        "and this template is an older one; pass use_jinja=True to render them with it"
    )


def _system_turn(
    system: Message | None, tools: Sequence[Mapping[str, Any]] | None, thinking: bool | str, media_marker: str
) -> str:
    text = f"{TURN_START}system\n" + (THINK if thinking else "")
    if system is not None:
        text += flatten_content(system["content"], media_marker, clean=str.strip, separator="")
    for tool in tools or ():
        text += f"<|tool>{format_function_declaration(tool)}<tool|>"
    return text + TURN_END


def render_gemma4(
    messages: Sequence[Message],
    *,
    template: str,
    add_generation_prompt: bool = True,
    thinking: bool | str = False,
    media_marker: str = IMAGE_TOKEN,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The prompt Google's Gemma 4 ``template`` renders for ``messages``, without BOS.

    ``template`` (the model's own) decides the variant behaviours above, and whether tools
    can be written at all. ``tools`` are OpenAI function specs (``{"type": "function",
    "function": {...}}``), declared in the system turn.
    """
    check_messages(messages)
    return gemma4_prompt(
        messages,
        template=template,
        add_generation_prompt=add_generation_prompt,
        thinking=thinking,
        media_marker=media_marker,
        tools=tools,
    )


def gemma4_prompt(
    messages: Sequence[Message],
    *,
    template: str,
    add_generation_prompt: bool = True,
    thinking: bool | str = False,
    media_marker: str = IMAGE_TOKEN,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """``render_gemma4`` for messages already checked (a ``Transcript``'s, or derived from it)."""
    if not is_gemma4_template(template):
        raise TemplateError("render_gemma4 needs a Gemma 4 template (one that writes <|turn>)")
    if not messages:
        raise TemplateError("a Gemma 4 prompt needs at least one message")
    _refuse_old_tools(template, tools, messages)

    out: list[str] = []
    rest = list(messages)
    system = rest.pop(0) if messages[0]["role"] in SYSTEM_ROLES else None
    state: str | None = None  # the template's prev_message_type, where it matters
    if thinking or tools or system is not None:
        out.append(_system_turn(system, tools, thinking, media_marker))

    last_user = max((i for i, m in enumerate(rest) if m["role"] == "user"), default=-1)
    merges = merges_model_turns(template)
    previous_role: str | None = None  # of the previous message that is not a tool result
    for i, message in enumerate(rest):
        if message["role"] == "tool":
            continue  # written after the call it answers, or not at all
        role = "model" if message["role"] == "assistant" else message["role"]
        if not (merges and role == "model" and previous_role == "assistant"):
            out.append(f"{TURN_START}{role}\n")
        previous_role = message["role"]
        state, answered = _tool_parts(rest, i, i > last_user, out)
        content = message.get("content")
        if content:
            clean = strip_thinking if role == "model" else str.strip
            out.append(flatten_content(content, media_marker, clean=clean, separator=""))
            if not isinstance(content, str) and any(is_image_part(part) for part in content):
                state = "image"
        if state == "tool_call" and not answered:
            out.append("<|tool_response>")  # the model writes the response next
        elif not (answered and not content):
            out.append(TURN_END)

    if add_generation_prompt and state not in ("tool_call", "tool_response"):
        out.append(f"{TURN_START}model\n")
        if not thinking and primes_empty_thought(template):
            out.append(EMPTY_THOUGHT)
    return "".join(out)


def _tool_parts(
    messages: Sequence[Message], i: int, after_last_user: bool, out: list[str]
) -> tuple[str | None, bool]:
    """Writes ``messages[i]``'s thoughts, calls and results; returns the template's
    ``prev_message_type`` after them, and whether any result was written."""
    message = messages[i]
    calls = message.get("tool_calls")
    thought = message.get("reasoning") or message.get("reasoning_content")
    if thought and after_last_user and calls:
        if not isinstance(thought, str):
            raise TemplateError(f"reasoning must be a str, got {type(thought).__name__}")
        out.append(f"<|channel>thought\n{thought}\n<channel|>")
    state = None
    if calls:
        out.extend(format_tool_call(call["function"]) for call in calls)
        state = "tool_call"
    legacy = message.get("tool_responses")
    results = legacy_responses(legacy) if legacy else responses_after(messages, i) if calls else []
    out.extend(results)
    return ("tool_response" if results else state), bool(results)
