"""Reuse the longest prefix of a chat session's context memory from one exchange to the next.

A session's state is one sequence of a shared llama context, with a record of the item (token id,
or one position of an image chunk) held at each of its positions. Each exchange keeps the longest
prefix the new prompt shares with that record, removes the rest and decodes only the new tail. The planning is
pure; `PrefixCache.prepare` applies it through the small `Memory` protocol. Where the memory cannot
give back a correct prefix (a recurrent state refuses a cut inside it; a sliding-window cache has
evicted what the next position attends to) it resumes from the newest checkpoint at or below the
cut if it holds one (`checkpoints`, recurrent memories only), else decodes everything again.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol, TypeAlias

from llmsession.config import CheckpointConfig
from llmsession.engine.checkpoints import Checkpoints

if TYPE_CHECKING:
    from typing_extensions import Buffer

Item: TypeAlias = Hashable


class ImagePosition(NamedTuple):
    """The item at one position of an image chunk: which image (a hash of its pixels), how many
    positions it spans, and which of them this is. Equal images give equal items."""

    digest: str
    n_tokens: int
    offset: int


def image_items(digest: str, n_tokens: int) -> list[Item]:
    return [ImagePosition(digest, n_tokens, i) for i in range(n_tokens)]


def starts_a_chunk(items: Sequence[Item], position: int) -> bool:
    """Whether decoding may resume at `position`: never inside an image (it is decoded whole)."""
    if position >= len(items):
        return True
    item = items[position]
    return not (isinstance(item, ImagePosition) and item.offset > 0)


@dataclass(frozen=True)
class Plan:
    """Positions 0..reused-1 stay in memory; the caller decodes prompt[reused:] from `reused` on.

    `remove_from` is None for a pure append, else the position from which memory was cut;
    `cleared` means nothing was kept (remove_from == 0) and the whole prompt is decoded;
    `from_checkpoint` that a checkpoint gave back the memory's state at `reused`.
    """

    reused: int
    remove_from: int | None
    cleared: bool
    from_checkpoint: bool = False


def common_prefix(a: Sequence[Item], b: Sequence[Item]) -> int:
    """The number of leading items a and b share."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def plan(
    recorded: Sequence[Item],
    prompt: Sequence[Item],
    *,
    can_cut: Callable[[int], bool] | None = None,
) -> Plan:
    """Keep the longest shared prefix that leaves the last prompt item to decode (sampling needs
    its fresh logits) and that ends where `can_cut` allows (an image chunk is never split)."""
    if not prompt:
        raise ValueError("the prompt must hold at least one item")
    keep = min(common_prefix(recorded, prompt), len(prompt) - 1)
    while keep > 0 and can_cut is not None and not can_cut(keep):
        keep -= 1
    if keep == len(recorded):
        return Plan(reused=keep, remove_from=None, cleared=False)
    return Plan(reused=keep, remove_from=keep, cleared=keep == 0)


def best_donor(
    prompt: Sequence[Item],
    records: Sequence[Sequence[Item]],
    *,
    can_cut: Callable[[int], bool] | None = None,
) -> tuple[int, int]:
    """For an empty memory: which of other memories' ``records`` gives the most of ``prompt``, as
    ``plan`` would keep it of that record (the last prompt item still to decode, no image split),
    and how many items; ``(-1, 0)`` when none gives any."""
    best = (-1, 0)
    for i, record in enumerate(records):
        kept = plan(record, prompt, can_cut=can_cut).reused
        if kept > best[1]:
            best = (i, kept)
    return best


class Memory(Protocol):
    """The part of a llama context's memory (``llama_memory_*`` on the session's sequence) that
    prefix reuse needs."""

    def seq_rm(self, p0: int) -> bool:
        """Remove positions >= p0; False when the memory refuses (recurrent state)."""
        ...

    def clear(self) -> None: ...

    def pos_min(self) -> int:
        """The smallest position still held, -1 when empty."""
        ...

    def snapshot(self) -> Buffer:
        """A checkpoint's blob: a copy of the recurrent state (only called on such memories)."""
        ...

    def resume(self, blob: Buffer, position: int) -> bool:
        """Put back the state ``blob`` copied after ``position`` items and remove every position
        from ``position`` on; False unless memory then holds exactly positions 0..position-1."""
        ...


_CLEARED = Plan(reused=0, remove_from=0, cleared=True)


