"""The model's picks played from a script, through the real library: each scripted token is
sampled only if the real mask allows it (a constraint's tokens are llguidance's, a reasoning
budget's are forced as ever); a pick the mask forbids is noted and the likeliest allowed token
is taken instead. What is tested is the library's path around the picks (masks, forcing,
splitting, parsing), on any script a model could write, not the tiny model's taste."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import internals
import numpy as np
import pytest

from llmsession import Model
from llmsession.native import constraints
from llmsession.native.sampler import Sampler
from llmsession.runtime import scoring


@dataclass
class Played:
    script: list[int]
    n_vocab: int
    refused: list[int] = field(default_factory=list)  # scripted tokens the mask forbade
    off_script: list[int] = field(default_factory=list)  # forced tokens the script did not hold

    def pick(self, logits: np.ndarray) -> int:
        if not self.script:
            return int(np.argmax(logits))
        token = self.script.pop(0)
        if np.isfinite(logits[token]):
            return token
        self.refused.append(token)
        self.script.clear()  # (off the script from here: the likeliest allowed tokens)
        return int(np.argmax(logits))

    def forced(self, tokens: list[int]) -> None:
        for token in tokens:
            if self.script and self.script[0] == token:
                self.script.pop(0)
            else:
                self.off_script.append(token)
                self.script.clear()


@contextmanager
def scripted(monkeypatch: pytest.MonkeyPatch, model: Model, text: str) -> Iterator[Played]:
    """Replies sampled in the block play ``text``'s tokens, then an end of turn."""
    native = internals.local(model).native
    end = next(t for t in range(native.n_vocab) if native.is_eog(t))
    played = Played([*model.tokenize(text, add_special=False), end], native.n_vocab)
    made = Sampler.from_options

    class Scripted(Sampler):
        def sample(self, context: Any, index: int = -1) -> int:
            return played.pick(context.last_logits(played.n_vocab, index))

        def accept(self, token: int) -> None:
            pass

    def from_options(options: Any, *, n_vocab: int, last_n: int) -> Sampler:
        sampler = made(options, n_vocab=n_vocab, last_n=last_n)
        sampler.__class__ = Scripted
        return sampler

    forced = constraints.GuidedSampler.forced

    def forcing(self: constraints.GuidedSampler) -> list[int]:
        tokens = forced(self)
        played.forced(tokens)
        return tokens

    monkeypatch.setattr(scoring.Sampler, "from_options", staticmethod(from_options))
    monkeypatch.setattr(constraints.GuidedSampler, "forced", forcing)
    yield played
