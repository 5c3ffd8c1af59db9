"""Flash attention chosen at load from a probe of the model on this machine (``engine.attention``,
``runtime.attention``): the choice follows the probe and the sessions' depth, the probe is
measured once and kept, a kept file that is not a probe's is measured again, and the models'
contexts take the choice."""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import internals
import pytest

from llmsession import GenerationOptions, Model
from llmsession.engine.attention import BATCH, STEPS, AttentionProbe
from llmsession.native.context import NativeContext
from llmsession.native.llama import NativeModel
from llmsession.native.shape import attention_scores_bytes, cost_shape
from llmsession.runtime import attention

GREEDY = GenerationOptions(max_tokens=4, temperature=0)


def test_the_choice_is_the_cheaper_turn_at_half_the_context() -> None:
    # A turn is a batch and STEPS steps. Flash attention a little slower at depth 0 but growing
    # more slowly with depth: off for short contexts, on for long ones.
    probe = AttentionProbe(off=(1.00, 1.20, 0.010, 0.012), on=(1.05, 1.10, 0.011, 0.011), depth=128)
    assert probe.turn_s(False, 256) == pytest.approx(1.40 + STEPS * 0.014)
    assert probe.choose(64) is False and probe.choose(8192) is True
    assert AttentionProbe(off=(1.0, 1.1, 0.1, 0.1), on=(0.8, 0.9, 0.08, 0.08)).choose(64) is True  # faster
    assert AttentionProbe(off=(0.8, 0.9, 0.1, 0.1), on=(1.0, 1.1, 0.1, 0.1)).choose(32768) is False
    assert (
        AttentionProbe(off=(1.0, 1.0, 0.1, 0.1), on=(0.97, 0.97, 0.097, 0.097)).choose(4096) is False
    )  # margin
    # What the AVX-512 EPYC measured: flash attention's batches cheaper at depth 0, but growing
    # five times as fast with the depth: off for any session past a few hundred positions.
    measured = AttentionProbe(off=(0.0800, 0.0851, 0.0067, 0.0073), on=(0.0737, 0.1000, 0.0060, 0.0073))
    assert measured.choose(8192) is False and measured.choose(2048) is False


@pytest.mark.parametrize(
    "data",
    [None, [], {"off": [1, 1, 1, 1], "on": [1, 1, 1, 1]},
     {"version": 2, "tokens": 128, "off": [1, 1], "on": [1, 1]},
     {"version": True, "depth": 128, "off": [1, 1, 1, 1], "on": [1, 1, 1, 1]},
     {"version": 3, "depth": 128, "off": [1, 1, 1], "on": [1, 1, 1, 1]},
     {"version": 3, "depth": 128, "off": [1, "2", 1, 1], "on": [1, 1, 1, 1]},
     {"version": 3, "depth": 128, "off": [0, 1, 1, 1], "on": [1, 1, 1, 1]},
     {"version": 3, "depth": 128, "off": [10**400, 1, 1, 1], "on": [1, 1, 1, 1]},
     {"version": 3, "depth": 128, "off": [float("nan"), 1, 1, 1], "on": [1, 1, 1, 1]},
     {"version": 3, "depth": "128", "off": [1, 1, 1, 1], "on": [1, 1, 1, 1]},
     {"version": 3, "depth": 0, "off": [1, 1, 1, 1], "on": [1, 1, 1, 1]}],
)  # fmt: skip
def test_what_is_not_a_probe_reads_as_none(data: Any) -> None:
    assert AttentionProbe.from_json(data) is None
    probe = AttentionProbe(off=(1.0, 2.0, 0.1, 0.2), on=(0.5, 0.75, 0.1, 0.1), depth=64)
    assert AttentionProbe.from_json(json.loads(json.dumps(probe.to_json()))) == probe


