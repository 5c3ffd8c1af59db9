"""Tool calling: specs are checked, each family's calls are written, held to their schemas, read
back and streamed as OpenAI streams them, and a tool turn keeps the session's prefix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmsession import GenerationOptions, GrammarError, Model, TemplateError
from llmsession.replies import ToolCall
from llmsession.runtime.stream import drain
from llmsession.text.gemma4 import EMPTY_THOUGHT, primes_empty_thought
from llmsession.text.tool_formats import FORMATS, GENERIC, CallIds, CallStream, ToolFormat, parse
from llmsession.text.tool_grammar import grammar
from llmsession.text.tools import checked_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}, "days": {"type": "integer"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
FAMILIES = {  # fixture, the format its template writes
    "smollm2-qwen25-template.gguf": "hermes",
    "smollm2-llama31-template.gguf": "llama3",
    "smollm2-mistral-template.gguf": "mistral",
    "smollm2-qwen25-special.gguf": "hermes",  # the markers as one special token each, as the
    "smollm2-mistral-special.gguf": "mistral",  # real vocabularies hold them
    "smollm2-gemma4-template.gguf": "gemma4",
    "smollm2-gemma4-special.gguf": "gemma4",
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
    made = made[:1] if fmt.single else made
    ids = CallIds(fmt)
    written = [ToolCall(ids(i), tool, as_read(fmt, args)) for i, (tool, args) in enumerate(made)]
    said = "" if fmt.anchored else "Let me look."
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
def matcher_accepts(model: Model, lark: str, text: str) -> bool:
    import llguidance

    from llmsession.native.constraints import tokenizer

    matcher = llguidance.LLMatcher(
        tokenizer(model.native), llguidance.grammar_from("lark", lark), log_level=0
    )
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


# -- whole exchanges on real templates -------------------------------------------------------------
def hf_render(model: Model, messages: list[dict[str, Any]], tools: list[Any]) -> str:
    """The oracle: the template as transformers renders it (arguments as objects)."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    hf = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
        hf.append(m)
    native = model.native
    bos, eos = native.token_text(native.bos()), native.token_text(native.eos())
    assert model.template is not None
    return env.from_string(model.template).render(
        messages=hf, tools=tools, add_generation_prompt=True, bos_token=bos, eos_token=eos
    )


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, fixture_path: Any) -> Any:
    path: Path = fixture_path(request.param)
    with Model(path, threads=2, use_jinja=True, anticipate=False) as model:
        yield model, FAMILIES[request.param]


def test_the_template_renders_tools_calls_and_results_as_transformers_does(family: Any) -> None:
    model, name = family
    assert model.local.tool_format().name == name
    ids = CallIds(FORMATS[name])
    call = ToolCall(ids(0), "get_weather", '{"city": "Paris"}')
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call.message_part()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    tools = checked_tools([WEATHER])
    ours = model.local.render(messages, tools=tools)
    assert ours == hf_render(model, messages, [WEATHER])
    with pytest.raises(TemplateError, match="answers no earlier call"):
        model.local.render([*messages, {"role": "tool", "tool_call_id": "unknown", "content": "x"}])


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
        asked = model.local.render([question], tools=tools)
        assert asked.endswith(EMPTY_THOUGHT)
        now = model.local.render([*session.messages], tools=tools)
        common = asked[: next(i for i, (a, b) in enumerate(zip(asked, now, strict=False)) if a != b)]
        assert len(asked) - len(EMPTY_THOUGHT) <= len(common) < len(asked)  # (the call, not the thought)
        assert after.usage.reused_tokens >= len(model.tokenize(common)) - 1, after.usage  # (a boundary)
    else:
        assert after.usage.decoded_prompt_tokens <= new + 1, (after.usage, first)


def scripted_start(monkeypatch: pytest.MonkeyPatch, script: list[int]) -> None:
    """The reply's first tokens are ``script`` (each checked by the constraint's matcher), the
    rest sampled: the trigger forced by the test, not by luck."""
    from llmsession.native.constraints import GuidedSampler

    original = GuidedSampler.sample

    def scripted(self: GuidedSampler, context: Any, index: int = -1) -> int:
        if not script:
            return original(self, context, index)
        token = script.pop(0)
        assert self.matcher.consume_token(token), "the script left the grammar"
        return token

    monkeypatch.setattr(GuidedSampler, "sample", scripted)


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
                st.just({"type": "array", "items": {"type": "integer"}, "maxItems": 2}),
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


