"""Carrying out the residency ledger's steps (``residency.Move``) on a shared context and the
parking lot: parks, evictions (to the disk tier where there is one), releases, restores, and the
moves that place a session beside those in exchanges (``placement``). Every state loaded is
checked against the session's record; one that does not hold what the record says leaves the
session cold, never wrong."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from llmsession.engine.budget import Counters
from llmsession.engine.lease import Lease, SharedContext
from llmsession.engine.parking import ParkingLot
from llmsession.engine.residency import Move
from llmsession.native.context import NativeContext

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = logging.getLogger("llmsession")


class Mover:
    """Applies the ledger's steps for one engine, counting what happened in its ``counters``."""

    def __init__(self, lot: ParkingLot, counters: Counters) -> None:
        self.lot, self.counters = lot, counters

    def apply(self, home: SharedContext, steps: list[Move]) -> None:
        """Carry out the ledger's moves on ``home``'s context and the parking lot. The ledger
        has them done already: where one fails, no sequence it freed keeps what it held
        (``_abandon``), or the next session placed there would decode beside those cells."""
        for done, step in enumerate(steps):
            try:
                self._apply(home, step)
            except BaseException:
                self._abandon(home, steps[done:])
                raise

    def _abandon(self, home: SharedContext, steps: list[Move]) -> None:
        """The sequences ``steps`` (from one that failed on) free, emptied, their sessions cold
        (a swap that failed has done so itself: it moves two sessions), a park's in the ledger
        too; a parked state the ledger lets go leaves RAM as it says."""
        for step in steps[1:] if steps[0].action == "swap" else steps:
            if step.action == "release":
                self.lot.discard(step.key)
                home.leases[step.key].cache.reset()  # type: ignore[index]
            if step.action in ("park", "evict", "swap"):
                home.context.seq_rm(-1, step.seq)
                home.leases[step.key].cache.reset()  # type: ignore[index]
            if step.action == "park":
                home.residency.lost(step.key)  # (the lot holds nothing of it)
            if step.action == "swap":
                home.context.seq_rm(-1, step.to)
                if step.other is not None:
                    home.leases[step.other].cache.reset()  # type: ignore[index]

    def _apply(self, home: SharedContext, step: Move) -> None:
        lease = home.leases[step.key]  # type: ignore[index]
        if step.action == "park":
            blob = home.context.state_get(step.seq)
            home.context.seq_rm(-1, step.seq)
            self.lot.park(lease.key, blob)
            self.counters.parks += 1
            log.debug(
                "parked session %d: %d positions, %d bytes",
                lease.key,
                len(lease.cache.items),
                memoryview(blob).nbytes,
            )
        elif step.action == "evict" and self.lot.disk_dir and lease.cache.items and lease.parkable:
            self.lot.park(lease.key, home.context.state_get(step.seq))  # too big for RAM
            home.context.seq_rm(-1, step.seq)
            self.apply(home, [Move("release", lease.key, -1)])
        elif step.action == "evict":
            home.context.seq_rm(-1, step.seq)
            if lease.cache.items:
                self.counters.drops += 1
                log.debug("dropped session %d (cold): %d positions", lease.key, len(lease.cache.items))
            lease.cache.reset()
        elif step.action == "release":
            if self.lot.spill(lease.key):
                self.counters.disk_writes += 1
                log.debug("moved session %d's parked state to disk", lease.key)
            else:
                self.counters.drops += 1
                log.debug("forgot session %d's parked state (cold)", lease.key)
                lease.cache.reset()
        elif step.action == "swap":
            self._swap(home, step)
        else:
            self.restore(home, lease, step.seq, self.lot.take(lease.key))

    def settle(self, home: SharedContext, lease: Lease, seq: int) -> None:
        """``lease`` seated in ``seq`` with no restore among the ledger's steps: its state
        brought back from the lot (spilled to disk, or parked past the ledger's view), else the
        sequence holding exactly its record's positions, or emptied and the session cold (lost;
        or cells a failed move left, which its next prompt would decode beside)."""
        if lease.cache.items and self.lot.holds(lease.key):
            self.restore(home, lease, seq, self.lot.take(lease.key))
        elif home.context.pos_max(seq) != len(lease.cache.items) - 1:
            home.context.seq_rm(-1, seq)
            lease.cache.reset()

    def free(self, lease: Lease, steps: list[Move]) -> None:
        """Let a session's state go on purpose (closed or collected): not an eviction. Its
        parked state goes too, also one on disk the ledger already counts as cold."""
        for step in steps:
            if step.action == "evict":
                lease.shared_context.context.seq_rm(-1, step.seq)
        self.lot.discard(lease.key)

    def _swap(self, home: SharedContext, step: Move) -> None:
        """Move a live session's state to another sequence, trading places with the session
        there if any (``placement``): each state goes through host memory."""
        context = home.context
        movers = [(home.leases[step.key], step.seq, step.to)]  # type: ignore[index]
        if step.other is not None:
            movers.append((home.leases[step.other], step.to, step.seq))  # type: ignore[index]
        try:
            blobs = [context.state_get(old) if lease.cache.items else None for lease, old, _ in movers]
            for _, old, _ in movers:
                context.seq_rm(-1, old)
            for (lease, _, new), blob in zip(movers, blobs, strict=True):
                if blob is not None and not self._load(context, lease, new, blob):
                    log.info("session %d's state did not move: it starts cold", lease.key)
        except BaseException:  # the ledger has them moved: neither may keep what it held, anywhere
            for lease, old, new in movers:
                context.seq_rm(-1, old)
                context.seq_rm(-1, new)
                lease.cache.reset()
            raise
        self.counters.moves += 1

    def restore(self, home: SharedContext, lease: Lease, seq: int, blob: Buffer | None) -> None:
        """Load ``lease``'s parked state (None: lost) into ``seq``, else leave it cold."""
        if self._load(home.context, lease, seq, blob):
            self.counters.restores += 1
            log.debug("restored session %d: %d positions", lease.key, len(lease.cache.items))
            return
        self.counters.failed_restores += 1
        log.info("session %d's parked state did not restore: it starts cold", lease.key)

    @staticmethod
    def _load(context: NativeContext, lease: Lease, seq: int, blob: Buffer | None) -> bool:
        """Load ``lease``'s state into ``seq``; if there is none (None) or it does not hold what
        the record says, the sequence is emptied and the session goes cold (False)."""
        if (
            blob is not None
            and context.state_set(blob, seq)
            and context.pos_max(seq) == len(lease.cache.items) - 1
        ):
            return True
        context.seq_rm(-1, seq)
        lease.cache.reset()
        return False
