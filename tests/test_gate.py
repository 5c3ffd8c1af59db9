"""Every native call on a model's shared contexts is made under its engine's gate, whoever
makes it: llama.cpp's context is not thread-safe, and a save, a load or a fork that copied a
state without the gate ran ``llama_state_seq_get_data`` / ``set_data`` beside another session's
``llama_decode`` on the same context (a restore allocates cells in the pool the decode is
writing: a crash, or two sequences in one cell). Each call is checked as it is made."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import internals
import pytest

from llmsession import GenerationOptions, Model
from llmsession.native.context import NativeContext

CALLS = ("decode", "decode_many", "encode", "seq_rm", "seq_cp", "clear", "pos_min", "pos_max")
CALLS += ("state_size", "state_get", "state_set", "last_logits")
GREEDY = GenerationOptions(max_tokens=4, temperature=0)


@pytest.fixture
def ungated(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Model], list[str]]]:
    """Once given a model: the calls made on its shared contexts without its gate held."""
    seen: list[str] = []
    watched: list[Any] = []

    def watch(model: Model) -> list[str]:
        engine = internals.local(model).engine
        watched.append((model, engine.gate))
        for name in CALLS:
            original = getattr(NativeContext, name)

            @functools.wraps(original)
            def checked(self: Any, *args: Any, _name: str = name, _o: Any = original, **kw: Any) -> Any:
                for each, gate in watched:
                    shared = any(context is self for context in internals.shared_contexts(each))
                    if shared and not gate.held_here:
                        seen.append(f"{_name} in {threading.current_thread().name}")
                return _o(self, *args, **kw)

            monkeypatch.setattr(NativeContext, name, checked)
        return seen

    yield watch


@pytest.mark.parametrize("layout", ["per_session", "shared"])
def test_save_load_and_fork_touch_the_shared_context_under_the_gate(
    smollm2_path: Path, tmp_path: Path, layout: str, ungated: Callable[[Model], list[str]]
) -> None:
    # (one live session: a fork's two states do not fit at once, so it copies the state)
    settings: dict[str, Any] = dict(threads=1, flash_attention=False, anticipate=False, kv_layout=layout)
    with Model(smollm2_path, kv_tokens=1024, max_live_sessions=1, **settings) as model:
        seen = ungated(model)
        session = model.session(system="You are terse.")
        session.respond("Name a colour.", GREEDY)
        session.save(tmp_path / "chat.llmsession")
        forked = session.fork()
        forked.respond("Another?", GREEDY)
        loaded = model.load_session(tmp_path / "chat.llmsession")
        loaded.respond("And a third?", GREEDY)
        session.respond("One more?", GREEDY)
        assert internals.local(model).engine.counters.exchanges >= 4
    assert seen == [], seen


def test_parking_anticipation_stateless_calls_and_choices_touch_it_under_the_gate(
    smollm2_path: Path, ungated: Callable[[Model], list[str]]
) -> None:
    settings: dict[str, Any] = dict(threads=1, flash_attention=False, kv_tokens=2048, max_live_sessions=2)
    with Model(smollm2_path, **settings) as model:
        seen = ungated(model)
        sessions = [model.session(system=f"You are assistant {i}.") for i in range(3)]
        for round_ in range(2):  # (three sessions on two sequences: each parks and comes back)
            for session in sessions:
                internals.settled(session).respond(f"Say {round_}.", GREEDY)
        history = [{"role": "user", "content": "Name a fruit."}]
        reply = model.chat(history, GREEDY)
        model.chat(
            [*history, {"role": "assistant", "content": reply.text}, {"role": "user", "content": "More?"}]
        )
        choices = list(model.chat_choices(history, GenerationOptions(max_tokens=4, seed=1), n=2))
        assert len(choices) == 2
        assert internals.local(model).engine.counters.parks >= 1
    assert seen == [], seen
