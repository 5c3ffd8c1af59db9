"""Anonymous memory for KV states: what ``llama_state_seq_get_data`` writes into and parking keeps."""

from __future__ import annotations

import mmap


def mapping(size: int) -> mmap.mmap:
    """An anonymous, prefaulted mapping of ``size`` bytes (at least one: mmap refuses zero)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(-1, max(size, 1), flags=flags)
