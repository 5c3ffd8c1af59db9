"""A ``llama_batch`` this process owns, filled in place for each decode. Part of the native
layer (see ``native``)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from llmsession.native.llama import bindings


class Batch:
    """Owns a ``llama_batch`` reused for every decode of one context. It is filled through cffi
    slices, not numpy views: right after a decode the caches are cold, and there each numpy
    call cost 5-15 µs (a one-token fill took 30-40 µs of a SmolLM2 token's 5 ms)."""

    def __init__(self, capacity: int, max_outputs: int | None = None) -> None:
        """``max_outputs``: the most rows of logits a fill may ask for (llama.cpp aborts the
        process past its context's ``n_outputs_max``); None: every token's."""
        lib, _ = bindings()
        self.max_outputs = capacity if max_outputs is None else max_outputs
        self.raw = lib.llama_batch_init(capacity, 0, 1)
        self._free = weakref.finalize(self, lib.llama_batch_free, self.raw)
        self.capacity = capacity
        self.raw.n_seq_id[0:capacity] = [1] * capacity
        self._seqs = [-1] * capacity  # what each slot's seq_id holds
        self._filled = capacity  # the slots the last fill used (whose logits flags to clear)

    def fill(self, tokens: Sequence[int], start: int, seq: int = 0, *, outputs: bool = False) -> None:
        """Tokens of sequence ``seq`` at consecutive positions from ``start``; logits only for
        the last one (for every one with ``outputs``: an encoder's batch)."""
        if outputs and len(tokens) > self.max_outputs:
            raise ValueError(f"a batch asks for at most {self.max_outputs} rows of logits, not {len(tokens)}")
        self.fill_many([(tokens, start, seq)])
        if outputs:
            self.raw.logits[0 : len(tokens)] = b"\x01" * len(tokens)

    def fill_many(
        self, runs: Sequence[tuple[Sequence[int], int, int]], outputs: Sequence[int] | None = None
    ) -> list[int]:
        """Several runs ``(tokens, start, seq)``, logits for each one's last token (its last
        ``outputs[i]``, if given: a drafted step's); the indices of those last tokens, in the
        runs' order. The runs go in by sequence: where sequences have cells of their own,
        llama.cpp computes together only those whose numbers follow each other in the batch."""
        n, ends, raw, seqs = 0, [0] * len(runs), self.raw, self._seqs
        wanted = [1] * len(runs) if outputs is None else outputs
        if sum(len(tokens) for tokens, _, _ in runs) > self.capacity or not runs or len(wanted) != len(runs):
            raise ValueError(f"a batch holds 1 to {self.capacity} tokens, with outputs for each run")
        rows = sum(max(1, min(want, len(tokens))) for (tokens, _, _), want in zip(runs, wanted, strict=True))
        if rows > self.max_outputs:
            raise ValueError(f"a batch asks for at most {self.max_outputs} rows of logits, not {rows}")
        raw.logits[0 : self._filled] = bytes(self._filled)
        for which in sorted(range(len(runs)), key=lambda i: runs[i][2]):
            (tokens, start, seq), rows = runs[which], wanted[which]
            k = len(tokens)
            raw.token[n : n + k] = tokens
            raw.pos[n : n + k] = range(start, start + k)
            for i in range(n, n + k):
                if seqs[i] != seq:
                    raw.seq_id[i][0] = seqs[i] = seq
            n += k
            rows = max(1, min(rows, k))
            raw.logits[n - rows : n] = b"\x01" * rows
            ends[which] = n - 1
        raw.n_tokens = self._filled = n
        return ends

    def close(self) -> None:
        self._free()
