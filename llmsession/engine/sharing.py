"""An empty session starts from the longest prefix of its prompt another session of its context
holds (a system prompt many conversations open with, say), live or parked: those positions are
not decoded again.

A live donor's cells are shared (``seq_cp``, then cut after the prefix); where each sequence has
cells of its own, its state is copied, as a parked donor's is, where it would be parked. A parked
donor's state is restored into the new session's sequence (a copy: the donor stays parked) and
cut after the prefix, unless the prefix is a sliver of the state: a restore copies all of it, at
microseconds a position, where a decode costs milliseconds. Only where a cut is exact (not the
small sliding-window cache); parked donors not on sliding-window models at all, as the pinned
llama.cpp restores a Gemma 3 state past its window wrong.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmsession.engine.lease import Lease
from llmsession.engine.prefix import Item, best_donor
from llmsession.engine.residency import State

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = logging.getLogger("llmsession")
RESTORE_SHARE = 64  # a parked state is restored for a prefix of at least 1/64 of it


@dataclass(frozen=True)
class Parked:
    """What sharing needs of the parking lot (``engine.Engine``)."""

    holds: Callable[[int], str]  # where a session's state is parked ("" if not)
    state: Callable[[Lease], Buffer | None]  # a parked state, left parked
    n_swa: int  # the model's sliding window (0: none)


def share(
    lease: Lease, seq: int, prompt: Sequence[Item], can_cut: Callable[[int], bool], parked: Parked
) -> int:
    """Put the longest prefix of ``prompt`` another session holds into ``seq``, from the live or
    parked donor that holds most of it; how many positions (the caller holds the engine's lock)."""
    home = lease.shared_context
    if not home.swa_full:
        return 0
    live = [
        (other, entry.seq)
        for other, entry in ((o, home.residency.entry(k)) for k, o in home.leases.items())
        if other is not lease and _donor(other) and entry.state is State.LIVE
    ]
    index, shared = best_donor(prompt, [donor.cache.items for donor, _ in live], can_cut=can_cut)
    if restored := _from_parked(lease, seq, prompt, can_cut, parked, beat=shared):
        return restored
    if not shared:
        return 0
    donor, donor_seq = live[index]
    if home.budget.own_cells and not (donor.parkable and _worth_copying(donor, shared)):
        return 0  # (a copy goes through the state: not past a sliding window, #25295)
    if not home.context.seq_cp(donor_seq, seq):  # (a copied state llama.cpp refused: decode it all)
        return 0
    return _keep_prefix(lease, seq, donor, shared, "")


def _donor(other: Lease) -> bool:
    """Whether a session's cells may be another's prefix: it shares, holds some, and none of
    them came from a file (``Engine.adopt``: a crafted file's would change the taker's replies)."""
    return other.shares and bool(other.cache.items) and not other.cache.foreign


def _worth_copying(donor: Lease, shared: int) -> bool:
    """Whether a copy of ``donor``'s whole state (then cut) is worth ``shared`` positions."""
    return shared * RESTORE_SHARE >= len(donor.cache.items)


def _from_parked(
    lease: Lease, seq: int, prompt: Sequence[Item], can_cut: Callable[[int], bool], parked: Parked, beat: int
) -> int:
    """``share`` from the parked donor that holds the most of ``prompt``, if more than ``beat``."""
    home = lease.shared_context
    if parked.n_swa:
        return 0
    donors = [
        other
        for key, other in home.leases.items()
        if other is not lease
        and _donor(other)
        and home.residency.entry(key).state is State.PARKED
        and parked.holds(key)
    ]
    index, shared = best_donor(prompt, [donor.cache.items for donor in donors], can_cut=can_cut)
    if shared <= beat or not _worth_copying(donors[index], shared):
        return 0
    donor, context = donors[index], home.context
    if len(donor.cache.items) > home.residency.room(lease.key):  # (the whole state goes in first)
        return 0
    blob = parked.state(donor)
    if blob is None or not context.state_set(blob, seq):
        context.seq_rm(-1, seq)
        return 0
    return _keep_prefix(lease, seq, donor, shared, "parked ")


def _keep_prefix(lease: Lease, seq: int, donor: Lease, shared: int, kind: str) -> int:
    """Cut ``seq`` (holding the donor's positions) after the ``shared`` prefix, which its lease
    then records; 0, with the sequence emptied, if the cut is not exact or a sliding window's
    layers lack a position the next one attends to."""
    context, window = lease.shared_context.context, lease.cache.n_swa
    exact = context.seq_rm(shared, seq) and context.pos_max(seq) == shared - 1
    if not exact or (window and context.pos_min(seq) > max(0, shared - window)):  # (what it attends to)
        context.seq_rm(-1, seq)
        return 0
    lease.cache.extend(donor.cache.items[:shared])
    log.debug("session %d starts from %d positions of %ssession %d", lease.key, shared, kind, donor.key)
    return shared
