"""Structured output: replies held to a JSON schema, a regex or a grammar by llguidance.

Per token, llguidance computes the set of tokens the constraint allows (a bitmask, about 0.05 ms
on a 49k vocabulary); the others' logits are set to -inf in llama.cpp's own logits buffer and the
usual C sampler chain picks from the rest, so temperature, top-k and penalties keep working.
Tokens the constraint forces (a JSON key after its opening quote, say) are not sampled: they are
decoded together in the next batch. The reply ends when the constraint is complete. llama.cpp's
own grammar sampler is not used: it aborts the process on some tokens it forbids.

The matcher's tokenizer comes from the GGUF vocabulary alone: each token's bytes with special
tokens spelled out, control tokens marked with a 0xFF prefix (llguidance's convention), and every
end-of-generation id as an end (SmolLM2 ends turns with ``<|im_end|>``, not its ``eos``).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np

from llmsession.errors import GrammarError, ReplyMismatchError
from llmsession.native.context import NativeContext
from llmsession.native.llama import NativeModel
from llmsession.native.sampler import Sampler
from llmsession.options import GenerationOptions
from llmsession.text.ecma import masked
from llmsession.text.schemas import after_reply_validator, schema_document, validator_of, violation

log = logging.getLogger("llmsession")
COMPACT = {"whitespace_flexible": False}  # small models given free whitespace may never stop


class _Vocabulary:
    """What ``llguidance.TokenizerWrapper`` reads from a tokenizer, from the GGUF."""

    def __init__(self, native: NativeModel) -> None:
        pieces, control, self.eog = native.vocabulary()
        self.tokens = [b"\xff" + piece if ctl else piece for piece, ctl in zip(pieces, control, strict=True)]
        self.special_token_ids = [token for token, ctl in enumerate(control) if ctl]
        self.eos_token_id = self.eog[0] if self.eog else native.eos()
        self.bos_token_id = native.bos() if native.bos() >= 0 else None
        self._native = native

    def __call__(self, data: bytes) -> list[int]:
        return self._native.tokenize_bytes(data, add_special=False, parse_special=False)


def tokenizer(native: NativeModel) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for a model (about 0.3 s at 49k tokens: build it once per model)."""
    vocabulary = _Vocabulary(native)
    wrapper = llguidance.TokenizerWrapper(vocabulary)
    return llguidance.LLTokenizer(wrapper, n_vocab=native.n_vocab, eos_token=vocabulary.eog or None)


MAX_SAID = 500  # characters of llguidance's own words in an error
BACKTRACE = re.compile(r"\s*<backtrace>.*?(</backtrace>|$)", re.DOTALL)  # (its panics carry one)
COMPILE = {**COMPACT, "lenient": True}  # keywords the mask cannot enforce: checked after


