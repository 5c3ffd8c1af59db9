"""The sandbox a chat template renders in, with its one-step amplifiers bounded: the template is
the model file's code, and one expression (``'a' * 10**10``, ``9**(9**9)`` or ``'%999999999s' %
''``, both folded as constants when the template compiles, ``'{:>9999999999}'.format(1)``) would
otherwise take the process's memory or time at load or at a request. What one operation would
make is reckoned before it runs and refused past ``MOST_CHARS`` characters (``MOST_BITS`` bits
for a power), a SecurityError that ``jinja`` makes a TemplateError: repetition, powers, ``%``
and ``str.format`` fields (a key may nest parentheses), the str and bytes methods that pad,
replace, join, expand tabs or translate (however reached: ``s.ljust``, ``s['ljust']``,
``map(attribute=...)``), ``int.to_bytes``, and the filters that do
(``center``, ``indent``, ``format``, ``replace``, ``join``, ``wordwrap``, ``batch``); ``lipsum``
is not offered. Joining (``~``, ``+``) is bounded as one operation too, so a string doubled
line by line stops at the bound. And a render takes at most ``MOST_STEPS`` steps (each
iteration of a loop, a recursive loop's too, each call: a macro's, a function's, a method's)
and at most ``MOST_SECONDS``, each more with the size of its input, so nested loops or a macro
calling itself twice a level end in a TemplateError, not in hours (``counted``). Pure: jinja2
only.
"""

from __future__ import annotations

import contextlib
import functools
import json
import operator
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jinja2.sandbox
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError
from jinja2.filters import make_attrgetter
from jinja2.runtime import LoopContext

MOST_CHARS = 1 << 24  # what one operation may make (16 Mi characters: far past any real prompt)
MOST_STEPS = 1 << 18  # loop iterations and calls in one render, beside its input's own share:
STEPS_PER_CHAR = 32  # (Gemma 4's template takes ~4 a character of messages and tools: 540K for
# 1,024 messages and 128 tools of 10 properties, ~5 s; a macro bomb with no input stops in ~1 s)
MOST_SECONDS = 10.0  # a render's time, beside its input's share (Gemma 4's: ~36 us a character)
SECONDS_PER_CHAR = 3e-4
_steps = threading.local()  # what the render on this thread may still take (``counted``)
MOST_BITS = 1 << 16  # an integer power's size
NUMBERS = re.compile(r"[0-9]+")  # (every number in a format spec: its width and precision)
SPEC = re.compile(r"[-#0 +]*[0-9.*]*")  # (a %-field's flags, width, precision, after its key)


def _bounded(chars: int, what: str) -> None:
    if chars > MOST_CHARS:
        raise SecurityError(
            f"the chat template's {what} would make {chars} characters (at most {MOST_CHARS})"
        )


def _length(value: Any) -> int:
    """The characters ``value`` is written as (a str's own; a container's, as rendered)."""
    return len(value) if isinstance(value, str | bytes) else len(str(value))


def _spec(spec: str, what: str = "format width") -> None:
    """Refuse a format spec (resolved, or %-style fields) whose width or precision is too large."""
    for number in NUMBERS.findall(spec):
        _bounded(int(number) if len(number) < 10 else MOST_CHARS + 1, what)


def _fields(text: str) -> Iterator[str]:
    """The flags, width and precision of each %-field, as Python reads them: a key in
    parentheses may nest them (``%(a(b))9s``: a regex stopping at the first one missed the width)."""
    at = text.find("%")
    while at >= 0:
        at += 1
        if text.startswith("(", at):
            depth = 0
            for end in range(at, len(text)):
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                if depth == 0:
                    break
            at = end + 1
        spec = SPEC.match(text, at)
        yield spec.group() if spec is not None else ""
        at = text.find("%", (spec.end() if spec is not None else at) + 1)


