"""What a loaded model's GGUF metadata says of its shape: its architecture, and what one KV cell
costs (to size the cells before llama.cpp allocates them, ``engine.sizing``)."""

from __future__ import annotations

from llmsession.native.llama import NativeModel, bindings

# Bytes per element of each KV type (``options.KV_TYPES``): f16, and ggml's 32-element blocks
# of q8_0 (32 bytes and an f16 scale) and q4_0 (16 bytes and a scale).
KV_TYPE_BYTES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


def meta(model: NativeModel, key: str) -> str | None:
    """A metadata value as llama.cpp spells it, or None where the file has no such key."""
    lib, ffi = bindings()
    buf = ffi.new("char[256]")
    n = lib.llama_model_meta_val_str(model.ptr, key.encode(), buf, 256)
    return None if n < 0 else ffi.string(buf).decode("utf-8", "replace")


def architecture(model: NativeModel) -> str:
    """``general.architecture`` (``llama``, ``gemma3``, ...), or "" where the file has none."""
    return meta(model, "general.architecture") or ""


def _int_meta(model: NativeModel, key: str) -> int | None:
    value = meta(model, key)
    return int(value) if value is not None and value.isdigit() else None


def attention_scores_bytes(model: NativeModel, positions: int, batch: int) -> int:
    """What llama.cpp's compute buffer holds of a batch's attention scores without flash
    attention: ``positions x batch`` floats for each head (one layer at a time)."""
    return positions * batch * max(1, int(bindings()[0].llama_model_n_head(model.ptr))) * 4


def kv_bytes_per_cell(model: NativeModel, kv_type: str = "f16") -> int:
    """About what one position of one sequence takes in KV cells of ``kv_type``: every layer's
    keys and values for its KV heads (the first layer's count of them, as llama.cpp reports;
    the head sizes from the metadata, else the embedding over the heads). An estimate: a model
    with fewer KV heads on some layers, or without attention on some (hybrid), takes less."""
    lib, _ = bindings()
    ptr = model.ptr
    n_layer, n_head = lib.llama_model_n_layer(ptr), max(1, lib.llama_model_n_head(ptr))
    n_head_kv = lib.llama_model_n_head_kv(ptr)
    arch = architecture(model)
    head = lib.llama_model_n_embd(ptr) // n_head
    k = _int_meta(model, f"{arch}.attention.key_length") or head
    v = _int_meta(model, f"{arch}.attention.value_length") or head
    return max(1, round(int(n_layer) * int(n_head_kv) * (k + v) * KV_TYPE_BYTES[kv_type]))


def cost_shape(model: NativeModel) -> dict[str, object]:
    """What a decode's cost depends on: the architecture, its sizes and the tensors' types and
    bytes (llama.cpp's description, ``"llama ?B Q4_1"``, its parameter count and size); not the
    weights' values nor the rest of the metadata. Copies of one file and files that differ only in
    their chat template (the tests' fixtures: SmolLM2's weights under other families' templates)
    have one shape; so do two fine-tunes of one base, quantized alike, and they decode alike."""
    lib, ffi = bindings()
    ptr, arch = model.ptr, architecture(model)
    buf = ffi.new("char[256]")
    described = lib.llama_model_desc(ptr, buf, 256)
    return {
        "architecture": arch,
        "description": ffi.string(buf).decode("utf-8", "replace") if described >= 0 else "",
        "bytes": int(lib.llama_model_size(ptr)),
        "parameters": int(lib.llama_model_n_params(ptr)),
        "sizes": [
            int(f(ptr))
            for f in (
                lib.llama_model_n_layer,
                lib.llama_model_n_embd,
                lib.llama_model_n_head,
                lib.llama_model_n_head_kv,
                lib.llama_model_n_swa,
                lib.llama_model_n_ctx_train,
            )
        ],
        "vocabulary": model.n_vocab,
        # (a mixture of experts' count, and how many each token runs: an edit of the latter alone
        # changes a token's cost, not the file's bytes)
        "experts": [meta(model, f"{arch}.{k}") for k in ("expert_count", "expert_used_count")],
    }
