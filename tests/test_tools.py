"""Tool calling: specs are checked, each family's calls are written, held to their schemas, read
back and streamed as OpenAI streams them, and a tool turn keeps the session's prefix."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import internals
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tool_helpers import TIME, WEATHER, hf_render, scripted_start

from llmsession import GenerationOptions, GrammarError, Model, TemplateError
from llmsession.replies import ToolCall
from llmsession.text.gemma4 import EMPTY_THOUGHT, primes_empty_thought
from llmsession.text.tool_formats import FORMATS, GENERIC, CallIds, CallStream, ToolFormat, parse
from llmsession.text.tool_grammar import grammar
from llmsession.text.tools import checked_tools

FAMILIES = {  # fixture, the format its template writes
    "smollm2-qwen25-template.gguf": "hermes",
    "smollm2-llama31-template.gguf": "llama3",
    "smollm2-mistral-template.gguf": "mistral",
    "smollm2-qwen25-special.gguf": "hermes",  # the markers as one special token each, as the
    "smollm2-mistral-special.gguf": "mistral",  # real vocabularies hold them
    "smollm2-gemma4-template.gguf": "gemma4",
    "smollm2-gemma4-special.gguf": "gemma4",
    "smollm2-gpt-oss-special.gguf": "harmony",  # (its markers as gpt-oss's vocabulary holds them)
}


# -- specs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("specs", "choice", "message"),
    [
        ([WEATHER, WEATHER], "auto", "share a name"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not among the tools"),
        ([WEATHER], "sometimes", "tool_choice must be"),
        ([{"type": "function", "function": {"name": "bad name!"}}], "auto", "the name must be"),
        ([{"type": "retrieval"}], "auto", "expected"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
            "auto",
            "object",
        ),
        ([], "required", "needs tools"),
    ],
)
def test_bad_tools_are_refused_before_anything_decodes(specs: list[Any], choice: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        checked_tools(specs, choice)


def test_a_schema_that_cannot_be_used_is_a_grammar_error() -> None:
    looped: dict[str, Any] = {"type": "object"}
    looped["properties"] = {"me": looped}
    with pytest.raises(GrammarError):
        checked_tools([{"type": "function", "function": {"name": "f", "parameters": looped}}])


def test_a_pydantic_class_is_a_tool() -> None:
    pydantic = pytest.importorskip("pydantic")

    class Lookup(pydantic.BaseModel):
        """Look a word up."""

        word: str

    tools = checked_tools([Lookup], {"type": "function", "function": {"name": "Lookup"}})
    assert tools is not None and tools.mode == "named" and tools.tools[0].description == "Look a word up."
    assert tools.tools[0].parameters["properties"]["word"]["type"] == "string"


# -- formats (pure) ------------------------------------------------------------------------------
arguments = st.dictionaries(
    st.text("abcxyz_", min_size=1, max_size=6),
    st.one_of(
        st.integers(-5, 500), st.text(max_size=8), st.booleans(), st.lists(st.integers(0, 9), max_size=3)
    ),
    max_size=3,
)
calls = st.lists(st.tuples(st.sampled_from(["get_weather", "get_time"]), arguments), min_size=1, max_size=3)


def as_read(fmt: ToolFormat, arguments: dict[str, Any]) -> str:
    """The JSON text a format's calls read back as: Gemma 4 writes keys in its template's order
    (case-insensitive), the JSON formats as written."""
    if fmt.syntax == "gemma4":
        arguments = dict(sorted(arguments.items(), key=lambda item: item[0].lower()))
    return json.dumps(arguments, ensure_ascii=False)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(sorted(FORMATS)), st.text(st.characters(exclude_characters="<[{"), max_size=20), calls)
def test_each_format_reads_back_what_it_writes(name: str, content: str, made: list[Any]) -> None:
    fmt = FORMATS[name]
    made = made[:1] if fmt.single else made
    content = "" if fmt.anchored else content  # (its calls open the reply)
    tools = checked_tools([WEATHER, TIME])
    assert tools is not None
    ids = CallIds(fmt)
    written = [ToolCall(ids(i), tool, as_read(fmt, args)) for i, (tool, args) in enumerate(made)]
    text, read = parse(fmt.reply_text(content, written), fmt, tools, ids)
    assert read == written and text == content


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(sorted(FORMATS)), calls, st.data())
def test_streamed_pieces_join_up_to_the_calls(name: str, made: list[Any], data: st.DataObject) -> None:
    fmt = FORMATS[name]
    made = made[:1] if fmt.single else [c for i, c in enumerate(made) if c not in made[:i]]  # (a repeat
    # ends the calls: test_tool_repeats)
    ids = CallIds(fmt)
    written = [ToolCall(ids(i), tool, as_read(fmt, args)) for i, (tool, args) in enumerate(made)]
    said = "" if fmt.anchored else f"Let me {fmt.trigger[:-1]} look."  # (all but the trigger, searched once)
    reply = fmt.reply_text(said, written)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(reply)), max_size=12)))
    stream, text, pieces = CallStream(fmt, ids), "", []
    for start, end in zip([0, *cuts], [*cuts, len(reply)], strict=True):
        out, got = stream.push(reply[start:end])
        text, pieces = text + out, pieces + list(got)
    text += stream.flush()
    assert text == said
    for index, call in enumerate(written):
        mine = [p for p in pieces if p.index == index]
        assert (mine[0].id, mine[0].name) == (call.id, call.name), "a call's first piece names it"
        assert all(p.id is None and p.name is None for p in mine[1:])
        assert "".join(p.arguments for p in mine) == call.arguments


def test_text_that_only_looks_like_a_call_is_text() -> None:
    hermes = FORMATS["hermes"]
    stream = CallStream(hermes, CallIds(hermes))
    assert stream.push("I like <tool") == ("I like ", ())  # held: it may begin the calls
    assert stream.push("s and braces>") == ("<tools and braces>", ())
    generic = CallStream(GENERIC, CallIds(GENERIC))  # its calls open the reply, or never come
    assert generic.push('I like {"tool_calls": [') == ('I like {"tool_calls": [', ())
    assert parse('I like {"tool_calls": [', GENERIC, checked_tools([WEATHER]), CallIds(GENERIC)) == (  # type: ignore[arg-type]
        'I like {"tool_calls": [',
        [],
    )


# -- grammars (the tokenizer of a real model) -------------------------------------------------------
@functools.cache
def llg_tokenizer(model: Model) -> Any:
    """llguidance's tokenizer for ``model``, built once (about 0.3 s each)."""
    from llmsession.native.constraints import tokenizer

    return tokenizer(internals.local(model).native)


