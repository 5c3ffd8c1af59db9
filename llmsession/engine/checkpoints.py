"""Checkpoints: copies of a recurrent memory's state at chosen positions of a session's record.

A recurrent or hybrid memory (Mamba, LFM2, Jamba, ...) keeps one running state, so llama.cpp
refuses to cut it inside the sequence: without help, every edit, regenerate or deleted turn
re-decodes the whole transcript. A checkpoint is the recurrent state after the first
``position`` items (``llama_state_seq_get_data_ext`` with ``PARTIAL_ONLY``: a hybrid's attention
cache is not copied, it is cut instead). A refused cut resumes from the newest checkpoint at or
below it, as llama-server's context checkpoints do. This module only decides where to take them
and which to keep; ``prefix.PrefixCache`` applies them through its ``Memory``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from llmsession.config import CheckpointConfig

if TYPE_CHECKING:
    from typing_extensions import Buffer


class Checkpoint(NamedTuple):
    """The memory's state after the record's first ``position`` items."""

    position: int
    blob: Buffer
    nbytes: int


class Checkpoints:
    """A session's checkpoints, each valid while the record keeps its first ``position`` items."""

    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config
        self._held: list[Checkpoint] = []  # oldest first

    @property
    def positions(self) -> list[int]:
        return sorted(c.position for c in self._held)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self._held)

    def stops(self, start: int, end: int) -> list[int]:
        """The positions in [start, end) a prefill decoding items start..end-1 stops at to take a
        checkpoint (ascending; a stop at ``start`` is taken before decoding anything)."""
        if self.config.max_count == 0 or end - start < 1:
            return []
        every = self.config.every
        wanted = {start, end - 1} | (set(range(every * (start // every + 1), end, every)) if every else set())
        held = {c.position for c in self._held}
        return sorted(p for p in wanted if p > 0 and p not in held)

    def add(self, position: int, blob: Buffer, nbytes: int) -> None:
        """Keep a new checkpoint; the oldest go first past the count or the byte cap (one that
        alone exceeds the cap is not kept)."""
        if position <= 0 or nbytes > self.config.max_bytes or self.config.max_count == 0:
            return
        self._held = [c for c in self._held if c.position != position]
        self._held.append(Checkpoint(position, blob, nbytes))
        while len(self._held) > self.config.max_count or self.nbytes > self.config.max_bytes:
            del self._held[0]

    def best(self, cut: int, can_cut: Callable[[int], bool] | None = None) -> Checkpoint | None:
        """The checkpoint nearest below or at ``cut`` where decoding may resume."""
        fitting = [c for c in self._held if c.position <= cut and (can_cut is None or can_cut(c.position))]
        return max(fitting, key=lambda c: c.position, default=None)

    def drop_above(self, position: int) -> None:
        """The record was cut to ``position`` items: later checkpoints hold items it lost."""
        self._held = [c for c in self._held if c.position <= position]

    def clear(self) -> None:
        self._held.clear()

    def copy(self) -> Checkpoints:
        """The same checkpoints (blobs are never written to, so they are shared) for a fork."""
        twin = Checkpoints(self.config)
        twin._held = list(self._held)
        return twin
