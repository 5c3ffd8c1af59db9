"""JSON schemas from callers: made plain and bounded before the matcher sees them, and the
keywords its token mask cannot enforce checked on the finished reply.

llguidance compiles a schema leniently: a keyword it does not implement (``uniqueItems``, which
pydantic writes for a ``set`` field; ``contains``, ``not``, ``if``...) is reported, not refused.
Each must be one ``jsonschema`` checks, and then every reply of that schema is validated against
the whole schema once complete; a schema whose keywords the mask enforces all is not checked
again. Patterns are searched with RE2 there (``patterns``: Python's ``re`` backtracks, and a
hostile pattern would take hours). Pure: no llguidance, no bindings; ``jsonschema`` loads with
the first schema.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from llmsession.errors import GrammarError

MAX_SCHEMA_DEPTH = 64  # nesting of a schema's objects and arrays (the matcher recurses)
# A call's schemas' values, all told (its format's, or its tools' together; every object, list,
# string, number and boolean): each is checked against its draft in Python (~0.3 ms an object or
# a boolean subschema here), holding the interpreter: 50,000 objects took 16 s, and every other
# request waited. OpenAI's structured outputs take 5,000 properties (about 10,000 values).
MAX_SCHEMA_NODES = 10_000
# Items of a schema's list: the metaschema's ``uniqueItems`` compares mixed items pairwise (a
# ``type`` list of 3,000 took 0.5 s, of 20,000 about a minute). OpenAI takes 1,000 enum values.
MAX_SCHEMA_LIST = 1000
# Keyword checks one reply's validation may make: a schema's references can branch without
# consuming the value (``oneOf`` of two references to the next of 18 definitions took 20 s here, of
# 30 it would take days), and jsonschema keeps no memo: ~20 us a check there, 2-2.5 s at the bound. A
# list of 1,000 objects of 20 integer properties each (a reply of ~100K tokens) took 44,000.
MAX_CHECK_STEPS = 100_000
UNIMPLEMENTED = "Unimplemented keys: "  # llguidance's lenient warning: a JSON list follows
REPEATED = re.compile(r" \(\d+ times?\)$")  # a warning given more than once says how often
# References the validator would resolve on its own (a URL included): never on a caller's word.
REFUSED = frozenset({"$dynamicRef", "$recursiveRef", "$dynamicAnchor", "$recursiveAnchor"})
# Keywords jsonschema checks inside another's validator rather than on their own.
CHECKED_WITH = {"then": "if", "else": "if", "minContains": "contains", "maxContains": "contains"}


def schema_document(given: Mapping[str, Any] | str | type) -> tuple[type | None, dict[str, Any]]:
    """A caller's schema as a plain, acyclic JSON object (and the pydantic class it came from),
    or GrammarError: a schema that contains itself crashed the matcher's converter, and one
    nested past ``MAX_SCHEMA_DEPTH`` would exhaust a stack."""
    schema_class, schema = None, given
    try:
        if isinstance(given, type):
            schema_class, schema = given, given.model_json_schema()  # type: ignore[attr-defined]
        text = schema if isinstance(schema, str) else json.dumps(schema, allow_nan=False)
        document = json.loads(text)
    except RecursionError:
        raise GrammarError(f"json_schema: nested deeper than {MAX_SCHEMA_DEPTH} levels") from None
    except (ValueError, TypeError) as error:  # contains itself, not JSON
        raise GrammarError(f"json_schema: not a JSON document: {error}") from None
    if not isinstance(document, dict):
        raise GrammarError(f"json_schema: a schema is a JSON object, not {type(document).__name__}")
    check_nodes(document)
    return schema_class, document


def schema_nodes(value: Any, limit: int) -> int:
    """How many values ``value`` holds (itself, and every object, list and scalar in it),
    counted no further than past ``limit`` (a structure that contains itself holds endlessly
    many)."""
    if not isinstance(value, dict | list):
        return 1
    nodes = 0
    for node, _ in containers(value):
        nodes += _values(node)
        if nodes > limit:
            break
    return nodes


def _values(node: dict[str, Any] | list[Any]) -> int:
    """A container and its scalar items (its containers count when they are walked)."""
    children = node.values() if isinstance(node, dict) else node
    return 1 + sum(1 for child in children if not isinstance(child, dict | list))


def containers(value: Any) -> Iterator[tuple[dict[str, Any] | list[Any], int]]:
    """JSON-like ``value``'s objects and lists with their nesting level (``value`` itself is 1),
    walked without recursion: what json reads on one thread's stack may be too deep to walk, or
    write again, on a deeper one. A consumer that stops early walks no further."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict | list):
            yield node, level
            stack += [(child, level + 1) for child in (node.values() if isinstance(node, dict) else node)]


