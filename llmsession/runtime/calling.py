"""An exchange with tools: its stream split into text and call pieces, and its reply read back
into text and calls, each call's arguments checked against its tool's schema."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from llmsession.errors import ReplyMismatchError
from llmsession.replies import FinishReason, Snapshot, ToolCall
from llmsession.text.harmony import canonical
from llmsession.text.schemas import validator_of, violations
from llmsession.text.stops import StopMatcher
from llmsession.text.tool_formats import CallIds, CallStream, ToolFormat, parse
from llmsession.text.tools import Tools


class TextStops(StopMatcher):
    """The user's stop strings over a reply that may call tools: they end its text, never its
    calls. One found where the calls have begun is let go, and the stop strings with it (what
    follows is calls): a call is whole or cut only by ``length``, as its stream showed it. One
    found inside what may yet be the calls' opening (a stop ``<tool`` in ``<tool_call>``) is
    undecided until the opening is whole (a call: let go) or cannot be (the stop stands): it cut
    the call, which was lost."""

    def __init__(self, stops: Sequence[str], stream: CallStream) -> None:
        super().__init__(stops)
        self.stream = stream  # (it has read all this has released: the exchange feeds it first)
        self.pending: str | None = None  # what follows a stop that may be inside the opening

    @property
    def stopped(self) -> bool:
        return super().stopped and self.pending is None

    def push(self, text: str) -> str:
        if self.stream.begun:
            return self.disarm() + text
        if self.pending is not None:
            return self._decided(self.pending + text)
        return self._unless_in_calls(super().push(text))

    def flush(self) -> str:
        if self.stream.begun:
            return self.disarm()
        if self.pending is not None:  # (the reply ended with the opening unfinished: the stop stands)
            self.pending = None
            return ""
        return self._unless_in_calls(super().flush())

    def _unless_in_calls(self, released: str) -> str:
        """``released`` (the text before a stop found, if one was: the stream reads it next),
        and the rest too if the calls begin in it; the stop undecided (``pending``) while what
        follows it may yet open them."""
        if not super().stopped:
            return released
        rest = self.held()
        if self.stream.begins(released + rest):
            return released + self.disarm()
        self.pending = rest if self.stream.may_open(released, rest) else None
        return released

    def _decided(self, rest: str) -> str:
        """An undecided stop's ``rest`` (from the stop on), once the calls begin in it; "" while
        it may yet open them; else "" and the stop stands."""
        if self.stream.begins(rest):
            self.pending = None
            self.disarm()
            return rest
        self.pending = rest if self.stream.may_open("", rest) else None
        return ""


def stop_matcher(stops: Sequence[str], calling: Calling | None) -> StopMatcher:
    """A reply's stop strings (``TextStops`` when it may call tools; none when it must: such
    a reply is all calls, and a stop met in their opening cut them before they had begun)."""
    if calling is None:
        return StopMatcher(stops)
    forced = calling.tools.mode in ("required", "named")
    return TextStops(() if forced else stops, calling.stream)


@dataclass
class Calling:
    """The tools of one exchange and the format its calls are written in."""

    tools: Tools
    fmt: ToolFormat
    ids: CallIds
    spelled: frozenset[int] = frozenset()  # the format's special tokens: their text is the reply's
    text: str = ""  # the reply's text so far (its calls apart)
    stream: CallStream = field(init=False)

    def __post_init__(self) -> None:
        self.stream = CallStream(self.fmt, self.ids)

    def snapshot(self, delta: str) -> Snapshot:
        """The step's snapshot: its text, and the pieces of calls it wrote."""
        text, pieces = self.stream.push(delta)
        self.text += text
        return Snapshot(text, self.text, pieces)

    @property
    def ended(self) -> bool:
        """Whether the reply's calls ended at a call that repeats an earlier one: the exchange
        generates no more (``CallStream``)."""
        return self.stream.cut >= 0

    def tail(self) -> Snapshot | None:
        """What was held back, at the end of a reply that made no call."""
        text = self.stream.flush()
        self.text += text
        return Snapshot(text, self.text) if text else None

    def conclude(
        self, raw: str, finish: FinishReason
    ) -> tuple[str, tuple[ToolCall, ...], FinishReason, ReplyMismatchError | None]:
        """The reply's text, its calls, its finish reason ("tool_calls" when it called), and an
        error if a call breaks its schema where the mask could not hold it. A reply cut short
        (``length``, ``cancelled``) makes no call: its text is what streamed as text (a call it
        began is dropped, markup and all, as its stream showed). A reply ``ended`` at a repeated
        call is its calls before it, whatever stopped its generation."""
        raw = canonical(raw) if self.fmt.harmony else raw  # (as the stream read it: ``cut`` is in it)
        if self.ended:
            raw, finish = raw[: self.stream.cut] + self.fmt.close, "complete"
        if finish not in ("complete", "stop"):
            return self.text + self.stream.flush(), (), finish, None
        try:
            text, calls = parse(raw, self.fmt, self.tools, self.ids)
        except ValueError as unparsed:
            if finish == "stop":  # a stop string inside a call's opening: cut there, as by ``length``
                return self.text + self.stream.flush(), (), finish, None
            return raw, (), finish, ReplyMismatchError(f"the reply's tool calls do not parse: {unparsed}")
        if not calls:
            return text, (), "stop", None
        at, problem = violations((validator_of(self._parameters(call)), call.parsed) for call in calls)
        if problem:
            error = ReplyMismatchError(f"the call of {calls[at].name} does not match its schema: {problem}")
            return text, tuple(calls), "tool_calls", error
        return text, tuple(calls), "tool_calls", None

    def _parameters(self, call: ToolCall) -> Any:
        tool = self.tools.by_name(call.name)
        assert tool is not None  # (parse checked it)
        return tool.parameters
