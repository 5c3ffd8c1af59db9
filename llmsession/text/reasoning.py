"""A reply's reasoning, split from its content as it streams. Pure.

Templates of thinking models mark a reply's reasoning: Qwen3 and DeepSeek-R1 between
``<think>`` and ``</think>`` (DeepSeek-R1's generation prompt opens the block itself, so its
reply begins inside it), Gemma 4 in a thought channel, ``<|channel>thought`` to ``<channel|>``,
gpt-oss in its analysis channel, ``<|channel|>analysis<|message|>`` to ``<|end|>``, its answer
then in the final channel, whose header (``<|start|>assistant<|channel|>final<|message|>``) is
not content.
``markers_for`` reads which from the renderer's template; ``opened`` says whether a prompt's
generation prompt leaves the block open. ``Splitter`` takes the reply's text as it is
generated and hands back, for each push, the reasoning and the content it released: a block
is reasoning only at the start of a reply (text before it, or a second one, is content, as
llama-server parses it), but for gpt-oss's analysis messages one after another, which are all
reasoning (joined by a newline; its template refuses them in the content), as is a commentary
preamble among them; the whitespace
around the reasoning and at the start of the content after it is dropped (a newline after the
opening marker, the blank line after the closing one). What may still become a marker is held
back until it is known, so the pieces streamed join up to exactly the reasoning and the content
of the whole reply.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import cached_property

from llmsession.text.harmony import FINAL, START


@dataclass(frozen=True)
class Markers:
    """The text that opens and closes a reply's reasoning, what a block begins with that is
    the channel's name rather than reasoning (Gemma 4's ``thought``), the headers that may
    begin the content and are not its text (gpt-oss's final channel's), what a budget
    writes to close a block (``forced``; else the closing marker between newlines), and what
    follows the closing marker before the content or the calls (``resume``: gpt-oss begins a
    new message, ``<|start|>assistant``; else a blank line). ``always``: the template has no
    thinking switch, every reply may reason (gpt-oss's analysis channel). ``answer``: the
    header a constrained answer opens with, its own or after the block (gpt-oss's final
    channel's; elsewhere the answer follows the blank line after the block). ``others``: other
    openings of a block, closed by the same marker, whose text is reasoning too (gpt-oss's
    commentary preamble, its note before a call: its template has no place for it in the
    content, which may not hold channel tags). ``breaks``: headers that end a block and begin
    the content at once (gpt-oss's final channel's, written without the closing marker before
    it). ``nested``: an opening marker inside a block is markup, and the reasoning goes on
    (gpt-oss's template refuses channel tags in the reasoning too); after the content began, a
    closing marker or a new message's header ends the reply (its final message), as does, in a
    reply that may not call, any other of the markup's tags (``runtime.thinking``)."""

    open: str
    close: str
    label: str = ""
    headers: tuple[str, ...] = ()
    forced: str = ""
    resume: str = ""
    always: bool = False
    answer: str = ""
    others: tuple[str, ...] = ()
    breaks: tuple[str, ...] = ()
    nested: bool = False

    @cached_property
    def openings(self) -> tuple[str, ...]:
        return (self.open, *self.others)

    @cached_property
    def inner(self) -> tuple[str, ...]:
        """What ends or goes on with a block from inside it: the closing marker, the breaks, and
        with ``nested`` markers an opening (a new message's header before it too), markup."""
        nested = (*(f"{self.resume}{o}" for o in self.openings), *self.openings) if self.nested else ()
        return (self.close, *self.breaks, *nested)

    @property
    def closing(self) -> str:
        return self.forced or f"\n{self.close}\n\n"

    @property
    def bare(self) -> str:
        """The closing without the blank line after it (a constraint decides what follows)."""
        return self.forced or f"\n{self.close}"


BLANK = " \t\r\n"  # the whitespace dropped at the start of the content after a block

THINK = Markers("<think>", "</think>")
GEMMA4 = Markers("<|channel>", "<channel|>", "thought")
HARMONY = Markers(
    "<|channel|>analysis<|message|>",
    "<|end|>",
    headers=(f"{START}{FINAL}", FINAL, START),  # (a call's header follows the last)
    forced=f"<|end|>{START}{FINAL}",
    resume=START,
    always=True,
    answer=FINAL,
    others=("<|channel|>commentary<|message|>",),
    breaks=(f"{START}{FINAL}", FINAL),
    nested=True,
)


def markers_for(template: str | None, gemma4: bool = False) -> Markers | None:
    """The reasoning markers a chat template writes, or None for a template without any."""
    if gemma4:
        return GEMMA4
    if template is not None and HARMONY.open in template and FINAL in template:
        return HARMONY
    if template is not None and THINK.open in template and THINK.close in template:
        return THINK
    return None


def opened(prompt_tail: str, markers: Markers) -> bool:
    """Whether a prompt ends inside a reasoning block: its generation prompt opened one, so the
    prompt ends with the opening marker (and whitespace). Text a message holds never counts:
    the turn's markup follows it."""
    return prompt_tail.rstrip().endswith(markers.open)


class Splitter:
    """A reply's text split into reasoning and content as it streams (the module says how)."""

    def __init__(self, markers: Markers, inside: bool = False, keep_spaces: bool = False) -> None:
        """``keep_spaces``: the whitespace that begins the content after a block stays in it (a
        constraint that begins there holds it: the content is what it held)."""
        self.markers, self.keep_spaces = markers, keep_spaces
        self.inside = inside  # in the reasoning block now
        self.started = inside  # a block was opened (content may not open another)
        self.done = False  # the block closed (or content began): the rest is content
        self._header = bool(markers.headers)  # a header may still begin the content
        self._held = ""  # text not yet known to be reasoning, content or a marker
        self._blank: list[str] = []  # whitespace before it, before anything (a list: no square)
        self._spaces: list[str] = []  # reasoning's whitespace, held until more reasoning follows it
        self._leading = inside  # drop the whitespace that starts the reasoning
        self._label = inside and bool(markers.label)
        self._strip = False  # drop the whitespace that starts the content after a block
        self._raw: list[str] = []  # every text pushed
        self._content_chars = 0  # how much of it came out as content (its end)
        self._again = False  # a new message began (``resume``): it may be another block (gpt-oss)
        self._reasoned = False  # some reasoning came out (a later block's is joined to it)

    def push(self, text: str) -> tuple[str, str]:
        """``text``'s (reasoning, content), as far as it is known now."""
        self._raw.append(text)
        self._held += text
        reasoning, content = [], []
        while self._held:
            if self.done:
                if self._header and not self._headed():
                    break
                if self._again and not self._another():
                    break
                if self.inside:
                    continue
                content.append(self._content(self._held))
                self._held = ""
            elif self.inside:
                piece, more = self._reasoning_step()
                reasoning.append(piece)
                if not more:
                    break
            elif not self._opening():
                break
        return "".join(reasoning), "".join(content)

    def copy(self) -> Splitter:
        """A twin in this state: text pushed to it leaves this one as it is."""
        twin = copy.copy(self)
        twin._raw, twin._blank, twin._spaces = list(self._raw), list(self._blank), list(self._spaces)
        return twin

    def flush(self) -> tuple[str, str]:
        """The end of the reply: what was held back, where it belongs (an unclosed block's
        text is reasoning; a marker cut off is text, but for a new message's header after a
        block, or the block it may open, cut short: markup, neither)."""
        held, self._held = "".join(self._blank) + self._held, ""
        self._blank = []
        if self.inside:
            return self._reasoning(held), ""
        if self.done and self._header and any(h.startswith(held) for h in self.markers.headers):
            return "", ""
        if self._again and any(opening.startswith(held) for opening in self.markers.openings):
            return "", ""
        return "", self._content(held)

    # -- the states -------------------------------------------------------------------------------
    def _opening(self) -> bool:
        """Before anything: a reply that opens with the marker (after whitespace) reasons, any
        other is content. False while the text may still become the marker."""
        stripped, openings = self._held.lstrip(), self.markers.openings
        if not stripped:  # (set aside: whitespace may go on for long before the marker)
            self._blank.append(self._held)
            self._held = ""
            return False
        for opening in openings:
            if stripped.startswith(opening):
                self._held, self._blank = stripped[len(opening) :], []
                self.inside = self.started = self._leading = True
                self._label = bool(self.markers.label)
                return True
        if not any(opening.startswith(stripped) for opening in openings):
            self.done = True  # (content from here on)
            self._held, self._blank = "".join(self._blank) + self._held, []
            return True
        return False

    def _headed(self) -> bool:
        """The content's header dropped (the longest the text begins with), or known absent;
        False while the text may still become one, or a longer one."""
        held, headers = self._held, self.markers.headers
        openings = self.markers.openings if self.markers.nested else ()
        if any(len(marker) > len(held) and marker.startswith(held) for marker in (*headers, *openings)):
            return False
        for header in sorted(headers, key=len, reverse=True):
            if held.startswith(header):
                self._held, self._header = held[len(header) :], False
                self._again = header == self.markers.resume  # (a new message: its channel follows)
                return True
        self._header = False
        self._again = any(held.startswith(opening) for opening in openings)  # (its header left out)
        return True

    def _another(self) -> bool:
        """After a new message's header: another block (gpt-oss writes analysis messages one
        after another, all of them reasoning, as llama-server reads them; a commentary preamble
        too) entered, or known not to be one; False while the text may still become an
        opening marker."""
        for opening in self.markers.openings:
            if self._held.startswith(opening):
                self._held = self._held[len(opening) :]
                self.inside, self.done, self._header, self._leading = True, False, True, True
                self._spaces, self._again = ["\n"] if self._reasoned else [], False  # (joined by a newline)
                return True
        if any(opening.startswith(self._held) for opening in self.markers.openings):
            return False
        self._again = False
        return True

    def _reasoning_step(self) -> tuple[str, bool]:
        """Reasoning up to the closing marker (then content), or as much as cannot be its start;
        True if there is more to read now."""
        if self._label:
            label = self.markers.label
            if len(self._held) < len(label) and label.startswith(self._held):
                return "", False
            if self._held.startswith(label):
                self._held = self._held[len(label) :]
            self._label = False
        markers = self.markers
        inner = markers.inner
        found = [(at, -len(m), m) for m in inner if (at := self._held.find(m)) >= 0]
        if found:
            at, _, marker = min(found)  # (the first; of two there, the longer)
            piece = self._reasoning(self._held[:at])
            self._held = self._held[at + len(marker) :]
            if marker != markers.close and marker not in markers.breaks:  # (opened again: markup)
                self._spaces, self._leading = ["\n"] if self._reasoned else [], True
                return piece, bool(self._held)
            self._spaces = []
            self.inside, self.done, self._strip = False, True, not self.keep_spaces
            self._header = self._header and marker == markers.close  # (a break is the header)
            return piece, bool(self._held)
        keep = max(_partial(self._held, marker) for marker in inner)
        piece = self._reasoning(self._held[: len(self._held) - keep])
        self._held = self._held[len(self._held) - keep :]
        return piece, False

    def _reasoning(self, text: str) -> str:
        """Reasoning text, less its leading whitespace, its trailing whitespace held back."""
        if self._leading:
            text = text.lstrip()
            self._leading = not text
        body = text.rstrip()
        if not body:  # (more whitespace: held on, not joined to what was held, no square)
            self._spaces.append(text)
            return ""
        body, self._spaces = "".join(self._spaces) + body, [text[len(body) :]]
        self._reasoned = True
        return body

    def _content(self, text: str) -> str:
        if self._strip:
            text = text.lstrip(BLANK)  # (only these: a grammar bars them, no more, before calls)
            self._strip = not text
        self._content_chars += len(text)
        return text

    def closing_tail(self, text: str) -> str | None:
        """What ``text`` goes on with after the closing marker of the open block (None: it does
        not close it). Nothing changes."""
        probe, close = self._held + text, self.markers.close
        at = probe.find(close) if self.inside else -1
        return None if at < 0 else probe[at + len(close) :]

    @property
    def holding(self) -> bool:
        """Text is held back, not yet known to be reasoning, content or markup."""
        return bool(self._held or self._blank)

    @property
    def labelling(self) -> bool:
        """The block's channel name (``Markers.label``) is still to be read."""
        return self._label

    @property
    def answering(self) -> bool:
        """The content has begun (its header, if any, read): with ``nested`` markers, a closing
        marker now ends the reply (``Markers``)."""
        return self.done and not self.inside and not self._header and not self._again

    @property
    def preamble(self) -> str:
        """The text generated before the content (the block, its markers, the whitespace
        dropped): the reply as generated is this and its content, once flushed."""
        raw = "".join(self._raw)
        held = len(self._held) + sum(map(len, self._blank))
        return raw[: len(raw) - held - self._content_chars]


def _partial(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` may begin ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
