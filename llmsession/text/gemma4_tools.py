"""Gemma 4's tool syntax: the macros of Google's template, in Python, for ``gemma4``.

``format_function_declaration``, ``format_parameters``, ``format_argument`` and
``format_tool_response_block`` are ported line by line from the current template (llama.cpp
``models/templates/google-gemma-4-31B-it.jinja``), quirks included, so the text is the one the
model was trained on:

- mappings are written in jinja's ``dictsort`` order: by key, case-insensitively, ties in
  their original order;
- strings are quoted ``<|"|>...<|"|>`` and written raw (no escaping of quotes or newlines);
  ``True``/``False`` as ``true``/``false``; other scalars as jinja prints them (``str``, so
  ``None`` is ``None`` and ``1.0`` is ``1.0``);
- a schema's types are upper-cased as text (a list type ``["string", "null"]`` becomes
  ``['STRING', 'NULL']``); properties named like a schema keyword (``description``, ``type``,
  ``properties``, ``required``, ``nullable``) are skipped; an ``object`` without a
  ``properties`` mapping lists its own other keys as properties; ``parameters`` and
  ``response`` are left unclosed when they have no (``OBJECT``) type.

A key missing from a mapping, or read from a value that is not one, is jinja's Undefined:
falsy, and printed as nothing. What jinja would fail on (non-str keys, iterating a number, a
value that is not JSON) is a TemplateError here too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from llmsession.errors import TemplateError
from llmsession.text.messages import Message, is_image_part, part_text

QUOTE = '<|"|>'
SCHEMA_KEYS = ("description", "type", "properties", "required", "nullable")
MISSING: Any = object()  # jinja's Undefined


def _get(value: object, key: str) -> Any:
    """``value[key]`` as jinja reads it: MISSING when absent or when value is no mapping."""
    return value.get(key, MISSING) if isinstance(value, Mapping) else MISSING


def _truthy(value: object) -> bool:
    return value is not MISSING and bool(value)


def _show(value: object) -> str:
    """``{{ value }}``."""
    return "" if value is MISSING else str(value)


def _upper(value: object) -> str:
    """``value | upper``."""
    return _show(value).upper()


def dictsort(mapping: object) -> list[tuple[str, Any]]:
    """jinja's ``dictsort``: items by key, case-insensitively; a sort is stable, as jinja's."""
    if not isinstance(mapping, Mapping):
        raise TemplateError(f"expected an object, got {type(mapping).__name__}")
    if not all(isinstance(key, str) for key in mapping):
        raise TemplateError(f"object keys must be str, got {list(mapping)!r:.80}")
    return sorted(mapping.items(), key=lambda item: item[0].lower())


def _each(values: object) -> list[Any]:
    """``for x in values`` in jinja: a str gives its characters, a mapping its keys."""
    if not isinstance(values, str | list | tuple | Mapping):
        raise TemplateError(f"expected a list, got {type(values).__name__}")
    return list(values)


def _quoted_list(values: object) -> str:
    """``[<|"|>a<|"|>,<|"|>b<|"|>]`` for a ``required`` list (items printed, not formatted)."""
    return "[" + ",".join(f"{QUOTE}{_show(item)}{QUOTE}" for item in _each(values)) + "]"


def format_argument(argument: object, escape_keys: bool = True) -> str:
    """A JSON value in Gemma's syntax; object keys quoted when ``escape_keys``."""
    if isinstance(argument, str):
        return QUOTE + argument + QUOTE
    if isinstance(argument, bool):
        return "true" if argument else "false"
    if isinstance(argument, Mapping):
        return (
            "{"
            + ",".join(
                (QUOTE + key + QUOTE if escape_keys else key) + ":" + format_argument(value, escape_keys)
                for key, value in dictsort(argument)
            )
            + "}"
        )
    if isinstance(argument, list | tuple):
        return "[" + ",".join(format_argument(item, escape_keys) for item in argument) + "]"
    if argument is None or isinstance(argument, int | float):
        return str(argument)
    raise TemplateError(f"a tool value must be JSON, got {type(argument).__name__}")


def _format_items(items: Mapping[str, Any]) -> str:
    """The ``items:{...}`` body of an array property."""
    fields = []
    for key, value in dictsort(items):
        if value is None:
            continue
        if key == "properties":
            inner = format_parameters(value) if isinstance(value, Mapping) else ""
            fields.append("properties:{" + inner + "}")
        elif key == "required":
            fields.append("required:" + _quoted_list(value))
        elif key == "type":
            kinds = value.upper() if isinstance(value, str) else [_upper(k) for k in _each(value)]
            fields.append("type:" + format_argument(kinds))
        else:
            fields.append(f"{key}:" + format_argument(value))
    return ",".join(fields)


