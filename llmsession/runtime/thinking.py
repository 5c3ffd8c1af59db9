"""An exchange's reasoning stage, between its detokenizer and its stop strings: each token's
text split into reasoning and content (``text.reasoning.Splitter``), the reasoning gathered for
the next snapshot and the reply, the block's tokens counted, and, at ``reasoning_budget``, the
tokens that close the block handed to the exchange to force in place of the next sampled one.

Under a constraint (a schema, a grammar, tools): a block the generation prompt opened is the
reply's reasoning, and the constraint begins where it closes (``waits``); a block the reply
opens itself is one its constraint let it write, so the constraint holds it too, and a budget
closes it at the first token where the constraint allows the closing marker."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

from llmsession.engine.prompt import Prompt
from llmsession.native.llama import NativeModel
from llmsession.native.sampler import TokenSampler
from llmsession.replies import Usage
from llmsession.text.reasoning import Markers, Splitter, opened
from llmsession.text.tool_grammar import begins_special

PROMPT_TAIL = 16  # tokens of a prompt read for an open reasoning block (its generation prompt)


class Thinking:
    """One reply's reasoning so far, and what the exchange must do about it."""

    def __init__(
        self,
        splitter: Splitter,
        closing: Sequence[int],
        budget: int | None,
        spelled: frozenset[int] = frozenset(),
        resumed: Sequence[int] = (),
        calls: bool = False,
        message_ends: tuple[frozenset[int], frozenset[int]] = (frozenset(), frozenset()),
        native: NativeModel | None = None,
        held: bool = False,
    ) -> None:
        self.splitter, self.closing, self.budget = splitter, tuple(closing), budget
        self.message_ends = message_ends  # the markup's tokens that end the answer (``Markup``)
        self.native = native  # (its tokens' text: ``trim``)
        self.held = held  # a constraint holds the reply (tools' too): ``trim`` looks
        self.calls = calls  # the reply may call (a call holds channel tags)
        closings = (tuple(resumed), self.closing) if calls else (self.closing, tuple(resumed))
        self.closings = tuple(c for c in closings if c)  # (the first its constraint allows)
        self.spelled = spelled  # the markers' special tokens: their text is needed to split
        self.reasoning = ""  # the reply's, so far
        self.pending = ""  # not yet in a snapshot
        self._closed = False  # closed at the budget (once)
        self.forced_from: int | None = None  # where the closing tokens start among the pending ones
        self.prompted = splitter.inside  # the generation prompt opened the block
        self.after_close = ""  # content the token that closed a prompted block went on with

    def ends(self, token: int) -> bool:
        """``token`` ends the reply: after the content began, the closing marker, which closes
        the answer's message (gpt-oss's final channel: llama.cpp does not count it as an end of
        generation, since it closes the analysis too), or a new message's header; in a reply
        that may not call, any tag of the markup (a call holds channel tags; where it may
        follow, the tools grammar keeps them out of an answer). The content cannot hold them:
        gpt-oss's template refuses channel tags there, and every later turn would fail."""
        always, tags = self.message_ends
        return self.splitter.answering and (token in always or (token in tags and not self.calls))

    def waits(self) -> bool:
        """A constraint has not begun: the block the prompt opened is still open."""
        return self.prompted and self.splitter.inside

    @property
    def preamble(self) -> str:
        return self.splitter.preamble

    def split(self, text: str, usage: Usage, *, counted: bool = True) -> str:
        """A token's text less the reasoning it holds, counted as a reasoning token if the model
        generated it in the block (``counted``: not a closing marker the budget forced; nor the
        channel's name, Gemma 4's ``thought``, unless the token holds reasoning too)."""
        splitter = self.splitter
        was_started, was_done, was_waiting = splitter.started, splitter.done, self.waits()
        was_label = splitter.labelling
        thought, content = splitter.push(text)
        if counted and was_started and not was_done and not (was_label and not thought):
            usage.reasoning_tokens += 1  # (not the token that opened the block)
        self._think(thought)
        self.after_close = content if was_waiting else ""
        return content

    def flush(self) -> str:
        """The reply's end: the reasoning held back noted, the content held back returned."""
        thought, content = self.splitter.flush()
        self._think(thought)
        return content

    def take(self) -> str:
        """The reasoning for the next snapshot."""
        taken, self.pending = self.pending, ""
        return taken

    def cut(self, usage: Usage, at: int, allowed: Callable[[Sequence[int]], bool]) -> list[int]:
        """The tokens that close the block once it has had its budget and ``allowed`` takes them
        in place of the sampled token (once; ``at``: where they will start among the pending
        tokens), else none. ``resumed`` (gpt-oss's marker and a new message's header, without
        the final channel's) comes first in a reply that may call, so a call may still follow;
        elsewhere it closes the block only where its constraint takes nothing else."""
        self.forced_from = None
        if self.budget is None or not self.splitter.inside or self._closed:
            return []
        if usage.reasoning_tokens < self.budget:
            return []
        for closing in self.closings:
            if allowed(closing):
                self._closed, self.forced_from = True, at
                return list(closing)
        return []

    def instead(self, usage: Usage, at: int, token: int, sampler: TokenSampler) -> list[int]:
        """The tokens that go in place of the sampled ``token`` (``cut``, ``trim``), or none."""
        return self.cut(usage, at, sampler.give_way) or self.trim(token, sampler)

    def trim(self, token: int, sampler: TokenSampler) -> list[int]:
        """In place of a sampled ``token`` that closes the block the prompt opened and goes on
        with content its constraint refuses (a text marker's last piece with a stop after it,
        ``>.`` for ``</think>``): the tokens of its text up to the marker's end, so the
        constraint begins where the content does (taken, else the reply would end in a
        GrammarError). Nothing otherwise."""
        native = self.native
        if token < 0 or native is None or not self.held or not self.waits():
            return []
        text = native.piece(token, special=token in self.spelled).decode("utf-8", "ignore")
        tail = self.splitter.closing_tail(text)
        tokenize = partial(native.tokenize, add_special=False, parse_special=False)
        if not tail or sampler.takes(tokenize(tail)):
            return []
        kept = tokenize(text[: len(text) - len(tail)])
        return kept if sampler.give_way(kept) else []

    def draftable(self, drafts: list[int]) -> list[int]:
        """The drafts a step may verify. Under a budget, none inside the block and none from the
        token that opens one on: the budget counts each token of a block and closes it in place
        of a sampled one, which it reads before the step's drafts (a block opened by the last of
        them let one more token in), so a reply with drafts is cut where it is without them."""
        splitter = self.splitter  # (its content may open no other block but gpt-oss's)
        if (
            self.budget is None
            or self._closed
            or not drafts
            or (splitter.done and not splitter.markers.nested)
        ):
            return drafts
        if splitter.inside or self.native is None:
            return []
        twin, native = splitter.copy(), self.native
        for i, token in enumerate(drafts):
            twin.push(native.piece(token, special=token in self.spelled).decode("utf-8", "ignore"))
            if twin.inside:
                return drafts[:i]
        return drafts

    def forced(self, index: int) -> bool:
        """Whether the pending token at ``index`` is one the budget forced."""
        return self.forced_from is not None and index >= self.forced_from

    def _think(self, thought: str) -> None:
        self.reasoning += thought
        self.pending += thought


