"""The random-weight model fixtures (each a real architecture llama.cpp loads, a few MB) and the
GGUF-writing helpers ``make_fixtures.py`` shares with them. Weights are scaled so that greedy
replies vary with the whole history: a model that answers the same tokens whatever it was told
would let a wrong cache restore pass a differential test.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import gguf
import numpy as np

SEED = 20240601
VARIED = 0.3  # weight scale at which the tiny recurrent models' replies depend on their history


class Source(Protocol):
    """What a builder reads: SmolLM2's GGUF (its tokenizer and chat template are copied)."""

    @property
    def reader(self) -> gguf.GGUFReader: ...


def copy_fields(
    reader: gguf.GGUFReader,
    writer: gguf.GGUFWriter,
    keep: Callable[[str], bool] = lambda key: True,
    overrides: dict[str, Any] | None = None,
) -> None:
    """Copy metadata in file order; ``overrides`` swap values but keep key order and type."""
    overrides = overrides or {}
    for field in reader.fields.values():
        name = field.name
        if name.startswith("GGUF.") or name == gguf.Keys.General.ARCHITECTURE or not keep(name):
            continue  # virtual fields, or written by GGUFWriter itself
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = overrides.get(name, field.contents())
        writer.add_key_value(name, value, vtype, sub_type=sub_type)


