"""Where an exchange's time goes (``Timings``), the shared context made while the model loads, the
flash-attention choice, each context's thread pool and the greedy pick, on SmolLM2."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import internals
import numpy as np
import pytest

from llmsession import GenerationOptions, Model
from llmsession.native import machine
from llmsession.native.context import NativeContext
from llmsession.native.llama import bindings
from llmsession.native.machine import default_threads, usable_cores
from llmsession.native.sampler import Sampler

GREEDY = GenerationOptions(max_tokens=8, temperature=0)


def test_the_split_accounts_for_the_time_to_first_token(smollm2: Model) -> None:
    """The parts of the time to first token add up to most of it. The questions are long enough
    that their prefill, not a thread's wake-up on a busy machine, is what takes the time, and
    the first reply's look-ahead is settled before the second (joining it is in no part)."""
    session = smollm2.session(system="You are a helpful assistant.")
    france = "What is the capital of France? " + "Say why it grew there, by its river and roads. " * 20
    for question in (france, "And of Italy? " + "Say why it grew there, by its hills and sea. " * 20):
        internals.settled(session)
        t = session.respond(question, GREEDY).timings
        parts = (t.render_s, t.tokenize_s, t.plan_s, t.prefill_s, t.first_sample_s)
        assert all(part > 0 for part in parts), t
        assert sum(parts) <= t.time_to_first_token_s
        assert t.time_to_first_token_s - sum(parts) < 0.5 * t.time_to_first_token_s, t
        assert t.prefill_s > t.first_sample_s  # the decode is what costs


def test_the_shared_context_is_made_while_the_model_loads(smollm2_path: Path) -> None:
    with Model(smollm2_path, threads=2) as model:
        warm = internals.local(model).engine.warm()  # a second call joins the same pool; wait for it
        assert warm is not None
        warm.join()
        (pool,) = internals.local(model).engine._shared_contexts.values()
        assert pool._context is not None  # before any session spoke
        reply = model.session().respond("Hello", GREEDY)
        assert reply.timings.plan_s < reply.timings.prefill_s


def test_flash_attention_reaches_the_kernels(smollm2: Model) -> None:
    """Off and on give (slightly) different logits on the CPU; auto is llama.cpp's AUTO, on."""
    _, ffi = bindings()
    tokens = smollm2.tokenize("The history of the river and its bridges, told slowly. " * 8)

    def logits(flash: bool | None) -> np.ndarray:
        context = NativeContext(
            internals.local(smollm2).native, n_ctx=256, n_batch=256, threads=2, flash_attention=flash
        )
        try:
            context.decode(tokens, 0)
            return np.frombuffer(
                ffi.buffer(internals.raw_logits(context), 4 * internals.local(smollm2).native.n_vocab),
                np.float32,
            ).copy()
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
        chosen = model.flash_attention if flash is None else flash  # (None: as this machine's probe chose)
        assert model.flash_attention is chosen and made[-1:] == [chosen]
        probing = [] if flash is not None or len(made) == 1 else [False, True]  # (measured at this load)
        assert made == [*probing, chosen]


def test_flash_attention_must_be_a_bool_or_none(smollm2_path: Path) -> None:
    with pytest.raises(TypeError, match="flash_attention"):
        Model(smollm2_path, flash_attention="off")  # type: ignore[arg-type]


def test_a_state_saved_with_flash_attention_is_not_loaded_without(smollm2_path: Path, tmp_path: Path) -> None:
    """Without flash attention the V cache is stored transposed: such a state must not load."""
    saved = tmp_path / "chat.llmsession"
    with Model(smollm2_path, threads=2, flash_attention=True) as model:
        session = model.session()
        session.respond("Hello", GREEDY)
        session.save(saved)
    with Model(smollm2_path, threads=2, flash_attention=False) as model:
        loaded = model.load_session(saved)
        assert loaded.cached_tokens == 0 and len(loaded.messages) == 2
        assert loaded.respond("Again", GREEDY).usage.reused_tokens == 0


def threads_now() -> int:
    return len(list(Path("/proc/self/task").iterdir()))