@dataclass(frozen=True)
class Markup:
    """A model's reasoning markers and their tokens, read once when it loads: what closes a
    block (forced at a budget) and the markers that are single special tokens (their text is
    needed to split)."""

    markers: Markers
    closing: tuple[int, ...]  # the closing marker between newlines, as templates write it
    bare: tuple[int, ...]  # the marker after a newline alone (a constraint decides what follows)
    spelled: frozenset[int]
    special: Mapping[str, int]  # the markers' special tokens, by spelling (as real vocabularies hold them)
    resumed: tuple[int, ...] = ()  # the marker and a new message's header (gpt-oss: calls may follow)
    close: tuple[int, ...] = ()  # the closing marker alone, where there is a header (gpt-oss)
    # gpt-oss's: what ends the answer once it began (the closing marker and a new message's
    # header) and what ends it too in a reply that may not call (every tag of the markup)
    message_ends: tuple[frozenset[int], frozenset[int]] = (frozenset(), frozenset())

    @property
    def grammar_markers(self) -> Markers | None:
        """The markers a tool grammar lets a reply open its reasoning with: only ones that begin
        with a special token, which free text cannot spell (text markers are free text already)."""
        markers = self.markers
        if begins_special(markers.open, self.special) and begins_special(markers.close, self.special):
            return markers
        return None


