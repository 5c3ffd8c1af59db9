"""A Messages request's calls and results, paired as Anthropic pairs them (``messages``). Pure."""

from __future__ import annotations

from collections import Counter
from typing import Any

from llmsession.serve.errors import ApiError


class Pairs:
    """Anthropic's rules for calls and results, naming its fields: every call is answered by a
    ``tool_result`` in the next turn, and every result answers a call of the turn before it (a
    turn: consecutive messages of one role, as Anthropic merges them). Ids may repeat
    (Anthropic's may not): a format whose model writes its calls' ids (Mistral's) may write one
    twice, and a client sending that reply back is not refused; the rule above pairs each
    result with its call regardless."""

    def __init__(self) -> None:
        self.open: Counter[str] = Counter()  # the last assistant turn's calls, unanswered (ids counted:
        # thousands of calls and results in one message were a list's square)
        self.where = ""  # the message that turn began with
        self.role: str | None = None

    def check(self, made: list[dict[str, Any]], where: str, blocks: list[Any], role: str) -> None:
        """One message's: ``made``, what it became; ``blocks``, its content's blocks (checked)."""
        answered = [m["tool_call_id"] for m in made if m["role"] == "tool"]
        for ident, j in zip(answered, _at(blocks, "tool_result"), strict=True):
            if self.open[ident] <= 0:
                at = f"{where}.content[{j}]"
                raise ApiError(
                    f"{at}: unexpected tool_use_id {ident!r:.80} in a tool_result block: each tool_result "
                    "must answer a tool_use block of the turn before",
                    f"{at}.tool_use_id",
                )
            self.open[ident] -= 1
        called = [call["id"] for m in made for call in m.get("tool_calls", ())]
        if role == "assistant" and self.role == "assistant":  # (the same turn, on)
            self.open.update(called)
        elif role == "assistant":
            self.finish()
            self.open, self.where = Counter(called), where
        self.role = role

    def finish(self) -> None:
        """The turn after the last calls is over: each must have been answered."""
        left = list(self.open.elements())
        if left:
            unanswered = ", ".join(f"{ident!r:.80}" for ident in left[:4])
            more = ", ..." if len(left) > 4 else ""
            raise ApiError(
                f"{self.where}: tool_use ids without tool_result blocks in the next turn: {unanswered}{more}",
                self.where,
            )


def _at(blocks: list[Any], kind: str) -> list[int]:
    """Where the ``kind`` blocks are among a message's (checked) blocks."""
    return [j for j, block in enumerate(blocks) if block["type"] == kind]