@dataclass(frozen=True)
class Constraint:
    """A constraint compiled for one model's tokenizer; ``sampler()`` starts a reply under it."""

    matcher: llguidance.LLMatcher  # compiled and untouched: each reply works on a copy
    end: int  # the end-of-generation token that follows a complete reply
    schema_class: type | None = None  # a pydantic model: replies are parsed into it
    json: bool = False
    validator: Any = None  # the whole JSON schema, where the mask leaves keywords to it
    ends: tuple[int, ...] = ()  # every end-of-generation token (none while a constraint waits)
    opened: bool = False  # it holds the reply's reasoning and its answer's header too (``compile``)
    plain: bool = False  # it holds where the text goes, not what it says: its end is a plain stop

    @classmethod
    def compile(
        cls,
        options: GenerationOptions,
        tokenizer: llguidance.LLTokenizer,
        opening: Callable[[str], str] | None = None,
    ) -> Constraint:
        """Raise GrammarError (naming what is wrong) for a constraint that cannot be used.
        ``opening``: the Lark grammar of a reply that reasons, then answers with the item it is
        given (gpt-oss's channels, ``tool_grammar.answered``): the schema, regex or grammar then
        holds the answer, not the reply's first token."""
        schema_class, kind, whole = None, "grammar", None
        try:
            if options.json_schema is not None:
                kind = "json_schema"
                schema_class, document = schema_document(options.json_schema)
                whole = validator_of(document)  # GrammarError if invalid
                document = masked(document)  # (its patterns as ECMA reads them: ``ecma``)
                if opening is not None:
                    given = document.get("x-guidance")
                    layout = {**COMPILE, **given} if isinstance(given, dict) else COMPILE
                    grammar = llguidance.grammar_from(
                        "lark", opening("%json " + json.dumps({**document, "x-guidance": layout}))
                    )
                else:
                    grammar = llguidance.LLMatcher.grammar_from_json_schema(document, defaults=COMPILE)  # type: ignore[arg-type]
            else:
                if options.regex is not None:
                    kind, grammar = "regex", llguidance.LLMatcher.grammar_from_regex(options.regex)
                else:
                    assert options.grammar is not None
                    grammar = llguidance.grammar_from("grammar", options.grammar)
                if opening is not None:
                    grammar = _nested(grammar, opening)
        except (ValueError, TypeError, RecursionError) as error:  # bad GBNF, an unusable schema
            if isinstance(error, GrammarError):
                raise
            raise GrammarError(f"{kind}: {said(str(error))}") from None
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)  # compiles it once
        if matcher.is_error():
            raise GrammarError(f"{kind}: {said(matcher.get_error())}")
        warnings = matcher.get_grammar_warnings()
        for warning in warnings:
            log.info("%s: %s", kind, warning)
        validator = None if whole is None else after_reply_validator(whole, warnings)
        return cls(
            matcher,
            tokenizer.eos_token,
            schema_class,
            json=kind == "json_schema",
            validator=validator,
            ends=tuple(tokenizer.eos_tokens),
            opened=opening is not None,
        )

    @classmethod
    def from_lark(
        cls, lark: str, tokenizer: llguidance.LLTokenizer, kind: str = "tools", *, plain: bool = False
    ) -> Constraint:
        """A constraint from a Lark grammar this library wrote (tool calls; ``plain``: where a
        reply's free text goes): GrammarError if llguidance refuses it (a tool's schema it
        cannot take, say)."""
        try:
            grammar = llguidance.grammar_from("lark", lark)
        except (ValueError, TypeError, RecursionError) as error:
            raise GrammarError(f"{kind}: {said(str(error))}") from None
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{kind}: {said(matcher.get_error())}")
        return cls(matcher, tokenizer.eos_token, ends=tuple(tokenizer.eos_tokens), plain=plain)

    def sampler(self, chain: Sampler, n_vocab: int, waits: Callable[[], bool] | None = None) -> GuidedSampler:
        """A reply's sampler under this constraint (``GuidedSampler`` says what ``waits`` does)."""
        return GuidedSampler(
            chain,
            self.matcher.deep_copy(),
            n_vocab,
            end=self.end,
            ends=self.ends,
            waits=waits,
            plain=self.plain,
        )

    def parse(self, text: str) -> Any:
        """A complete JSON reply as an object (a ``schema_class`` instance when there is one);
        ValueError if it breaks a keyword of its schema the mask could not enforce."""
        if not self.json:
            return None
        try:
            value = json.loads(text)
        except RecursionError:
            raise ValueError("the reply is nested too deep to parse") from None
        problem = violation(self.validator, value) if self.validator is not None else ""
        if problem:
            raise ValueError(problem)
        if self.schema_class is not None:
            return self.schema_class.model_validate_json(text)  # type: ignore[attr-defined]
        return value


def _nested(grammar: str, opening: Callable[[str], str]) -> str:
    """A regex's or a grammar's llguidance grammar (``grammar``: JSON of a grammar list, or Lark
    text) as the answer ``opening`` wraps: nested by name, its rules kept apart from the
    wrapper's."""
    listed = grammar.lstrip().startswith("{")
    nested = json.loads(grammar)["grammars"][0] if listed else {"lark_grammar": grammar}
    nested = {**nested, "name": "answer_body"}
    return json.dumps({"grammars": [{"lark_grammar": opening("@answer_body")}, nested]})


