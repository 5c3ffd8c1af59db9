"""Generation options, validated up front so a bad value fails before anything is decoded."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp picks a random seed
INT32_MAX = 2**31 - 1  # llama.cpp's counts are int32_t: a larger Python int cannot be passed
TOOL_FORMATS = ("hermes", "llama3", "mistral", "generic")
DRAFTS = ("prompt_lookup",)
# The KV cells' types a model may hold (``Model(kv_type=...)``): f16 (llama.cpp's default), q8_0
# (half its bytes) and q4_0 (about a quarter); quantized V needs flash attention.
KV_TYPES = ("f16", "q8_0", "q4_0")
KV_LAYOUTS = ("per_session", "shared")  # live sessions' KV cells: their own each, or one pool
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs
MAX_POSITIONS = 2**24  # a context or batch size beyond this is a typo, not a plan (16.7M positions)


def check_int(name: str, value: object, low: int, high: int) -> int:
    """A count given by a caller, as an int within [low, high]; else TypeError/ValueError naming it."""
    if not _is_int(value):
        raise TypeError(f"{name}: must be an int, got {type(value).__name__}")
    assert isinstance(value, int)
    if not low <= value <= high:
        raise ValueError(f"{name}: must be between {low} and {high}, got {value}")
    return value


@dataclass(frozen=True)
class GenerationOptions:
    """How a reply is sampled. ``temperature == 0`` is greedy decoding.

    At most one constraint shapes the reply: ``json_schema`` (a dict, its JSON text, or a
    pydantic model class: the reply's ``parsed`` is then an instance), ``regex``, or ``grammar``
    (llguidance's Lark syntax, or llama.cpp's GBNF)."""

    max_tokens: int = 256
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    json_schema: Mapping[str, Any] | str | type | None = None
    regex: str | None = None
    grammar: str | None = None
    tools: tuple[Mapping[str, Any] | type, ...] | None = None
    tool_choice: str | Mapping[str, Any] = "auto"  # "auto", "none", "required", a function, allowed_tools
    parallel_tool_calls: bool = True
    tool_format: str | None = None  # "hermes", "llama3", "mistral", "generic"; None: from the template
    logprobs: int | None = None  # score each token, with this many likeliest alternatives (0-20)
    draft: str | None = None  # "prompt_lookup": tokens drafted from the transcript, verified in one decode
    reasoning_budget: int | None = None  # a thinking template's reasoning ends at this many tokens

    def __post_init__(self) -> None:
        if isinstance(self.tools, list | tuple):  # (the options' own copy: the caller's may change)
            object.__setattr__(self, "tools", tuple(_copied(spec, "tools") for spec in self.tools))
        if isinstance(self.tool_choice, Mapping):
            object.__setattr__(self, "tool_choice", _copied(self.tool_choice, "tool_choice"))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, Iterable) and not isinstance(self.stop, bytes | Mapping):
            object.__setattr__(self, "stop", tuple(self.stop))
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field with a bad value."""
        _require("max_tokens", self.max_tokens, _int_in(self.max_tokens, 1, INT32_MAX))
        _require("temperature", self.temperature, _is_real(self.temperature) and self.temperature >= 0)
        _require("top_k", self.top_k, _int_in(self.top_k, 0, INT32_MAX))
        _require("top_p", self.top_p, _is_real(self.top_p) and 0 < self.top_p <= 1)
        _require("min_p", self.min_p, _is_real(self.min_p) and 0 <= self.min_p <= 1)
        _require(
            "repeat_penalty", self.repeat_penalty, _is_real(self.repeat_penalty) and self.repeat_penalty > 0
        )
        _require("repeat_last_n", self.repeat_last_n, _int_in(self.repeat_last_n, -1, INT32_MAX))
        _require("frequency_penalty", self.frequency_penalty, _is_real(self.frequency_penalty))
        _require("presence_penalty", self.presence_penalty, _is_real(self.presence_penalty))
        seed_ok = self.seed is None or (_is_int(self.seed) and 0 <= self.seed < LLAMA_DEFAULT_SEED)
        _require("seed", self.seed, seed_ok)
        stops_ok = isinstance(self.stop, tuple) and all(
            isinstance(s, str) and s and "\0" not in s for s in self.stop
        )
        _require("stop", self.stop, stops_ok)
        schema = self.json_schema
        schema_ok = (
            schema is None or isinstance(schema, Mapping | str) or hasattr(schema, "model_json_schema")
        )
        _require("json_schema", schema, schema_ok)
        _require("regex", self.regex, self.regex is None or isinstance(self.regex, str))
        _require("grammar", self.grammar, self.grammar is None or isinstance(self.grammar, str))
        tools_ok = self.tools is None or isinstance(self.tools, tuple)
        _require("tools", self.tools, tools_ok)
        choice_ok = isinstance(self.tool_choice, str | Mapping)
        _require("tool_choice", self.tool_choice, choice_ok)
        _require("parallel_tool_calls", self.parallel_tool_calls, isinstance(self.parallel_tool_calls, bool))
        logprobs_ok = self.logprobs is None or _int_in(self.logprobs, 0, MAX_TOP_LOGPROBS)
        _require("logprobs", self.logprobs, logprobs_ok)
        _require("draft", self.draft, self.draft is None or self.draft in DRAFTS)
        budget_ok = self.reasoning_budget is None or _int_in(self.reasoning_budget, 0, INT32_MAX)
        _require("reasoning_budget", self.reasoning_budget, budget_ok)
        check_tool_format(self.tool_format)
        given = self._constraints()
        if len(given) > 1:
            raise ValueError(f"GenerationOptions: {' and '.join(given)} given; a reply takes one constraint")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def constrained(self) -> bool:
        return bool(self._constraints())

    def _constraints(self) -> list[str]:
        """The constraint fields that are set (at most one passes validation)."""
        given = [name for name in ("json_schema", "regex", "grammar") if getattr(self, name) is not None]
        return [*given, "tools"] if self.calls_tools else given

    @property
    def calls_tools(self) -> bool:
        """Tools are given and the reply may call them."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def penalized(self) -> bool:
        return self.repeat_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0


def _copied(value: Any, name: str) -> Any:
    """A copy of JSON-like data (mappings as dicts, lists and tuples as lists; anything else,
    a pydantic class say, as it is)."""
    try:
        return _copy(value)
    except RecursionError:
        raise ValueError(f"GenerationOptions.{name}: nested too deep") from None


def _copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _copy(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_copy(item) for item in value]
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_in(value: object, low: int, high: int) -> bool:
    return _is_int(value) and low <= value <= high  # type: ignore[operator]


REAL_RANGE = (1e-30, 1e30)  # a float llama.cpp's samplers take: 0 or within these (float32's,
# with room for logits divided or offset by it: 1e-46 is 0 there and 1e39 infinite, NaN after)


def _is_real(value: object) -> bool:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        return False
    return value == 0 or REAL_RANGE[0] <= abs(value) <= REAL_RANGE[1]


def check_tool_format(tool_format: object) -> None:
    """A tool format (``TOOL_FORMATS``) or None, else ValueError (``Model.render`` and
    ``prompt_tokens`` check theirs so: another raised a bare KeyError there)."""
    if tool_format is not None and tool_format not in TOOL_FORMATS:
        raise ValueError(f"tool_format must be one of {list(TOOL_FORMATS)} or None, got {tool_format!r:.40}")


def _require(name: str, value: object, ok: bool) -> None:
    if not ok:
        raise ValueError(f"GenerationOptions.{name}: invalid value {value!r}")


def checked_options(options: GenerationOptions | None) -> GenerationOptions:
    """A caller's options (defaults for None): a ``GenerationOptions``, validated again here (a
    few comparisons): it was when it was made, but a frozen dataclass can still be forced."""
    if options is None:
        return GenerationOptions()
    if not isinstance(options, GenerationOptions):
        raise TypeError(
            f"options must be a GenerationOptions, got {type(options).__name__} "
            "(write GenerationOptions(**values) for a dict)"
        )
    options.validate()
    return options
