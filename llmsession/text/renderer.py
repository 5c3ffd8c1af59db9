"""Which renderer turns a model's chats into prompt text, chosen once when it is loaded.

The template: ``chat_template`` if the caller gives one (jinja text, or the name of one of
llama.cpp's built-in templates), else the file's own, else the built-in template llama.cpp
has for the file's architecture (Gemma 3's files may carry none: its turns, not ChatML), else
llama.cpp's ChatML default. The renderer: jinja2, as Hugging Face's ``apply_chat_template``
and llama-server's default do, when the template is jinja text that renders a probe chat;
llama.cpp's built-in template matcher otherwise (and Gemma 4's renderer, ``templates``).
``use_jinja`` True insists on jinja (an error at load if it cannot render), False refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmsession.errors import TemplateError
from llmsession.text.jinja import render_jinja

# llama.cpp's built-in template names (``llama_chat_apply_template`` takes them as templates)
# for architectures whose files may come without a template of their own.
BUILTIN_BY_ARCHITECTURE = {
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3": "gemma",
    "gemma3n": "gemma",
    "phi3": "phi3",
    "command-r": "command-r",
    "cohere2": "command-r",
    "exaone": "exaone3",
    "exaone4": "exaone4",
    "granite": "granite",
    "rwkv6": "rwkv-world",
    "rwkv7": "rwkv-world",
    "deepseek2": "deepseek2",
    "llama4": "llama4",
    "orion": "orion",
    "minicpm": "minicpm",
    "chatglm": "chatglm4",
}

# A short chat jinja must render for the template to be used by default: with a system message,
# which some templates refuse (Gemma 1's raises) where llama.cpp's built-in ones fold it into
# the first user turn.
PROBE = (
    {"role": "system", "content": "You are a probe."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye"},
)


def is_jinja(template: str | None) -> bool:
    """Jinja text, as opposed to a built-in template's name (or none)."""
    return template is not None and ("{%" in template or "{{" in template)


@dataclass(frozen=True)
class Renderer:
    """How prompts are written: ``jinja`` (jinja2 over ``template``) or not (llama.cpp's
    built-in templates, matched from ``template`` or named by it; Gemma 4's renderer);
    ``template`` None is llama.cpp's ChatML default; ``source`` says where the template came
    from and ``note`` why jinja was not used where it might have been. ``typed_content``: the
    jinja template reads a message's content as a list of parts (else each message's parts
    reach it joined into one string, images as the media marker, as llama-server does)."""

    jinja: bool
    template: str | None
    source: str
    note: str = ""
    typed_content: bool = False

    def __str__(self) -> str:
        if self.template is None:
            what = "llama.cpp's chatml default"
        elif self.jinja:
            what = "jinja"
        elif is_jinja(self.template):
            what = "llama.cpp's built-in template matcher"
        else:
            what = f"llama.cpp's built-in {self.template!r} template"
        note = f"; {self.note}" if self.note else ""
        return f"{what} ({self.source}{note})"


def choose_renderer(
    file_template: str | None,
    architecture: str,
    *,
    use_jinja: bool | None = None,
    chat_template: str | None = None,
    bos_token: str = "",
    eos_token: str = "",
) -> Renderer:
    """The renderer for a model whose file holds ``file_template`` (None if none) and whose
    architecture is ``architecture``, as the module describes. ``use_jinja`` True with no
    jinja template, or a jinja template that fails the probe where ``use_jinja`` is True or the
    template was given as ``chat_template``, is a TemplateError."""
    if chat_template is not None:
        if not isinstance(chat_template, str) or not chat_template.strip():
            raise TemplateError("chat_template must be a template's text or a built-in template's name")
        template, source = chat_template, "chat_template given"
    elif file_template is not None:
        template, source = file_template, "the file's template"
    elif architecture in BUILTIN_BY_ARCHITECTURE:
        template = BUILTIN_BY_ARCHITECTURE[architecture]
        source = f"the file has no template; llama.cpp's for architecture {architecture!r}"
    else:
        template, source = None, "the file has no template"
    if use_jinja is False or not is_jinja(template):
        if use_jinja:
            has = "a built-in template's name" if template is not None else "no template"
            raise TemplateError(
                f"use_jinja needs a jinja chat template, and this model has {has} "
                "(pass chat_template= with one)"
            )
        return Renderer(False, template, source)
    assert template is not None
    failure = _probe(template, bos_token, eos_token)
    if failure is None:
        return Renderer(True, template, source, typed_content=_reads_parts(template))
    if use_jinja or chat_template is not None:  # (a template given is never silently replaced)
        raise TemplateError(f"jinja cannot render this chat template: {failure}")
    return Renderer(False, template, source, note=f"jinja could not render it: {failure}")


def _reads_parts(template: str) -> bool:
    """Whether the template writes a message given as a list of text parts as its text (not the
    list's repr, and without failing: SmolLM2's concatenates content to a str)."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Bye"}]}]
    try:
        text = render_jinja(template, parts)
    except TemplateError:
        return False
    return "Bye" in text and "'type'" not in text and '"type"' not in text


def _probe(template: str, bos_token: str, eos_token: str) -> str | None:
    """Why jinja cannot render a short chat with ``template``, or None when it can."""
    try:
        text = render_jinja(template, PROBE, bos_token=bos_token, eos_token=eos_token)
    except TemplateError as error:
        return str(error)[:200]
    return None if "Bye" in text else "its prompt leaves out the messages"