def _percent(text: str | bytes) -> None:
    """Refuse %-style fields whose width is too large or taken from the arguments (``*``)."""
    fields = list(_fields(text.decode("latin-1") if isinstance(text, bytes) else text))
    if any("*" in field for field in fields):
        raise SecurityError("the chat template's % format takes no width from its arguments")
    _spec(" ".join(fields))


@contextlib.contextmanager
def counted(chars: int = 0) -> Iterator[None]:
    """A render's steps, counted on this thread (a render outside one is not bounded in them):
    ``MOST_STEPS``, and ``STEPS_PER_CHAR`` for each of the ``chars`` its input holds; and its
    time, ``MOST_SECONDS`` and ``SECONDS_PER_CHAR`` a character (a step may be a sum of five
    million items: counted, 2**18 of them took hours)."""
    before = getattr(_steps, "left", None), getattr(_steps, "until", None)
    _steps.left = MOST_STEPS + STEPS_PER_CHAR * chars
    _steps.until = time.monotonic() + MOST_SECONDS + SECONDS_PER_CHAR * chars
    try:
        yield
    finally:
        _steps.left, _steps.until = before


def _step() -> None:
    left = getattr(_steps, "left", None)
    if left is not None:
        if left <= 0:
            raise SecurityError("the chat template took too many steps (loops and calls) for its input")
        if time.monotonic() > _steps.until:
            raise SecurityError("the chat template took too long for its input")
        _steps.left = left - 1


def _iterated(items: Any) -> Iterator[Any]:
    """A loop's items, one step each."""
    for item in items:
        _step()
        yield item


def _joined_up(parts: tuple[Any, ...]) -> str:
    """``a ~ b ~ ...``, bounded as one operation (doubled line by line, a string had no bound)."""
    texts = [str(part) for part in parts]
    _bounded(sum(map(len, texts)), "joining (~)")
    return "".join(texts)


def _concat(pieces: Iterable[str], what: str = "output") -> str:
    """What jinja joins a render's, a macro's or a ``{% set %}`` block's output with, bounded
    as it goes (a macro that writes its argument twice, called on its own output 30 times)."""
    kept, total = [], 0
    for piece in pieces:
        total += len(piece)
        _bounded(total, what)
        kept.append(piece)
    return "".join(kept)


def bounded_json(value: Any, **options: Any) -> str:
    """``json.dumps(value, **options)`` within ``MOST_CHARS``: at once where it cannot be past
    them (a character is at most 12 of JSON: an escaped astral one), else written piece by
    piece and refused once past them (an indent's width times each line's depth has no other
    bound)."""
    if not options.get("indent") and 12 * _length(value) <= MOST_CHARS:
        return json.dumps(value, **options)
    return _concat(json.JSONEncoder(**options).iterencode(value), "tojson filter")


def _chars(value: Any) -> int:
    """The characters a string holds, or a list's or tuple's items (``_length`` each)."""
    if isinstance(value, list | tuple):  # (a string item by its length, another as one: a
        return sum(len(v) if isinstance(v, str | bytes) else 1 for v in value) + len(value)
    return _length(value)  # list grown a message at a time must not write each one out each time)


def _plus(left: Any, right: Any) -> Any:
    sized = (str, list, tuple, bytes)  # (a list's items as they are written: ``a = a + a``)
    if isinstance(left, sized) and isinstance(right, sized):
        _bounded(_chars(left) + _chars(right), "joining (+)")
    return operator.add(left, right)


def _times(left: Any, right: Any) -> Any:
    for seq, n in ((left, right), (right, left)):
        if isinstance(seq, str | bytes | list | tuple) and isinstance(n, int) and n > 0:
            _bounded(_length(seq) * n, "repetition")
    return operator.mul(left, right)


def _power(left: Any, right: Any) -> Any:
    big = isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0
    if big and abs(left).bit_length() * right > MOST_BITS:
        raise SecurityError(f"the chat template's power has more than {MOST_BITS} bits")
    return operator.pow(left, right)