def test_a_context_keeps_one_thread_pool_for_its_decodes(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool's workers (threads - 1) live as long as the context, not one graph: without a
    pool of its own, ggml starts and joins them for every graph it computes."""
    monkeypatch.setattr(machine, "usable_cores", lambda: 2)  # (on a 1-core runner too)
    before = threads_now()
    context = NativeContext(internals.local(smollm2).native, n_ctx=256, n_batch=32, threads=2)
    try:
        assert threads_now() == before + 1
        for pos in range(4):
            context.decode([pos + 10], pos)
        assert threads_now() == before + 1
    finally:
        context.close()
    assert threads_now() == before


def test_a_context_asked_for_more_threads_than_cores_decodes_with_the_cores(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every native context is cut to the cores the process may use, whoever asked (a
    benchmark, a test, the library): one core, so no pool workers to spin for."""
    monkeypatch.setattr(machine, "usable_cores", lambda: 1)
    before = threads_now()
    context = NativeContext(internals.local(smollm2).native, n_ctx=256, n_batch=32, threads=2)
    try:
        assert threads_now() == before
        context.decode([10, 11], 0)
    finally:
        context.close()


def test_threads_default_to_the_usable_cores_and_more_are_warned_of_and_cut(
    smollm2_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """More threads than cores make every decode wait at each barrier for a descheduled thread
    (three on two cores: 3 s a SmolLM2 token instead of 5 ms): the default takes the cores the
    process may use (its affinity, its cgroup's quota), and a larger choice is warned of and
    cut to them."""
    quota = tmp_path / "cpu.max"
    affinity = len(os.sched_getaffinity(0))
    for text, cores in (
        ("max 100000", affinity),
        ("50000 100000", 1),
        (f"{affinity * 200000} 100000", affinity),
    ):
        quota.write_text(text + "\n")
        assert usable_cores(quota) == cores
    assert usable_cores(tmp_path / "absent") == affinity
    assert default_threads() == min(usable_cores(), 8)
    with caplog.at_level(logging.WARNING, logger="llmsession"):
        with Model(smollm2_path, threads=usable_cores() + 1) as model:
            assert model.threads == usable_cores()
        assert "more than the" in caplog.text
        caplog.clear()
        with Model(smollm2_path, threads=usable_cores()) as model:
            assert model.threads == usable_cores()
        assert "more than the" not in caplog.text


def test_a_forked_child_decodes_without_the_parents_pool(smollm2_path: Path) -> None:
    """A forked child has none of the pool's threads (with them, its decode would wait for them
    forever): it decodes without, and gets the parent's logits."""
    code = f"""
        import os, sys, time
        import numpy as np
        from llmsession.native.llama import NativeModel
        from llmsession.native.context import NativeContext
        native = NativeModel({str(smollm2_path)!r})
        context = NativeContext(native, n_ctx=256, n_batch=32, threads=2)
        def logits():
            context.clear()
            context.decode([1, 2, 3, 4], 0)
            return context.last_logits(native.n_vocab).copy()
        mine = logits()
        child = os.fork()
        if child == 0:
            os._exit(0 if np.array_equal(logits(), mine) else 3)
        for _ in range(600):  # 30 s
            done, status = os.waitpid(child, os.WNOHANG)
            if done:
                sys.exit(print("child", os.waitstatus_to_exitcode(status)))
            time.sleep(0.05)
        os.kill(child, 9)
        print("child hung")
        """
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.split()[-2:] == ["child", "0"], out.stdout + out.stderr


def test_a_greedy_pick_is_the_greedy_samplers(smollm2: Model) -> None:
    """The greedy chain's pick, taken as numpy's argmax, is llama.cpp's greedy sampler's: the
    first maximum, over real logits, ties and a constraint's -inf alike."""
    n_vocab = internals.local(smollm2).native.n_vocab
    fast = Sampler.from_options(GREEDY, n_vocab=n_vocab, last_n=0)
    chain = Sampler([lambda lib: lib.llama_sampler_init_greedy()])
    assert fast.argmax_of == n_vocab and chain.argmax_of == 0
    context = NativeContext(internals.local(smollm2).native, n_ctx=256, n_batch=64, threads=2)
    try:
        tokens = smollm2.tokenize("The river runs under seven bridges before it meets the sea.")
        for end in range(1, len(tokens) + 1):
            context.clear()
            context.decode(tokens[:end], 0)
            logits = context.last_logits(n_vocab)
            assert fast.sample(context) == chain.sample(context)
            low, high = sorted(np.argsort(logits)[-50:][:2])  # a tie: the first one wins
            logits[low] = logits[high] = logits.max() + 1
            assert fast.sample(context) == chain.sample(context) == low
            logits[: high + 1] = -np.inf  # masked: the pick comes after
            assert fast.sample(context) == chain.sample(context) > high
    finally:
        context.close()
        fast.close()
        chain.close()
