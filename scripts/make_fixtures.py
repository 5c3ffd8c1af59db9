"""Write the tiny, deterministic test fixtures into the llmsession cache.

Real small models cannot cover every code path (recurrent memory, vision, foreign chat
templates), so we synthesise the missing ones: random weights, SmolLM2's tokenizer.

    python scripts/make_fixtures.py [--llama-src PATH] [--force]

Needs ``scripts/fetch_models.py`` to have run first (the SmolLM2 GGUF is the source of
the tokenizer and of the template copies) and ``pip install gguf pillow``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fixture_models import (
    SEED,
    add_tensors,
    build_bert,
    build_lfm2,
    build_mamba,
    build_t5,
    copy_fields,
    normal,
    ones,
    write_gguf,
)

from llmsession.commands import paths

# Bump when any fixture changes so that old caches are rebuilt.
FIXTURE_VERSION = "6"  # 2: Gemma 4 adds BOS; 3: Mamba varied, LFM2, T5; 4: tool templates; 5: special markers
# 6: BERT embedding model
STAMP_FILE = ".fixtures-version"
GEMMA4_TEMPLATE = "models/templates/google-gemma-4-31B-it.jinja"
QWEN3_TEMPLATE = "models/templates/Qwen-Qwen3-0.6B.jinja"
GPT_OSS_TEMPLATE = "models/templates/openai-gpt-oss-120b.jinja"
TOOL_TEMPLATES = {  # each family's real template, for tool calling in its own format
    "smollm2-qwen25-template.gguf": "models/templates/Qwen-Qwen2.5-7B-Instruct.jinja",
    "smollm2-llama31-template.gguf": "models/templates/meta-llama-Llama-3.1-8B-Instruct.jinja",
    "smollm2-mistral-template.gguf": "models/templates/mistralai-Mistral-Nemo-Instruct-2407.jinja",
}
USER_DEFINED, CONTROL = 4, 3  # llama.cpp's token types: user-defined ones print as text, control ones do not
SPECIAL_MARKERS = {  # the family's markers as the real vocabulary holds them: one token each
    "smollm2-qwen25-special.gguf": (  # Qwen 2.5's added tokens are user-defined
        TOOL_TEMPLATES["smollm2-qwen25-template.gguf"],
        dict.fromkeys(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"], USER_DEFINED),
    ),
    "smollm2-qwen3-special.gguf": (  # Qwen3's too, its reasoning markers among them
        QWEN3_TEMPLATE,
        dict.fromkeys(
            ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
            USER_DEFINED,
        ),
    ),
    "smollm2-gpt-oss-special.gguf": (  # gpt-oss's: llama.cpp prints four of them (user-defined)
        GPT_OSS_TEMPLATE,
        {
            **dict.fromkeys(["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"], USER_DEFINED),
            **dict.fromkeys(["<|end|>", "<|return|>", "<|call|>"], CONTROL),
        },
    ),
    "smollm2-mistral-special.gguf": (  # Mistral's markers are control tokens
        TOOL_TEMPLATES["smollm2-mistral-template.gguf"],
        dict.fromkeys(
            [
                "[INST]",
                "[/INST]",
                "[TOOL_CALLS]",
                "[AVAILABLE_TOOLS]",
                "[/AVAILABLE_TOOLS]",
                "[TOOL_RESULTS]",
                "[/TOOL_RESULTS]",
            ],
            CONTROL,
        ),
    ),
    "smollm2-gemma4-special.gguf": (
        GEMMA4_TEMPLATE,
        dict.fromkeys(
            [
                "<|turn>",
                "<turn|>",
                "<|tool>",
                "<tool|>",
                "<|tool_call>",
                "<tool_call|>",
                '<|"|>',
                "<|tool_response>",
                "<tool_response|>",
                "<|channel>",
                "<channel|>",
                "<|think|>",
            ],
            CONTROL,
        ),
    ),
}
EMPTY_THOUGHT_EMISSION = "{{- '<|channel>thought\\n<channel|>' -}}"
FIRST_SPARE = 3  # SmolLM2's control tokens 3-16 (<repo_name> ... <empty_output>) are renamed
# Matches none of llama_chat_detect_template's heuristics and has no Gemma 4 syntax.
UNKNOWN_TEMPLATE = (
    "{% for m in messages %}{{ '<<' + m.role | upper + '>> ' + m.content + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<<ASSISTANT>> ' }}{% endif %}"
)

_START = time.monotonic()


class FixtureError(Exception):
    """A failure worth one clear line to the user, not a traceback."""


def log(msg: str) -> None:
    print(f"[{time.monotonic() - _START:6.1f}s] {msg}", flush=True)


class Sources:
    """Inputs shared by the builders; the SmolLM2 GGUF is parsed once, only if needed."""

    def __init__(self, smollm2: Path, llama_src: Path) -> None:
        self.smollm2 = smollm2
        self.llama_src = llama_src

    @cached_property
    def reader(self) -> gguf.GGUFReader:
        if not self.smollm2.is_file():
            raise FixtureError(f"{self.smollm2} is missing; run `python scripts/fetch_models.py` first")
        log(f"reading {self.smollm2.name}")
        return gguf.GGUFReader(self.smollm2)

    def field(self, key: str) -> Any:
        return self.reader.fields[key].contents()


def build_mmproj(out: Path, src: Sources) -> None:
    """A LLaVA-style ``mlp`` projector that libmtmd accepts next to SmolLM2.

    32x32 image, 16px patches: 4 image tokens. Names and keys from ``clip-impl.h``,
    layout from ``clip.cpp`` (``load_tensors``) and ``models/llava.cpp``.
    """
    width, n_block, n_head, n_ff, image, patch = 32, 2, 2, 64, 32, 16
    n_text = int(src.field("llama.embedding_length"))  # mm.2 must project to this
    n_pos = (image // patch) ** 2 + 1  # + class embedding
    rng = np.random.default_rng(SEED + 1)

    writer = gguf.GGUFWriter(out, "clip")
    writer.add_name("mmproj-tiny (random weights, llmsession test fixture)")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", "mlp")
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.embedding_length", width)
    writer.add_uint32("clip.vision.feed_forward_length", n_ff)
    writer.add_uint32("clip.vision.block_count", n_block)
    writer.add_uint32("clip.vision.projection_dim", n_text)
    writer.add_uint32("clip.vision.attention.head_count", n_head)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    writer.add_uint32("clip.vision.image_size", image)
    writer.add_uint32("clip.vision.patch_size", patch)
    writer.add_array("clip.vision.image_mean", [0.48145466, 0.4578275, 0.40821073])  # CLIP's
    writer.add_array("clip.vision.image_std", [0.26862954, 0.26130258, 0.27577711])

    def norm_pair(prefix: str, n: int) -> dict[str, np.ndarray]:
        return {
            prefix + ".weight": ones(n),
            prefix + ".bias": np.zeros(n, dtype=np.float32),
        }

    tensors = {
        "v.patch_embd.weight": normal(rng, width, 3, patch, patch),
        "v.class_embd": normal(rng, width),
        "v.position_embd.weight": normal(rng, n_pos, width),
        **norm_pair("v.pre_ln", width),
    }
    for i in range(n_block):
        p = f"v.blk.{i}."
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            tensors[p + name + ".weight"] = normal(rng, width, width)
            tensors[p + name + ".bias"] = normal(rng, width)
        tensors |= norm_pair(p + "ln1", width) | norm_pair(p + "ln2", width)
        tensors |= {
            p + "ffn_up.weight": normal(rng, n_ff, width),
            p + "ffn_up.bias": normal(rng, n_ff),
            p + "ffn_down.weight": normal(rng, width, n_ff),
            p + "ffn_down.bias": normal(rng, width),
        }
    tensors |= {
        "mm.0.weight": normal(rng, n_text, width),
        "mm.0.bias": normal(rng, n_text),
        "mm.2.weight": normal(rng, n_text, n_text),
        "mm.2.bias": normal(rng, n_text),
    }
    add_tensors(writer, tensors)
    write_gguf(writer)


def copy_with_template(
    out: Path, src: Sources, template: str, *, add_bos: bool = False, markers: dict[str, int] | None = None
) -> None:
    """SmolLM2 byte-for-byte in tensors and metadata, except ``tokenizer.chat_template`` (and
    ``add_bos_token``, which Gemma models set: it makes the one-BOS rule testable); ``markers``
    rename spare control tokens, with the given types, so a family's markers are one token each."""
    reader = src.reader
    writer = gguf.GGUFWriter(out, str(src.field(gguf.Keys.General.ARCHITECTURE)))
    overrides: dict[str, Any] = {
        gguf.Keys.Tokenizer.CHAT_TEMPLATE: template,
        gguf.Keys.Tokenizer.ADD_BOS: add_bos,
    }
    if markers:
        tokens, types = (
            list(src.field(gguf.Keys.Tokenizer.LIST)),
            list(src.field(gguf.Keys.Tokenizer.TOKEN_TYPE)),
        )
        for token, (text, kind) in enumerate(markers.items(), start=FIRST_SPARE):
            assert types[token] == CONTROL and token <= 16, "only SmolLM2's spare control tokens"
            tokens[token], types[token] = text, kind
        overrides |= {gguf.Keys.Tokenizer.LIST: tokens, gguf.Keys.Tokenizer.TOKEN_TYPE: types}
    copy_fields(reader, writer, overrides=overrides)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    write_gguf(writer)