class GuidedSampler:
    """A sampler chain held to a constraint: masks the logits, samples, advances the matcher.

    While ``waits()`` says so (a reasoning block the prompt opened is still open), the constraint
    has not begun: tokens are sampled without its mask and not fed to its matcher, except that
    the reply may not end (``ends`` masked) before its constraint had its say."""

    def __init__(
        self,
        chain: Sampler,
        matcher: llguidance.LLMatcher,
        n_vocab: int,
        *,
        end: int,
        ends: Sequence[int] = (),
        waits: Callable[[], bool] | None = None,
        plain: bool = False,
    ) -> None:
        self.chain, self.matcher, self.n_vocab, self.end = chain, matcher, n_vocab, end
        self.plain = plain  # (never ``complete``: a reply ends as a plain one does)
        self.mask = np.full((n_vocab + 31) // 32, -1, dtype=np.int32)
        self.ends = np.array(sorted({end, *ends}), dtype=np.int64)
        self.waits = waits
        self._last: int | None = None  # the last sampled token, while the matcher holds it

    @property
    def complete(self) -> bool:
        """The reply so far satisfies the constraint (it may still allow more: ``12`` of an
        integer); never, where the constraint holds no more than where plain text goes."""
        return not self.plain and bool(self.matcher.is_accepting())

    @property
    def finished(self) -> bool:
        """The constraint allows nothing more: a reply cut here is whole, not cut short."""
        return not self.waiting and bool(self.matcher.is_stopped())

    def accept(self, token: int) -> None:
        self.chain.accept(token)

    def restrict(self, logits: np.ndarray) -> None:
        """Set the logits of every token the constraint forbids next to -inf."""
        self.matcher.unsafe_compute_mask_ptr(self.mask.ctypes.data, self.mask.nbytes)
        self._check()
        allowed = np.unpackbits(self.mask.view(np.uint8), count=self.n_vocab, bitorder="little")
        logits[allowed == 0] = -np.inf

    def sample(self, context: NativeContext, index: int = -1) -> int:
        logits = context.last_logits(self.n_vocab, index)
        if self.waiting:
            logits[self.ends] = -np.inf
            self._last = None
            return self.chain.sample(context, index)
        self.restrict(logits)
        token = self.chain.sample(context, index)
        if not self.matcher.consume_token(token):
            self._check(reply=True)
        self._last = token
        return token

    @property
    def waiting(self) -> bool:
        return self.waits is not None and self.waits()

    def give_way(self, tokens: Sequence[int]) -> bool:
        """The last sampled token is dropped for ``tokens`` (the marker a reasoning budget forces):
        False, and nothing changed, if the constraint does not allow them in its place."""
        if self._last is not None:
            self.matcher.rollback(1)
            if self.matcher.validate_tokens(list(tokens)) < len(tokens):
                self.matcher.consume_token(self._last)  # (as it was)
                return False
            if not self.matcher.consume_tokens(list(tokens)):
                self._check(reply=True)
            self._last = None
        for token in tokens:
            self.chain.accept(token)
        return True

    def catch_up(self, tokens: Sequence[int]) -> None:
        """The constraint begins with ``tokens``: content the reply wrote in the token that
        closed its reasoning, before the matcher saw any (GrammarError if it does not allow them)."""
        if not self.takes(tokens):
            raise ReplyMismatchError("the reply's content after its reasoning does not match its constraint")
        if not self.matcher.consume_tokens(list(tokens)):
            self._check(reply=True)

    def takes(self, tokens: Sequence[int]) -> bool:
        """Whether the constraint would take ``tokens`` next (nothing changes)."""
        return bool(self.matcher.validate_tokens(list(tokens)) == len(tokens))

    def forced(self) -> list[int]:
        """The tokens the constraint allows next and no other: decoded with the sampled one. Once
        it is complete and allows nothing more, the end of generation (nothing after a sampled
        end: the reply is over). None while it waits."""
        if self.waiting:
            return []
        if self.matcher.is_stopped():
            return [] if self._last is not None and self._last in self.ends else [self.end]
        tokens = self.matcher.compute_ff_tokens()
        if tokens and not self.matcher.consume_tokens(tokens):
            self._check()
        if tokens:
            self._last = None  # (the sampled token is no longer the matcher's last)
        for token in tokens:
            self.chain.accept(token)
        return tokens

    def close(self) -> None:
        self.chain.close()

    def _check(self, *, reply: bool = False) -> None:
        """A GrammarError if the matcher failed: where no token can go on (the constraint's
        fault: nothing satisfies it), or past one of its limits whatever the reply (a constraint
        too large to follow: a regex's ``a{1000000}``, a schema that only recurses), or a
        ``reply`` token it refused (ReplyMismatchError: the request was fine)."""
        if self.matcher.is_error():  # (its first line: what follows is llguidance's state, its stats)
            said = self.matcher.get_error().split("\n", 1)[0][:200]
            failed = ReplyMismatchError if reply and not LIMITS.search(said) else GrammarError
            raise failed(f"the constraint's matcher failed: {said} (no reply can go on from here)")


# What llguidance says when a grammar outgrows its limits as it is followed (its lexer's and
# parser's: expressions, fuel, items, states, sizes), not when a token is refused.
# (Its own phrases only: a refused token is quoted in the message, and may spell "limit".)
LIMITS = re.compile(
    r"too many expressions constructed|Too many items \(limit|fuel exhausted|too big \(limit"
    r"|too many states|exceeded the maximum number"
)


def said(text: str) -> str:
    """What llguidance said of a grammar it refused, for the caller: without the backtrace of
    its panics (a grammar too large for it, say), at most ``MAX_SAID`` characters."""
    text = BACKTRACE.sub("", text).strip()
    return text if len(text) <= MAX_SAID else f"{text[: MAX_SAID - 3]}..."
