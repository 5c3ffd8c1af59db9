"""A request's body read as JSON, before any field is checked (``schema``). Pure.

Whatever json accepts is read, and then what would fail later without naming a field is
refused here naming it (``param``): a string or key UTF-8 cannot encode (a lone surrogate), and a
number no double holds. A message quotes no more of what was sent than a few characters
(``shown``).
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from llmsession.serve.errors import ApiError
from llmsession.text.schemas import containers

NAMES = {
    dict: "an object",
    list: "a list",
    str: "a string",
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    type(None): "null",
}
# A lone surrogate in a UTF-8 body can only come from a \uD800-\uDFFF escape or from the bytes
# UTF-8 never uses for one (json decodes with surrogatepass); a body without either needs no walk.
SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
# The most digits a JSON integer a double can hold has (1.8e308); int() reads no more than 4,300.
DOUBLE_DIGITS = len(str(int(sys.float_info.max)))
MAX_PATH = 120  # characters of a field's path in a message and in ``param``
MAX_KEY = 32  # characters of each key in that path


def string(value: Any, where: str) -> str:
    """``value``, a string, else a 400 naming ``where``."""
    if not isinstance(value, str):
        raise ApiError(f"{where} must be a string, got {kind_of(value)}", where)
    return value


def nests_deeper(value: Any, levels: int) -> bool:
    """Whether JSON-like ``value`` nests more than ``levels`` objects and lists deep (what json
    reads on a worker's stack may be too deep to write again on the event loop's)."""
    return any(level > levels for _, level in containers(value))


def parse_json(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object, whose every string (and key) UTF-8 can encode (the
    tokenizer's error would otherwise name no field) and whose every number a double can hold.

    NaN and Infinity are not JSON; a number past a double's range (``1e400``, which json reads as
    infinity, or a 400-digit integer: float() of it overflowed in the checks, a 500) is a 400
    naming where it is, whichever field holds it (a schema's bound that large was refused only
    when the schema compiled, naming no field and quoting the number whole): RFC 8259 calls
    numbers past that range not interoperable, and no field of the API needs one. So ``seed``
    takes any integer up to 1.8e308. A body in UTF-16 or UTF-32 (with or without a BOM: json
    detects them, as RFC 4627 had it) is decided for, not refused: it is read as its UTF-8 twin
    would be, with the same checks (a lone surrogate in it is a 400 naming its field). RFC 8259
    asks for UTF-8, but such bodies were always answered here, and refusing them would take from
    clients what they had."""
    numbers = _Numbers()

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not valid JSON")

    try:
        value = json.loads(body, parse_constant=refuse, parse_int=numbers.integer, parse_float=numbers.real)
    except (ValueError, RecursionError) as error:  # (UnicodeDecodeError is a ValueError)
        raise ApiError(f"the body is not valid JSON: {error or 'nested too deep'}") from None
    if not isinstance(value, dict):
        raise ApiError(f"the body must be a JSON object, got {kind_of(value)}")
    utf8 = json.detect_encoding(body).startswith("utf-8")  # (else the byte patterns say nothing)
    found = unfit(value) if numbers.out_of_range or not utf8 or SURROGATE.search(body) else None
    if found is not None:
        where, problem = found
        raise ApiError(f"{where} {problem}", where)
    return value


class _Numbers:
    """json's readers of numbers: one a double cannot hold is read as an infinity (a signed one)
    and noted, so the walk after (``unfit``) names where it was; an integer past int()'s 4,300
    digits is never converted (json's own reader would fail with no field named)."""

    def __init__(self) -> None:
        self.out_of_range = False

    def integer(self, text: str) -> int | float:
        if len(text.lstrip("-")) <= DOUBLE_DIGITS:
            value = int(text)
            if -sys.float_info.max <= value <= sys.float_info.max:
                return value
        self.out_of_range = True
        return -math.inf if text.startswith("-") else math.inf

    def real(self, text: str) -> float:
        value = float(text)
        if math.isinf(value):  # (json's grammar has no NaN: only overflow makes one)
            self.out_of_range = True
        return value


OUT_OF_RANGE = "is a number of a size no double holds (past 1.8e308)"
LONE_SURROGATE = "holds a lone surrogate, which is not valid Unicode text"


# Where a value is: its parent's link and its key or index; None for the body itself.
Link = tuple[Any, str | int] | None


def unfit(value: object) -> tuple[str, str] | None:
    """Where the first string or key with a lone surrogate, or the first infinite number, is
    (``messages[0].content``), in the body's order, and what is wrong there; or None. Iterative
    (the body may be nested as deep as json allows), and a value costs no more than its own
    link whatever its depth: a path is spelled only for the value found, and bounded
    (``MAX_PATH``, each key ``MAX_KEY``)."""
    stack: list[tuple[Link, Iterator[tuple[str | int, object]]]] = [(None, _children(value))]
    while stack:
        where, children = stack[-1]
        for key, item in children:
            kind = type(item)  # (not isinstance: json makes only these types, and this runs a lot)
            if type(key) is str and not _encodable(key):
                return f"a key of {_path(where)}", LONE_SURROGATE
            if kind is str and not _encodable(item):  # type: ignore[arg-type]
                return _path((where, key)), LONE_SURROGATE
            if kind is float and item in INFINITIES:
                return _path((where, key)), OUT_OF_RANGE
            if kind is dict or kind is list:
                stack.append(((where, key), _children(item)))
                break
        else:
            stack.pop()
    return None


INFINITIES = (math.inf, -math.inf)


def _children(value: object) -> Iterator[tuple[str | int, object]]:
    if isinstance(value, dict):
        return iter(value.items())
    return enumerate(value) if isinstance(value, list) else iter(())


def _path(where: Link) -> str:
    """A field's path (``tools[0].function``) from its link, its middle cut out past
    ``MAX_PATH`` characters."""
    parts: list[str] = []
    while where is not None:
        where, key = where
        parts.append(f"[{key}]" if isinstance(key, int) else f".{shown(key)}" if where else shown(key))
    path = "".join(reversed(parts)) or "the body"
    if len(path) <= MAX_PATH:
        return path
    half = MAX_PATH // 2
    return f"{path[:half]}...{path[-half:]}"


def shown(value: object, most: int = MAX_KEY) -> str:
    """``value`` as a message quotes it, bounded: a string cut after ``most`` characters, an
    integer past 15 digits by its length (str() of one past 4,300 digits would fail)."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        return repr(value)[:most]
    if isinstance(value, str):
        return value if len(value) <= most else f"{value[:most]}..."
    if -(10**15) < value < 10**15:
        return str(value)
    digits = len(str(abs(value))) if value.bit_length() < 14_000 else "thousands of"
    return f"{'-' if value < 0 else ''}an integer of {digits} digits"


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def kind_of(value: object) -> str:
    return NAMES.get(type(value), type(value).__name__)


def optional(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], where: str = "") -> Any:
    """``body[name]`` if present and not null, of ``kind`` (a bool is not an int here)."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        names = " or ".join(NAMES.get(k, k.__name__) for k in kinds)
        raise ApiError(f"{where or name} must be {names}, got {kind_of(value)}", where or name)
    return value


def plain_text(value: object, where: str) -> str:
    """A string field without NUL characters (which no prompt may hold)."""
    if "\0" in (text := string(value, where)):
        raise ApiError(f"{where} contains a NUL character", where)
    return text
