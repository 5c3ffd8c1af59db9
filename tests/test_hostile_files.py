"""Files a caller hands the library that are broken or hostile: a model whose metadata makes its
logits NaN, images past the pixel bound, session files that claim more than they hold, model
and projector files whose metadata llama.cpp asserts on (an abort of the whole process)."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import pytest

from llmsession import GenerationOptions, Model, ModelOutputError


def edited(source: Path, target: Path, key: str, value: float | int) -> Path:
    """A copy of ``source`` with one number of its metadata changed in place."""
    shutil.copyfile(source, target)
    reader = gguf.GGUFReader(target, "r+")
    field = reader.fields[key]
    field.parts[field.data[0]][0] = value
    del reader  # (its memory map written back)
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