def markup_for(native: NativeModel, markers: Markers | None) -> Markup | None:
    if markers is None:
        return None
    closing = native.tokenize(markers.closing, add_special=False, parse_special=True)
    bare = native.tokenize(markers.bare, add_special=False, parse_special=True)
    single = {
        marker: ids[0]
        for marker in (markers.open, markers.close)
        if len(ids := native.tokenize(marker, add_special=False, parse_special=True)) == 1
    }
    special = {  # (each special token the markers hold, by its spelling: gpt-oss's are several)
        native.detokenize([token], special=True): token
        for marker in (markers.open, markers.close, markers.resume)
        if marker
        for token in native.tokenize(marker, add_special=False, parse_special=True)
        if native.is_special(token)
    }
    spelled = frozenset(single.values()) | frozenset(special.values())
    resumed = markers.close + markers.resume if markers.resume else ""
    resumed_ids = native.tokenize(resumed, add_special=False, parse_special=True) if resumed else []
    close = native.tokenize(markers.close, add_special=False, parse_special=True) if resumed else []
    nested = special if markers.nested else {}
    always = frozenset(  # (the closing marker's tag and a new message's: ``<|end|>``, ``<|start|>``)
        t for s, t in nested.items() if markers.close.startswith(s) or markers.resume.startswith(s)
    )
    ends = (always, frozenset(nested.values()))
    return Markup(
        markers, tuple(closing), tuple(bare), spelled, special, tuple(resumed_ids), tuple(close), ends
    )


def thinking(
    native: NativeModel,
    markup: Markup | None,
    prompt: Prompt,
    budget: int | None,
    held: bool = False,
    calls: bool = False,
) -> Thinking | None:
    """The reasoning stage of a reply to ``prompt`` on a template with reasoning ``markup``
    (None without): inside the block from the start if the generation prompt opened it.
    ``held``: a constraint other than tools holds the reply; after a block the prompt opened, the
    content keeps its leading whitespace, which that constraint saw, and a budget closes the
    block without the blank line templates put after it (the constraint decides what follows).
    ``calls``: the reply may make tool calls; after a block the prompt opened, the tools'
    grammar begins at the block's end, so a budget forces the closing marker alone (gpt-oss:
    the grammar writes the new message's header, which it would not read from a forced run)."""
    if markup is None or prompt.raw:  # (a raw completion is text continued as it is)
        return None
    tail = native.detokenize(prompt.tokens()[-PROMPT_TAIL:], special=True)
    inside = opened(tail, markup.markers)
    splitter = Splitter(markup.markers, inside=inside, keep_spaces=held and inside)
    closing = markup.bare if splitter.keep_spaces else markup.closing  # (no blank line it did not hold)
    spelled, resumed, ends = markup.spelled, markup.resumed, markup.message_ends
    if inside and calls and resumed:  # (the tools grammar writes the new message's header)
        resumed = markup.close
    return Thinking(splitter, closing, budget, spelled, resumed, calls, ends, native, held or calls)
