"""Regression tests for the eleven defects adversarial use found in the wave-2 features (issue
25), on the real library. Where the old code crashed or hung, the probe runs in a subprocess
with a timeout that must exit 0."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import internals
import pytest
from fuzz_hostile import not_a_regular_file
from pydantic import BaseModel, ConfigDict, Field, field_validator
from test_defects import run_python

from llmsession import (
    GenerationOptions,
    GrammarError,
    Model,
    ReplyMismatchError,
    SessionBusyError,
    SessionConfig,
    SessionFileError,
    TemplateError,
    files,
)
from llmsession.commands import cli
from llmsession.engine import sessionfile

GREEDY = GenerationOptions(max_tokens=16, temperature=0)
SYSTEM = {"role": "system", "content": "You are a bank's assistant."}


def forge(path: Path, header: bytes | dict[str, Any], blobs: tuple[bytes, ...] = ()) -> Path:
    """A session file with valid checksums around whatever header and blobs a test wants."""
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    body = sessionfile.MAGIC + struct.pack("<Q", len(head)) + head + b"".join(blobs)
    path.write_bytes(body + hashlib.sha256(body).digest())
    return path


def saved_header(smollm2: Model, tmp_path: Path) -> tuple[dict[str, Any], bytes]:
    """The header and state blob of a real saved session (one short exchange)."""
    session = smollm2.session("Be brief.", share_prefix=False)
    session.respond("Hi", GREEDY)
    path = tmp_path / "real.llms"
    session.save(path)
    data = path.read_bytes()
    (length,) = struct.unpack_from("<Q", data, len(sessionfile.MAGIC))
    start = len(sessionfile.MAGIC) + 8
    return json.loads(data[start : start + length]), data[start + length : -32]


# 1. exit while the shared context is being made ------------------------------------------------
EXIT_EARLY = """
import sys, threading, time
import llmsession.native.llama as native
from llmsession import Model
lib, ffi = native.bindings()
freed_while_warming = []

class SlowInit:
    def __getattr__(self, name):
        return getattr(lib, name)
    def llama_init_from_model(self, model, params):
        time.sleep(0.4)  # the context is still being made when the main thread ends
        return lib.llama_init_from_model(model, params)

real_free = native.free_model
def watched_free(l, ptr, uses):
    warming = any(t.name == "llmsession-warm" and t.is_alive() for t in threading.enumerate())
    freed_while_warming.append(warming)
    if warming:
        sys.stderr.write("the model was freed while its context was being made\\n")
        sys.stderr.flush()
        native.os._exit(3)
    real_free(l, ptr, uses)

native._loaded = (SlowInit(), ffi)
native.free_model = watched_free
m = Model(sys.argv[1], threads=1)
try:
    m.detokenize([10**6])
except ValueError:
    pass