@pytest.mark.parametrize(
    ("name", "marker", "printed"),
    [
        ("smollm2-qwen25-special.gguf", "<tool_call>", b"<tool_call>"),  # user-defined: printed
        ("smollm2-mistral-special.gguf", "[TOOL_CALLS]", b""),  # control: printed only when asked
    ],
)
def test_markers_held_as_special_tokens_are_generated_as_those_tokens(
    fixture_path: Any, monkeypatch: pytest.MonkeyPatch, name: str, marker: str, printed: bytes
) -> None:
    """Spelled as text in the grammar, a special marker could only come byte by byte, which a
    real model never writes: the grammar names its id, and the reply's text spells it."""
    with Model(fixture_path(name), threads=2, use_jinja=True, anticipate=False) as model:
        fmt = model.local.tool_format()
        (special,) = model.tokenize(marker, add_special=False)
        assert model.local.special_markers(fmt)[marker] == special
        assert model.native.piece(special) == printed and model.native.is_special(special)
        session = model.session()
        options = GenerationOptions(
            max_tokens=48, temperature=0, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False
        )
        stream = session.stream("Weather in Oslo?", options)
        reply = drain(stream)
        assert reply.finish_reason == "tool_calls", reply
        assert stream.exchange.tokens[0] == special  # the marker as its one token
        assert reply.tool_calls[0].name == "get_weather" and reply.text == ""
        # "auto": text, then the special trigger (scripted, not by luck), then the held call
        prefix = [] if fmt.anchored else model.tokenize("Let me check.\n", add_special=False)
        scripted_start(monkeypatch, [*prefix, special])
        auto = model.session().respond(
            "Weather in Oslo?",
            GenerationOptions(max_tokens=64, temperature=0, tools=[WEATHER], parallel_tool_calls=False),
        )
        assert auto.finish_reason == "tool_calls" and auto.text == (
            "" if fmt.anchored else "Let me check."
        ), auto
        jsonschema.validate(auto.tool_calls[0].parsed, WEATHER["function"]["parameters"])


def test_tool_choice_none_still_declares_the_tools(smollm2: Model, fixture_path: Any) -> None:
    """A turn that may not call keeps the prompt's prefix: a 10-turn tool conversation decoded
    25 times its new tokens while "none" left the tools out."""
    messages = [{"role": "user", "content": "Hi"}]
    for choice in ("auto", "required"):
        assert smollm2.local.render(messages, tools=checked_tools([WEATHER], "none")) == smollm2.local.render(
            messages, tools=checked_tools([WEATHER], choice)
        )
    with Model(
        fixture_path("smollm2-qwen25-template.gguf"), threads=1, use_jinja=True, anticipate=False
    ) as qwen:
        declared = qwen.local.render(messages, tools=checked_tools([WEATHER], "none"))
        assert "get_weather" in declared and declared == qwen.local.render(
            messages, tools=checked_tools([WEATHER])
        )