def build_gemma4_template(out: Path, src: Sources) -> None:
    template = (src.llama_src / GEMMA4_TEMPLATE).read_text(encoding="utf-8")
    copy_with_template(out, src, template, add_bos=True)


def build_tool_template(out: Path, src: Sources) -> None:
    template = (src.llama_src / TOOL_TEMPLATES[out.name.lstrip(".").removesuffix(".tmp")]).read_text(
        encoding="utf-8"
    )
    copy_with_template(out, src, template)


def build_special_markers(out: Path, src: Sources) -> None:
    template, markers = SPECIAL_MARKERS[out.name.lstrip(".").removesuffix(".tmp")]
    text = (src.llama_src / template).read_text(encoding="utf-8")
    if template == GEMMA4_TEMPLATE:  # as E2B/E4B's: no empty thought primed after the turn opens
        assert text.count(EMPTY_THOUGHT_EMISSION) == 1
        text = text.replace(EMPTY_THOUGHT_EMISSION, "")
    copy_with_template(out, src, text, add_bos=template == GEMMA4_TEMPLATE, markers=markers)


def build_unknown_template(out: Path, src: Sources) -> None:
    copy_with_template(out, src, UNKNOWN_TEMPLATE)


def build_red(out: Path, src: Sources) -> None:
    Image.new("RGB", (48, 40), (255, 0, 0)).save(out, format="PNG")


