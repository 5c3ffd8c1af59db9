"""A sequence's saved state is checked before llama.cpp reads it (``native.stateblob``): its
loaders abort the process on some malformed input, and a session file's state can be rewritten
and its checksums recomputed by anyone. Real states of each kind of memory pass the check and
load as before; a crafted one leaves the loaded session cold, and the process lives."""

from __future__ import annotations

import dataclasses
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import internals
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmsession import GenerationOptions, Model, Reply
from llmsession.engine.sessionfile import write
from llmsession.engine.sessionread import read
from llmsession.native.stateblob import StateLayout, refusal

GREEDY = GenerationOptions(max_tokens=8, temperature=0)
FIRST, SECOND = "Name three colours.", "And three animals?"
REPO = Path(__file__).resolve().parents[1]
# Each kind of memory: a plain KV cache (V transposed, and not: f16 and q8_0 cells), an iSWA one,
# a recurrent one and a hybrid one.
KINDS = ("smollm2", "smollm2-flash-q8", "gemma3", "mamba-tiny.gguf", "lfm2-tiny.gguf")


@contextmanager
def opened(kind: str, request: pytest.FixtureRequest) -> Iterator[Model]:
    """The model of ``kind``, loaded for these tests: one thread (two would spin at each graph
    node's barrier for a core another process holds), a small context."""
    settings: dict[str, Any] = {"threads": 1, "kv_tokens": 2048}
    if kind.endswith(".gguf"):
        path = request.getfixturevalue("fixture_path")(kind)
    else:
        path = request.getfixturevalue(f"{kind.split('-')[0]}_path")
        settings |= {"flash_attention": kind == "smollm2-flash-q8"}
        settings |= {"kv_type": "q8_0"} if kind == "smollm2-flash-q8" else {}
    with Model(path, **settings) as model:
        yield model


@dataclasses.dataclass(frozen=True, repr=False)
class Saved:
    """A real state of a session after one reply, what it was checked against, and the replies
    to the next question of the session that saved it and of the session loaded from it."""

    blob: bytes
    checkpoint: bytes  # the partial state (``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``) of the same
    layout: StateLayout
    positions: int
    control: str
    loaded: Reply


def saved_state(model: Model, path: Path) -> Saved:
    """Answer FIRST in a new session, save it to ``path``, answer SECOND in it and in a session
    loaded from ``path``."""
    session = model.session(context_size=512)
    session.respond(FIRST, GREEDY)
    session.save(path)
    context = internals.live_context(session)
    assert context is not None and context.state_layout is not None
    _, seq = internals.placement(session)
    checkpoint = bytes(context.state_get(seq, partial=True))
    saved = read(path)
    control = session.respond(SECOND, GREEDY).text
    loaded = model.load_session(path).respond(SECOND, GREEDY)
    return Saved(
        bytes(saved.blobs["state"]), checkpoint, context.state_layout, len(saved.record), control, loaded
    )


@pytest.fixture(scope="module")
def states(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Saved]:
    """Each kind's saved state (a model loaded once for all the tests of each kind)."""
    found = {}
    for kind in KINDS:
        with opened(kind, request) as model:
            found[kind] = saved_state(model, tmp_path_factory.mktemp("states") / "saved.llmsession")
    return found


@pytest.mark.parametrize("kind", KINDS)
def test_a_real_state_passes_and_loads_as_before(kind: str, states: dict[str, Saved]) -> None:
    state = states[kind]
    assert refusal(state.blob, state.layout, state.positions) is None
    assert refusal(state.blob, state.layout) is None  # (positions as the state says)
    assert refusal(state.checkpoint, state.layout.partial()) is None
    assert state.loaded.usage.restored_tokens == state.positions, state.loaded.usage.cache_note
    assert state.loaded.text == state.control


CRAFTED = """
    import sys
    from llmsession import GenerationOptions, Model
    with Model(sys.argv[1], threads=1) as model:
        reply = model.load_session(sys.argv[2]).respond("Hi", GenerationOptions(max_tokens=2, temperature=0))
        print(reply.usage.restored_tokens, reply.usage.cache_note)
"""