def format_parameters(properties: Mapping[str, Any]) -> str:
    """The template's ``format_parameters``: each property's schema, in ``dictsort`` order."""
    out = []
    for key, value in dictsort(properties):
        if key in SCHEMA_KEYS:
            continue
        fields = []
        description = _get(value, "description")
        if _truthy(description):
            fields.append(f"description:{QUOTE}{_show(description)}{QUOTE}")
        kind = _upper(_get(value, "type"))
        enum = _get(value, "enum")
        items = _get(value, "items")
        if kind == "STRING" and _truthy(enum):
            fields.append("enum:" + format_argument(enum))
        elif kind == "ARRAY" and isinstance(items, Mapping) and items:
            fields.append("items:{" + _format_items(items) + "}")
        if _truthy(_get(value, "nullable")):
            fields.append("nullable:true")
        if kind == "OBJECT":
            inner = _get(value, "properties")
            fields.append(
                "properties:{" + format_parameters(inner if isinstance(inner, Mapping) else value) + "}"
            )
            required = _get(value, "required")
            if _truthy(required):
                fields.append("required:" + _quoted_list(required))
        fields.append(f"type:{QUOTE}{kind}{QUOTE}")
        out.append(f"{key}:{{" + ",".join(fields) + "}")
    return ",".join(out)


def format_function_declaration(tool: object) -> str:
    """``declaration:NAME{description:...,parameters:{...},response:{...}}`` for one OpenAI
    function spec, as the template writes it (trimmed, as between ``<|tool>`` and ``<tool|>``)."""
    function = _get(tool, "function")
    if not isinstance(function, Mapping):
        raise TemplateError(f'a tool must be {{"type": "function", "function": {{...}}}}, got {tool!r:.80}')
    text = f"declaration:{_show(_get(function, 'name'))}"
    text += f"{{description:{QUOTE}{_show(_get(function, 'description'))}{QUOTE}"
    parameters = _get(function, "parameters")
    if _truthy(parameters):
        text += ",parameters:{"
        properties = _get(parameters, "properties")
        if _truthy(properties):
            text += "properties:{" + format_parameters(properties) + "},"
        required = _get(parameters, "required")
        if _truthy(required):
            text += "required:" + _quoted_list(required) + ","
        kind = _get(parameters, "type")
        if _truthy(kind):
            text += f"type:{QUOTE}{_upper(kind)}{QUOTE}}}"
    if "response" in function:
        response = function["response"]
        text += ",response:{"
        description = _get(response, "description")
        if _truthy(description):
            text += f"description:{QUOTE}{_show(description)}{QUOTE},"
        if _upper(_get(response, "type")) == "OBJECT":
            text += f"type:{QUOTE}OBJECT{QUOTE}}}"
    return (text + "}").strip()


def format_tool_call(function: Mapping[str, Any]) -> str:
    """``<|tool_call>call:NAME{...}<tool_call|>``: arguments given as an object are written
    key:value in ``dictsort`` order, arguments given as JSON text are written as they are."""
    arguments = function.get("arguments")
    if isinstance(arguments, Mapping):
        body = ",".join(f"{key}:{format_argument(value, False)}" for key, value in dictsort(arguments))
    else:
        body = arguments if isinstance(arguments, str) else ""
    return f"<|tool_call>call:{function['name']}{{{body}}}<tool_call|>"


def format_tool_response_block(name: str, response: object) -> str:
    """``<|tool_response>response:NAME{...}<tool_response|>``; a response that is not an
    object is written ``{value:...}``."""
    if isinstance(response, Mapping):
        fields = ",".join(f"{key}:{format_argument(value, False)}" for key, value in dictsort(response))
    else:
        fields = "value:" + format_argument(response, False)
    return f"<|tool_response>response:{name}{{{fields}}}<tool_response|>"


def legacy_responses(responses: object) -> list[str]:
    """The blocks of Gemma's own ``tool_responses`` field: ``[{"name", "response"}]``."""
    if not isinstance(responses, list | tuple):
        raise TemplateError(f"tool_responses must be a list, got {type(responses).__name__}")
    blocks = []
    for response in responses:
        name = _get(response, "name")
        if not isinstance(response, Mapping) or "response" not in response:
            raise TemplateError(f'a tool response must be {{"name", "response"}}, got {response!r:.80}')
        if not isinstance(name, str) and name is not MISSING:
            raise TemplateError(f"a tool response's name must be a str, got {name!r:.40}")
        blocks.append(
            format_tool_response_block("unknown" if name is MISSING else name, response["response"])
        )
    return blocks


def _result_text(content: str | Sequence[Any]) -> str:
    """A tool message's content: a str, or its text parts joined as they are."""
    if isinstance(content, str):
        return content
    if any(is_image_part(part) for part in content):
        raise TemplateError("the Gemma 4 renderer does not support images in tool results")
    return "".join(part_text(part) for part in content)


def responses_after(messages: Sequence[Message], index: int) -> list[str]:
    """The template's forward scan: the ``tool`` messages right after ``messages[index]`` (an
    assistant message with calls) as response blocks, each named by the call its
    ``tool_call_id`` answers (the last such call), else by its own ``name``."""
    calls = messages[index]["tool_calls"]
    blocks = []
    for message in messages[index + 1 :]:
        if message["role"] != "tool":
            break
        name = message.get("name")
        for call in calls:
            if call.get("id") == message.get("tool_call_id"):
                name = call["function"]["name"]
        if not isinstance(name, str):
            raise TemplateError(
                f"tool result {message.get('tool_call_id')!r} answers none of the calls just before "
                "it and has no name"
            )
        blocks.append(format_tool_response_block(name, _result_text(message["content"])))
    return blocks
