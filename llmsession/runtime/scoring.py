"""An exchange asked for ``logprobs``: each token it generates scored, and the scores handed out
with the text they belong to (``text.logprobs`` lines them up)."""

from __future__ import annotations

from dataclasses import replace

from llmsession.native.llama import NativeModel
from llmsession.native.sampler import ScoringSampler
from llmsession.replies import Alternative, Snapshot, TokenLogprob
from llmsession.text.logprobs import LogprobTrail


class Scoring:
    """The scores of one reply's tokens, from its ``ScoringSampler``."""

    def __init__(self, native: NativeModel, sampler: ScoringSampler) -> None:
        self.native, self.sampler = native, sampler
        self.trail = LogprobTrail()

    def note(self, token: int, piece: bytes, text: str, *, sampled: bool) -> None:
        """Score a token of the reply: ``piece`` is its bytes, ``text`` what it completed;
        ``sampled``: the sampler's last pick, else a token a constraint forced after it (the only
        one allowed: log-probability 0)."""
        logprob, top = self.sampler.scored if sampled else (0.0, [(token, 0.0)])
        alternatives = tuple(self._alternative(t, p) for t, p in top[: self.sampler.top])
        self.trail.push(TokenLogprob(text, piece, logprob, alternatives))

    def snapshot(self, snapshot: Snapshot) -> Snapshot:
        """``snapshot`` with the entries of the text it has shown so far."""
        return replace(snapshot, logprobs=self.trail.release(len(snapshot.text)))

    def reply(self, text: str) -> tuple[TokenLogprob, ...]:
        return self.trail.reply(text)

    def _alternative(self, token: int, logprob: float) -> Alternative:
        piece = self.native.piece(token, special=True)  # (an end of turn is named, not "")
        return Alternative(piece.decode("utf-8", errors="replace"), piece, logprob)