def check_nodes(document: dict[str, Any]) -> None:
    """GrammarError if a schema nests past ``MAX_SCHEMA_DEPTH``, holds more than
    ``MAX_SCHEMA_NODES`` values or a list of more than ``MAX_SCHEMA_LIST`` items, or refers
    outside itself (a ``$ref`` that is not ``#...``, a dynamic reference), which a validator
    would try to fetch; the matcher does not look everywhere (inside ``not``, say)."""
    nodes = 0
    for node, level in containers(document):
        if level > MAX_SCHEMA_DEPTH:
            raise GrammarError(f"json_schema: nested deeper than {MAX_SCHEMA_DEPTH} levels")
        if isinstance(node, list) and len(node) > MAX_SCHEMA_LIST:
            raise GrammarError(f"json_schema: a list of more than {MAX_SCHEMA_LIST} items")
        nodes += _values(node)
        if nodes > MAX_SCHEMA_NODES:
            raise GrammarError(f"json_schema: more than {MAX_SCHEMA_NODES} values")
        if isinstance(node, dict):
            reference = node.get("$ref")
            if REFUSED & node.keys() or (isinstance(reference, str) and not reference.startswith("#")):
                shown = sorted(REFUSED & node.keys()) or [str(reference)]
                raise GrammarError(f"json_schema: only references inside the schema are allowed: {shown}")


def after_reply_validator(validator: Any, warnings: Sequence[str]) -> Any:
    """``validator`` (the whole schema's, ``checked_schema``) if the lenient compile's
    ``warnings`` left keywords to it, None if the mask enforces them all; GrammarError for a
    warning that leaves something enforced by no one (an unknown format; a keyword this draft
    does not define)."""
    keys: list[str] = []
    for warning in warnings:
        warning = REPEATED.sub("", warning)
        if not warning.startswith(UNIMPLEMENTED):
            raise GrammarError(f"json_schema: {warning}")
        try:
            keys += json.loads(warning.removeprefix(UNIMPLEMENTED))
        except ValueError:
            raise GrammarError(f"json_schema: {warning}") from None
    known = validator.VALIDATORS
    unchecked = sorted(
        {key for key in keys if key in REFUSED or (key not in known and CHECKED_WITH.get(key) not in known)}
    )
    if unchecked:
        raise GrammarError(f"json_schema: {UNIMPLEMENTED}{json.dumps(unchecked)}")
    return validator if keys else None


REMEMBERED_SCHEMA_CHARS = 64 << 10  # a larger schema is checked each time, never kept


def checked_schema(text: str) -> Any:
    """A validator for a schema (its JSON text), once the schema is checked against its draft's
    metaschema (GrammarError if invalid). Remembered up to a size: checking costs 2-3 ms, and a
    client sends one schema often; a cache of any 64 schemas of megabytes each held gigabytes
    (a validator is ~13 times its text), even for requests refused afterwards. It resolves no
    reference outside the schema (an empty registry). Formats are checked where jsonschema has a
    checker; patterns with RE2, in linear time (``patterns``: GrammarError for one it cannot
    take)."""
    return _remembered_schema(text) if len(text) <= REMEMBERED_SCHEMA_CHARS else _checked_schema(text)


def validator_of(document: Mapping[str, Any]) -> Any:
    """``checked_schema`` of a schema document by its canonical text (keys sorted): a schema's
    check with its request, at its compile and after a reply share one remembered validator."""
    return checked_schema(json.dumps(dict(document), sort_keys=True))


@functools.lru_cache(maxsize=64)
def _remembered_schema(text: str) -> Any:
    return _checked_schema(text)


