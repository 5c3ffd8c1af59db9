"""Gemma 4's call arguments: ``call:name{key:value,...}``, not JSON.

Google's template writes a call's arguments (a mapping) as ``key:value`` pairs in ``dictsort``
order (keys compared case-insensitively, written bare), strings between ``<|"|>`` quotes with no
escapes, ``true``/``false``, lists ``[a,b]``, nested mappings ``{k:v}``, and other values as
Python prints them. A reply's calls are generated in exactly that form (the grammar below fixes
key order and quoting), so the template re-renders what was generated and the next prompt keeps
its tokens. Read back, they become the JSON text OpenAI's ``arguments`` carry.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from llmsession.errors import GrammarError
from llmsession.text.gemma4_tools import QUOTE, dictsort, format_argument

_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")  # what the reader takes
_KEY = re.compile(r"[^:{}\[\],<>]+")
_DIGITS = "(0|[1-9][0-9]{0,15})"  # (bounded: a small model may not stop)
INTEGER = "/(0|-?[1-9][0-9]{0,15})/"
NUMBER = f"/(0|-?[1-9][0-9]{{0,15}}|-?{_DIGITS}\\.(0|[0-9]{{0,15}}[1-9]))/"
"""Numbers as Python prints them back (no ``-0``, ``1.50``, ``1e5``): a call re-rendered by the
template spells what was generated."""
STRING_BODY = r"([^<]|(<(\|(\"\|?)?)?)*<([^<|]|\|([^<\"]|\"([^<|]|\|[^<>]))))*(<(\|(\"\|?)?)?)*"
"""Text without ``<|"|>`` in it: the reader ends a string at the first one."""
MAX_DEPTH = 32


def write_body(arguments: Mapping[str, Any]) -> str:
    """A call's arguments between its braces, as the template writes a mapping."""
    return ",".join(f"{key}:{format_argument(value, False)}" for key, value in dictsort(arguments))


def body_from_json(arguments: str) -> str:
    """OpenAI's JSON arguments in Gemma's syntax. A non-object (which no generated call holds)
    is left as it is: the template writes it otherwise, so such a reply keeps no tokens."""
    value = json.loads(arguments)
    return write_body(value) if isinstance(value, dict) else arguments