def matcher_accepts(model: Model, lark: str, text: str) -> bool:
    import llguidance

    matcher = llguidance.LLMatcher(llg_tokenizer(model), llguidance.grammar_from("lark", lark), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    taken = matcher.consume_tokens(model.tokenize(text, add_special=False))
    return bool(taken) and not matcher.is_error() and bool(matcher.is_accepting())  # the whole reply


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_parallel_calls_pass_the_mask_only_when_allowed(smollm2: Model, name: str) -> None:
    fmt = FORMATS[name]
    ids = CallIds(fmt)
    two = fmt.reply_text(
        "", [ToolCall(ids(0), "get_time", '{"zone": "UTC"}'), ToolCall(ids(1), "get_time", '{"zone": "CET"}')]
    )
    one = fmt.reply_text("", [ToolCall(ids(0), "get_time", '{"zone": "UTC"}')])
    made = [ids(k) for k in range(8)]
    for parallel in (True, False):
        tools = checked_tools([WEATHER, TIME], "required", parallel)
        assert tools is not None
        lark = grammar(fmt, tools, made)
        assert matcher_accepts(smollm2, lark, one)
        assert matcher_accepts(smollm2, lark, two) == (parallel and not fmt.single)
    bad = fmt.reply_text("", [ToolCall(ids(0), "get_time", '{"zone": "PST"}')])
    assert not matcher_accepts(smollm2, grammar(fmt, checked_tools([TIME], "required"), made), bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_schema_without_a_type_still_holds_the_arguments_to_an_object(smollm2: Model, name: str) -> None:
    """``parameters`` with properties but no ``type`` is an object schema (as it is checked);
    the mask held it to nothing, and a forced call's arguments came out a list, which the
    Messages door then wrapped in an ``arguments`` key the schema does not have."""
    fmt, untyped = FORMATS[name], {"properties": {"city": {"type": "string"}}}
    tools = checked_tools(
        [{"type": "function", "function": {"name": "where", "parameters": untyped}}], "required"
    )
    assert tools is not None
    ids = CallIds(fmt)
    lark = grammar(fmt, tools, [ids(k) for k in range(8)])
    for arguments, fits in (
        ('{"city": "Paris"}', True),
        ('["Paris"]', False),
        ('"Paris"', False),
        ("7", False),
    ):
        reply = fmt.reply_text("", [ToolCall(ids(0), "where", arguments)])
        assert matcher_accepts(smollm2, lark, reply) == fits, arguments


# -- whole exchanges on real templates -------------------------------------------------------------
@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, fixture_path: Any) -> Any:
    path: Path = fixture_path(request.param)
    with Model(path, threads=2, use_jinja=True, anticipate=False) as model:
        yield model, FAMILIES[request.param]


def test_the_template_renders_tools_calls_and_results_as_transformers_does(family: Any) -> None:
    model, name = family
    assert internals.local(model).tool_format().name == name
    ids = CallIds(FORMATS[name])
    call = ToolCall(ids(0), "get_weather", '{"city": "Paris"}')
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call.message_part()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    tools = checked_tools([WEATHER])
    ours = internals.local(model).render(messages, tools=tools)
    assert ours == hf_render(model, messages, [WEATHER])
    with pytest.raises(TemplateError, match="answers no earlier call"):
        internals.local(model).render(
            [*messages, {"role": "tool", "tool_call_id": "unknown", "content": "x"}]
        )


def test_a_forced_call_validates_and_the_result_turn_keeps_the_prefix(family: Any) -> None:
    model, _ = family
    session = model.session()
    options = GenerationOptions(
        max_tokens=48, temperature=0, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False
    )
    question = {"role": "user", "content": "What's the weather in Paris?"}
    stream = session.stream(question["content"], options)
    pieces = [piece for snapshot in stream for piece in snapshot.tool_calls]
    reply = stream.reply
    assert reply is not None and reply.finish_reason == "tool_calls", reply
    (call,) = reply.tool_calls  # (parallel_tool_calls=False: one)
    tool = next(t for t in (WEATHER, TIME) if t["function"]["name"] == call.name)
    jsonschema.validate(call.parsed, tool["function"]["parameters"])
    assert "".join(p.arguments for p in pieces if p.index == 0) == call.arguments
    first = session.cached_tokens
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}
    after = session.respond(result, GenerationOptions(max_tokens=4, temperature=0, tools=[WEATHER, TIME]))
    new = after.usage.prompt_tokens - first  # the result and the headers around it
    if model.template and primes_empty_thought(model.template):
        # Gemma 4 31B's template primes an empty thought after the turn opens and drops it from
        # the turn once written: the prompt differs from there on, exactly there.
        tools = checked_tools([WEATHER, TIME])
        asked = internals.local(model).render([question], tools=tools)
        assert asked.endswith(EMPTY_THOUGHT)
        now = internals.local(model).render([*session.messages], tools=tools)
        common = asked[: next(i for i, (a, b) in enumerate(zip(asked, now, strict=False)) if a != b)]
        assert len(asked) - len(EMPTY_THOUGHT) <= len(common) < len(asked)  # (the call, not the thought)
        assert after.usage.reused_tokens >= len(model.tokenize(common)) - 1, after.usage  # (a boundary)
    else:
        assert after.usage.decoded_prompt_tokens <= new + 1, (after.usage, first)