def _checked_schema(text: str) -> Any:
    import jsonschema  # loaded with the first schema, not with llmsession
    import referencing

    document = json.loads(text)
    if not isinstance(document.get("$schema", ""), str):
        raise GrammarError("json_schema: $schema must be a string naming a draft")
    draft = jsonschema.validators.validator_for(document, default=jsonschema.Draft202012Validator)
    try:
        draft.check_schema(document, format_checker=None)  # type: ignore[call-arg]  # (Rust patterns)
    except jsonschema.SchemaError as error:
        raise GrammarError(f"json_schema: invalid schema: {error.message}") from None
    from llmsession.text import patterns  # (RE2, with the validator)

    patterns.check_patterns(document)
    keywords = {**draft.VALIDATORS, **patterns.KEYWORDS, "uniqueItems": _unique_items}
    counted = {keyword: _counted(check) for keyword, check in keywords.items()}
    extended = jsonschema.validators.extend(draft, counted)  # type: ignore[no-untyped-call]
    return extended(document, registry=referencing.Registry(), format_checker=draft.FORMAT_CHECKER)


def _unique_items(validator: Any, unique: Any, instance: Any, schema: Any) -> Iterator[Any]:
    """``uniqueItems`` in linear time, by each item's canonical form (jsonschema's compares
    every pair of items it cannot sort, objects among them: 2,000 took 4 s, one step)."""
    if unique and validator.is_type(instance, "array"):
        seen: set[Any] = set()
        for item in instance:
            key = _canonical(item)
            if key in seen:
                from jsonschema.exceptions import ValidationError

                yield ValidationError(f"{instance!r:.200} has non-unique elements")
                return
            seen.add(key)


def _canonical(value: Any) -> Any:
    """A hashable form of a JSON value that is equal where JSON Schema's equality is: 1 and
    1.0 alike, true and 1 not, an object's keys in any order."""
    if isinstance(value, bool) or value is None:
        return ("literal", value)
    if isinstance(value, int | float):
        return ("number", int(value) if isinstance(value, float) and value.is_integer() else value)
    if isinstance(value, dict):
        return ("object", frozenset((k, _canonical(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return ("array", tuple(map(_canonical, value)))
    return ("string", value)


class _OverBudget(Exception):
    """A reply's validation made ``MAX_CHECK_STEPS`` keyword checks."""


_budget = threading.local()  # the checks the thread's validation may still make (``violation``)


def _counted(check: Any) -> Any:
    """A keyword's check that spends one of its validation's steps (``MAX_CHECK_STEPS``)."""

    def counted(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
        left = getattr(_budget, "left", None)
        if left is not None:
            if left <= 0:
                raise _OverBudget
            _budget.left = left - 1
        return check(validator, value, instance, schema)

    return counted


def violation(validator: Any, value: Any) -> str:
    """What in a complete reply breaks its schema ("" if nothing does), found within
    ``MAX_CHECK_STEPS`` keyword checks (a reply not checked within them breaks it)."""
    return violations([(validator, value)])[1]


def violations(checks: Iterable[tuple[Any, Any]]) -> tuple[int, str]:
    """The first of ``checks`` (a validator and a value: a reply's calls, say) whose value
    breaks its schema, and what breaks it ((-1, "") if none does), all found within one
    ``MAX_CHECK_STEPS`` (eight calls each just within it took eight times as long)."""
    _budget.left = MAX_CHECK_STEPS
    try:
        for index, (validator, value) in enumerate(checks):
            problem = _problem(validator, value)
            if problem:
                return index, problem
        return -1, ""
    finally:
        _budget.left = None


def _problem(validator: Any, value: Any) -> str:
    try:
        problem = next(iter(validator.iter_errors(value)), None)
    except _OverBudget:
        return (
            f"the reply could not be checked against its schema within {MAX_CHECK_STEPS:,} keyword "
            "checks (its references branch too much)"
        )
    except Exception as error:  # deep recursion, an unresolvable reference, a regex Python lacks
        return f"the reply could not be checked against its schema: {type(error).__name__}: {error}"
    if problem is None:
        return ""
    where = "/".join(str(p) for p in problem.absolute_path) or "the reply"
    return f"{where}: {problem.message} ({problem.validator!r} is checked after the reply)"
