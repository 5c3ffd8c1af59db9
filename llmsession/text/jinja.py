"""Render any Hugging Face chat template with jinja2, the way ``apply_chat_template`` does.

The environment matches transformers': a sandbox with ``trim_blocks`` and ``lstrip_blocks``,
the ``loopcontrols`` extension, ``raise_exception``, ``strftime_now`` and a ``tojson`` that
does not escape HTML. Not provided: the ``{% generation %}`` tag transformers adds for
assistant masks (templates using it fail with a TemplateError). A template is the model file's
code: what it raises is a TemplateError, and its arithmetic, formatting and joining are
bounded, and its steps (loop iterations, calls) counted (``jinja_bounds``).

jinja2 is a dependency, imported only when a template is first rendered (a bare import stays light);
without it, a model's prompts fall back to llama.cpp's built-in templates (``renderer``).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, NoReturn

from llmsession.errors import TemplateError
from llmsession.text.messages import lone_surrogate

if TYPE_CHECKING:
    import jinja2

WIDTH = re.compile(r"%[-_0^#]*[0-9]")  # (a strftime field given a width)


def _require_jinja2() -> None:
    try:
        import jinja2  # noqa: F401
    except ImportError as exc:
        raise TemplateError("rendering a chat template with jinja needs jinja2: pip install jinja2") from exc


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson``: plain ``json.dumps``, keeping non-ASCII and ``<>&`` as they are
    (an indent of at most 64: each level of each line takes it), bounded as what it makes
    (``jinja_bounds.bounded_json``)."""
    if (isinstance(indent, int) and indent > 64) or (isinstance(indent, str) and len(indent) > 64):
        raise TemplateError("the chat template's tojson indents by at most 64")
    from llmsession.text.jinja_bounds import bounded_json  # (with jinja2, as the environment)

    return bounded_json(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    """The time now, as ``fmt`` writes it: at most 1,024 characters of format and no field
    widths (glibc pads ``%1000000Y`` as asked, and Python grows its buffer up to 256 times the
    format's length to hold it)."""
    if not isinstance(fmt, str) or len(fmt) > 1024 or WIDTH.search(fmt):
        raise TemplateError("the chat template's strftime_now takes a short format without field widths")
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    """Compiled once per template text: compiling a large template costs milliseconds. The
    template is the model file's code, read as hostile: its failures are TemplateErrors."""
    _require_jinja2()
    import jinja2.ext

    from llmsession.text.jinja_bounds import bounded_environment

    env = bounded_environment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except TemplateError:
        raise
    except Exception as exc:  # (a parse error, or one its constants raise when folded)
        raise TemplateError(f"the chat template does not parse: {type(exc).__name__}: {exc}") from exc


def _size(messages: Sequence[Mapping[str, Any]], variables: Mapping[str, Any]) -> int:
    """The characters a render's input holds, about (its share of steps: ``counted``)."""
    try:
        return len(json.dumps([list(messages), dict(variables)], ensure_ascii=False, default=repr))
    except (RecursionError, ValueError):  # (nested past the encoder: the base share only)
        return 0


def render_jinja(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **variables: Any,
) -> str:
    """``template`` rendered over ``messages``; ``variables`` become template variables
    (``enable_thinking``, ``tools``, ...). ``tools`` and ``documents`` default to None, as in
    transformers. Any failure while rendering is a TemplateError."""
    from llmsession.text.jinja_bounds import counted

    compiled = _compile(template)
    context = {"tools": None, "documents": None, **variables}
    try:
        with counted(_size(messages, context)):
            text: str = compiled.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=bos_token,
                eos_token=eos_token,
                **context,
            )
    except TemplateError:
        raise
    except Exception as exc:  # (the file's code: an assert, a recursing macro, a bound met)
        raise TemplateError(f"the chat template failed: {type(exc).__name__}: {exc}") from exc
    if lone_surrogate(text):  # (from a message's key no check reads: the template's choice)
        raise TemplateError("the rendered prompt holds a lone surrogate, which UTF-8 cannot encode")
    return text