"""


def test_exit_waits_for_the_shared_context_being_made(smollm2_path: Path, tmp_path: Path) -> None:
    """The model's finalizer ran at exit while the warm thread was inside llama_init_from_model:
    a SIGSEGV about 1 time in 10. Slowed on purpose, the old code freed it under the thread."""
    script = tmp_path / "exit_early.py"
    script.write_text(EXIT_EARLY)
    out = subprocess.run(
        [sys.executable, str(script), str(smollm2_path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]


def test_short_scripts_never_die_at_exit_on_a_busy_machine(smollm2_path: Path) -> None:
    code = f"""
    from llmsession import Model
    m = Model({str(smollm2_path)!r}, threads=1)
    try:
        m.detokenize([10**6])
    except ValueError:
        pass
    """
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        codes = [run_python(code, timeout=120).returncode for _ in range(12)]
    finally:
        burner.kill()
        burner.wait()
    assert codes == [0] * 12


# 2, 7, 11. schemas -------------------------------------------------------------------------------
def test_a_schema_that_contains_itself_is_a_grammar_error_not_a_crash(smollm2_path: Path) -> None:
    code = f"""
    from llmsession import GenerationOptions, GrammarError, Model
    schema = {{"type": "object", "properties": {{}}}}
    schema["properties"]["x"] = schema
    deep = {{"type": "array"}}
    node = deep
    for _ in range(5000):
        node["items"] = {{"type": "array"}}
        node = node["items"]
    for isolated in (False, True):
        with Model({str(smollm2_path)!r}, threads=1, isolated=isolated) as m:
            s = m.session()
            for bad in (schema, deep, "[" * 100000, '{{"type": "object"}}' + "]" * 10):
                try:
                    s.respond("Hi", GenerationOptions(json_schema=bad, max_tokens=4))
                except GrammarError as e:
                    print("typed:", str(e)[:60])
                else:
                    raise SystemExit("accepted " + repr(bad)[:40])
            assert s.messages == [], s.messages  # nothing decoded, nothing recorded
            print("after:", s.respond("Hi", GenerationOptions(max_tokens=2, temperature=0)).finish_reason)
    """
    out = run_python(code, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("typed:") == 8 and out.stdout.count("after:") == 2, out.stdout


def test_a_pattern_that_backtracks_is_checked_after_the_reply_in_linear_time(smollm2_path: Path) -> None:
    """The mask lets through the 26 a's the pattern's second branch takes; its first branch
    made Python's ``re`` backtrack for hours (285 s at 22 a's), holding the interpreter: in a
    reply's after-check (``not`` sends it there) and in a tool call's arguments. In a
    subprocess, so that a regression fails here instead of hanging the run."""
    code = f"""
    import time
    from llmsession import GenerationOptions, GrammarError, Model
    evil = r"^(?:(a|aa)+)+[^\\s\\S]$|^a{{26}}$"  # (the first branch matches nothing: only 26 a's do)
    reply = {{"type": "string", "pattern": evil, "maxLength": 26, "not": {{"const": "x"}}}}
    tool = {{"type": "function", "function": {{"name": "f", "parameters": {{
        "type": "object", "properties": {{"s": {{"type": "string", "pattern": evil, "maxLength": 26}}}},
        "required": ["s"]}}}}}}
    with Model({str(smollm2_path)!r}, threads=1) as m:
        began = time.perf_counter()
        said = [{{"role": "user", "content": "a"}}]
        got = m.chat(said, GenerationOptions(json_schema=reply, max_tokens=40))
        print("reply:", got.finish_reason, got.parsed == "a" * 26, round(time.perf_counter() - began, 1))
        began = time.perf_counter()
        asked = GenerationOptions(tools=[tool], tool_choice="required", max_tokens=160, temperature=0)
        got = m.chat([{{"role": "user", "content": "Call f."}}], asked)
        print("call:", got.finish_reason, got.tool_calls[0].arguments, round(time.perf_counter() - began, 1))
        try:
            m.chat(said, GenerationOptions(json_schema={{"pattern": "(?=a)a"}}))
        except GrammarError as error:
            print("refused:", "lookaround" in str(error))
    """
    out = run_python(code, timeout=90)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "reply: complete True" in out.stdout and '"s": "aaaaaaaaaaaaaaaaaaaaaaaaaa"' in out.stdout, (
        out.stdout
    )
    assert "refused: True" in out.stdout, out.stdout


def test_references_that_branch_are_checked_after_the_reply_within_a_budget(smollm2_path: Path) -> None:
    """Each of 30 definitions is ``oneOf`` two references to the next: jsonschema walks all 2**30
    ways without a memo (18 took 20 s here), holding the interpreter, in a reply's after-check
    (the matcher skips ``not``, so the check has it) and in a call's arguments. The check
    stops at ``MAX_CHECK_STEPS`` keyword checks and the reply is refused; at 8 definitions the
    reply is checked whole and taken. In a subprocess, so that a regression fails here instead
    of hanging the run."""
    code = f"""
    from llmsession import GenerationOptions, Model, ReplyMismatchError
    def schema(depth):
        defs = {{f"L{{i}}": {{"oneOf": [{{"$ref": f"#/$defs/L{{i + 1}}"}}] * 2}} for i in range(depth)}}
        defs[f"L{{depth}}"] = {{"const": "zzz"}}
        return {{"$defs": defs, "type": "string", "maxLength": 3, "not": {{"$ref": "#/$defs/L0"}}}}
    with Model({str(smollm2_path)!r}, threads=1) as m:
        said = [{{"role": "user", "content": "a"}}]
        got = m.chat(said, GenerationOptions(json_schema=schema(8), max_tokens=8, temperature=0))
        print("shallow:", got.finish_reason, isinstance(got.parsed, str) and got.parsed != "zzz")
        try:
            m.chat(said, GenerationOptions(json_schema=schema(30), max_tokens=8, temperature=0))
        except ReplyMismatchError as error:
            print("deep:", "100,000 keyword checks" in str(error))
    """
    out = run_python(code, timeout=90)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "shallow: complete True" in out.stdout and "deep: True" in out.stdout, out.stdout


def test_a_grammar_too_large_for_the_matcher_is_a_grammar_error_in_a_few_words(smollm2: Model) -> None:
    """llguidance panics on a grammar of more than 65,525 symbols; its message carried the
    panic's backtrace (2.5 KB of frames). The error says what it refused, bounded, and the
    session goes on."""
    session = smollm2.session()
    alternatives = " | ".join(f'"w{i}"' for i in range(66_000))
    with pytest.raises(GrammarError) as refused:
        session.respond("Hi", GenerationOptions(grammar=f"start: {alternatives}", max_tokens=4))
    said = str(refused.value)
    assert said.startswith("grammar: ") and "symbols" in said, said
    assert "backtrace" not in said and len(said) <= 520, said
    assert session.messages == [] and session.respond("Hi", GenerationOptions(max_tokens=2)).text


class Tags(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tags: set[Literal["red", "green", "blue"]] = Field(max_length=3)
    sizes: set[Literal[1, 2, 3]] = Field(max_length=3)  # two set fields: one warning, counted twice


def test_keywords_the_mask_cannot_enforce_are_checked_after_the_reply(smollm2: Model) -> None:
    """A pydantic ``set`` field (``uniqueItems``) is accepted; a reply that breaks it is never
    handed out as valid: forced to [1, 1], it is a GrammarError naming the keyword."""
    session = smollm2.session(share_prefix=False)
    options = GenerationOptions(json_schema=Tags, max_tokens=64, temperature=0)
    try:
        reply = session.respond("Tag a sunset with colours and sizes.", options)
    except GrammarError as error:  # a greedy reply that repeated an item: told, not parsed
        assert "uniqueItems" in str(error)
    else:
        assert reply.finish_reason == "complete" and isinstance(reply.parsed, Tags), reply
        written = json.loads(reply.text)
        assert len(written["tags"]) == len(reply.parsed.tags)  # none deduplicated away
        assert len(written["sizes"]) == len(reply.parsed.sizes)
    forced_duplicates = {
        "type": "array",
        "items": {"const": 1},
        "minItems": 2,
        "maxItems": 2,
        "uniqueItems": True,
    }
    with pytest.raises(ReplyMismatchError, match="uniqueItems"):  # (a valid schema: the reply failed)
        session.respond("Two ones.", GenerationOptions(json_schema=forced_duplicates, max_tokens=16))
    assert session.messages[-1]["content"].replace(" ", "") == "[1,1]"
    with pytest.raises(GrammarError, match="invalid schema"):
        session.respond("Hi", GenerationOptions(json_schema={"type": 5}, max_tokens=4))
    needs_b = {"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}  # was refused
    assert internals.local(smollm2).constraint(GenerationOptions(json_schema=needs_b)) is not None
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", "dependencies": {"a": ["b"]}}
    assert (
        internals.local(smollm2).constraint(GenerationOptions(json_schema=draft7)) is not None
    )  # draft 7 checks it
    with pytest.raises(GrammarError, match="dependencies"):  # 2020-12 does not: nobody would
        internals.local(smollm2).constraint(GenerationOptions(json_schema={"dependencies": {"a": ["b"]}}))
    rust_only = {"type": "string", "pattern": "^\\p{Lu}+$"}  # Python's re lacks \p{...}; the mask has it
    assert internals.local(smollm2).constraint(GenerationOptions(json_schema=rust_only)) is not None
    for covered in (  # keywords jsonschema checks inside another's validator
        {"if": {"type": "integer"}, "then": {"minimum": 0}, "else": {"type": "string"}},
        {"type": "array", "contains": {"const": 1}, "minContains": 1, "maxContains": 2},
    ):
        assert (
            internals.local(smollm2).constraint(GenerationOptions(json_schema=covered)).validator is not None
        )
    # Inside a keyword the mask skips, a pattern is the after-check's: it never escapes.
    starts_with_x = {"type": "array", "items": {"type": "string"}, "contains": {"pattern": "^x"}}
    checker = internals.local(smollm2).constraint(GenerationOptions(json_schema=starts_with_x))
    assert checker.parse('["xy"]') == ["xy"]
    with pytest.raises(ValueError, match="contain"):
        checker.parse('["abc"]')
    # A Rust-only pattern the mask enforced is not second-guessed by Python's re.
    upper = {"patternProperties": {"^\\p{Lu}+$": {"type": "integer"}}, "dependentRequired": {"A": ["B"]}}
    checker = internals.local(smollm2).constraint(GenerationOptions(json_schema=upper))
    assert checker.parse('{"A": 1, "B": 2}') == {"A": 1, "B": 2}
    with pytest.raises(ValueError, match="B"):
        checker.parse('{"A": 1}')
    for bad in ({"$schema": 5}, {"$schema": []}):
        with pytest.raises(GrammarError):
            internals.local(smollm2).constraint(GenerationOptions(json_schema=bad))
    deep = internals.local(smollm2).constraint(
        GenerationOptions(json_schema={"type": "array", "items": {"$ref": "#"}})
    )
    assert deep is not None
    with pytest.raises(ValueError):  # typed, where a RecursionError escaped
        deep.parse("[" * 5000 + "]" * 5000)


@pytest.mark.native
@pytest.mark.parametrize(
    ("fixture", "hostile"),
    [
        ("smollm2-qwen25-template.gguf", "deep arguments"),  # (jinja parses a call's arguments)
        ("smollm2-gemma4-template.gguf", "deep arguments"),  # (its renderer walks them)
        ("smollm2-gemma4-template.gguf", "NUL in a tool"),  # (written raw: no JSON escape)
    ],
)
def test_what_no_template_can_render_is_a_template_error(
    fixture_path: Callable[[str], Path], fixture: str, hostile: str
) -> None:
    """A call's arguments nested too deep to render, or a tool's NUL that a template writes as
    it is: a TemplateError (a request's error, a 400 at every door), where a RecursionError or a
    ValueError escaped (a 500)."""
    call: dict[str, Any] = {
        "id": "c1",
        "type": "function",
        "function": {"name": "f", "arguments": '{"a": 1}'},
    }
    tool: dict[str, Any] = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    if hostile == "deep arguments":
        call["function"]["arguments"] = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"
    else:
        tool["function"]["description"] = "before\0after"
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "r"},
    ]
    with Model(fixture_path(fixture), kv_tokens=1024, use_jinja=True) as model:
        with pytest.raises(TemplateError, match=r"nests too deep|NUL"):
            model.prompt_tokens(messages, tools=[tool])
        assert model.prompt_tokens(messages[:1], tools=[tool] if hostile == "deep arguments" else None)


@pytest.mark.native
def test_a_nul_is_a_template_error_under_llama_cpps_built_in_templates_too(smollm2_path: Path) -> None:
    """Without Jinja the messages go to ``llama_chat_apply_template`` as C strings: a NUL in a
    message was a plain ValueError there (a 500 at the doors). (A tool's NUL is no matter here:
    the generic format writes its tools as JSON, the NUL escaped.)"""
    tool = {"type": "function", "function": {"name": "f", "description": "a\0b", "parameters": {}}}
    with Model(smollm2_path, kv_tokens=1024, use_jinja=False) as model:
        with pytest.raises(TemplateError, match="NUL"):
            model.session().respond("before\0after", GenerationOptions(max_tokens=1))
        assert "\\u0000" in model.render([{"role": "user", "content": "q"}], tools=[tool])


def test_a_reply_that_chose_the_nul_byte_lets_its_conversation_go_on(smollm2: Model) -> None:
    """A reply choosing the token of the byte 0 (here by a caller's pattern; a sampled reply
    may too) held a NUL, which every later turn's prompt refused: the conversation was stuck.
    It shows U+FFFD, as an invalid byte does, and the next turn is answered."""
    session = smollm2.session()
    reply = session.respond("Say hi.", GenerationOptions(max_tokens=8, temperature=0, regex=r"a\x00b"))
    generated = internals.record(session)[reply.usage.prompt_tokens :][: reply.usage.completion_tokens]
    assert reply.text == "a\ufffdb" == smollm2.detokenize(generated)
    again = session.respond("And again?", GenerationOptions(max_tokens=2, temperature=0))
    # (the reply went back as its tokens: reused whole, where the NUL's token was decoded again)
    assert again.text and again.usage.reused_tokens >= reply.usage.prompt_tokens + len(generated)


def test_a_schema_past_the_remembered_size_is_checked_but_never_kept() -> None:
    """The checked-schema cache held any 64 schemas whatever their size: 64 requests with a
    6 MB tool schema each (refused afterwards) kept ~5 GB. Small ones are still remembered."""
    from llmsession.text import schemas

    schemas._remembered_schema.cache_clear()
    small = json.dumps({"type": "object", "properties": {"a": {"type": "string"}}}, sort_keys=True)
    big = json.dumps(
        {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}, sort_keys=True
    )
    assert len(big) > schemas.REMEMBERED_SCHEMA_CHARS
    assert schemas.checked_schema(small) is schemas.checked_schema(small)
    assert schemas.checked_schema(big) is not None
    assert schemas._remembered_schema.cache_info().currsize == 1
    with pytest.raises(GrammarError):  # (checked all the same)
        schemas.checked_schema(big.replace('"type": "object"', '"type": "nope"', 1))


@pytest.mark.native
def test_a_draft_3_required_flag_on_gemma_4_calls_is_no_crash(fixture_path: Callable[[str], Path]) -> None:
    """Draft 3 writes ``required: true`` on a property; Gemma 4's call grammar read every
    ``required`` as a list of names (TypeError: a 500 at the doors)."""
    inner = {"type": "object", "required": True, "properties": {"b": {"type": "string"}}}
    parameters = {
        "$schema": "http://json-schema.org/draft-03/schema#",
        "type": "object",
        "properties": {"a": {"type": "array", "items": {"type": "array", "items": inner}}},
    }
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    with Model(fixture_path("smollm2-gemma4-template.gguf"), kv_tokens=1024, use_jinja=True) as model:
        reply = model.session().respond("Call f.", GenerationOptions(tools=(tool,), max_tokens=2))
    assert reply.finish_reason in ("length", "stop", "tool_calls")


def test_a_schema_never_makes_the_library_fetch_a_url(smollm2: Model) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/schema.json"
        session = smollm2.session(share_prefix=False)
        for schema in (
            {"type": "integer", "$dynamicRef": url},
            {"not": {"$dynamicRef": url}},
            {"$ref": url},
            {"type": "array", "uniqueItems": True, "items": {"$ref": url}},
        ):
            with pytest.raises(GrammarError):
                session.respond("7", GenerationOptions(json_schema=schema, max_tokens=8))
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody came


# 3. share_prefix=False through model.chat ---------------------------------------------------------
def test_an_apart_stateless_call_never_starts_from_another_calls_cells(smollm2: Model) -> None:
    secret = [SYSTEM, {"role": "user", "content": "My PIN is 4 9 1 7. Remember it."}]
    smollm2.chat(secret, GREEDY, share_prefix=False)
    for guess in ("0 0 0 0", "4 0 0 0", "4 9 0 0", "4 9 1 7"):
        probe = [SYSTEM, {"role": "user", "content": f"My PIN is {guess}. Remember it."}]
        usage = smollm2.chat(probe, GREEDY, share_prefix=False).usage
        assert (usage.reused_tokens, usage.shared_tokens) == (0, 0), guess
        usage = smollm2.chat(probe, GREEDY, share_prefix=False, tenant=f"mallory {guess}").usage
        assert (usage.reused_tokens, usage.shared_tokens) == (0, 0), guess


def test_a_tenant_reuses_only_what_its_own_calls_left(smollm2: Model) -> None:
    history = [SYSTEM, {"role": "user", "content": "Name a colour."}]
    first = smollm2.chat(history, GREEDY, share_prefix=False, tenant="alice")
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Another?"}]
    again = smollm2.chat(history, GREEDY, share_prefix=False, tenant="alice")
    assert again.usage.reused_tokens >= first.usage.prompt_tokens  # its own history, spliced
    other = smollm2.chat(history, GREEDY, share_prefix=False, tenant="bob")
    assert (other.usage.reused_tokens, other.usage.shared_tokens) == (0, 0)
    with pytest.raises(TypeError, match="tenant"):
        smollm2.chat(history, GREEDY, tenant=7)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="share_prefix"):
        smollm2.chat(history, GREEDY, share_prefix="no")


def test_counting_under_many_tenants_pushes_no_tenants_replies_out(smollm2: Model) -> None:
    """Counting a prompt (``count_tokens``) made and touched its tenant's record of replies: a
    caller counting under 64 names (``metadata.user_id``) pushed every other tenant's out, their
    next prompts then tokenized otherwise than their replies were generated. Read only now."""
    history = [SYSTEM, {"role": "user", "content": "Name a colour."}]
    smollm2.chat(history, GREEDY, share_prefix=False, tenant="alice")
    records = internals.local(smollm2).stateless._records._records
    alices = records["alice"]
    apart = SessionConfig(share_prefix=False)
    for i in range(100):
        smollm2.prompt_size(history, tenant=f"counter{i}", config=apart)
        smollm2.prompt_tokens(history, tenant=f"counter{i}", config=apart)
    assert records.get("alice") is alices and not any(name.startswith("counter") for name in records)


# 4. save never replaces what is not a regular file ----------------------------------------------------
def test_save_refuses_devices_fifos_and_directories_and_follows_symlinks(
    smollm2: Model, tmp_path: Path
) -> None:
    session = smollm2.session("Be brief.", share_prefix=False)
    session.respond("Hi", GREEDY)
    odd, linked = tmp_path / "odd", tmp_path / "linked"
    odd.mkdir()
    linked.mkdir()
    # Never the machine's own /dev/null: a regression would replace it (it did, here, once).
    targets = [not_a_regular_file(odd, kind) for kind in ("device", "fifo", "socket")]
    targets += [odd, not_a_regular_file(linked, "fifo", link=True)]  # a directory; a link to a FIFO
    for target in targets:
        with pytest.raises(SessionFileError, match="not a regular file"):
            session.save(target)
        assert not target.resolve().is_file()
    real = tmp_path / "real.llms"
    real.write_bytes(b"old")
    link = tmp_path / "link.llms"
    link.symlink_to(real)
    session.save(link)
    assert link.is_symlink() and real.read_bytes().startswith(sessionfile.MAGIC)
    assert smollm2.load_session(link).messages == session.messages
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.llms", "linked", "odd", "real.llms"]


# 5. a constrained reply cut by max_tokens is "length", never parsed ---------------------------------
@pytest.mark.parametrize(
    ("constraint", "max_tokens"),
    [
        ({"json_schema": {"type": "integer"}}, 2),
        ({"regex": "[0-9]+"}, 3),
        ({"json_schema": {"type": "number"}}, 6),
    ],
)
def test_a_constrained_reply_cut_short_is_length_not_complete(
    smollm2: Model, constraint: dict[str, Any], max_tokens: int
) -> None:
    session = smollm2.session(share_prefix=False)
    options = GenerationOptions(max_tokens=max_tokens, temperature=0, **constraint)
    reply = session.respond("Write the number 1234567.", options)
    assert reply.usage.completion_tokens == max_tokens, reply
    assert (reply.finish_reason, reply.parsed) == ("length", None), reply


def test_a_constraint_that_allows_nothing_more_is_complete(smollm2: Model) -> None:
    session = smollm2.session(share_prefix=False)
    reply = session.respond("Two digits.", GenerationOptions(regex="[0-9]{2}", max_tokens=2, temperature=0))
    assert reply.finish_reason == "complete" and len(reply.text) == 2, reply
    reply = session.respond("1234567", GenerationOptions(json_schema={"enum": [12, 345]}, max_tokens=8))
    assert reply.finish_reason == "complete" and reply.parsed in (12, 345), reply
    # Finished exactly at max_tokens by a forced token ("2" after "1"): the tokens before the
    # last are decoded, so the next exchange keeps them (they were dropped from the cache).
    options = GenerationOptions(json_schema={"enum": [12, 345]}, max_tokens=2, temperature=0)
    reply = session.respond("Write 12.", options)
    assert (reply.text, reply.finish_reason, reply.parsed) == ("12", "complete", 12), reply
    assert session.cached_tokens >= reply.usage.prompt_tokens + reply.usage.completion_tokens - 1


# 6, 7, 10. hostile session files ------------------------------------------------------------------
def test_hostile_session_files_are_typed_errors_quickly(smollm2_path: Path, tmp_path: Path) -> None:
    header = {"format": 1, "compat": {}, "settings": {}, "messages": [], "images": {}, "blobs": []}
    huge_run = forge(
        tmp_path / "run.llms",
        {**header, "record": [{"image": "x", "n": 10**10 + 1, "from": 0, "count": 10**10}]},
    )
    deep = forge(tmp_path / "deep.llms", b"[" * 200000)
    digits = forge(tmp_path / "digits.llms", b'{"format": 1, "settings": {"x": ' + b"1" * 5000 + b"}}")
    os.mkfifo(tmp_path / "fifo.llms")
    code = f"""
    import time
    from llmsession import Model, SessionFileError
    m = Model({str(smollm2_path)!r}, threads=1)
    fifo = {str(tmp_path / "fifo.llms")!r}
    for path in ({str(huge_run)!r}, {str(deep)!r}, {str(digits)!r}, fifo, "/dev/zero", "/proc"):
        began = time.perf_counter()
        try:
            m.load_session(path)
        except SessionFileError as e:
            print("typed in %.2f s: %s" % (time.perf_counter() - began, str(e)[:70]))
        else:
            raise SystemExit("loaded " + path)
    """
    out = run_python(code, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    times = [float(line.split()[2]) for line in out.stdout.splitlines() if line.startswith("typed")]
    assert len(times) == 6 and max(times) < 2, out.stdout


def test_a_fifo_or_a_device_named_as_a_model_an_image_or_a_template_is_a_typed_error(
    smollm2_path: Path, tmp_path: Path
) -> None:
    """The model's opening, an image part's path and a template file were opened as they came:
    a FIFO blocked for ever (no writer), ``/dev/zero`` read until memory ran out. Only regular
    files are read now, and a typed error says why."""
    os.mkfifo(tmp_path / "fifo")
    code = f"""
    import time
    from pathlib import Path
    from llmsession import ImageError, Model, ModelLoadError, TemplateError
    from llmsession.text.images import image_from_part
    fifo, model = {str(tmp_path / "fifo")!r}, {str(smollm2_path)!r}
    calls = [(lambda p=p: Model(p), ModelLoadError) for p in (fifo, "/dev/zero", "/proc")]
    image = lambda p: image_from_part({{"type": "image", "image": p}})
    calls += [(lambda p=p: image(p), ImageError) for p in (fifo, "/dev/zero", "/proc")]
    template = lambda p: Model(model, threads=1, chat_template=Path(p))
    calls += [(lambda p=p: template(p), TemplateError) for p in (fifo, "/dev/zero")]
    for call, typed in calls:
        began = time.perf_counter()
        try:
            call()
        except typed as e:
            print("typed in %.2f s: %s" % (time.perf_counter() - began, e))
        else:
            raise SystemExit("read it")
    """
    out = run_python(code, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("typed")]
    assert len(lines) == 8 and max(float(line.split()[2]) for line in lines) < 2, out.stdout
    assert all(line.endswith("not a regular file") for line in lines), out.stdout  # (/proc: a directory)


def test_closing_from_inside_a_step_is_a_busy_error_not_a_hang(smollm2_path: Path) -> None:
    """A validator (or a signal handler, a finalizer) run inside a step that closes its session
    or its model waited for the step's own lock: for ever. Refused now, nothing shut, and both
    close once the step has returned."""
    code = f"""
    import time
    from pydantic import BaseModel, Field, field_validator
    from llmsession import GenerationOptions, Model, SessionBusyError
    model = Model({str(smollm2_path)!r}, threads=1, anticipate=False)
    session = model.session()
    said = [{{"role": "user", "content": "Hi"}}]
    model.chat(said, GenerationOptions(max_tokens=2), conversation="kept")
    for close in (session.close, model.close):
        class Answer(BaseModel):
            word: str = Field(max_length=12)  # (whole within max_tokens: the validator runs)
            @field_validator("word")
            @classmethod
            def closing(cls, value: str) -> str:
                close()
                return value
        began = time.perf_counter()
        try:
            options = GenerationOptions(max_tokens=64, temperature=0.0, json_schema=Answer)
            reply = session.respond("Say a word.", options)
            print("replied", reply.finish_reason, repr(reply.text))
        except SessionBusyError as e:
            print("busy in %.2f s: %s" % (time.perf_counter() - began, e))
        assert not session.closed and not model.closed
    assert model.conversations() == ["kept"]  # (the stateless calls' kept sessions stay too)
    again = model.chat(said, GenerationOptions(max_tokens=2), conversation="kept")
    assert again.usage.reused_tokens > 0, again.usage
    reply = session.respond("Hi", GenerationOptions(max_tokens=2))
    assert session.messages[-1]["content"] == reply.text and reply.usage.completion_tokens > 0
    session.close()
    model.close()
    assert session.closed and model.closed
    """
    out = run_python(code, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    busy = [line for line in out.stdout.splitlines() if line.startswith("busy")]
    assert len(busy) == 2 and all("from inside its own step" in line for line in busy), out.stdout


def test_a_stream_closed_from_inside_its_own_step_is_refused_at_once(smollm2: Model) -> None:
    """A validator (a signal handler, a finalizer) run inside a stream's step that closes that
    stream waited 10 s for the step's own guard, then was busy: refused at once now, nothing
    cancelled, and the stream goes on to its end."""
    from pydantic import BaseModel, Field, field_validator

    streams: list[Any] = []
    refused: list[tuple[float, str]] = []

    class Answer(BaseModel):
        word: str = Field(max_length=12)  # (whole within max_tokens: the validator runs)

        @field_validator("word")
        @classmethod
        def closing(cls, value: str) -> str:
            began = time.perf_counter()
            try:
                streams[0].close()
            except SessionBusyError as error:
                refused.append((time.perf_counter() - began, str(error)))
            return value

    session = smollm2.session()
    options = GenerationOptions(max_tokens=64, temperature=0.0, json_schema=Answer)
    streams.append(session.stream("Say a word.", options))
    for _snapshot in streams[0]:
        pass
    assert len(refused) == 1 and refused[0][0] < 1.0, refused
    assert "from inside its own step" in refused[0][1]
    assert streams[0].reply is not None and streams[0].reply.finish_reason == "complete"  # (not cancelled)
    streams[0].close()  # (once the step has returned: closed)


def test_a_regular_file_is_read_up_to_its_bound_and_no_further(tmp_path: Path) -> None:
    (tmp_path / "small").write_bytes(b"x" * 10)
    assert files.read_regular(tmp_path / "small", 10) == b"x" * 10
    with pytest.raises(OSError, match="larger than 9 bytes"):
        files.read_regular(tmp_path / "small", 9)
    with pytest.raises(FileNotFoundError):
        files.read_regular(tmp_path / "gone", 9)


def test_a_record_that_does_not_match_its_state_restores_nothing(smollm2: Model, tmp_path: Path) -> None:
    header, blobs = saved_header(smollm2, tmp_path)
    n = len(header["record"])
    bad = forge(tmp_path / "minus5.llms", {**header, "record": [-5] * n}, (blobs,))
    session = smollm2.load_session(bad)
    reply = session.respond("And?", GREEDY)
    assert reply.usage.restored_tokens == 0 and "vocabulary" in reply.usage.cache_note, reply.usage
    good = forge(tmp_path / "good.llms", header, (blobs,))
    reply = smollm2.load_session(good).respond("And?", GREEDY)
    assert 0 < reply.usage.restored_tokens == n <= reply.usage.reused_tokens, reply.usage
    for name, value in (("swa_full", [1]), ("thinking", "yes"), ("share_prefix", 1)):
        forged = forge(
            tmp_path / f"{name}.llms", {**header, "settings": {**header["settings"], name: value}}, (blobs,)
        )
        with pytest.raises(SessionFileError, match=name):
            smollm2.load_session(forged)
        with pytest.raises(TypeError, match=name):
            smollm2.session(**{name: value})


# 8. isolated models and arguments that cannot travel ----------------------------------------------
def test_an_isolated_model_takes_a_local_pydantic_class_and_refuses_a_lambda_typed(
    smollm2_path: Path,
) -> None:
    class City(BaseModel):  # defined inside a function: it cannot be pickled
        model_config = ConfigDict(extra="forbid")
        name: str = Field(max_length=12)

    class Nowhere(City):  # its own validator runs in this process only
        @field_validator("name")
        @classmethod
        def refuse(cls, value: str) -> str:
            raise ValueError("no such place")

    options = GenerationOptions(json_schema=City, max_tokens=32, temperature=0)
    replies = []
    for isolated in (False, True):
        with Model(smollm2_path, threads=1, isolated=isolated) as model:
            session = model.session(share_prefix=False)
            replies.append(session.respond("Name a city.", options))
            with pytest.raises(TemplateError):  # refused alike in both homes
                session.respond(lambda: "hi", GREEDY)  # type: ignore[arg-type]
            with pytest.raises(TemplateError):
                model.chat([{"role": "user", "content": lambda: "hi"}], GREEDY)
            odd = [{"type": "text", "text": "Hi", "note": lambda: 1}]  # fine here; cannot travel
            if isolated:
                with pytest.raises(TypeError, match="pickle"):
                    session.respond(odd, GREEDY)
            else:
                session.respond(odd, GREEDY)
            assert session.respond("Thanks", GenerationOptions(max_tokens=2, temperature=0)).text is not None
            with pytest.raises(ReplyMismatchError, match="no such place"):
                session.respond("Name a town.", GenerationOptions(json_schema=Nowhere, max_tokens=32))
            asked, answered = session.messages[-2:]  # the transcript keeps the reply, in step
            assert asked["content"] == "Name a town." and answered["content"].startswith('{"name"')
            assert session.respond("Bye", GenerationOptions(max_tokens=2, temperature=0)).text is not None
    local, isolated = replies
    assert local.text == isolated.text and local.finish_reason == isolated.finish_reason == "complete"
    assert isinstance(isolated.parsed, City) and isolated.parsed == local.parsed


# 9. commands check their arguments before any work -------------------------------------------------
@pytest.mark.parametrize(
    "args",
    [
        ["setup", "--prefix", "/proc/x"],
        ["setup", "--prefix", "/etc/passwd/x"],
        ["bench", "--think", "-5"],
        ["bench", "--think", "nan"],
        ["bench", "memory", "--sessions", "0"],
        ["bench", "memory", "--sessions", "4,,2"],
        ["bench", "structured", "--repeats", "-1"],
        ["bench", "concurrent", "--json", "/proc/x.json"],
        ["bench", "concurrent", "--json", "/dev/null"],
        ["bench", "--plot", "/nonexistent-dir/plot.png"],
        ["chat", "--max-tokens", "0"],
        ["chat", "--temperature", "inf"],
        ["rpc-server", "--port", "70000"],
    ],
)
def test_a_bad_argument_is_an_error_and_status_2_before_any_work(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """In this process (a fresh interpreter per case made the pure tier a minute slower): any
    exception but argparse's SystemExit(2) fails the test, as would a model being loaded."""
    began = time.perf_counter()
    with pytest.raises(SystemExit) as exited:
        cli.main(args)
    assert exited.value.code == 2
    assert "error:" in capsys.readouterr().err
    assert time.perf_counter() - began < 5  # no model loaded, no run


def test_chat_reports_a_schema_file_nested_too_deep_and_goes_on(smollm2_path: Path, tmp_path: Path) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000)
    nested = tmp_path / "nested.json"
    nested.write_text('{"type": "array", "items": ' * 200 + "{}" + "}" * 200)
    stdin = f"/json {deep}\n/json {nested}\nSay hi\n"
    out = subprocess.run(
        [sys.executable, "-m", "llmsession", "chat", "--model", str(smollm2_path), "--max-tokens", "4"],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2, out.stderr
    assert "[prompt" in out.stdout  # the chat went on to the next line
