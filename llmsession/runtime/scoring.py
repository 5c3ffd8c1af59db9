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
from llmsession.text.reasoning import Splitter

if TYPE_CHECKING:
    from llmsession.native.constraints import Constraint
    from llmsession.runtime.thinking import Thinking


class Scoring:
    """The scores of one reply's tokens, from its ``ScoringSampler``."""

    def __init__(self, native: NativeModel, sampler: ScoringSampler) -> None:
        self.native, self.sampler = native, sampler
        self.trail = LogprobTrail()
        self._waiting: list[TokenLogprob] = []  # (``note_split``: tokens whose text is held)

    def note(self, token: int, piece: bytes, text: str, held: bytes, *, sampled: bool) -> None:
        """Score a token of the reply: ``piece`` is its bytes, ``text`` what it completed after
        the ``held`` bytes of a character before it; ``sampled``: the sampler's last pick, else a
        token a constraint forced after it (the only one allowed: log-probability 0)."""
        self.trail.push(self._entry(token, piece, text, held, sampled))

    def noted(
        self,
        token: int,
        piece: bytes,
        text: str,
        content: str,
        held: bytes,
        sampled: bool,
        thinking: Thinking | None,
    ) -> None:
        """``note``, or ``note_split`` where the reply is split into reasoning and content."""
        if thinking is None:
            self.note(token, piece, text, held, sampled=sampled)
        else:
            self.note_split(token, piece, text, content, held, sampled=sampled, splitter=thinking.splitter)

    def note_split(
        self,
        token: int,
        piece: bytes,
        text: str,
        content: str,
        held: bytes,
        *,
        sampled: bool,
        splitter: Splitter,
    ) -> None:
        """Score a token of a reply ``splitter`` splits into reasoning and content, as ``note``:
        ``text`` what it completed, ``content`` what of the held text came out as content with
        it. Its entry is its share of the content: a token whose text the splitter holds (a
        marker's start, the whitespace before one) waits until the content comes out (the tail
        of what was held: shared from the end) or the text goes as reasoning or markup (no
        entries). A held token's score was lost, and the next token's entry spelled both texts
        with its own bytes."""
        self._waiting.append(self._entry(token, piece, text, held, sampled))
        answering = splitter.done and not splitter.inside
        if content or (not splitter.holding and answering and not text):  # (a character's first bytes)
            self.settle(content)
        elif not splitter.holding and text:  # (its text, and what was held, is reasoning or markup)
            self._waiting.clear()
        # (else it waits: held, or a character's first bytes before the splitter knows where)

    def flushed(self, content: str) -> None:
        """The reply's end: what the splitter held came out as ``content`` (none: the waiting
        tokens were reasoning or markup, and have no entries)."""
        if content:
            self.settle(content)
        self._waiting.clear()

    def settle(self, content: str) -> None:
        """The waiting tokens' entries, ``content`` shared among them from the end (the first
        takes what is left; a token whose text is empty, the first bytes of a character, says
        "" where it lies within the content); those before the content have none."""
        waiting, self._waiting, end = self._waiting, [], len(content)
        shares: list[TokenLogprob] = []
        for position, entry in enumerate(reversed(waiting)):
            if end == 0 and position > 0 and entry.token:  # (a character's first bytes: its own)
                break
            size = end if position == len(waiting) - 1 else min(len(entry.token), end)
            shares.append(replace(entry, token=content[end - size : end]))
            end -= size
        for entry in reversed(shares):
            self.trail.push(entry)

    def _entry(self, token: int, piece: bytes, text: str, held: bytes, sampled: bool) -> TokenLogprob:
        logprob, top = self.sampler.scored if sampled else (0.0, [(token, 0.0)])
        alternatives = tuple(self._alternative(t, p, held) for t, p in top[: self.sampler.top])
        return TokenLogprob(text, piece, logprob, alternatives)

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
