"""llama.cpp's sampler chains: what an exchange samples its tokens with. Part of the native layer
(see ``native``): sampling runs in C (the chain, or numpy's argmax for a greedy pick), never per
token over the vocabulary in Python."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from llmsession.errors import ModelOutputError
from llmsession.native.context import NativeContext
from llmsession.native.llama import (
    bindings,
    not_null,
)
from llmsession.options import LLAMA_DEFAULT_SEED, GenerationOptions


class TokenSampler(Protocol):
    """What an exchange samples with: a ``Sampler``, or one held to a constraint."""

    def sample(self, context: NativeContext, index: int = -1) -> int: ...
    def forced(self) -> list[int]: ...
    def accept(self, token: int) -> None: ...
    def give_way(self, tokens: Sequence[int]) -> bool: ...
    def catch_up(self, tokens: Sequence[int]) -> None: ...
    def takes(self, tokens: Sequence[int]) -> bool: ...
    def close(self) -> None: ...
    @property
    def complete(self) -> bool: ...
    @property
    def finished(self) -> bool: ...


class Sampler:
    """Owns a ``llama_sampler`` chain; sampling runs in C, never per token over the vocabulary in Python."""

    def __init__(
        self, links: Sequence[Callable[[Any], Any]], *, argmax_of: int = 0, n_vocab: int = 0
    ) -> None:
        """``argmax_of``: the chain is llama.cpp's greedy pick alone over that many logits, so
        ``sample`` takes their first maximum itself, as the greedy sampler does: it need not
        copy the whole vocabulary into candidates first (0.09 ms a token on a 49k vocabulary,
        against 0.01). ``n_vocab``: the logits a sample checks first (``finite``)."""
        self.argmax_of, self.n_vocab = argmax_of, n_vocab
        lib, _ = bindings()
        params = lib.llama_sampler_chain_default_params()
        params.no_perf = True
        self.ptr = not_null(lib.llama_sampler_chain_init(params), "llama_sampler_chain_init")
        self._free = weakref.finalize(self, lib.llama_sampler_free, self.ptr)
        for make in links:
            lib.llama_sampler_chain_add(self.ptr, not_null(make(lib), "creating a sampler"))

    @classmethod
    def from_options(cls, o: GenerationOptions, *, n_vocab: int, last_n: int) -> Sampler:
        """The llama.cpp sampler chain for these options (penalties over the ``last_n`` latest
        tokens, then truncation, then the pick)."""
        links: list[Callable[[Any], Any]] = []
        if o.penalized:
            penalties = (n_vocab, last_n, o.repeat_penalty, o.frequency_penalty, o.presence_penalty)
            links.append(lambda lib: lib.llama_sampler_init_penalties(*penalties))
        if o.greedy:
            links.append(lambda lib: lib.llama_sampler_init_greedy())
            if len(links) == 1:
                return cls(links, argmax_of=n_vocab, n_vocab=n_vocab)
        else:
            seed = LLAMA_DEFAULT_SEED if o.seed is None else o.seed
            links += [
                lambda lib: lib.llama_sampler_init_top_k(o.top_k),
                lambda lib: lib.llama_sampler_init_top_p(o.top_p, 1),
                lambda lib: lib.llama_sampler_init_min_p(o.min_p, 1),
                lambda lib: lib.llama_sampler_init_temp(o.temperature),
                lambda lib: lib.llama_sampler_init_dist(seed),
            ]
        return cls(links, n_vocab=n_vocab)

    def accept(self, token: int) -> None:
        bindings()[0].llama_sampler_accept(self.ptr, token)

    def sample(self, context: NativeContext, index: int = -1) -> int:
        """The next token from the logits of the last decode's token at batch ``index``;
        ``ModelOutputError`` if they hold a NaN or an infinity (a broken file's: its greedy pick
        was the first NaN's token, an end of turn, so its reply was silently empty)."""
        if self.argmax_of:  # (the greedy sampler accepts nothing: no state to keep up)
            logits = context.last_logits(self.argmax_of, index)
            token = int(np.argmax(logits))  # (a NaN is the largest: the first one is picked)
            finite(float(logits[token]))
            return token
        if self.n_vocab:  # (~10 us a token on a 49k vocabulary: a NaN anywhere makes the max one)
            finite(float(context.last_logits(self.n_vocab, index).max()))
        return int(bindings()[0].llama_sampler_sample(self.ptr, context.ptr, index))

    def forced(self) -> list[int]:
        """Tokens that must follow the last sample (a constraint may force some): none here."""
        return []

    def give_way(self, tokens: Sequence[int]) -> bool:
        """The last sample is dropped for ``tokens`` (a forced marker): the penalties see them."""
        for token in tokens:
            self.accept(token)
        return True

    def catch_up(self, tokens: Sequence[int]) -> None:
        """Tokens a constraint must see before it begins: there is none."""

    def takes(self, tokens: Sequence[int]) -> bool:
        """Whether a constraint would take ``tokens`` next: there is none to refuse them."""
        return True

    @property
    def complete(self) -> bool:
        """Whether a constraint is satisfied (there is none)."""
        return False

    @property
    def finished(self) -> bool:
        """Whether a constraint allows nothing more (there is none)."""
        return False

    def close(self) -> None:
        self._free()


def finite(largest: float) -> None:
    """Refuse logits whose largest is not finite (NaN, or an infinity): no token is a pick."""
    if not math.isfinite(largest):
        raise ModelOutputError(
            f"the model computed logits that are not finite ({largest}): its file is broken or "
            "mis-converted (a metadata value such as a rope base or a norm's epsilon), or its build "
            "computes it wrongly; no reply can be sampled from them"
        )


class ScoringSampler:
    """A sampler that also scores what it picks: the picked token's log-probability and the
    ``top`` likeliest tokens', from the logits it sampled from (after a constraint's mask, so
    under a constraint they are the constrained distribution's; before penalties, temperature
    and truncation, as OpenAI's and llama-server's default ``logprobs`` are)."""

    def __init__(self, inner: TokenSampler, n_vocab: int, top: int) -> None:
        self.inner, self.n_vocab, self.top = inner, n_vocab, top
        self.scored: tuple[float, list[tuple[int, float]]] = (0.0, [])

    def sample(self, context: NativeContext, index: int = -1) -> int:
        token = self.inner.sample(context, index)
        self.scored = log_softmax_top(context.last_logits(self.n_vocab, index), token, self.top)
        return token

    def forced(self) -> list[int]:
        return self.inner.forced()

    def accept(self, token: int) -> None:
        self.inner.accept(token)

    def give_way(self, tokens: Sequence[int]) -> bool:
        return self.inner.give_way(tokens)

    def catch_up(self, tokens: Sequence[int]) -> None:
        self.inner.catch_up(tokens)

    def takes(self, tokens: Sequence[int]) -> bool:
        return self.inner.takes(tokens)

    def close(self) -> None:
        self.inner.close()

    @property
    def complete(self) -> bool:
        return self.inner.complete

    @property
    def finished(self) -> bool:
        return self.inner.finished


def log_softmax_top(logits: np.ndarray, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """``token``'s log-probability under ``logits`` and the ``top`` likeliest tokens' (id,
    log-probability), likeliest first, leaving out tokens a constraint forbids (-inf: fewer than
    ``top`` may be allowed); one pass over the vocabulary in numpy."""
    peak = float(np.max(logits))
    log_total = peak + float(np.log(np.sum(np.exp(logits - peak, dtype=np.float64))))
    best: list[tuple[int, float]] = []
    if top:
        ids = np.argpartition(-logits, top - 1)[:top]
        ids = ids[np.argsort(-logits[ids], kind="stable")]
        best = [(int(i), float(logits[i]) - log_total) for i in ids if np.isfinite(logits[i])]
    return float(logits[token]) - log_total, best
