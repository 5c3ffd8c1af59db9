"""The longest start of a guarded text that a text ends with (``Guard``'s tail), found in one
pass over the text by Aho and Corasick's automaton (``automaton``) over the guarded texts'
proper starts. A table of every start, and a try at every cut, were both quadratic in a token's
length: a hostile vocabulary's token of 10,000 characters made a table of 50 MB at load, and
10,000 lookups of slices up to as long at every message. Pure: no bindings."""

from __future__ import annotations

from collections.abc import Sequence

from llmsession.text.automaton import failures, grown


class Starts:
    """The proper starts (the first ``n`` characters, ``0 < n < len``, ``n < most``) of
    ``texts``, each named ``"i.n"`` (``i`` the last of ``texts`` that starts so)."""

    def __init__(self, texts: Sequence[str], most: int) -> None:
        goto: list[dict[str, int]] = [{}]  # (a node a start; its children by next character)
        named: dict[int, tuple[int, str]] = {}  # a node's length and name
        for index, text in enumerate(texts):
            for n, node in enumerate(grown(goto, text[: max(0, min(len(text), most) - 1)]), 1):
                named[node] = (n, f"{index}.{n}")
        self._depth, self._names = [0] * len(goto), [""] * len(goto)
        for node, (n, name) in named.items():
            self._depth[node], self._names[node] = n, name
        self._goto, self._fail = goto, failures(goto)[0]
        self.longest = max(self._depth)

    def ending(self, text: str, end: int) -> tuple[int, str] | None:
        """The longest start ``text[:end]`` ends with: its length and name; None for none."""
        goto, fail, node = self._goto, self._fail, 0
        for index in range(max(0, end - self.longest), end):
            char = text[index]
            while node and char not in goto[node]:
                node = fail[node]
            node = goto[node].get(char, 0)
        return (self._depth[node], self._names[node]) if node else None
