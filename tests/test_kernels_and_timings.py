"""Where an exchange's time goes (``Timings``), the shared context made while the model loads, and
the flash-attention choice, on SmolLM2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llmsession import GenerationOptions, Model
from llmsession.native import bindings
from llmsession.native_context import NativeContext

GREEDY = GenerationOptions(max_tokens=8, temperature=0)


def test_the_split_accounts_for_the_time_to_first_token(smollm2: Model) -> None:
    session = smollm2.session(system="You are a helpful assistant.")
    for question in ("What is the capital of France?", "And of Italy?"):
        t = session.respond(question, GREEDY).timings
        parts = (t.render_s, t.tokenize_s, t.plan_s, t.prefill_s, t.first_sample_s)
        assert all(part > 0 for part in parts), t
        assert sum(parts) <= t.time_to_first_token_s
        assert t.time_to_first_token_s - sum(parts) < 0.5 * t.time_to_first_token_s, t
        assert t.prefill_s > t.first_sample_s  # the decode is what costs


def test_the_shared_context_is_made_while_the_model_loads(smollm2_path: Path) -> None:
    with Model(smollm2_path, threads=2) as model:
        warm = model._engine.warm()  # a second call joins the same pool; wait for it
        assert warm is not None
        warm.join()
        (pool,) = model._engine._pools.values()
        assert pool._context is not None  # before any session spoke
        reply = model.session().respond("Hello", GREEDY)
        assert reply.timings.plan_s < reply.timings.prefill_s


def test_flash_attention_reaches_the_kernels(smollm2: Model) -> None:
    """Off and on give (slightly) different logits on the CPU; auto is llama.cpp's AUTO, on."""
    _, ffi = bindings()
    tokens = smollm2.tokenize("The history of the river and its bridges, told slowly. " * 8)

    def logits(flash: bool | None) -> np.ndarray:
        context = NativeContext(smollm2.native, n_ctx=256, n_batch=256, threads=2, flash_attention=flash)
        try:
            context.decode(tokens, 0)
            return np.frombuffer(ffi.buffer(context.logits(), 4 * smollm2.native.n_vocab), np.float32).copy()
        finally:
            context.close()

    on, off, auto = logits(True), logits(False), logits(None)
    assert np.array_equal(on, auto)
    assert not np.array_equal(on, off)
    assert np.abs(on - off).max() < 1.0  # the same model, another order of sums


@pytest.mark.parametrize("flash", [False, True, None])
def test_the_model_s_contexts_take_its_choice(
    smollm2_path: Path, flash: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[bool | None] = []
    init = NativeContext.__init__

    def recording(self: NativeContext, *args: Any, **kwargs: Any) -> None:
        made.append(kwargs["flash_attention"])
        init(self, *args, **kwargs)

    monkeypatch.setattr(NativeContext, "__init__", recording)
    with Model(smollm2_path, threads=2, flash_attention=flash) as model:
        model.session().respond("Hello", GREEDY)
        assert model.flash_attention is flash and made == [flash]


def test_flash_attention_must_be_a_bool_or_none(smollm2_path: Path) -> None:
    with pytest.raises(TypeError, match="flash_attention"):
        Model(smollm2_path, flash_attention="off")  # type: ignore[arg-type]


def test_a_state_saved_with_flash_attention_is_not_loaded_without(smollm2_path: Path, tmp_path: Path) -> None:
    """Without flash attention the V cache is stored transposed: such a state must not load."""
    saved = tmp_path / "chat.llmsession"
    with Model(smollm2_path, threads=2) as model:
        session = model.session()
        session.respond("Hello", GREEDY)
        session.save(saved)
    with Model(smollm2_path, threads=2, flash_attention=False) as model:
        loaded = model.load_session(saved)
        assert loaded.cached_tokens == 0 and len(loaded.messages) == 2
        assert loaded.respond("Again", GREEDY).usage.reused_tokens == 0
