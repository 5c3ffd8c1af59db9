"""A session's place in the engine (``Lease``) and one shared context with its ledger (``SharedContext``):
the records a seat works on, apart from the engine that hands them out."""

from __future__ import annotations

from collections.abc import Callable

from llmsession.config import CheckpointConfig
from llmsession.engine.budget import Budget
from llmsession.engine.prefix import PrefixCache
from llmsession.engine.residency import Residency
from llmsession.native.context import NativeContext


class SharedContext:
    """One shared context (made on first use by ``make_context``) for one memory layout, and
    its ledger."""

    def __init__(
        self, make_context: Callable[[], NativeContext], budget: Budget, *, swa_full: bool, n_batch: int
    ) -> None:
        self.swa_full, self.n_batch, self.budget = swa_full, n_batch, budget
        self.residency = Residency(budget, park_bytes=self._park_bytes)
        self.leases: dict[int, Lease] = {}
        self._make_context = make_context
        self._context: NativeContext | None = None

    @property
    def context(self) -> NativeContext:
        if self._context is None:
            self._context = self._make_context()
        return self._context

    def _park_bytes(self, key: object) -> int:
        return self.context.state_size(self.residency.entry(key).seq)

    def close(self) -> None:
        if self._context is not None:
            self._context.close()


class Lease:
    """A session's place in the engine: its key, the record of what its state holds, and whether
    it shares prefixes with other sessions (``Engine.share``)."""

    def __init__(
        self,
        home: SharedContext,
        key: int,
        n_swa: int,
        window: int,
        *,
        checkpoints: CheckpointConfig | None,
        shares: bool = True,
    ) -> None:
        """``checkpoints``: a recurrent memory's (None for attention-only models)."""
        self.shared_context, self.key, self.n_swa, self.shares = home, key, n_swa, shares
        # A recurrent state refuses cuts inside it: checkpoints let it rewind. Never a sliding
        # window's: its states past the window restore wrong in the pinned llama.cpp (#25295).
        self.cache = PrefixCache(n_swa=window, checkpoints=checkpoints if window == 0 else None)

    @property
    def parkable(self) -> bool:
        """A sliding-window state past its window restores wrong in the pinned llama.cpp
        (#25295): such a state is never parked, it goes cold."""
        return not (self.n_swa > 0 and len(self.cache.items) > self.n_swa)
