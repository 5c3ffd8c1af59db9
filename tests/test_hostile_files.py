"""Files a caller hands the library that are broken or hostile: a model whose metadata makes its
logits NaN, images past the pixel bound, session files that claim more than they hold, model
and projector files whose metadata llama.cpp asserts on (an abort of the whole process)."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import internals
import pytest
from test_defects import run_python
from test_hostile import forge, saved_header

from llmsession import GenerationOptions, Model, ModelOutputError, SessionFileError
from llmsession.engine import sessionfile
from llmsession.engine.sessionread import read
from llmsession.runtime import persistence


def edited(source: Path, target: Path, key: str, value: float | int) -> Path:
    """A copy of ``source`` with one number of its metadata changed in place (found by its key,
    which precedes the vocabulary: ``gguf``'s reader parses all of it, a second a file)."""
    shutil.copyfile(source, target)
    with target.open("r+b") as f:
        head = f.read(1 << 20)
        named = struct.pack("<Q", len(key)) + key.encode()
        at = head.find(named) + len(named)
        assert at >= len(named), key
        (kind,) = struct.unpack_from("<I", head, at)
        form = {4: "<I", 5: "<i", 6: "<f", 10: "<Q"}[kind]
        f.seek(at + 4)
        f.write(struct.pack(form, value))
    return target


def test_logits_that_are_not_finite_are_a_model_output_error(smollm2_path: Path, tmp_path: Path) -> None:
    """A model whose rope base is NaN computes NaN logits: its greedy pick was the first NaN's
    token (an end of turn), a silently empty reply that ``stop``ped; sampled, dots. A sample from
    logits that are not finite is a ``ModelOutputError`` (the server's 500
    ``model_output_invalid``), as a NaN embedding is."""
    broken = edited(smollm2_path, tmp_path / "nan.gguf", "llama.rope.freq_base", float("nan"))
    with Model(broken, kv_tokens=512, max_live_sessions=1, threads=1, anticipate=False) as model:
        for options in (
            GenerationOptions(max_tokens=4, temperature=0),
            GenerationOptions(max_tokens=4, temperature=0, logprobs=2),
            GenerationOptions(max_tokens=4, temperature=0.8, seed=1),
        ):
            with pytest.raises(ModelOutputError, match="not finite"):
                model.chat([{"role": "user", "content": "Hi"}], options)
        session = model.session()
        with pytest.raises(ModelOutputError):
            session.respond("Hi", GenerationOptions(max_tokens=4, temperature=0))
    with Model(smollm2_path, kv_tokens=512, max_live_sessions=1, threads=1, anticipate=False) as model:
        assert model.chat(
            [{"role": "user", "content": "Hi"}], GenerationOptions(max_tokens=4, temperature=0)
        ).text


def test_an_image_past_the_pixel_bound_is_refused_from_its_header() -> None:
    """A 12,000 × 12,000 PNG of one colour is a few hundred kilobytes and 432 MB of pixels (2 GB
    at its peak, decoded): the library decoded it (the server refused it, by its header). Now
    an encoded or PIL image past ``Image.MAX_PIXELS`` is an ``ImageError`` before any decode;
    one at the bound is read."""
    import io

    import PIL.Image

    from llmsession import Image, ImageError

    side = 4096
    for width, height, refused in ((side, side + 1, True), (side, side, False)):
        data = io.BytesIO()
        PIL.Image.new("RGB", (width, height), (200, 10, 10)).save(data, format="PNG")
        assert len(data.getvalue()) < 1 << 20
        if refused:
            with pytest.raises(ImageError, match="at most"):
                Image(data.getvalue())
            with pytest.raises(ImageError, match="at most"):
                Image(PIL.Image.open(io.BytesIO(data.getvalue())))
        else:
            assert Image(data.getvalue()).width == side
    assert side * side == Image.MAX_PIXELS  # (as the server bounds a request's images)


def test_a_constraint_past_the_matchers_limits_is_the_requests_fault(smollm2: Model) -> None:
    """A regex or schema llguidance takes, but outgrows its limits as it is followed (a
    repetition of a million, a schema that only recurses), failed as a ``ReplyMismatchError``:
    a reply that failed a valid constraint, the server's 500 "the request was fine". It is a
    ``GrammarError`` (a 400): sent again it fails again."""
    from llmsession import GrammarError, ReplyMismatchError

    recursing = {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}
    for constraint in ({"regex": "a{1000000}"}, {"json_schema": recursing}):
        options = GenerationOptions(max_tokens=4, temperature=0, **constraint)  # type: ignore[arg-type]
        with pytest.raises(GrammarError, match=r"(?i)too many") as raised:
            smollm2.chat([{"role": "user", "content": "Hi"}], options)
        assert not isinstance(raised.value, ReplyMismatchError), raised.value
    from llmsession.native.constraints import LIMITS  # (a refused token is quoted: not a limit)

    assert not LIMITS.search('token " limit exceeded fuel" doesn\'t satisfy the grammar; byte 32')


MODEL_EDITS = [
    ("llama.block_count", 1000, "1 to 512 layers"),
    ("llama.block_count", 0, "1 to 512 layers"),
    ("llama.attention.layer_norm_rms_epsilon", -1.0, "epsilon"),
    ("llama.attention.layer_norm_rms_epsilon", float("nan"), "epsilon"),
]
PROJECTOR_EDITS = [
    ("clip.vision.attention.head_count", 3, "does not divide"),
    ("clip.vision.attention.head_count", 0, "does not divide"),
    ("clip.vision.image_size", 8, "smaller than one patch"),
    ("clip.vision.image_size", 0, "smaller than one patch"),
    ("clip.vision.attention.layer_norm_epsilon", -1.0, "epsilon"),
    ("clip.vision.patch_size", 3, "patch embedding's 16x16"),
    ("clip.vision.image_size", 48, "past its 5"),
    ("clip.vision.embedding_length", 64, "not its patch embedding's 32"),
]


def test_metadata_llama_cpp_aborts_on_is_a_model_load_error(
    smollm2_path: Path, fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """One edited number in a model's or a projector's metadata aborted the whole process
    (``GGML_ASSERT``: a layer count past llama.cpp's 512 or 0 as it loads, a negative epsilon at
    the first decode, a projector's head count that does not divide its width, an image smaller
    than a patch, a patch size not its convolution's, more patches than positions): a broken
    file in a served folder took the server down. Each is a
    ``ModelLoadError`` naming the value, before llama.cpp reads the file (in a child process,
    so that a regression fails this test, not the run); the files as they are still load."""
    cases = [(smollm2_path, None, *edit) for edit in MODEL_EDITS]
    cases += [(smollm2_path, fixture_path("mmproj-tiny.gguf"), *edit) for edit in PROJECTOR_EDITS]
    loads = []
    for i, (model, projector, key, value, said) in enumerate(cases):
        source = model if projector is None else projector
        broken = edited(source, tmp_path / f"{i}.gguf", key, value)
        paths = (broken, None) if projector is None else (model, broken)
        loads.append((str(paths[0]), None if paths[1] is None else str(paths[1]), said))
    loads.append((str(smollm2_path), str(fixture_path("mmproj-tiny.gguf")), None))
    ran = run_python(
        f"""
        from llmsession import Model, ModelLoadError
        for model, projector, said in {loads!r}:
            try:
                Model(model, mmproj_path=projector, kv_tokens=512, max_live_sessions=1, threads=1).close()
                print("loaded", said)
            except ModelLoadError as error:
                print("refused", said, "|", error)
        """,
        timeout=120,
    )
    lines = ran.stdout.splitlines()
    assert ran.returncode == 0 and len(lines) == len(loads), (ran.returncode, ran.stdout, ran.stderr[-2000:])
    for line, (_, _, said) in zip(lines, loads, strict=True):
        if said is None:
            assert line.startswith("loaded"), line
        else:
            assert line.startswith(f"refused {said} |") and said in line.split("|", 1)[1], line


def test_the_metadata_reader_never_fails_on_what_it_cannot_follow(smollm2_path: Path, tmp_path: Path) -> None:
    """Pure: a file cut anywhere in its metadata, or with a length or type changed to nonsense,
    is None (left to llama.cpp, which refuses it itself), never an exception of the reader's;
    the whole file's values are read (its vocabulary skipped)."""
    from llmsession.native.metadata import metadata

    whole = metadata(smollm2_path)
    assert whole is not None and whole["llama.block_count"] == 30 and whole["general.architecture"] == "llama"
    head = smollm2_path.read_bytes()[: 2 << 20]
    cut = tmp_path / "cut.gguf"
    for size in (0, 3, 4, 8, 23, 24, 40, 100, 1000, 5000, 100_000, 1 << 20):
        cut.write_bytes(head[:size])
        assert metadata(cut) is None, size
    for at, junk in ((16, b"\xff" * 8), (24, b"\xff" * 8), (40, b"\xff" * 4), (60, b"\x00" * 16)):
        cut.write_bytes(head[:at] + junk + head[at + len(junk) :])
        assert metadata(cut) is None or isinstance(metadata(cut), dict), at


@pytest.mark.parametrize(
    ("fields", "refused"),
    [
        ({"expert_count": 2000, "expert_used_count": 2}, True),  # (past LLAMA_MAX_EXPERTS)
        ({"expert_count": 8, "expert_used_count": 0}, True),
        ({"expert_count": 8, "expert_used_count": 9}, True),
        ({"expert_count": 0, "expert_used_count": 2}, True),
        ({"expert_count": 8, "expert_used_count": 2, "expert_group_count": 8}, True),
        (
            {
                "expert_count": 8,
                "expert_used_count": 2,
                "expert_group_count": 3,
                "expert_group_used_count": 1,
            },
            True,
        ),
        ({"expert_count": 8, "expert_used_count": 2, "expert_group_count": 4}, True),  # (none used)
        ({"nextn_predict_layers": 5}, True),
        ({"expert_count": 8, "expert_used_count": 2}, False),
        (
            {
                "expert_count": 8,
                "expert_used_count": 2,
                "expert_group_count": 4,
                "expert_group_used_count": 2,
            },
            False,
        ),
        ({"expert_count": 8, "expert_used_count": ()}, False),  # (an array per layer: llama.cpp's)
        ({"nextn_predict_layers": 1}, False),
        ({}, False),
    ],
)
def test_expert_counts_llama_cpp_asserts_on_are_refused(fields: dict[str, Any], refused: bool) -> None:
    """Pure: what ``llama_model::load_hparams`` asserts of a model's experts and next-token
    layers (each an abort of the process), on a model of 4 layers."""
    from llmsession.native.metadata import _model_problem

    values = {"general.architecture": "x", "x.block_count": 4, **{f"x.{k}": v for k, v in fields.items()}}
    assert (_model_problem(values) is not None) is refused, _model_problem(values)
    hunyuan = {
        "general.architecture": "hunyuan_vl",
        "hunyuan_vl.block_count": 4,
        "hunyuan_vl.expert_count": 1,
    }
    assert _model_problem({**hunyuan, "hunyuan_vl.expert_used_count": 1}) is None  # (read as none)


def test_a_projector_without_a_vision_transformer_is_left_to_llama_cpp() -> None:
    """Pure: the head, patch and position checks are a vision transformer's (its graph reshapes
    by them); a projector of another encoder (a ConvNeXt, a MobileNet: no attention heads) whose
    converter writes other values is not refused for them."""
    from llmsession.native.metadata import _projector_problem

    odd = {"clip.vision.attention.head_count": 0, "clip.vision.embedding_length": 32}
    odd |= {
        "clip.vision.image_size": 8,
        "clip.vision.patch_size": 16,
        "tensor v.patch_embd.weight": (4, 4, 3, 96),
    }
    assert _projector_problem(odd) is None
    vit = {**odd, "tensor v.blk.0.attn_q.weight": (32, 32)}
    assert _projector_problem(vit) is not None
    fine = {**vit, "clip.vision.attention.head_count": 3, "clip.vision.attention.head_dim": 8}
    fine |= {"clip.vision.image_size": 0, "clip.projector_type": "qwen2vl_merger"}  # (0: dynamic)
    assert _projector_problem(fine) is None, _projector_problem(fine)  # (as clip.cpp takes them)
    assert _projector_problem({**fine, "clip.projector_type": "mlp"}) is not None  # (fixed: 0 aborts)


def holes(path: Path, header: dict[str, Any], tail: int) -> Path:
    """A session file of ``header`` and then ``tail`` bytes it does not hold (a sparse file: a
    few KiB on disk whatever its blob table says; its checksum is zeros)."""
    head = json.dumps(header).encode()
    with path.open("wb") as f:
        f.write(sessionfile.MAGIC + struct.pack("<Q", len(head)) + head)
        f.truncate(len(sessionfile.MAGIC) + 8 + len(head) + tail)
    return path


def peak_while(call: Callable[[], object]) -> tuple[int, float, BaseException | None]:
    """The most memory Python held above its level before ``call``, its time, what it raised."""
    tracemalloc.start()
    began, raised = time.monotonic(), None
    try:
        call()
    except BaseException as error:  # (returned for the test's own check)
        raised = error
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak, time.monotonic() - began, raised


def test_a_session_files_sizes_cost_memory_only_as_far_as_they_can_be_true(
    smollm2: Model, tmp_path: Path
) -> None:
    """A file's sizes are its word: a sparse file of 4 KiB whose table said its state had 3 GiB
    was read whole, into 3 GiB of memory, before its checksum refused it. The header comes first
    now: a state larger than this model's cells could write is refused unread, another model's
    state is read through in chunks and never held, an image's blob must be its table's pixels,
    and what a file holds must fit in the memory the caller says is free."""
    header, state = saved_header(smollm2, tmp_path)
    size = len(sessionfile.MAGIC) + 8 + len(json.dumps(header)) + len(state)  # (and its checksum)
    huge = {**header, "blobs": [{"name": "state", "size": 3 << 30, "sha256": "0" * 64}]}
    sparse = holes(tmp_path / "sparse.llms", huge, (3 << 30) + 32)
    peak, took, raised = peak_while(lambda: smollm2.load_session(sparse))
    assert isinstance(raised, SessionFileError) and "cells hold" in str(raised), raised
    assert peak < 32 << 20 and took < 2, (peak, took)

    foreign = {**huge, "compat": {**header["compat"], "model_sha256": "0" * 64}}
    sparse = holes(
        tmp_path / "foreign.llms",
        {**foreign, "blobs": [{**huge["blobs"][0], "size": 1 << 30}]},
        (1 << 30) + 32,
    )
    peak, took, raised = peak_while(lambda: smollm2.load_session(sparse))
    assert isinstance(raised, SessionFileError) and "'state' is corrupt" in str(raised), raised
    assert peak < 32 << 20, peak  # (read through, 1 GiB of it, a chunk at a time)

    real = forge(tmp_path / "other.llms", {**header, "compat": foreign["compat"]}, (state,))
    saved, _ = persistence.read_saved(internals.local(smollm2), real)
    assert "state" not in saved.blobs and "another model" in saved.dropped["state"], saved.dropped
    reply = smollm2.load_session(real).respond("And?", GenerationOptions(max_tokens=2, temperature=0))
    assert reply.usage.restored_tokens == 0 and "model_sha256 differs" in reply.usage.cache_note, reply.usage
    assert persistence.read_saved(internals.local(smollm2), forge(tmp_path / "own.llms", header, (state,)))[
        0
    ].blobs

    image = {"name": "image:ab", "size": 12, "sha256": hashlib.sha256(bytes(12)).hexdigest()}
    for table, blob in (({"ab": [2, 2]}, bytes(12)), ({"ab": [2, 3]}, bytes(12)), ({}, bytes(12))):
        path = forge(tmp_path / "image.llms", {**header, "images": table, "blobs": [image]}, (blob,))
        if table == {"ab": [2, 2]}:
            assert read(path).images == {"ab": (2, 2)}
        else:
            with pytest.raises(SessionFileError, match="not an image of the file's image table"):
                read(path)
    big = {**header, "images": {"ab": [5000, 5000]}, "blobs": [{**image, "size": 75_000_000}]}
    began = time.monotonic()
    with pytest.raises(SessionFileError, match="bytes of memory, and 1,048,576 are free"):  # (unread)
        read(holes(tmp_path / "big.llms", big, 75_000_032), max_bytes=1 << 20)
    assert time.monotonic() - began < 1
    own = forge(tmp_path / "own.llms", header, (state,))
    without = read(own, max_bytes=size - 1)  # (room for all but the state: the transcript loads)
    assert "state" not in without.blobs and "no memory was free" in without.dropped["state"]
    assert without.messages == header["messages"]
    with pytest.raises(
        SessionFileError, match=f"takes {size - len(state):,} bytes of memory, and 10 are free"
    ):
        read(own, max_bytes=10)
