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

from llmsession.text.gemma4_tools import QUOTE, dictsort, format_argument

_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
INTEGER = r"/-?(0|[1-9][0-9]{0,15})/"  # (generated numbers are bounded: a small model may not stop)
NUMBER = r"/-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,16})?([eE][+-]?[0-9]{1,3})?/"
_KEY = re.compile(r"[^:{}\[\],<>]+")
MAX_DEPTH = 32


def write_body(arguments: Mapping[str, Any]) -> str:
    """A call's arguments between its braces, as the template writes a mapping."""
    return ",".join(f"{key}:{format_argument(value, False)}" for key, value in dictsort(arguments))


def body_from_json(arguments: str) -> str:
    """OpenAI's JSON arguments in Gemma's syntax (a non-object is written as the template
    writes a string argument: as it is)."""
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
    return json.dumps(value, ensure_ascii=False), reader.pos


# -- the grammar ------------------------------------------------------------------------------------
class BodyGrammar:
    """Lark rules for a tool's arguments body from its JSON schema: types, enums, required and
    optional properties in the template's order. Keywords it does not hold (lengths, ranges,
    patterns, combinators) are checked once the call is complete."""

    def __init__(self, prefix: str, say: Callable[[str], str]) -> None:
        self.prefix, self.say, self.rules = prefix, say, dict[str, str]()
        quote = say(QUOTE)
        special = quote.startswith("<[")  # a special token: a string may hold any text before it
        self.quote, self.special = quote, special
        self.rules[f"{prefix}_str"] = self._string({})
        scalars = [f"{prefix}_str", NUMBER, '"true"', '"false"', '"None"']
        array = f'"[" ({prefix}_any ("," {prefix}_any)*)? "]"'
        mapping = f'"{{" ({prefix}_pair ("," {prefix}_pair)*)? "}}"'
        self.rules[f"{prefix}_any"] = " | ".join([*scalars, array, mapping])
        self.rules[f"{prefix}_pair"] = f'/{_KEY.pattern}/ ":" {prefix}_any'

    def body(self, schema: Mapping[str, Any]) -> str:
        """The rule name of an object schema's body (any pairs when it declares no properties)."""
        properties = schema.get("properties")
        if not isinstance(properties, Mapping) or not properties:
            return f'({self.prefix}_pair ("," {self.prefix}_pair)*)?'
        required = set(schema.get("required") or ())
        pairs = [(self.say(f"{k}:") + " " + self.value(v), k in required) for k, v in dictsort(properties)]
        made: dict[tuple[int, bool], str] = {}

        def chain(i: int, first: bool) -> str:
            """Pairs i.. where ``first`` says none was written yet (no comma before the next)."""
            if i == len(pairs):
                return ""
            if (i, first) not in made:
                made[i, first] = name = f"{self.prefix}_o{len(self.rules)}"
                self.rules[name] = ""  # (its name taken before the rules it refers to)
                pair, needed = pairs[i]
                written = (pair if first else f'"," {pair}') + " " + chain(i + 1, False)
                skipped = "" if needed else chain(i + 1, first)
                optional = f"({written}) | {skipped}" if skipped else f"({written})?"
                self.rules[name] = written if needed else optional
            return made[i, first]

        return chain(0, True)

    def value(self, schema: Any) -> str:
        if not isinstance(schema, Mapping):
            return f"{self.prefix}_any"
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
            item = self.value(schema.get("items"))
            return f'"[" ({item} ("," {item})*)? "]"'
        if kind == "object":
            return '"{" ' + self.body(schema) + ' "}"'
        return f"{self.prefix}_any"

    def _string(self, schema: Mapping[str, Any]) -> str:
        """A quoted string: any text before a special-token quote, no ``<`` before a spelled one;
        at most ``maxLength`` characters, which the model would otherwise not stop at."""
        most = schema.get("maxLength")
        times = f"{{0,{most}}}" if isinstance(most, int) and not isinstance(most, bool) and most >= 0 else "*"
        body = f"/(.|\\n){times}/" if self.special else f"/[^<]{times}/"
        return f"{self.quote} {body} {self.quote}"

    def lines(self) -> list[str]:
        return [f"{name}: {rule}" for name, rule in self.rules.items()]
