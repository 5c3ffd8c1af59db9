"""What one fuzzer process shares: the model, the split noise measured on it, the image fixtures,
the step log and the statistics the run prints at the end."""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from test_reuse import split_noise, tolerance_for

from llmsession import Image, Model

LONG_PROMPT = 400  # beyond this many tokens, the split noise measured on 900 tokens applies


@dataclass
class Env:
    model: Model
    noise: float  # split noise on a ~300-token prompt (test_reuse.short_prompt_noise)
    images: dict[str, Image]
    image_paths: dict[str, Path]
    log: TextIO | None = None
    long_noise: float | None = None  # on a ~900-token prompt, measured when first needed

    def noise_at(self, n_tokens: int) -> float:
        """The split noise for a prompt of n_tokens: more positions, more rounding differences."""
        if n_tokens <= LONG_PROMPT:
            return self.noise
        if self.long_noise is None:
            started = time.monotonic()
            self.long_noise = max(self.noise, split_noise(self.model, 900))
            print(
                f"split noise on 900 tokens {self.long_noise:.4f}, tolerance "
                f"{tolerance_for(self.long_noise):.4f} ({time.monotonic() - started:.1f} s)",
                flush=True,
            )
        return self.long_noise


@dataclass
class Stats:
    examples: int = 0
    steps: int = 0
    rules: Counter[str] = field(default_factory=Counter)
    seconds: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    outcomes: Counter[str] = field(default_factory=Counter)
    differentials: int = 0
    largest_logit_difference: float = 0.0
    largest_difference_prompt: int = 0
    largest_choice_margin: float = 0.0

    def summary(self) -> str:
        rules = ", ".join(
            f"{name} {n} ({self.seconds[name]:.1f} s)" for name, n in sorted(self.rules.items())
        )
        outcomes = ", ".join(f"{name} {n}" for name, n in sorted(self.outcomes.items()))
        return (
            f"{self.examples} examples, {self.steps} steps\n"
            f"  rules: {rules}\n"
            f"  outcomes: {outcomes}\n"
            f"  differential checks: {self.differentials}, largest logit difference "
            f"{self.largest_logit_difference:.4f} (prompt of {self.largest_difference_prompt} tokens), "
            f"largest margin of the cached choice {self.largest_choice_margin:.4f}"
        )


STATS = Stats()
_env: Env | None = None


def set_env(value: Env | None) -> None:
    global _env
    _env = value


def env() -> Env:
    """The environment: module state, since hypothesis builds the machine with no arguments."""
    assert _env is not None, "run the fuzzer through fuzz_worker.main()"
    return _env
