"""How many prompt tokens a scheduling step may add to the generating streams' tokens (chunked
prefill, as llama-server's ``update_slots`` and vLLM do it), measured as the steps run.

A step's time is roughly a fixed cost (the weights read once, the threads woken) plus a cost
per token. Generation steps are nearly all fixed cost, so a prompt chunk rides along cheaply,
but each token of it adds its own time: a chunk of ``allowance()`` tokens keeps a mixed step
near ``SLOWDOWN`` times a generation step, so streams keep flowing while a long prompt is
decoded, and the prompt still gets most of the machine.
"""

from __future__ import annotations

SLOWDOWN = 2.5  # a mixed step's time over a generation step's, at most (about)
FIRST_CHUNK = 32  # before any mixed step was measured
MIN_CHUNK = 32  # so a prompt always advances, however slow the model
WEIGHT = 0.3  # of the newest measurement in the running averages


class ChunkSizer:
    """Running averages of a generation step's time and of a prompt token's added time."""

    def __init__(self) -> None:
        self.step_s: float | None = None  # a step of generating streams' tokens alone
        self.token_s: float | None = None  # what each prompt token added to a mixed step

    def observe(self, prompt_tokens: int, other_tokens: int, seconds: float) -> None:
        """A decode of ``prompt_tokens`` prompt tokens beside ``other_tokens`` streams' tokens."""
        if prompt_tokens == 0:
            self.step_s = _average(self.step_s, seconds)
        elif other_tokens > 0 and self.step_s is not None:
            added = max(0.0, seconds - self.step_s) / prompt_tokens
            self.token_s = _average(self.token_s, added)

    def allowance(self, capacity: int) -> int:
        """Prompt tokens the next mixed step may take (of a batch that holds ``capacity``)."""
        if self.step_s is None or not self.token_s:  # (none measured, or only free tokens)
            return max(1, min(capacity, FIRST_CHUNK))
        fits = (SLOWDOWN - 1.0) * self.step_s / self.token_s
        if not fits < capacity:  # (~2,000 steps of free tokens: a denormal, and fits infinite)
            return capacity
        return max(1, min(capacity, max(MIN_CHUNK, int(fits))))


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1.0 - WEIGHT) * old + WEIGHT * new