def test_the_probe_is_measured_once_and_kept(
    smollm2: Model,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fixture_path: Callable[[str], Path],
) -> None:
    monkeypatch.setattr(attention, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(attention, "PROBE_DEPTH", 2 * BATCH)  # (what is kept, not how well: short)
    monkeypatch.setattr(attention, "REPEATS", 1)
    native, path = internals.local(smollm2).native, smollm2.path
    measured: list[AttentionProbe] = []
    measure = attention.measure

    def counted(*args: Any, **kwargs: Any) -> AttentionProbe:
        measured.append(measure(*args, **kwargs))
        return measured[-1]

    monkeypatch.setattr(attention, "measure", counted)
    first = attention.probed(native, path, 2, 4096)
    assert len(measured) == 1 and first is measured[0].choose(4096)
    (off, on) = measured[0].off, measured[0].on
    assert all(0 < t < 30 for t in (*off, *on)) and measured[0].depth == 2 * BATCH
    assert attention.probed(native, path, 2, 4096) is first and len(measured) == 1  # kept
    attention.probed(native, path, 1, 4096)  # another thread count is another measurement
    assert len(measured) == 2
    file = tmp_path / attention.PROBES_FILE
    kept = json.loads(file.read_text())
    assert len(kept) == 2 and all(AttentionProbe.from_json(v) for v in kept.values())
    for hostile in ("not json", "[" * 100_000 + "]" * 100_000, '{"x": ' + "9" * 5000 + "}"):
        file.write_text(hostile)  # not the probes': measured again, and rewritten
        assert attention.probed(native, path, 2, 4096) is measured[-1].choose(4096)
        assert len(json.loads(file.read_text())) == 1
    assert len(measured) == 5

    def never(*_args: Any, **_kwargs: Any) -> AttentionProbe:
        raise AssertionError("more threads than cores measure nothing useful")

    monkeypatch.setattr(attention, "measure", never)  # (off, and nothing measured)
    assert attention.probed(native, path, attention.usable_cores() + 1, 4096) is False
    # a batch's scores past MAX_SCORES_BYTES without it: on, unmeasured (SmolLM2 has 9 heads)
    assert attention_scores_bytes(native, 8192, 512) == 8192 * 512 * 9 * 4 < attention.MAX_SCORES_BYTES
    assert attention.probed(native, path, 2, 8192, batch=4096) is True
    bert = NativeModel(fixture_path("bert-tiny.gguf"))  # (an embedding model: nothing to speed up)
    try:
        assert attention.probed(bert, fixture_path("bert-tiny.gguf"), 1, 512) is False
    finally:
        bert.close()
    monkeypatch.setattr(attention, "measure", counted)
    file.unlink()
    os.mkfifo(file)  # a pipe where the file was: not read (it would never end), measured again
    assert attention.probed(native, path, 2, 4096) is measured[-1].choose(4096) and len(measured) == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([attention.LOCK_FILE, attention.PROBES_FILE])


def test_files_of_one_shape_share_a_probe_and_another_shape_is_measured(
    smollm2: Model,
    gemma3: Model,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fixture_path: Callable[[str], Path],
) -> None:
    """SmolLM2's weights under another family's template (a test fixture) decode as SmolLM2
    does: one probe for both, where the file's path, size and time once made one each (the
    suite measured 14, ~10 s each on a worker's core). Gemma 3 is another shape: measured."""
    monkeypatch.setattr(attention, "cache_root", lambda: tmp_path)
    measured: list[NativeModel] = []
    probe = AttentionProbe((1.0, 1.1, 0.1, 0.1), (0.5, 0.6, 0.05, 0.05), depth=attention.PROBE_DEPTH)

    def counted(native: NativeModel, *_args: Any, **_kwargs: Any) -> AttentionProbe:
        measured.append(native)
        return probe

    monkeypatch.setattr(attention, "measure", counted)
    qwen_path = fixture_path("smollm2-qwen25-template.gguf")
    qwen, smol = NativeModel(qwen_path), internals.local(smollm2).native
    try:
        assert qwen.chat_template() != smol.chat_template()
        assert cost_shape(qwen) == cost_shape(smol)
        for native, path in ((smol, smollm2.path), (qwen, qwen_path)):
            assert attention.probed(native, path, 1, 4096) is True
        assert len(measured) == 1
    finally:
        qwen.close()
    gemma = internals.local(gemma3).native
    assert cost_shape(gemma) != cost_shape(internals.local(smollm2).native)
    assert attention.probed(gemma, gemma3.path, 1, 4096) is True and len(measured) == 2
    assert len(json.loads((tmp_path / attention.PROBES_FILE).read_text())) == 2


def test_a_probe_lock_held_past_its_wait_is_a_failed_probe_not_a_hung_load(
    smollm2: Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process stuck holding the probes' lock (stopped mid-probe) made every model load
    on the machine wait forever: past ``LOCK_WAIT_S`` the load goes on with flash attention off,
    nothing measured or kept."""
    monkeypatch.setattr(attention, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(attention, "LOCK_WAIT_S", 0.5)
    monkeypatch.setattr(attention, "measure", lambda *_a, **_k: pytest.fail("measured without the lock"))
    native, path = internals.local(smollm2).native, smollm2.path
    outcome: list[bool] = []
    with open(tmp_path / attention.LOCK_FILE, "a") as held:  # (another open file: another holder)
        fcntl.flock(held, fcntl.LOCK_EX)
        began = time.monotonic()
        waiting = threading.Thread(target=lambda: outcome.append(attention.probed(native, path, 1, 4096)))
        waiting.start()
        waiting.join(30)
        assert not waiting.is_alive(), "the load waited for the lock's holder past its bound"
    assert outcome == [False] and time.monotonic() - began < 5
    assert not (tmp_path / attention.PROBES_FILE).exists()


def test_a_kept_probe_is_read_while_another_process_measures(
    smollm2: Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load whose probe is kept does not wait for the lock another load holds while it measures
    another model (in the suite: a worker's every load waited ~10 s behind each of the other's
    probes; a fleet's replicas likewise)."""
    monkeypatch.setattr(attention, "cache_root", lambda: tmp_path)
    native, path = internals.local(smollm2).native, smollm2.path
    probe = AttentionProbe((1.0, 1.1, 0.1, 0.1), (0.5, 0.6, 0.05, 0.05), depth=attention.PROBE_DEPTH)
    monkeypatch.setattr(attention, "measure", lambda *_a, **_k: probe)
    assert attention.probed(native, path, 1, 4096) is True  # measured and kept
    monkeypatch.setattr(attention, "measure", lambda *_a, **_k: pytest.fail("measured again"))
    monkeypatch.setattr(attention, "LOCK_WAIT_S", 5.0)
    with open(tmp_path / attention.LOCK_FILE, "a") as held:  # (another open file: another holder)
        fcntl.flock(held, fcntl.LOCK_EX)
        began = time.monotonic()
        assert attention.probed(native, path, 1, 4096) is True
        assert time.monotonic() - began < 2.5, "the load waited for the lock with its probe kept"


def test_the_kept_probe_decides_the_models_setting(
    smollm2_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe saying flash attention is faster turns it on, one saying slower leaves it off
    (the variant that must fail: a choice that ignored the probe would be the same both times)."""
    monkeypatch.setattr(attention, "cache_root", lambda: tmp_path)

    def measured(probe: AttentionProbe) -> Any:
        return lambda *_args, **_kwargs: probe

    made: list[bool | None] = []
    init = NativeContext.__init__

    def recording(context: NativeContext, *args: Any, **kwargs: Any) -> None:
        made.append(kwargs["flash_attention"])
        init(context, *args, **kwargs)

    monkeypatch.setattr(NativeContext, "__init__", recording)
    for probe, chosen in (
        (AttentionProbe((1.0, 1.1, 0.1, 0.1), (0.5, 0.6, 0.05, 0.05)), True),
        (AttentionProbe((0.5, 0.6, 0.05, 0.05), (1.0, 1.1, 0.1, 0.1)), False),
    ):
        (tmp_path / attention.PROBES_FILE).unlink(missing_ok=True)
        monkeypatch.setattr(attention, "measure", measured(probe))
        made.clear()
        with Model(smollm2_path, threads=2) as model:
            assert model.flash_attention is chosen
            assert model.session().respond("Hello", GREEDY).text
            assert made and set(made) == {chosen}  # the engine's contexts take it
        with Model(smollm2_path, threads=2, flash_attention=not chosen) as model:  # (asked: no probe)
            assert model.flash_attention is (not chosen)