def test_a_crafted_recurrent_state_leaves_the_session_cold(fixture_path: Any, tmp_path: Path) -> None:
    """The tester's file: an empty Mamba session's file given a record of two tokens and a state
    of two recurrent cells (llama.cpp asserted on it: the process aborted), checksums recomputed.
    Loaded in a subprocess, so that a regression fails this test instead of killing pytest."""
    model_path = fixture_path("mamba-tiny.gguf")
    plain, crafted = tmp_path / "plain.llmsession", tmp_path / "crafted.llmsession"
    with Model(model_path, threads=1) as model:
        model.session().save(plain)
    cells = struct.pack("<I", 2) + struct.pack("<iIiI", 0, 0, 1, 0)  # (pos, n_seq_id 0) each
    blob = struct.pack("<Ii", 0xAF143CD8, 0) + cells
    write(crafted, dataclasses.replace(read(plain), record=[1, 2], blobs={"state": blob}))
    command = [sys.executable, "-c", textwrap.dedent(CRAFTED), str(model_path), str(crafted)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    restored, note = result.stdout.strip().splitlines()[-1].split(" ", 1)
    assert restored == "0" and "cache not reused" in note


def meta_fields(
    blob: bytes, layout: StateLayout, regions: list[tuple[int, int, int]] | None = None
) -> list[tuple[int, str]]:
    """Where each field of ``blob`` that is not tensor data is, and its struct format: an
    independent walk of the format (``stateblob``'s docstring), for the mutations below.
    ``regions`` gets each run of tensor data: (where, bytes, ggml type)."""
    fields: list[tuple[int, str]] = []
    at = 0
    found = [] if regions is None else regions

    def take(code: str) -> int:
        nonlocal at
        fields.append((at, code))
        value: int = struct.unpack_from("<" + code, blob, at)[0]
        at += struct.calcsize(code)
        return value

    take("I"), take("i")
    for part in layout.parts:
        if part.kind == "recurrent":
            count = take("I")
            for _ in range(count):
                take("i"), take("I")
            take("I"), take("I")
            while at < len(blob):
                ggml = take("i")
                size = take("Q") * count
                found.append((at, size, ggml))
                at += size
            continue
        for _ in range(take("I")):
            count = take("I")
            if not count:
                continue
            for _ in range(count):
                take("i"), take("I")
                at += 12 if part.cell_ext else 0
                take("i")
            v_trans, n_layer = take("I"), take("I")
            for _ in range(n_layer):
                ggml = take("i")
                size = take("Q") * count
                found.append((at, size, ggml))
                at += size
            for _ in range(n_layer if part.values else 0):
                ggml = take("i")
                size = (take("I") * take("I") if v_trans else take("Q")) * count
                found.append((at, size, ggml))
                at += size
    assert at == len(blob)
    return fields


WIDTHS = {"I": (0, 2**32 - 1), "i": (-(2**31), 2**31 - 1), "Q": (0, 2**64 - 1)}
BLOCKS = {0: (4, "<f"), 1: (2, "<e"), 2: (18, "<e"), 8: (34, "<e")}  # bytes a value or block, its float
# (a quantized block's first bytes are its f16 scale: what a NaN or infinity would sit in)


@pytest.mark.parametrize("kind", KINDS)
def test_a_value_that_is_not_finite_is_refused_where_values_are_checked(
    kind: str, states: dict[str, Saved]
) -> None:
    """A NaN or an infinity planted among the K, V or recurrent values (a file rewritten and
    re-hashed: the structure stays whole) passes the structural walk but not the value check a
    file's state gets, in the first, a middle and the last run of values."""
    state = states[kind]
    assert refusal(state.blob, state.layout, values=True) is None
    assert refusal(state.checkpoint, state.layout.partial(), values=True) is None
    regions: list[tuple[int, int, int]] = []
    meta_fields(state.blob, state.layout, regions)
    regions = [region for region in regions if region[1]]  # (a layer may hold no state: LFM2's)
    for start, size, ggml in (regions[0], regions[len(regions) // 2], regions[-1]):
        block, code = BLOCKS[ggml]
        for bad in (float("nan"), float("inf"), float("-inf")):
            blob = bytearray(state.blob)
            struct.pack_into(code, blob, start + (size // 2) // block * block, bad)
            assert refusal(bytes(blob), state.layout) is None, "only its values are wrong"
            why = refusal(bytes(blob), state.layout, values=True)
            assert why is not None and "not finite" in why, (kind, ggml, bad, why)


def test_a_session_file_with_a_value_that_is_not_finite_loads_cold(
    smollm2_path: Path, tmp_path: Path
) -> None:
    """Loaded unchecked, such a state made every later reply garbage (greedy: an empty reply,
    sampled: dots); checked, the session starts cold and decodes its transcript again."""
    path, planted = tmp_path / "saved.llmsession", tmp_path / "planted.llmsession"
    with Model(smollm2_path, threads=1, kv_tokens=2048) as model:
        session = model.session(context_size=512)
        session.respond(FIRST, GREEDY)
        session.save(path)
        layout = internals.live_context(session).state_layout  # type: ignore[union-attr]
        assert layout is not None
        session.close()  # (its cells would be shared with the loaded one)
        saved = read(path)
        blob, regions = bytearray(saved.blobs["state"]), list[tuple[int, int, int]]()
        meta_fields(bytes(blob), layout, regions)
        start, size, _ = regions[0]
        blob[start : start + size] = b"\xff\xff" * (size // 2)  # (f16 NaNs: layer 0's keys)
        write(planted, dataclasses.replace(saved, blobs={**saved.blobs, "state": bytes(blob)}))
        reply = model.load_session(planted).respond(SECOND, GREEDY)
        assert reply.usage.restored_tokens == 0 and "cache not reused" in reply.usage.cache_note
        assert reply.usage.decoded_prompt_tokens == reply.usage.prompt_tokens
        assert reply.text.strip(), "a cold session answers as a fresh one does"


def test_a_file_state_of_a_layout_that_cannot_be_checked_loads_cold(
    smollm2_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where ``stateblob`` cannot walk a context's states (an ``UNCHECKED`` architecture's, or
    an empty state it could not read) a file's state is not handed to llama.cpp, whose loaders
    abort on some crafted ones: the session loads cold. A state this process wrote (parked,
    ``values`` False) still loads as it did."""
    path = tmp_path / "saved.llmsession"
    with Model(smollm2_path, threads=1, kv_tokens=2048) as model:
        session = model.session(context_size=512)
        session.respond(FIRST, GREEDY)
        session.save(path)
        context = internals.live_context(session)
        assert context is not None
        session.close()
        monkeypatch.setattr(context, "state_layout", None)
        loaded = model.load_session(path)
        reply = loaded.respond(SECOND, GREEDY)
        assert reply.usage.restored_tokens == 0 and "cache not reused" in reply.usage.cache_note, reply.usage
        assert internals.live_context(loaded) is context
        _, seq = internals.placement(loaded)
        blob = bytes(context.state_get(seq))
        assert context.state_set(blob, seq) and context.pos_max(seq) >= 0  # (its own: unchecked)
        assert not context.state_set(blob, seq, values=True)  # (a file's: refused, the sequence emptied)


def refused_quickly(blob: bytes, state: Saved) -> str | None:
    start = time.monotonic()
    why = refusal(blob, state.layout, state.positions)
    assert time.monotonic() - start < 1, "refusal took over a second"
    return why


def test_a_real_state_is_accepted_unchanged(states: dict[str, Saved]) -> None:
    """The property below's control: the same check passes each blob it mutates."""
    for kind, state in states.items():
        assert refused_quickly(state.blob, state) is None, kind
        assert len(meta_fields(state.blob, state.layout)) > 3, kind


@settings(
    max_examples=1000,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data(), kind=st.sampled_from(KINDS))
def test_a_mutated_state_is_refused(states: dict[str, Saved], data: st.DataObject, kind: str) -> None:
    """Any meta field changed (a count, position, n_seq_id, type, row size, layer count...), the
    blob cut short or given trailing bytes: ``refusal`` says why, without raising, at once."""
    state = states[kind]
    blob = bytearray(state.blob)
    how = data.draw(st.sampled_from(("field", "field", "field", "cut", "trailing")))
    if how == "cut":
        blob = blob[: data.draw(st.integers(0, len(blob) - 1))]
    elif how == "trailing":
        blob += data.draw(st.binary(min_size=1, max_size=64))
    else:
        # (the header's sequence id left out: a state of any sequence may be loaded)
        fields = [field for i, field in enumerate(meta_fields(state.blob, state.layout)) if i != 1]
        at, code = data.draw(st.sampled_from(fields))
        (old,) = struct.unpack_from("<" + code, blob, at)
        low, high = WIDTHS[code]
        tricky = st.sampled_from([low, high, 0, 1, 2, old - 1, old + 1, old * 2, high // 2])
        new = data.draw(
            st.one_of(tricky, st.integers(low, high)).filter(lambda v: low <= v <= high and v != old)
        )
        struct.pack_into("<" + code, blob, at, new)
    assert refused_quickly(bytes(blob), state) is not None


def test_a_sliding_window_state_past_its_window_loads_cold(
    gemma3_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Restoring a Gemma 3 state longer than its window is wrong in the pinned llama.cpp
    (#25295): ``save`` writes none (``Lease.parkable``), but a file that holds one (another
    writer's, or an edited one) was restored, and the session answered unlike a fresh one."""
    from llmsession.engine.lease import Lease

    path = tmp_path / "long.llmsession"
    with Model(gemma3_path, threads=2, kv_tokens=2048, max_live_sessions=1, anticipate=False) as model:
        n_swa = internals.local(model).native.n_swa
        session = model.session(context_size=1024)
        long = " ".join(["The lighthouse keeper counted the ships that passed the harbour."] * 50)
        session.respond(long, GenerationOptions(max_tokens=1, temperature=0))
        assert len(internals.record(session)) > n_swa > 0
        with monkeypatch.context() as patched:  # (a writer that does not refuse it)
            patched.setattr(Lease, "parkable", property(lambda lease: True))
            session.save(path)
        session.close()
        reply = model.load_session(path).respond("And then?", GenerationOptions(max_tokens=1))
    assert reply.usage.restored_tokens == 0 and "25295" in reply.usage.cache_note, reply.usage
