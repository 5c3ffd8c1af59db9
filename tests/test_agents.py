"""Coding agents' conversations on ``llmsession serve`` over real HTTP, as ``bench agents``
drives them: a system prompt with 8 tool schemas, 10 turns with tool calls and their results,
the whole transcript resent every turn. Claude-Code-shaped on ``/v1/messages`` (streamed, its
billing line new every request) and Codex-shaped on ``/v1/responses`` (``store: false``): turns
2-10 each decode at most what they add and one token more. The variant that must fail: a server
that keeps the billing line decodes everything after it. The system prompt is ~1K tokens here
(~1,900 with the tools, four 512-token batches); ``bench agents`` sends ~4K (5,600 with the
tools), whose prefill alone took 25 s of the suite and shows nothing more about what is decoded."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serve_helpers import running

from llmsession import Model, SessionConfig
from llmsession.commands.bench import agents_load
from llmsession.serve.app import VOLATILE_LINES, create_app

KEY = "sk-bench"
TURNS = 10


@pytest.fixture(scope="module")
def model(smollm2_path: Path) -> Iterator[Model]:
    """Flash attention on: the ~1,900-token first prompt then prefills faster on the CPU (what
    is decoded, not how fast, is what these tests count)."""
    with Model(smollm2_path, kv_tokens=8192, max_live_sessions=1, threads=2, flash_attention=True) as model:
        yield model


@contextlib.contextmanager
def served(model: Model, volatile: tuple[str, ...] = VOLATILE_LINES) -> Iterator[str]:
    app = create_app(model, api_key=KEY, session=SessionConfig(context_size=8192), volatile_lines=volatile)
    with running(app) as url:
        yield url.removesuffix("/v1")


@pytest.mark.parametrize("shape", ["claude_code", "codex"])
def test_every_resent_turn_decodes_only_what_it_adds(model: Model, shape: str) -> None:
    drive = getattr(agents_load, shape)
    with served(model) as url, httpx.Client(timeout=300) as client:
        turns = drive(client, url, TURNS, 48, KEY, system_tokens=1000)
    assert len(turns) == TURNS and turns[0].prompt_tokens > 1800
    assert sum(t.tool_calls for t in turns) >= 3  # (forced on turns 2, 5 and 8: answered after)
    measured = [turn for turn in turns[1:] if turn.new_tokens is not None]
    assert len(measured) >= TURNS - 3, turns  # (a turn after a call cut short is not: see Turn)
    for turn in measured:
        assert turn.new_tokens is not None and turn.new_tokens > 0, turn
        assert turn.decoded_tokens <= turn.new_tokens + 1, (shape, turn)


@pytest.mark.parametrize("shape", ["claude_code", "codex"])
def test_a_replayed_conversation_decodes_only_what_the_script_adds(model: Model, shape: str) -> None:
    """``bench agents``' replayed shapes send the script's replies back (a call on turn 2,
    answered on turn 3), the same to every server: each later turn decodes what it adds."""
    drive = getattr(agents_load, shape)
    with served(model) as url, httpx.Client(timeout=300) as client:
        turns = drive(client, url, 3, 8, KEY, system_tokens=400, replay=True)
    for turn in turns[1:]:
        assert turn.new_tokens is not None and turn.new_tokens > 8, turn  # (a reply and a question)
        assert turn.decoded_tokens <= turn.new_tokens + 1, (shape, turn)


def test_three_conversations_at_once_each_decode_only_what_they_add(model: Model) -> None:
    """``bench agents``' ``3x`` shape on a server that keeps one conversation live: a turn of
    each in turn, each under its own session id, each later turn decoding only what it adds."""
    with served(model) as url, httpx.Client(timeout=300) as client:
        turns = agents_load.claude_code(
            client, url, 2, 8, KEY, system_tokens=400, replay=True, conversations=3
        )
    assert [(t.conversation, t.turn) for t in turns] == [(0, 1), (1, 1), (2, 1), (0, 2), (1, 2), (2, 2)]
    for turn in turns[3:]:
        assert turn.new_tokens is not None and turn.new_tokens > 8, turn
        assert turn.decoded_tokens <= turn.new_tokens + 1, turn


def test_a_server_that_keeps_the_billing_line_decodes_everything_again(model: Model) -> None:
    with served(model, ()) as url, httpx.Client(timeout=300) as client:
        turns = agents_load.claude_code(client, url, 2, 8, KEY, system_tokens=400)
    for turn in turns[1:]:
        assert turn.decoded_tokens > turn.prompt_tokens - 64, turn  # (all but the line's start)