def test_gemma4_without_jinja_renders_and_calls_in_its_own_syntax(fixture_path: Any) -> None:
    """The Python Gemma 4 renderer declares the tools and writes calls and results as the
    template does, and a forced call comes back in Gemma 4's syntax, read into JSON."""
    with Model(fixture_path("smollm2-gemma4-special.gguf"), threads=2, anticipate=False) as model:
        assert not model.use_jinja and model.local.tool_format().name == "gemma4"
        call = ToolCall("call_1", "get_weather", '{"city": "Paris", "days": 2}')
        messages = [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [call.message_part()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
        ]
        ours = model.local.render(messages, tools=checked_tools([WEATHER]))
        assert '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|>' in ours
        assert hf_render(model, messages, [WEATHER]) == model.native.token_text(model.native.bos()) + ours
        options = GenerationOptions(
            max_tokens=48, temperature=0, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False
        )
        reply = model.session().respond("Weather in Oslo?", options)
        assert reply.finish_reason == "tool_calls", reply
        jsonschema.validate(reply.tool_calls[0].parsed, WEATHER["function"]["parameters"])


def test_a_reply_cut_mid_call_keeps_only_its_text(fixture_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``length`` inside a call: no call, and the text is what streamed as text (the markup of
    the call it began is not passed off as the reply's words)."""
    with Model(fixture_path("smollm2-qwen25-template.gguf"), threads=2, use_jinja=True) as model:
        scripted_start(monkeypatch, model.tokenize("Let me check.\n<tool_call>", add_special=False))
        options = GenerationOptions(max_tokens=12, temperature=0, tools=[WEATHER])
        stream = model.session().stream("Weather in Oslo?", options)
        streamed = "".join(snapshot.delta for snapshot in stream)
        reply = stream.reply
    assert reply is not None and reply.finish_reason == "length" and not reply.tool_calls
    assert reply.text == streamed == "Let me check.", reply


def test_a_stop_string_inside_a_call_cuts_it_as_length_does(
    fixture_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user's stop string that matches inside a call ends the reply there: no call, the
    text before it, and no error for a call that could not be read."""
    with Model(fixture_path("smollm2-qwen25-template.gguf"), threads=2, use_jinja=True) as model:
        scripted_start(monkeypatch, model.tokenize("Let me check.\n<tool_call>", add_special=False))
        options = GenerationOptions(max_tokens=48, temperature=0, tools=[WEATHER], stop=['"arguments"'])
        reply = model.session().respond("Weather in Oslo?", options)
    assert reply.finish_reason == "stop" and not reply.tool_calls and reply.text == "Let me check.", reply


def steered(monkeypatch: pytest.MonkeyPatch, model: Model, target: str) -> None:
    """Constrained sampling steered to write ``target``: each sampled token is the allowed one
    whose text is the longest prefix of what is left (tokens the constraint forces advance it
    too); once ``target`` is written, or the constraint allows none of it, sampling goes on as
    usual."""
    import numpy as np

    from llmsession.native.constraints import GuidedSampler

    left, sample, forced = [target], GuidedSampler.sample, GuidedSampler.forced
    pieces = [model.native.piece(t).decode("utf-8", "replace") for t in range(model.native.n_vocab)]

    def advance(tokens: list[int]) -> None:
        for token in tokens:
            left[0] = left[0][len(pieces[token]) :] if left[0].startswith(pieces[token]) else ""

    def steered_sample(self: GuidedSampler, context: Any, index: int = -1) -> int:
        if not left[0]:
            return sample(self, context, index)
        logits = np.zeros(self.n_vocab, np.float32)
        self.restrict(logits)
        allowed = [t for t in np.flatnonzero(logits == 0) if pieces[t] and left[0].startswith(pieces[t])]
        if not allowed:  # the constraint will not write the rest: it goes its own way
            left[0] = ""
            return sample(self, context, index)
        token = int(max(allowed, key=lambda t: len(pieces[t])))
        assert self.matcher.consume_token(token)
        self.chain.accept(token)
        advance([token])
        return token

    def steered_forced(self: GuidedSampler) -> list[int]:
        tokens = forced(self)
        advance(tokens)
        return tokens

    monkeypatch.setattr(GuidedSampler, "sample", steered_sample)
    monkeypatch.setattr(GuidedSampler, "forced", steered_forced)


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_calls_come_as_two_calls_only_when_allowed(
    fixture_path: Any, monkeypatch: pytest.MonkeyPatch, parallel: bool
) -> None:
    """A reply steered to write two calls yields both, each streamed under its own index; with
    ``parallel_tool_calls=False`` the mask ends the reply after the first, whatever was wanted."""
    with Model(fixture_path("smollm2-qwen25-template.gguf"), threads=2, use_jinja=True) as model:
        one = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
        two = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
        steered(monkeypatch, model, f"{one}\n{two}")
        options = GenerationOptions(
            max_tokens=64,
            temperature=0,
            tools=[WEATHER, TIME],
            tool_choice="required",
            parallel_tool_calls=parallel,
        )
        stream = model.session().stream("Time in UTC and weather in Oslo?", options)
        pieces = [piece for snapshot in stream for piece in snapshot.tool_calls]
        reply = stream.reply
    assert reply is not None and reply.finish_reason == "tool_calls", reply
    wanted = [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo"})]
    assert [(c.name, c.parsed) for c in reply.tool_calls] == wanted[: 2 if parallel else 1]
    assert {p.index for p in pieces} == set(range(len(reply.tool_calls)))