def build_blue(out: Path, src: Sources) -> None:
    """A left-to-right blue gradient, so it is not mistaken for a flat colour."""
    blue = np.linspace(64, 255, 48, dtype=np.uint8)
    pixels = np.zeros((40, 48, 3), dtype=np.uint8)
    pixels[:, :, 2] = blue
    Image.fromarray(pixels).save(out, format="PNG")


FIXTURES: dict[str, Callable[[Path, Sources], None]] = {
    "mamba-tiny.gguf": build_mamba,
    "lfm2-tiny.gguf": build_lfm2,
    "t5-tiny.gguf": build_t5,
    "bert-tiny.gguf": build_bert,
    "mmproj-tiny.gguf": build_mmproj,
    "smollm2-gemma4-template.gguf": build_gemma4_template,
    "smollm2-unknown-template.gguf": build_unknown_template,
    **dict.fromkeys(TOOL_TEMPLATES, build_tool_template),
    **dict.fromkeys(SPECIAL_MARKERS, build_special_markers),
    "image-red.png": build_red,
    "image-blue.png": build_blue,
}


def build(name: str, out_dir: Path, src: Sources) -> None:
    """Build one fixture into a temp file and rename it, so a crash leaves no half file."""
    out = out_dir / name
    tmp = out.with_name(f".{name}.tmp")
    t0 = time.monotonic()
    try:
        FIXTURES[name](tmp, src)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    size = out.stat().st_size
    log(f"wrote {name} ({size:,} bytes, {time.monotonic() - t0:.1f}s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--llama-src",
        type=Path,
        default=paths.llama_source_dir(),
        help="extracted llama.cpp source (for the Gemma 4 template); default: %(default)s",
    )
    parser.add_argument("--force", action="store_true", help="rebuild every fixture")
    args = parser.parse_args(argv)

    out_dir = paths.fixtures_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = out_dir / STAMP_FILE
    current = stamp.is_file() and stamp.read_text().strip() == FIXTURE_VERSION
    todo = [n for n in FIXTURES if args.force or not current or not (out_dir / n).is_file()]

    src = Sources(paths.default_model_path(), args.llama_src)
    try:
        needed = [GEMMA4_TEMPLATE, QWEN3_TEMPLATE, GPT_OSS_TEMPLATE, *TOOL_TEMPLATES.values()]
        missing = [n for n in needed if not (args.llama_src / n).is_file()]
        if any(n.startswith("smollm2-") for n in todo) and missing:
            raise FixtureError(
                f"the chat templates {missing} are not in {args.llama_src}; pass --llama-src PATH "
                "pointing at the extracted llama.cpp source"
            )
        if todo:
            stamp.unlink(missing_ok=True)  # a half-finished run must not look current
        for name in todo:
            build(name, out_dir, src)
    except FixtureError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    stamp.write_text(FIXTURE_VERSION + "\n")

    state = f"built {len(todo)}" if todo else "all up to date"
    print(f"Fixtures v{FIXTURE_VERSION} ready in {out_dir} ({state}): {', '.join(FIXTURES)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
