"""An exchange asked for ``logprobs``: each token it generates scored, and the scores handed out
with the text they belong to (``text.logprobs`` lines them up)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from llmsession.engine.prompt import Prompt
from llmsession.native.llama import NativeModel
from llmsession.native.sampler import Sampler, ScoringSampler, TokenSampler
from llmsession.options import GenerationOptions
from llmsession.replies import Alternative, Snapshot, TokenLogprob
from llmsession.text.detokenize import completes
from llmsession.text.logprobs import LogprobTrail

if TYPE_CHECKING:
    from llmsession.native.constraints import Constraint


class Scoring:
    """The scores of one reply's tokens, from its ``ScoringSampler``."""

    def __init__(self, native: NativeModel, sampler: ScoringSampler) -> None:
        self.native, self.sampler = native, sampler
        self.trail = LogprobTrail()

    def note(self, token: int, piece: bytes, text: str, held: bytes, *, sampled: bool) -> None:
        """Score a token of the reply: ``piece`` is its bytes, ``text`` what it completed after
        the ``held`` bytes of a character before it; ``sampled``: the sampler's last pick, else a
        token a constraint forced after it (the only one allowed: log-probability 0)."""
        logprob, top = self.sampler.scored if sampled else (0.0, [(token, 0.0)])
        alternatives = tuple(self._alternative(t, p, held) for t, p in top[: self.sampler.top])
        self.trail.push(TokenLogprob(text, piece, logprob, alternatives))

    def snapshot(self, snapshot: Snapshot) -> Snapshot:
        """``snapshot`` with the entries of the text it has shown so far."""
        return replace(snapshot, logprobs=self.trail.release(len(snapshot.text)))

    def reply(self, text: str) -> tuple[TokenLogprob, ...]:
        return self.trail.reply(text)

    def _alternative(self, token: int, logprob: float, held: bytes) -> Alternative:
        """An alternative spelled as the chosen token is: the text it would have completed
        there ("" for the first bytes of a character, as the chosen token's)."""
        piece = self.native.piece(token, special=True)  # (an end of turn is named, not "")
        return Alternative(completes(held, piece), piece, logprob)


def sampler_for(
    options: GenerationOptions,
    native: NativeModel,
    context_size: int,
    prompt: Prompt,
    constraint: Constraint | None,
    waits: Callable[[], bool] | None = None,
) -> tuple[TokenSampler, Scoring | None]:
    """An exchange's sampler chain, its penalty window primed with the prompt's tokens, held to
    its constraint if it has one (which has not begun while ``waits()``: ``GuidedSampler``);
    and its scoring, if ``logprobs`` are asked for."""
    n_vocab = native.n_vocab
    # -1 is "the whole context"; llama.cpp sizes a ring buffer by it, so never more than that
    window = options.repeat_last_n
    last_n = context_size if window == -1 else min(window, context_size)
    sampler = Sampler.from_options(options, n_vocab=n_vocab, last_n=last_n)
    if options.penalized and last_n > 0:
        for token in prompt.tokens()[-last_n:]:
            sampler.accept(token)
    held: TokenSampler = sampler if constraint is None else constraint.sampler(sampler, n_vocab, waits)
    if options.logprobs is None:
        return held, None
    scorer = ScoringSampler(held, n_vocab, options.logprobs)
    return scorer, Scoring(native, scorer)