def _modulo(left: Any, right: Any) -> Any:
    if isinstance(left, str | bytes):
        _percent(left)
    return operator.mod(left, right)


def _replaced(text: str, old: Any, new: Any) -> int:
    if not isinstance(old, str) or not isinstance(new, str):
        return len(text)
    if not old:
        return len(text) + (len(text) + 1) * len(new)
    return len(text) + text.count(old) * max(0, len(new) - len(old))


def _joined(separator: str | bytes, items: list[Any]) -> int:
    return sum(map(_length, items)) + len(separator) * max(0, len(items) - 1)


def _made(text: str | bytes, name: str, args: tuple[Any, ...]) -> int:
    """At most what ``text.name(*args)`` makes, in characters (the str and bytes methods that
    amplify; bytes reckoned as the text of their latin-1 reading, one character a byte)."""
    if isinstance(text, bytes):
        text = text.decode("latin-1")
        args = tuple(a.decode("latin-1") if isinstance(a, bytes) else a for a in args)
    first = args[0] if args else None
    if name == "expandtabs":
        return len(text) + text.count("\t") * (first if isinstance(first, int) else 8)
    if name == "replace":
        return _replaced(text, first, args[1] if len(args) > 1 else None)
    if name == "translate":
        values = first.values() if isinstance(first, dict) else []
        return len(text) * max([1, *(_length(v) for v in values if v is not None)])
    return first if isinstance(first, int) else 0  # (a padding method's width)


AMPLIFIERS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs", "replace", "translate", "join"})