class _Reader:
    """A recursive reader of Gemma values; ValueError where the text is not one."""

    def __init__(self, text: str, pos: int) -> None:
        self.text, self.pos = text, pos

    def expect(self, literal: str) -> None:
        if not self.text.startswith(literal, self.pos):
            got = self.text[self.pos : self.pos + 20]
            raise ValueError(f"expected {literal!r} at {self.pos}, got {got!r}")
        self.pos += len(literal)

    def body(self, depth: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        while not self.text.startswith("}", self.pos):
            if out:
                self.expect(",")
            key = _KEY.match(self.text, self.pos)
            if key is None:
                raise ValueError(f"expected a key at {self.pos}")
            if key.group() in out:
                raise ValueError(f"the key {key.group()!r} is written twice")
            self.pos = key.end()
            self.expect(":")
            out[key.group()] = self.value(depth + 1)
        return out

    def value(self, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError("a call's arguments are nested too deep to read")
        text, pos = self.text, self.pos
        if text.startswith(QUOTE, pos):
            end = text.find(QUOTE, pos + len(QUOTE))
            if end < 0:
                raise ValueError("an unclosed string")
            self.pos = end + len(QUOTE)
            return text[pos + len(QUOTE) : end]
        for word, value in (("true", True), ("false", False), ("None", None)):
            if text.startswith(word, pos):
                self.pos += len(word)
                return value
        if text.startswith("{", pos):
            self.pos += 1
            mapping = self.body(depth)
            self.expect("}")
            return mapping
        if text.startswith("[", pos):
            self.pos += 1
            items: list[Any] = []
            while not text.startswith("]", self.pos):
                if items:
                    self.expect(",")
                items.append(self.value(depth + 1))
            self.pos += 1
            return items
        number = _NUMBER.match(text, pos)
        if number is None:
            raise ValueError(f"expected a value at {pos}, got {text[pos : pos + 20]!r}")
        self.pos = number.end()
        return json.loads(number.group())


def read_body(text: str, pos: int) -> tuple[str, int]:
    """The arguments body at ``pos`` (up to, not including, its closing brace) as JSON text,
    and where it ends; ValueError if it is not one."""
    reader = _Reader(text, pos)
    value = reader.body(0)
    if not text.startswith("}", reader.pos):
        raise ValueError(f"expected '}}' at {reader.pos}")
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False), reader.pos
    except ValueError:
        raise ValueError("a call's number is out of JSON's range") from None


# -- the grammar ------------------------------------------------------------------------------------
class BodyGrammar:
    """Lark rules for a tool's arguments body from its JSON schema: types, enums, required and
    optional properties in the template's order, ``maxLength``. Keywords it does not hold
    (ranges, patterns, combinators, item counts) are checked once the call is complete."""

    def __init__(self, prefix: str, say: Callable[[str], str]) -> None:
        self.prefix, self.say, self.rules = prefix, say, dict[str, str]()
        quote = say(QUOTE)
        special = quote.startswith("<[")  # a special token: a string may hold any text before it
        self.quote, self.special = quote, special
        self.rules[f"{prefix}_str"] = self._string({})

    def _any(self, depth: int) -> str:
        """The rule of any value at ``depth`` (a call's own pairs hold values at 1): containers
        only while their items are within ``MAX_DEPTH``, as the reader takes them."""
        name = f"{self.prefix}_any{depth}"
        if name not in self.rules:
            self.rules[name] = ""  # (named before its levels below: each level is written once)
            scalars = [f"{self.prefix}_str", NUMBER, '"true"', '"false"', '"None"']
            inner, pairs = (self._any(depth + 1), self._pairs(depth)) if depth < MAX_DEPTH else (None, "")
            array = f'"[" ({inner} ("," {inner})*)? "]"' if inner else '"[" "]"'
            self.rules[name] = " | ".join([*scalars, array, f'"{{" {pairs} "}}"'])
        return name

    def _pairs(self, depth: int) -> str:
        """Any pairs of a mapping at ``depth`` (their values one deeper)."""
        pair = f"{self.prefix}_pair{depth}"
        if pair not in self.rules:
            self.rules[pair] = f'/{_KEY.pattern}/ ":" {self._any(depth + 1)}'
        return f'({pair} ("," {pair})*)?'

    def body(self, schema: Mapping[str, Any], depth: int = 0) -> str:
        """The rule of the body of an object schema at ``depth`` (a call's own: 0), any pairs
        when it declares no properties; past the reader's depth an empty one, or a refusal
        where a property is required there."""
        properties = schema.get("properties")
        listed = schema.get("required")  # (draft 3's is a bool on the property: not Gemma 4's)
        required = {key for key in listed if isinstance(key, str)} if isinstance(listed, list) else set()
        if depth >= MAX_DEPTH:
            if isinstance(properties, Mapping) and required & set(properties):
                raise GrammarError(
                    f"Gemma 4's calls are read at most {MAX_DEPTH} levels deep: a schema requires more"
                )
            return ""
        if not isinstance(properties, Mapping) or not properties:
            return self._pairs(depth)
        for key in properties:
            if not isinstance(key, str) or not _KEY.fullmatch(key):
                raise GrammarError(f"Gemma 4 writes property names bare: {key!r} cannot be one")
        pairs = [
            (self.say(f"{k}:") + " " + self.value(v, depth + 1), k in required)
            for k, v in dictsort(properties)
        ]
        return self._chain(pairs)

    def _chain(self, pairs: list[tuple[str, bool]]) -> str:
        """Rules for the pairs in order, each required or optional, commas between those written:
        rule (i, first) holds pairs i.. when none was written before (``first``: no comma)."""
        names: dict[tuple[int, bool], str] = {(len(pairs), False): "", (len(pairs), True): ""}
        for i in range(len(pairs) - 1, -1, -1):  # (from the last: no recursion however many)
            pair, needed = pairs[i]
            for first in (False, True):
                written = (pair if first else f'"," {pair}') + " " + names[i + 1, False]
                skipped = names[i + 1, first]
                rule = written if needed else f"({written}) | {skipped}" if skipped else f"({written})?"
                names[i, first] = name = f"{self.prefix}_o{len(self.rules)}"
                self.rules[name] = rule
        return names[0, True]

    def value(self, schema: Any, depth: int) -> str:
        """The rule of a value at ``depth`` that ``schema`` describes."""
        if not isinstance(schema, Mapping):
            return self._any(depth)
        if "enum" in schema and isinstance(schema["enum"], list) and schema["enum"]:
            return "(" + " | ".join(self.say(format_argument(v, False)) for v in schema["enum"]) + ")"
        kind = schema.get("type")
        if kind == "string":
            return self._string(schema) if "maxLength" in schema else f"{self.prefix}_str"
        if kind == "integer":
            return INTEGER
        if kind == "number":
            return NUMBER
        if kind == "boolean":
            return '("true" | "false")'
        if kind == "array":
            if depth >= MAX_DEPTH:  # (only an empty one: its items would be past the reader)
                return '"[" "]"'
            item = f"{self.prefix}_a{len(self.rules)}"
            self.rules[item] = ""  # (named once: an array of arrays does not double the grammar)
            self.rules[item] = self.value(schema.get("items"), depth + 1)
            return f'"[" ({item} ("," {item})*)? "]"'
        if kind == "object":
            return '"{" ' + self.body(schema, depth) + ' "}"'
        return self._any(depth)

    def _string(self, schema: Mapping[str, Any]) -> str:
        """A quoted string holding no quote, at most ``maxLength`` characters (a model may not
        stop otherwise). Spelled quotes and the text between are one lexeme, so the string ends
        at its closing quote; a bounded one holds no ``<`` then. Between special-token quotes,
        a bounded string may spell a quote (the reader then refuses the call)."""
        most = schema.get("maxLength")
        bounded = isinstance(most, int) and not isinstance(most, bool) and most >= 0
        if self.special:
            body = f"(.|\\n){{0,{most}}}" if bounded else STRING_BODY
            return f"{self.quote} /{body}/ {self.quote}"
        quote = re.escape(QUOTE).replace("/", "\\/")
        body = f"[^<]{{0,{most}}}" if bounded else STRING_BODY
        return f"/{quote}{body}{quote}/"

    def lines(self) -> list[str]:
        return [f"{name}: {rule}" for name, rule in self.rules.items()]
