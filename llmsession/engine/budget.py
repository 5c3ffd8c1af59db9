"""The memory budget a model's sessions share, and what ``Model.memory()`` reports of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from llmsession.config import CheckpointConfig
from llmsession.errors import MemoryBudgetError

MIB = 1 << 20


class BudgetError(MemoryBudgetError):
    """The request cannot fit even after evicting every idle session."""


@dataclass(frozen=True)
class Budget:
    kv_cells: int  # KV cells of the shared context (with own_cells: of each sequence)
    max_live: int  # its sequences
    host_bytes: int  # parked states in host RAM, in total
    own_cells: bool = False  # each sequence has cells of its own, not a share of one pool

    def __post_init__(self) -> None:
        if self.kv_cells < 1 or self.max_live < 1 or self.host_bytes < 0:
            raise ValueError(f"invalid budget {self}")


@dataclass(frozen=True)
class MemoryPlan:
    """The model's memory budget as the engine runs it: the public ``config.MemoryConfig``
    with its KV cells chosen for the loaded model (``runtime.loading.sized``)."""

    kv_tokens: int = 8192  # KV cells of the live sessions (per layout: swa_full); Model's are sized
    max_live_sessions: int = 4  # sequences of the shared context
    host_cache_bytes: int = 1 << 30  # parked states in RAM
    disk_cache_dir: Path | None = None  # parked states the RAM budget lets go (else forgotten)
    batch_size: int = 512  # the largest prefill batch
    checkpoints: CheckpointConfig = field(default_factory=CheckpointConfig)  # per session, recurrent only
    kv_layout: str = "per_session"  # live sessions' own kv_tokens / max_live_sessions cells each, or "shared"


CELLS_QUANTUM = 256  # llama.cpp pads a sequence's own cells to a multiple of this


def own_cells(kv_tokens: int, max_live: int) -> int:
    """The cells each of ``max_live`` sequences holds of ``kv_tokens`` when each has its own:
    a multiple of what llama.cpp pads to, rounded down (at least one), so the whole stays
    within ``kv_tokens`` where it can."""
    return max(CELLS_QUANTUM, kv_tokens // max_live // CELLS_QUANTUM * CELLS_QUANTUM)


def uses_own_cells(config: MemoryPlan, *, full: bool, recurrent: bool, encoder: bool) -> bool:
    """Whether live sessions of a layout each attend over cells of their own (llama.cpp's
    per-sequence streams): not a recurrent memory's (its states are its own already), nor the
    small sliding-window cache's (``full`` False: one live session), nor an encoder-decoder
    model's (each exchange a context of its own)."""
    pooled = config.kv_layout == "shared" or config.max_live_sessions == 1
    return full and not pooled and not recurrent and not encoder


@dataclass
class Counters:
    exchanges: int = 0
    reused_tokens: int = 0
    parks: int = 0
    restores: int = 0  # from RAM or disk
    disk_writes: int = 0
    drops: int = 0  # states lost: evicted unparkable, or past every budget
    failed_restores: int = 0
    moves: int = 0  # live sessions moved to join the sequences in exchanges (``placement``)


@dataclass(frozen=True)
class SessionMemory:
    key: int
    state: str  # live, parked, disk, cold
    tokens: int  # positions its state holds (wherever it is)
    parked_bytes: int  # its parked state's size (RAM or disk)


@dataclass(frozen=True)
class MemoryReport:
    """``Model.memory()``: what the budget holds now, and what happened so far."""

    kv_tokens: int
    live_tokens: int
    max_live_sessions: int
    live_sessions: int
    host_cache_bytes: int
    parked_bytes: int
    disk_entries: int
    disk_bytes: int
    sessions: list[SessionMemory]
    checkpoint_bytes: int = 0  # recurrent states kept to rewind to, all sessions
    counters: Counters = field(default_factory=Counters)
    kv_layout: str = "shared"  # as built: "per_session" where live sessions have cells of their own
    session_cells: int = 0  # the most one live session holds
    context_size: int = 0  # a new session's default context (within session_cells)
    kv_bytes: int = 0  # about what the live sessions' KV cells take (allocated at load)
    kv_sizing: str = ""  # how kv_tokens was chosen
    renderer: str = ""  # how prompts are rendered (``text.renderer.Renderer``)
    # llama.cpp's compute and output buffers of its contexts and projector (as it reported them)
    buffer_bytes: int = 0

    def __str__(self) -> str:
        c = self.counters
        return (
            f"memory: {self.live_sessions}/{self.max_live_sessions} sessions live holding "
            f"{self.live_tokens}/{self.kv_tokens} KV cells ({self.kv_bytes / MIB:.0f} MiB; "
            f"{self.kv_sizing}), buffers {self.buffer_bytes / MIB:.0f} MiB; "
            f"parked {self.parked_bytes / MIB:.1f}"
            f"/{self.host_cache_bytes / MIB:.0f} MiB in RAM, {self.disk_entries} on disk "
            f"({self.disk_bytes / MIB:.1f} MiB), checkpoints {self.checkpoint_bytes / MIB:.1f} MiB "
            f"| parks {c.parks}, restores {c.restores}, "
            f"disk writes {c.disk_writes}, drops {c.drops}, failed restores {c.failed_restores}, "
            f"moves {c.moves}" + (f"\nprompts: {self.renderer}" if self.renderer else "")
        )
