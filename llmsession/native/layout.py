"""The context parameters a saved sequence state depends on (``context_layout``), and the
llama.cpp values they are set with. Part of the native layer."""

from __future__ import annotations

from llmsession.native.llama import bindings
from llmsession.options import KV_TYPES


def flash_attn_type(flash_attention: bool | None) -> int:
    lib, _ = bindings()
    if flash_attention is None:
        return int(lib.LLAMA_FLASH_ATTN_TYPE_AUTO)
    return int(lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attention else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED)


def kv_ggml_type(kv_type: str) -> int:
    """ggml's type for a ``kv_type`` name, checked."""
    if kv_type not in KV_TYPES:
        raise ValueError(f"kv_type must be one of {', '.join(KV_TYPES)}, got {kv_type!r:.40}")
    return int(getattr(bindings()[0], f"GGML_TYPE_{kv_type.upper()}"))


def context_layout(
    swa_full: bool, flash_attention: bool | None, kv_type: str = "f16", streams: int = 1
) -> dict[str, int | bool]:
    """The context parameters a saved sequence state depends on, as NativeContext sets them
    (a sequence's state does not depend on how many sequences share one pool of cells, but it
    names how many have cells of their own, ``streams``, and loads only into as many; its V cache
    is stored transposed without flash attention; its cells are of ``kv_type``)."""
    return ({"streams": streams} if streams != 1 else {}) | {
        "type_k": kv_ggml_type(kv_type),
        "type_v": kv_ggml_type(kv_type),
        # (quantized V turns llama.cpp's AUTO on: a state saved either way has one layout)
        "flash_attn_type": flash_attn_type(
            True if kv_type != "f16" and flash_attention is None else flash_attention
        ),
        "swa_full": swa_full,
    }
