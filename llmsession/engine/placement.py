"""Which sequence a session starting an exchange should sit in, where each sequence of the shared
context has cells of its own: next to the sequences already in exchanges.

llama.cpp computes a batch's sequences of their own cells together only where their numbers
follow each other (``split_equal`` is sequential there): three streams in sequences 0, 1 and 2
make one graph pass a step, in 0, 2 and 4 three (``scripts/bench_kv_layout.py --only steps`` on
SmolLM2: 17.6 against 20.0 ms a step on an AMD EPYC, 24.4 against 38.5 on an Intel Xeon). A
session joining others is placed where it extends or bridges their run, taking a free sequence or
trading places with an idle live session; its state (and that session's) moves by a copy through
host memory, so a move is made only where it joins more runs than the current place does, and
only when what it copies stays within ``MAX_MOVE_BYTES``.

Pure planning, like ``residency``: ``choose`` returns a ``Placement``; ``Residency`` turns it
into the engine's moves.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import NamedTuple

MAX_MOVE_BYTES = 64 << 20  # what one placement may copy: tens of ms, against ms saved each step


class Placement(NamedTuple):
    """``seq``: where the session goes (its own sequence if it stays); ``evicts``: the idle
    session holding ``seq`` now, which must make room (None if ``seq`` is free or its own);
    ``copied``: the bytes of state the placement copies."""

    seq: int
    evicts: object | None = None
    copied: int = 0


def joins(seq: int, busy: Collection[int]) -> int:
    """How many of the runs of ``busy`` sequences ``seq`` would join (0, 1 or 2)."""
    return (seq - 1 in busy) + (seq + 1 in busy)


def choose(
    current: int | None,
    free: Collection[int],
    idle: Mapping[int, object],
    busy: Collection[int],
    size: Callable[[object | None], int],
) -> Placement:
    """The best place for a session now in ``current`` (None: it has no sequence yet and takes
    one of ``free``, at least one of which exists then), with the other sequences ``free``,
    held by movable idle sessions (``idle``: sequence to key), or in exchanges (``busy``).
    ``size(key)`` is the bytes a session's state would copy (``size(None)``: the session's own).
    The place joining the most runs wins; then the fewest bytes copied, then the lowest number;
    a move must join more runs than staying, within ``MAX_MOVE_BYTES``."""
    stay = Placement(current if current is not None else min(free))
    if not busy:
        return stay
    mine = 0 if current is None else size(None)
    options = [stay] + [Placement(seq, None, mine) for seq in free if seq != current]
    options += [Placement(seq, key, mine + size(key)) for seq, key in idle.items()]
    affordable = [p for p in options if p.copied <= MAX_MOVE_BYTES]
    best = min(affordable, key=lambda p: (-joins(p.seq, busy), p.copied, p.seq))
    return best if joins(best.seq, busy) > joins(stay.seq, busy) else stay
