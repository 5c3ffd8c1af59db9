"""Gemma 4 prompts in pure Python, because llama.cpp's built-in templates cannot make them.

``llama_chat_apply_template`` recognises a template by marker strings; Gemma 4 writes turns
as ``<|turn>role\\n ... <turn|>\\n`` and has none of them (Gemma 1-3 had ``<start_of_turn>``),
so llama.cpp reports an unknown template. This module reproduces Google's template
(llama.cpp ``models/templates/google-gemma-4-31B-it.jinja``) for plain chats:

- a first ``system`` or ``developer`` message becomes the leading ``system`` turn, trimmed;
- ``thinking=True`` writes ``<|think|>\\n`` at the top of that turn, opening one if needed;
- ``assistant`` is written ``model``; other roles are written as given;
- user and system texts are trimmed; model texts lose their ``<|channel>...<channel|>``
  thinking spans and are then trimmed; each text part separately, parts joined directly;
- an image part becomes ``media_marker`` (the template writes ``<|image|>``);
- the generation prompt opens a model turn. With thinking off, the 26B/31B templates then
  close an empty thought channel ``<|channel>thought\\n<channel|>``; the E2B/E4B templates do
  not. We write it exactly when the template text contains that emission;
- in the current template an ``assistant`` (or ``model``) message right after an
  ``assistant`` message continues that turn (no second ``<|turn>model``, though the first
  was closed); older ones, such as llama.cpp's "interleaved" variant, open a new turn. We
  follow whichever the template text does.

Deliberate differences from the Jinja output:

- no BOS: it is added when the prompt is tokenized;
- a first system message whose content is a list of parts is rendered like any other
  message (the template writes the Python repr of the list);
- str parts count as text, and ``image_url`` dicts and non-dict objects as images (the
  template writes nothing for them);
- refused with TemplateError instead of rendered: tool calls, tool results and ``tool``
  messages (use ``use_jinja=True`` for those), non-text non-image parts (audio, video,
  unknown types, which the template writes as ``<|audio|>``/``<|video|>`` or drops),
  malformed messages, and an empty message list (on which the template fails too).
"""

from __future__ import annotations

from collections.abc import Sequence

from llmsession.errors import TemplateError
from llmsession.text.messages import Message, check_messages, flatten_content

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


def _refuse_tools(messages: Sequence[Message]) -> None:
    for i, message in enumerate(messages):
        if message["role"] == "tool" or any(message.get(key) for key in TOOL_KEYS):
            raise TemplateError(
                f"message {i}: the built-in Gemma 4 renderer does not support tool calls or "
                "tool results; pass use_jinja=True to render them with the model's template"
            )


def render_gemma4(
    messages: Sequence[Message],
    *,
    template: str,
    add_generation_prompt: bool = True,
    thinking: bool = False,
    media_marker: str = IMAGE_TOKEN,
) -> str:
    """The prompt Google's Gemma 4 ``template`` renders for ``messages``, without BOS.

    ``template`` (the model's own) decides only the two variant behaviours above.
    """
    if not is_gemma4_template(template):
        raise TemplateError("render_gemma4 needs a Gemma 4 template (one that writes <|turn>)")
    check_messages(messages)
    if not messages:
        raise TemplateError("a Gemma 4 prompt needs at least one message")
    _refuse_tools(messages)

    out: list[str] = []
    rest = list(messages)
    has_system = messages[0]["role"] in SYSTEM_ROLES
    if thinking or has_system:
        out.append(f"{TURN_START}system\n")
        if thinking:
            out.append(THINK)
        if has_system:
            system = rest.pop(0)["content"]
            out.append(flatten_content(system, media_marker, clean=str.strip, separator=""))
        out.append(TURN_END)

    merges = merges_model_turns(template)
    previous_role: str | None = None
    for message in rest:
        role = "model" if message["role"] == "assistant" else message["role"]
        if not (merges and role == "model" and previous_role == "assistant"):
            out.append(f"{TURN_START}{role}\n")
        clean = strip_thinking if role == "model" else str.strip
        out.append(flatten_content(message["content"], media_marker, clean=clean, separator=""))
        out.append(TURN_END)
        previous_role = message["role"]

    if add_generation_prompt:
        out.append(f"{TURN_START}model\n")
        if not thinking and primes_empty_thought(template):
            out.append(EMPTY_THOUGHT)
    return "".join(out)