class PrefixCache:
    """The record of which items a context's memory holds, position by position."""

    def __init__(self, n_swa: int = 0, checkpoints: CheckpointConfig | None = None) -> None:
        """n_swa > 0: the memory is a sliding-window cache that drops positions the newest one
        no longer attends to (llama_model_n_swa; pass 0 when the context was made with swa_full).
        ``checkpoints``: the memory is recurrent (cuts inside it are refused) and keeps these."""
        if n_swa < 0:
            raise ValueError(f"n_swa must be >= 0, got {n_swa}")
        self.n_swa = n_swa
        self.checkpoints = Checkpoints(checkpoints) if checkpoints is not None else None
        self._items: list[Item] = []
        self.foreign = False  # its items' cells came from a file: no other session's prefix

    @property
    def items(self) -> tuple[Item, ...]:
        """What memory holds now, one item per position."""
        return tuple(self._items)

    def prepare(
        self,
        prompt: Sequence[Item],
        memory: Memory,
        *,
        can_cut: Callable[[int], bool] | None = None,
    ) -> Plan:
        """Plan against the record, apply the plan to memory and return the plan applied."""
        planned = plan(self._items, prompt, can_cut=can_cut)
        if planned.remove_from is None:
            return planned  # appending needs no removal on any backend
        cut = planned.remove_from
        if cut > 0 and self._holds_context(memory, cut) and memory.seq_rm(cut):
            self._truncate(cut)
            return planned
        return self.rewind(memory, cut, can_cut)

    def rewind(self, memory: Memory, cut: int, can_cut: Callable[[int], bool] | None = None) -> Plan:
        """Make memory hold the record's first ``cut`` items or fewer, from the newest checkpoint
        at or below ``cut``, or else nothing; the plan applied."""
        best = self.checkpoints.best(cut, can_cut) if self.checkpoints is not None else None
        if best is not None and memory.resume(best.blob, best.position):
            self._truncate(best.position)
            return Plan(reused=best.position, remove_from=best.position, cleared=False, from_checkpoint=True)
        memory.clear()
        self.reset()
        return _CLEARED

    def recover(self, memory: Memory) -> None:
        """After an aborted decode, which may have left part of its batch in memory: make memory
        hold the record or a prefix of it again, or nothing."""
        self._forget_from(memory, len(self._items))

    def cut(self, memory: Memory, keep: int) -> None:
        """Forget the record's items from ``keep`` on (drafts a step decoded and rejected)."""
        if keep < len(self._items):
            self._forget_from(memory, keep)

    def _forget_from(self, memory: Memory, keep: int) -> None:
        """Memory and record cut to ``keep`` items where memory can be cut there (a recurrent
        state only through a checkpoint, as its cells may be partly written); else rewound."""
        cutting = keep < len(self._items)
        if self.checkpoints is None and memory.seq_rm(keep) and self._holds_context(memory, keep, cutting):
            self._truncate(keep)  # (a sliding window may have moved past what the next one needs)
        else:
            self.rewind(memory, keep)

    def checkpoint_stops(self, end: int) -> list[int]:
        """Where a prefill from the record's end to ``end`` takes checkpoints (none for memories
        that need none)."""
        return self.checkpoints.stops(len(self._items), end) if self.checkpoints is not None else []

    def take_checkpoint(self, memory: Memory) -> None:
        """Keep a copy of the memory's recurrent state after the items recorded so far."""
        if self.checkpoints is not None and self._items:
            blob = memory.snapshot()
            self.checkpoints.add(len(self._items), blob, memoryview(blob).nbytes)

    @property
    def checkpoint_bytes(self) -> int:
        return self.checkpoints.nbytes if self.checkpoints is not None else 0

    def share_checkpoints(self, source: PrefixCache) -> None:
        """Take ``source``'s checkpoints: this cache now records what ``source`` records."""
        if self.checkpoints is not None and source.checkpoints is not None:
            self.checkpoints = source.checkpoints.copy()

    def _truncate(self, cut: int) -> None:
        del self._items[cut:]
        if self.checkpoints is not None:
            self.checkpoints.drop_above(cut)

    def _holds_context(self, memory: Memory, reused: int, cutting: bool = True) -> bool:
        """Whether memory still holds what position `reused` attends to (llama-server's test).

        A sliding window needs the n_swa - 1 positions before it (one more, to be safe, where
        the record is cut: not where an aborted decode is undone, nothing cut, in a pool whose
        other sequences take this one's cells as they leave its window); otherwise something
        below the cut must survive. Recurrent and hybrid memories report their latest state as
        pos_min, so a rewind on them clears here rather than leaning on rollback snapshots; an
        empty memory under a non-empty record is caught the same way.
        """
        exact = 0 if cutting else 1
        limit = max(0, reused - self.n_swa + exact) if self.n_swa else reused - 1
        return 0 <= memory.pos_min() <= limit

    def extend(self, items: Sequence[Item]) -> None:
        """Record items the caller just decoded at the end (a prompt chunk, a generated token)."""
        self._items.extend(items)

    def reset(self) -> None:
        """Forget everything: the caller cleared memory or discarded the context."""
        self._items.clear()
        self.foreign = False
        if self.checkpoints is not None:
            self.checkpoints.clear()