def _sized(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """``int.to_bytes``, refusing a length past the bound."""

    def bounded(*args: Any, **kwargs: Any) -> Any:
        length = args[0] if args else kwargs.get("length", 1)
        if isinstance(length, int):
            _bounded(length, f"int.{name}")
        return method(*args, **kwargs)

    return bounded


def _method(text: str | bytes, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """``text``'s ``name`` method, refusing what it would make past the bound."""

    def bounded(*args: Any, **kwargs: Any) -> Any:
        if name == "join" and args:
            items = list(args[0]) if isinstance(args[0], Iterable) else args[0]
            _bounded(_joined(text, items), "str.join")
            return method(items, *args[1:], **kwargs)
        _bounded(_made(text, name, (*args, *kwargs.values())), f"str.{name}")
        return method(*args, **kwargs)

    return bounded


def _filter(original: Callable[..., Any], reckon: Callable[..., int], name: str) -> Callable[..., Any]:
    """The filter ``name`` refusing what ``reckon`` (given its value and arguments) says it
    would make past the bound; jinja's marks of what it is passed stay on it."""

    @functools.wraps(original)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _bounded(reckon(*args, **kwargs), f"{name} filter")
        return original(*args, **kwargs)

    return bounded


def _indent(s: Any, width: Any = 4, *_: Any, **__: Any) -> int:
    pad = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    return len(s) + (s.count("\n") + 1) * pad if isinstance(s, str) else 0


def _wrapped(env: Any, s: Any, width: Any = 79, *_: Any, wrapstring: Any = None, **__: Any) -> int:
    if not isinstance(s, str):
        return 0
    breaks = len(s) // max(1, width if isinstance(width, int) else 1) + s.count(" ") + 1
    return len(s) + breaks * len(wrapstring if isinstance(wrapstring, str) else "\n")


def _format(value: Any, *_: Any, **__: Any) -> int:
    if isinstance(value, str):
        _percent(value)
    return 0


FILTERS: dict[str, Callable[..., int]] = {
    "center": lambda value, width=80, *_, **__: width if isinstance(width, int) else 0,
    "indent": _indent,
    "format": _format,
    "replace": lambda ctx, s, old, new, *_, **__: _replaced(s, old, new) if isinstance(s, str) else 0,
    "wordwrap": _wrapped,
    "batch": lambda value, linecount, *_, **__: linecount if isinstance(linecount, int) else 0,
    # (what they make of their value, at most: ``&`` escaped is ``&amp;``, a control character
    # in JSON ``\u0001``; a string as a list is an item a character)
    "escape": lambda value, *_, **__: 5 * _length(value),
    "e": lambda value, *_, **__: 5 * _length(value),
    "forceescape": lambda value, *_, **__: 5 * _length(value),
    "string": lambda value, *_, **__: _length(value),
    "list": lambda value, *_, **__: len(value) if isinstance(value, str | bytes | list | tuple) else 0,
    "pprint": lambda value, *_, **__: 2 * _length(value),
    "urlencode": lambda value, *_, **__: 9 * _length(value),
    "xmlattr": lambda ctx, value, *_, **__: 6 * _length(value),
}


class _Generator(CodeGenerator):
    """Jinja's code generator, ``~`` joined through ``_joined_up``."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.joined_up((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """transformers' sandbox, with the amplifiers above bounded, and its steps counted."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})
    code_generator_class = _Generator
    concat = staticmethod(_concat)
    joined_up = staticmethod(_joined_up)
    iterated = staticmethod(_iterated)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.binop_table = {**self.binop_table, "*": _times, "**": _power, "%": _modulo, "+": _plus}
        for name, reckon in FILTERS.items():
            self.filters[name] = _filter(self.filters[name], reckon, name)
        self.filters["join"] = self._join_filter(self.filters["join"])
        self.globals.pop("lipsum", None)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        return self.binop_table[operator](left, right)

    def call(self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _step()  # (a macro calling itself twice a level made 2**n calls)
        if isinstance(__obj, LoopContext) and args:  # (a recursive loop's ``loop(items)``)
            args = (_iterated(args[0]), *args[1:])
        return super().call(__context, __obj, *args, **kwargs)

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        """The template's tree, each loop's items taken a step each (``_iterated``, reached as
        the environment's: a name the template could define itself would be its own)."""
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Call(nodes.EnvironmentAttribute("iterated"), [loop.iter], [], None, None)
        return tree

    def getattr(self, obj: Any, attribute: str) -> Any:
        return self._bounded_method(obj, attribute, super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        return self._bounded_method(obj, argument, super().getitem(obj, argument))

    @staticmethod
    def _bounded_method(obj: Any, name: Any, value: Any) -> Any:
        if isinstance(obj, str | bytes) and name in AMPLIFIERS and callable(value):
            return _method(obj, name, value)
        if isinstance(obj, int) and name == "to_bytes" and callable(value):
            return _sized(name, value)
        return value

    @staticmethod
    def _join_filter(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def bounded(ctx: Any, value: Any, d: str = "", attribute: Any = None) -> Any:
            items = list(value) if isinstance(value, Iterable) else value
            if isinstance(items, list) and isinstance(d, str):  # (an attribute's too: its parts)
                parts = (
                    items
                    if attribute is None
                    else list(map(make_attrgetter(ctx.environment, attribute), items))
                )
                _bounded(_joined(d, parts), "join filter")
            return original(ctx, items, d, attribute)

        return bounded

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """``str.format`` and ``format_map`` as the sandbox runs them, each field's resolved
        spec checked (``_Formatter``)."""
        if super().wrap_str_format(value) is None:
            return None
        formatter, text = _Formatter(self), value.__self__
        if value.__name__ == "format_map":
            return lambda mapping: str(formatter.vformat(text, (), mapping))
        return lambda *args, **kwargs: str(formatter.vformat(text, args, kwargs))


class _Formatter(jinja2.sandbox.SandboxedFormatter):
    def format_field(self, value: Any, format_spec: str) -> Any:
        _spec(format_spec)
        return super().format_field(value, format_spec)


def bounded_environment(**options: Any) -> BoundedEnvironment:
    """A bounded sandbox with jinja2's ``options``."""
    return BoundedEnvironment(**options)