def test_auto_stays_text_until_the_trigger_then_holds_the_call(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The generic format's calls open the reply: text that does not is text, whatever follows."""
    options = GenerationOptions(max_tokens=48, temperature=0, tools=[WEATHER], parallel_tool_calls=False)
    text_reply = smollm2.session().respond("Say hello.", options)
    assert text_reply.finish_reason in ("stop", "length") and not text_reply.tool_calls
    scripted_start(monkeypatch, smollm2.tokenize("{", add_special=False))  # the grammar forces the rest
    reply = smollm2.session().respond("Weather in Oslo?", options)
    assert reply.finish_reason == "tool_calls" and reply.text == "", reply
    assert reply.tool_calls[0].name == "get_weather"
    jsonschema.validate(reply.tool_calls[0].parsed, WEATHER["function"]["parameters"])


def test_auto_text_then_a_lazy_trigger_holds_the_call(
    fixture_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hermes calls may follow text: free until ``<tool_call>``, constrained from there."""
    with Model(fixture_path("smollm2-qwen25-template.gguf"), threads=2, use_jinja=True) as model:
        options = GenerationOptions(max_tokens=64, temperature=0, tools=[WEATHER], parallel_tool_calls=False)
        scripted_start(monkeypatch, model.tokenize("Let me check.\n<tool_call>", add_special=False))
        reply = model.session().respond("Weather in Oslo?", options)
    assert reply.finish_reason == "tool_calls" and reply.text == "Let me check.", reply
    assert reply.tool_calls[0].name == "get_weather"
    jsonschema.validate(reply.tool_calls[0].parsed, WEATHER["function"]["parameters"])


object_schemas = st.fixed_dictionaries(
    {
        "type": st.just("object"),
        "properties": st.dictionaries(
            st.sampled_from(["a", "b", "c", "d"]),
            st.one_of(
                st.just({"type": "string", "maxLength": 8}),
                st.just({"type": "integer", "minimum": 0, "maximum": 99}),
                st.just({"type": "boolean"}),
                st.just({"enum": ["x", "y"]}),
                st.just(
                    {
                        "type": "array",
                        "items": {"type": "integer", "minimum": 0, "maximum": 99},
                        "maxItems": 2,
                    }
                ),
            ),
            min_size=1,
            max_size=3,
        ),
    }
)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(object_schemas, st.integers(0, 3))
def test_forced_calls_always_validate(smollm2: Model, schema: dict[str, Any], seed: int) -> None:
    schema = {**schema, "required": sorted(schema["properties"]), "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "act", "parameters": schema}}
    options = GenerationOptions(
        max_tokens=160,
        temperature=0.9,
        seed=seed,
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    reply = smollm2.session().respond("Do it.", options)
    assert reply.finish_reason == "tool_calls", reply  # (every value is bounded: a call fits)
    (call,) = reply.tool_calls
    assert call.name == "act"
    jsonschema.validate(call.parsed, schema)


def test_plain_text_of_a_format_whose_calls_open_the_reply_streams_whole() -> None:
    for fmt in (GENERIC, FORMATS["llama3"], FORMATS["mistral"]):
        stream = CallStream(fmt, CallIds(fmt))
        pieces = [stream.push(piece) for piece in ("Hel", "lo there", ', {"name": "x"}', "!")]
        assert "".join(text for text, _ in pieces) + stream.flush() == 'Hello there, {"name": "x"}!'
        assert not any(calls for _, calls in pieces)


def test_a_gemma4_call_streaming_for_long_is_read_once_its_tail_is_written(monkeypatch: Any) -> None:
    """Gemma 4's arguments come whole, once read: each token of a call re-read it from its
    start in Python (a small model looping in an array: 64 s over 8,000 tokens, half the
    generation's time). It is read only once its tail is written."""
    from llmsession.text import tool_formats

    fmt, reads = FORMATS["gemma4"], []
    real = tool_formats.read_arguments
    monkeypatch.setattr(tool_formats, "read_arguments", lambda *a: reads.append(1) or real(*a))
    stream = CallStream(fmt, CallIds(fmt))
    stream.push("<|tool_call>call:f{a:[")
    for _ in range(2000):
        stream.push("1,")
    assert reads == []
    _, pieces = stream.push("1]}<tool_call|>")
    assert len(reads) == 1 and json.loads("".join(p.arguments or "" for p in pieces)) == {"a": [1] * 2001}


@pytest.mark.parametrize("name", ["gemma4", "hermes"])
def test_a_whole_call_is_read_once_however_long_the_next_goes_on(name: str, monkeypatch: Any) -> None:
    """Each token re-read every whole call before the one being written: after a Gemma 4 call
    of 10,000 tokens, 2,000 tokens of the next took 31 s (15 ms of Python a token). A whole
    call is read once; the calls stream as before."""
    from llmsession.text import tool_formats

    fmt, reads = FORMATS[name], []
    real = tool_formats.read_arguments
    monkeypatch.setattr(tool_formats, "read_arguments", lambda *a: reads.append(a[2]) or real(*a))
    stream = CallStream(fmt, CallIds(fmt))
    if name == "gemma4":
        first, second, more, end = (
            "<|tool_call>call:f{xs:[" + "0," * 500 + "0]}<tool_call|>",
            "<|tool_call>call:g{a:[",
            "1,",
            "1]}<tool_call|>",
        )
    else:
        first = '<tool_call>\n{"name": "f", "arguments": {"xs": [' + "0, " * 500 + "0]}}\n</tool_call>\n"
        second, more, end = '<tool_call>\n{"name": "g", "arguments": {"a": [', "1, ", "1]}}\n</tool_call>"
    pieces = list(stream.push(first)[1])
    for _ in range(300):
        pieces += stream.push(second if _ == 0 else more)[1]
    pieces += stream.push(end)[1]
    starts = [start for start in reads if start < len(first)]
    assert len(starts) <= 2, len(starts)  # (the first call: read once it was whole, and once more
    # while the separator that says another begins was not yet written)
    calls = {p.index: p.name for p in pieces if p.name}
    arguments = ["".join(p.arguments or "" for p in pieces if p.index == i) for i in sorted(calls)]
    assert calls == {0: "f", 1: "g"} and json.loads(arguments[0]) == {"xs": [0] * 501}
    assert json.loads(arguments[1]) == {"a": [1] * 300}


def test_tool_choice_none_still_declares_the_tools(smollm2: Model, fixture_path: Any) -> None:
    """A turn that may not call keeps the prompt's prefix: a 10-turn tool conversation decoded
    25 times its new tokens while "none" left the tools out."""
    messages = [{"role": "user", "content": "Hi"}]
    for choice in ("auto", "required"):
        assert internals.local(smollm2).render(
            messages, tools=checked_tools([WEATHER], "none")
        ) == internals.local(smollm2).render(messages, tools=checked_tools([WEATHER], choice))
    with Model(
        fixture_path("smollm2-qwen25-template.gguf"), threads=1, use_jinja=True, anticipate=False
    ) as qwen:
        declared = internals.local(qwen).render(messages, tools=checked_tools([WEATHER], "none"))
        assert "get_weather" in declared and declared == internals.local(qwen).render(
            messages, tools=checked_tools([WEATHER])
        )


def test_free_text_never_spells_a_special_trigger(fixture_path: Any) -> None:
    """Where the trigger is a special token, text before calls may not write its spelling in
    ordinary tokens: the reply's reader finds calls by their text, so "wrap calls in <tool_call>
    tags" in prose cut the stream there and ended the reply in an error (no call parses)."""
    with Model(fixture_path("smollm2-qwen25-special.gguf"), threads=1) as model:
        options = GenerationOptions(tools=[WEATHER], parallel_tool_calls=False)
        tools = checked_tools([WEATHER], parallel=False)
        checker = internals.local(model).constraint(options, tools, ["call_1"])
        assert checker is not None
        prose = model.tokenize("Wrap calls in <tool", add_special=False)
        prose += model.tokenize("_call> tags.", add_special=False)
        assert model.detokenize(prose) == "Wrap calls in <tool_call> tags."
        assert len(model.tokenize("<tool_call>", add_special=False)) == 1  # (the special token)

        def takes(tokens: list[int]) -> bool:
            return bool(checker.matcher.deep_copy().validate_tokens(tokens) == len(tokens))

        assert takes(prose[:4]) and not takes(prose)
        assert takes(model.tokenize("Let me check.\n<tool_call>", add_special=False))


def test_a_replys_calls_are_checked_within_one_budget_not_one_each() -> None:
    """Each call's arguments were checked with a budget of its own: eight calls of a schema
    whose references branch, each just within it, took eight budgets (7.5 s here). One budget
    for the reply's calls now; past it, the reply is refused as unchecked."""
    import time

    from llmsession.runtime.calling import Calling
    from llmsession.text.schemas import MAX_CHECK_STEPS

    defs: dict[str, Any] = {
        f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}", "minimum": 10}, {"$ref": f"#/$defs/d{i + 1}"}]}
        for i in range(14)
    }
    defs["d14"] = {"type": "integer"}
    schema = {"type": "object", "properties": {"x": {"$ref": "#/$defs/d0"}}, "$defs": defs}
    tools = checked_tools([{"type": "function", "function": {"name": "f", "parameters": schema}}])
    assert tools is not None
    hermes = FORMATS["hermes"]
    ids = CallIds(hermes)
    calling = Calling(tools, hermes, ids)
    began = time.monotonic()
    _, calls, _, one = calling.conclude(
        hermes.reply_text("", [ToolCall(ids(0), "f", '{"x": 1}')]), "complete"
    )
    alone = time.monotonic() - began
    assert one is None and len(calls) == 1  # (one call: within the budget)
    eight = hermes.reply_text("", [ToolCall(ids(k), "f", json.dumps({"x": k})) for k in range(8)])
    began = time.monotonic()
    _, calls, finish, error = Calling(tools, hermes, ids).conclude(eight, "complete")
    assert (len(calls), finish) == (8, "tool_calls") and error is not None
    assert f"within {MAX_CHECK_STEPS:,} keyword checks" in str(error)
    assert time.monotonic() - began < 2.5 * alone + 0.5  # (8 budgets before: 7.5 s against 0.94 s)


def test_allowed_tools_narrow_the_calls_and_keep_the_prompt(smollm2: Model) -> None:
    """OpenAI's ``allowed_tools``: calls name only the tools it lists, every tool still declared
    (the prompt is the one without it: read from the cache). The variant that must differ: the
    same forced reply with every tool allowed calls the weather tool this question is about."""
    question = "What's the weather in Paris?"
    clock = {**TIME, "function": {**TIME["function"], "parameters": {**TIME["function"]["parameters"]}}}
    clock["function"]["parameters"]["additionalProperties"] = False  # (a call that ends)

    def allowed(mode: str, *names: str) -> dict[str, Any]:
        tools = [{"type": "function", "function": {"name": name}} for name in names]
        return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": tools}}

    narrowed = checked_tools([WEATHER, TIME], allowed("required", "get_time"))
    assert narrowed is not None and [t.name for t in narrowed.callable] == ["get_time"]
    assert narrowed.mode == "required" and len(narrowed.tools) == 2
    base = {"max_tokens": 64, "temperature": 0, "tools": [WEATHER, clock], "parallel_tool_calls": False}
    replies = {}
    for label, choice in (("all", "required"), ("time", allowed("required", "get_time"))):
        session = smollm2.session()
        reply = session.respond(question, GenerationOptions(**base, tool_choice=choice))
        assert reply.finish_reason == "tool_calls", (label, reply)
        replies[label] = (reply.tool_calls[0].name, reply.usage.prompt_tokens)
    assert replies["all"][0] == "get_weather" and replies["time"][0] == "get_time", replies
    assert replies["all"][1] == replies["time"][1]  # (the same prompt: every tool declared)
    for bad in (
        allowed("sometimes", "get_time"),
        allowed("auto"),
        allowed("auto", "get_date"),
        {"type": "allowed_tools"},
        {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": ["get_time"]}},
        allowed("auto", *["get_time"] * 129),  # (past MAX_TOOLS: a reviewer's read)
    ):
        with pytest.raises(ValueError, match="allowed_tools"):
            checked_tools([WEATHER, TIME], bad)
