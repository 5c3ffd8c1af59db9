"""Tools a reply may call: the caller's specs checked (``Tools``), and ``ToolCall``s as the reply
reports them. How calls are written and read for each model family is in ``tool_formats``."""

from __future__ import annotations

import dataclasses
import re
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from llmsession.errors import GrammarError
from llmsession.options import GenerationOptions
from llmsession.replies import ToolCall
from llmsession.text.messages import unencodable
from llmsession.text.schemas import MAX_SCHEMA_NODES, schema_document, schema_nodes, validator_of

__all__ = ["MAX_TOOLS", "Mode", "Tool", "ToolCall", "Tools", "checked_tools", "tool_from"]

NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # OpenAI's rule for function names
MAX_TOOLS = 128
Mode = Literal["auto", "none", "required", "named"]


@dataclass(frozen=True)
class Tool:
    """One function a reply may call: its name, what it does, and its arguments' JSON schema."""

    name: str
    description: str
    parameters: Mapping[str, Any]

    def spec(self) -> dict[str, Any]:
        """As OpenAI and Hugging Face templates take it."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class Tools:
    """The tools of one exchange and how the reply may use them: ``mode`` "auto" (text, or
    calls), "required" (calls only), "named" (one call of ``name``) or "none" (text only);
    ``allowed``: the names calls may take, where OpenAI's ``allowed_tools`` narrowed them (every
    tool is still declared in the prompt: it stays the same, and is read from the cache)."""

    tools: tuple[Tool, ...]
    mode: Mode = "auto"
    name: str | None = None
    parallel: bool = True
    allowed: frozenset[str] | None = None

    def by_name(self, name: str) -> Tool | None:
        return next((tool for tool in self.tools if tool.name == name), None)

    @property
    def callable(self) -> tuple[Tool, ...]:
        """The tools a call may name."""
        if self.mode == "named":
            return tuple(tool for tool in self.tools if tool.name == self.name)
        if self.allowed is not None:
            return tuple(tool for tool in self.tools if tool.name in self.allowed)
        return () if self.mode == "none" else self.tools

    def specs(self) -> list[dict[str, Any]]:
        return [tool.spec() for tool in self.tools]


def tool_from(spec: object, index: int) -> Tool:
    """A caller's tool: an OpenAI function spec or a pydantic model class (its schema the
    arguments, its docstring the description); ValueError naming what is wrong."""
    if isinstance(spec, type) and hasattr(spec, "model_json_schema"):
        _, document = schema_document(spec)
        description = (spec.__doc__ or "").strip()
        return _checked(spec.__name__, description, document, index)
    if not isinstance(spec, Mapping) or spec.get("type", "function") != "function":
        raise ValueError(
            f'tools[{index}]: expected {{"type": "function", "function": {{...}}}}, got {spec!r:.80}'
        )
    function = spec.get("function")
    if not isinstance(function, Mapping):
        raise ValueError(f"tools[{index}]: 'function' must be an object")
    description = function.get("description", "")
    if not isinstance(description, str):
        raise ValueError(f"tools[{index}]: 'description' must be a str")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    _, document = schema_document(parameters)  # GrammarError (a ValueError) for a bad schema
    validator_of(document)  # against its draft, before anything decodes
    return _checked(function.get("name"), description, document, index)


def _checked(name: object, description: str, parameters: Any, index: int) -> Tool:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(
            f"tools[{index}]: the name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}"
        )
    if not isinstance(parameters, Mapping) or parameters.get("type", "object") != "object":
        raise ValueError(f"tools[{index}] ({name}): 'parameters' must be an object schema")
    unfit = unencodable((description, parameters))
    if unfit is not None:
        subject = "'parameters'" if unfit.startswith("is nested") else "it"  # (a description is flat)
        raise ValueError(f"tools[{index}] ({name}): {subject} {unfit}")
    return Tool(name, description, parameters)


def options_tools(options: GenerationOptions) -> Tools | None:
    """An exchange's tools, from its options (checked: ``checked_tools``), once per options
    object: the server's schema checks them, and the call it makes reads what was checked (the
    options are frozen, and hold their own copy of the tools, made with them)."""
    known = _CHECKED.get(id(options), _UNSEEN)
    if known is not _UNSEEN:
        return cast(Tools | None, known)
    tools = checked_tools(options.tools, options.tool_choice, options.parallel_tool_calls)
    if options.tools:  # (nothing to keep for options without tools)
        _remember(options, tools)
    return tools


def _remember(options: GenerationOptions, tools: Tools | None) -> None:
    weakref.finalize(options, _CHECKED.pop, id(options), None)  # (forgotten before its id is reused)
    _CHECKED[id(options)] = tools


def replaced_options(options: GenerationOptions, **changes: Any) -> GenerationOptions:
    """``dataclasses.replace(options, **changes)``, keeping what was checked of its tools when
    the changes leave them as they were."""
    replaced = dataclasses.replace(options, **changes)
    known = _CHECKED.get(id(options), _UNSEEN)
    if known is not _UNSEEN and not changes.keys() & {"tools", "tool_choice", "parallel_tool_calls"}:
        _remember(replaced, cast(Tools | None, known))
    return replaced


_UNSEEN = object()
_CHECKED: dict[int, object] = {}  # each living options object's checked tools, by its id


def checked_tools(
    specs: Sequence[object] | None, choice: object = "auto", parallel: object = True
) -> Tools | None:
    """The caller's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked (ValueError or
    GrammarError before anything decodes); None without tools."""
    if not isinstance(parallel, bool):
        raise ValueError(f"parallel_tool_calls must be a bool, got {parallel!r}")
    if specs is None or len(specs) == 0:
        if choice not in ("auto", "none", None):
            raise ValueError(f"tool_choice {choice!r} needs tools")
        return None
    if len(specs) > MAX_TOOLS:
        raise ValueError(f"at most {MAX_TOOLS} tools, got {len(specs)}")
    nodes = 0  # (counted before any is checked against its draft: ``schemas``)
    for spec in specs:
        if isinstance(spec, Mapping):
            nodes += schema_nodes(spec.get("function"), MAX_SCHEMA_NODES - nodes)
        if nodes > MAX_SCHEMA_NODES:
            raise GrammarError(f"the tools hold more than {MAX_SCHEMA_NODES} values, all told")
    tools = tuple(tool_from(spec, i) for i, spec in enumerate(specs))
    names = [tool.name for tool in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"two tools share a name: {sorted({n for n in names if names.count(n) > 1})}")
    if isinstance(choice, Mapping) and choice.get("type") == "allowed_tools":
        mode, allowed = _allowed(choice.get("allowed_tools"), names)
        return Tools(tools, mode, None, parallel, allowed)
    mode, name = _choice(choice, names)
    return Tools(tools, mode, name, parallel)


def _choice(choice: object, names: list[str]) -> tuple[Mode, str | None]:
    if choice is None or choice == "auto":
        return "auto", None
    if choice in ("none", "required"):
        return choice, None
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if name in names:
            return "named", name
        raise ValueError(f"tool_choice names {name!r}, which is not among the tools {names}")
    raise ValueError(
        'tool_choice must be "auto", "none", "required", a named function or allowed_tools, '
        f"got {choice!r:.80}"
    )


def _allowed(allowed: object, names: list[str]) -> tuple[Mode, frozenset[str]]:
    """OpenAI's ``{"type": "allowed_tools", "allowed_tools": {"mode": "auto" | "required",
    "tools": [{"type": "function", "function": {"name": ...}}, ...]}}``: calls of those only."""
    mode = allowed.get("mode") if isinstance(allowed, Mapping) else None
    listed = allowed.get("tools") if isinstance(allowed, Mapping) else None
    if mode not in ("auto", "required") or not isinstance(listed, list | tuple) or not listed:
        raise ValueError('tool_choice allowed_tools needs a mode ("auto" or "required") and tools')
    if len(listed) > MAX_TOOLS:
        raise ValueError(f"tool_choice allowed_tools: at most {MAX_TOOLS} tools, got {len(listed)}")
    chosen = set()
    for entry in listed:
        function = entry.get("function") if isinstance(entry, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(entry, Mapping) or entry.get("type") != "function" or name not in names:
            raise ValueError(f"tool_choice allowed_tools: {entry!r:.80} is not a function among the tools")
        chosen.add(cast(str, name))
    return cast(Mode, mode), frozenset(chosen)