def write_gguf(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_tensors(writer: gguf.GGUFWriter, tensors: dict[str, np.ndarray]) -> None:
    for name, data in tensors.items():
        writer.add_tensor(name, data)


def normal(rng: np.random.Generator, *shape: int, scale: float = 0.02) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def ones(n: int) -> np.ndarray:
    return np.ones(n, dtype=np.float32)


def fixture_writer(out: Path, arch: str, *, context_length: int, n_embd: int) -> gguf.GGUFWriter:
    """A writer for the random-weight fixture ``<arch>-tiny``, its common header written."""
    writer = gguf.GGUFWriter(out, arch)
    writer.add_name(f"{arch}-tiny (random weights, llmsession test fixture)")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(context_length)
    writer.add_embedding_length(n_embd)
    return writer


def tokenizer_keys(key: str) -> bool:
    return key.startswith("tokenizer.")


def vocab_size(src: Source) -> int:
    return len(src.reader.fields["tokenizer.ggml.tokens"].data)


def build_mamba(out: Path, src: Source) -> None:
    """A 2-layer Mamba: recurrent memory, so partial ``seq_rm`` must be refused.

    Shapes follow ``llama_model_mamba::load_arch_tensors`` (numpy order = reversed ggml ne).
    """
    n_embd, n_layer, d_inner, d_state, dt_rank, d_conv = 64, 2, 128, 16, 4, 4
    n_vocab = len(src.reader.fields["tokenizer.ggml.tokens"].data)
    rng = np.random.default_rng(SEED)

    writer = fixture_writer(out, "mamba", context_length=2048, n_embd=n_embd)
    writer.add_block_count(n_layer)
    writer.add_ssm_conv_kernel(d_conv)
    writer.add_ssm_inner_size(d_inner)
    writer.add_ssm_state_size(d_state)
    writer.add_ssm_time_step_rank(dt_rank)
    writer.add_layer_norm_rms_eps(1e-5)
    copy_fields(src.reader, writer, keep=lambda key: key.startswith("tokenizer."))

    tensors = {
        "token_embd.weight": normal(rng, n_vocab, n_embd, scale=VARIED),  # output is tied to it
        "output_norm.weight": ones(n_embd),
    }
    # Mamba's usual init: A = -[1..d_state] per channel, dt ~ 0.01 via inverse softplus.
    a = -np.tile(np.arange(1, d_state + 1, dtype=np.float32), (d_inner, 1))
    dt_bias = np.full(d_inner, np.log(np.expm1(0.01)), dtype=np.float32)
    for i in range(n_layer):
        p = f"blk.{i}."
        tensors |= {
            p + "attn_norm.weight": ones(n_embd),
            p + "ssm_in.weight": normal(rng, 2 * d_inner, n_embd, scale=VARIED),
            p + "ssm_conv1d.weight": normal(rng, d_inner, d_conv, scale=VARIED),
            p + "ssm_conv1d.bias": normal(rng, d_inner, scale=VARIED),
            p + "ssm_x.weight": normal(rng, dt_rank + 2 * d_state, d_inner, scale=VARIED),
            p + "ssm_dt.weight": normal(rng, d_inner, dt_rank, scale=VARIED),
            p + "ssm_dt.bias": dt_bias.copy(),
            p + "ssm_a": a.copy(),
            p + "ssm_d": ones(d_inner),
            p + "ssm_out.weight": normal(rng, n_embd, d_inner, scale=VARIED),
        }
    add_tensors(writer, tensors)
    write_gguf(writer)


def build_lfm2(out: Path, src: Source) -> None:
    """A 4-layer LFM2: a hybrid memory (short-convolution layers 0 and 2, attention 1 and 3), so a
    partial ``seq_rm`` is refused and checkpoints must carry the recurrent part.

    Shapes follow ``llama_model_lfm2``; the final norm is ``token_embd_norm``, output is tied.
    """
    n_embd, n_ff, head, l_cache, kv_heads = 64, 128, 16, 3, [0, 2, 0, 2]
    rng = np.random.default_rng(SEED)
    writer = fixture_writer(out, "lfm2", context_length=2048, n_embd=n_embd)
    writer.add_block_count(len(kv_heads))
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_embd // head)
    writer.add_head_count_kv(kv_heads)  # 0: a short-convolution layer
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_shortconv_l_cache(l_cache)
    copy_fields(src.reader, writer, keep=tokenizer_keys)

    def w(*shape: int) -> np.ndarray:
        return normal(rng, *shape, scale=VARIED)

    tensors = {"token_embd.weight": w(vocab_size(src), n_embd), "token_embd_norm.weight": ones(n_embd)}
    for i, n_kv in enumerate(kv_heads):
        p = f"blk.{i}."
        tensors |= {
            p + "attn_norm.weight": ones(n_embd),
            p + "ffn_norm.weight": ones(n_embd),
            p + "ffn_gate.weight": w(n_ff, n_embd),
            p + "ffn_up.weight": w(n_ff, n_embd),
            p + "ffn_down.weight": w(n_embd, n_ff),
        }
        if n_kv == 0:
            tensors |= {
                p + "shortconv.conv.weight": w(n_embd, l_cache),
                p + "shortconv.in_proj.weight": w(3 * n_embd, n_embd),
                p + "shortconv.out_proj.weight": w(n_embd, n_embd),
            }
        else:
            tensors |= {
                p + "attn_q_norm.weight": ones(head),
                p + "attn_k_norm.weight": ones(head),
                p + "attn_q.weight": w(n_embd, n_embd),
                p + "attn_k.weight": w(n_kv * head, n_embd),
                p + "attn_v.weight": w(n_kv * head, n_embd),
                p + "attn_output.weight": w(n_embd, n_embd),
            }
    add_tensors(writer, tensors)
    write_gguf(writer)


def build_t5(out: Path, src: Source) -> None:
    """A T5 encoder-decoder (2 + 2 layers) on SmolLM2's BPE vocabulary; decoding starts from
    token 1. Layer 0's relative-position bias serves every layer. Weights of scale 1: at 0.02
    it answers end-of-generation forever."""
    n_embd, n_ff, n_layer, n_head, buckets = 64, 128, 2, 2, 32
    rng = np.random.default_rng(SEED)
    writer = fixture_writer(out, "t5", context_length=512, n_embd=n_embd)
    writer.add_feed_forward_length(n_ff)
    writer.add_block_count(n_layer)
    writer.add_decoder_block_count(n_layer)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_relative_attn_buckets_count(buckets)
    writer.add_decoder_start_token_id(1)
    copy_fields(src.reader, writer, keep=tokenizer_keys)

    def w(*shape: int) -> np.ndarray:
        return normal(rng, *shape, scale=1.0)

    tensors = {
        "token_embd.weight": w(vocab_size(src), n_embd),  # output is tied to it
        "enc.output_norm.weight": ones(n_embd),
        "dec.output_norm.weight": ones(n_embd),
    }
    for side in ("enc", "dec"):
        for i in range(n_layer):
            p = f"{side}.blk.{i}."
            tensors |= {p + "attn_norm.weight": ones(n_embd), p + "ffn_norm.weight": ones(n_embd)}
            tensors |= {p + f"attn_{x}.weight": w(n_embd, n_embd) for x in "qkvo"}
            tensors |= {p + "ffn_gate.weight": w(n_ff, n_embd), p + "ffn_up.weight": w(n_ff, n_embd)}
            tensors[p + "ffn_down.weight"] = w(n_embd, n_ff)
            if i == 0:
                tensors[p + "attn_rel_b.weight"] = w(buckets, n_head)
            if side == "dec":
                tensors[p + "cross_attn_norm.weight"] = ones(n_embd)
                tensors |= {p + f"cross_attn_{x}.weight": w(n_embd, n_embd) for x in "qkvo"}
    add_tensors(writer, tensors)
    write_gguf(writer)


# Lowercase English words for the WordPiece fixture; anything else spells out in single characters.
BERT_WORDS = """
the of and to in is was for on that with as by at from it he she they we you i his her their our
your its be are were been has have had do does did not no but or if so than then there here this
these those what which who whom when where why how all any some each every many much more most
other such only also very just can could will would shall should may might must one two three
first last new old good bad great small big long short high low same different own right left
hello world sentence word text test example model language token question answer time day year
people man woman child life work home house city country way thing place part case point fact
water fire air earth sun moon star sky sea tree book story name number cat dog bird fish
quick brown fox jumps over lazy red blue green black white yellow say said make made go went get
got see saw know knew think thought take took come came give gave find found tell told ask asked
use used want like look run read write written learn about after before again against because
between during into through under up down out off above below while until now today
"""
BERT_SUFFIXES = "s es ed ing ly er est ion tion ment ness ful less able"  # the ## continuations
BERT_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def bert_vocab() -> list[str]:
    """A WordPiece vocabulary in llama.cpp's phantom-space form (``convert_hf_to_gguf.py``
    ``BertModel.set_vocab``): a word start ``w`` is ``▁w``, a continuation ``##w`` is ``w``."""
    chars = [*"abcdefghijklmnopqrstuvwxyz0123456789"]
    punct = [*".,!?;:'\"()-"]
    words = [f"▁{w}" for w in BERT_WORDS.split()]
    pieces = [*(f"▁{c}" for c in chars + punct), *chars, *BERT_SUFFIXES.split(), *words]
    return BERT_SPECIAL + list(dict.fromkeys(pieces))


def build_bert(out: Path, src: Source) -> None:
    """A 2-layer BERT embedding model (mean pooling, non-causal) with its own WordPiece vocabulary.

    Names and shapes follow ``llama_model_bert::load_arch_tensors``; keys as the converter writes
    them for ``BertModel``, less its EOS. Token embeddings dominate, so texts sharing words embed alike."""
    n_embd, n_ff, n_layer, n_head, n_ctx, n_types = 64, 128, 2, 4, 512, 2
    tokens = bert_vocab()
    pad, unk, cls, sep, mask = (tokens.index(t) for t in BERT_SPECIAL)
    rng = np.random.default_rng(SEED)
    writer = fixture_writer(out, "bert", context_length=n_ctx, n_embd=n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_layer_norm_eps(1e-12)
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType.MEAN)
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    control, normal_ = gguf.TokenType.CONTROL, gguf.TokenType.NORMAL
    writer.add_token_types([control if t in BERT_SPECIAL else normal_ for t in tokens])
    writer.add_token_type_count(n_types)
    writer.add_bos_token_id(cls)
    writer.add_unk_token_id(unk)
    writer.add_sep_token_id(sep)
    writer.add_pad_token_id(pad)
    writer.add_mask_token_id(mask)
    writer.add_add_bos_token(True)
    writer.add_add_sep_token(True)  # no EOS: llama.cpp's bert default, [SEP] ends the input

    def norm_pair(prefix: str) -> dict[str, np.ndarray]:
        return {prefix + ".weight": ones(n_embd), prefix + ".bias": np.zeros(n_embd, dtype=np.float32)}

    tensors = {
        "token_embd.weight": normal(rng, len(tokens), n_embd, scale=1.0),
        "token_types.weight": normal(rng, n_types, n_embd, scale=0.1),
        "position_embd.weight": normal(rng, n_ctx, n_embd, scale=0.1),
        **norm_pair("token_embd_norm"),
    }
    for i in range(n_layer):
        p = f"blk.{i}."
        for x in ("attn_q", "attn_k", "attn_v", "attn_output"):
            tensors |= {p + x + ".weight": normal(rng, n_embd, n_embd), p + x + ".bias": normal(rng, n_embd)}
        tensors |= norm_pair(p + "attn_output_norm") | norm_pair(p + "layer_output_norm")
        tensors |= {
            p + "ffn_up.weight": normal(rng, n_ff, n_embd),
            p + "ffn_up.bias": normal(rng, n_ff),
            p + "ffn_down.weight": normal(rng, n_embd, n_ff),
            p + "ffn_down.bias": normal(rng, n_embd),
        }
    add_tensors(writer, tensors)
    write_gguf(writer)
