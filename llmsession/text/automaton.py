"""Aho and Corasick's automaton over a set of texts: a trie of them (``goto``: a node a start of
one, its children by next character) and each node's failure (its longest proper suffix that is
a node too). What ``Starts`` finds a text's ending in, and ``Overlaps`` reads which texts can
overlap from, each in time linear in the texts' length, where pairs and tries at every cut were
quadratic in a hostile vocabulary. Pure: no bindings."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


def grown(goto: list[dict[str, int]], text: str) -> list[int]:
    """``text`` added to the trie ``goto`` (its root ``goto[0]``; new nodes appended): the nodes
    of its starts, the first character's first."""
    path, node = [], 0
    for char in text:
        child = goto[node].get(char)
        if child is None:
            child = goto[node][char] = len(goto)
            goto.append({})
        path.append(child)
        node = child
    return path


def failures(goto: Sequence[dict[str, int]]) -> tuple[list[int], list[int]]:
    """Each node's failure, and the nodes breadth first (a node's failure is found from its
    parent's, so it comes before every node it is the failure of)."""
    fail, order = [0] * len(goto), []
    queue = deque(goto[0].values())
    while queue:
        node = queue.popleft()
        order.append(node)
        for char, child in goto[node].items():
            back = fail[node]
            while back and char not in goto[back]:
                back = fail[back]
            fail[child] = goto[back].get(char, 0)
            queue.append(child)
    return fail, order


class Overlaps:
    """Which of a vocabulary's ``texts`` (distinct, none empty) no occurrence of another text,
    nor another of its own, can overlap in any text (``segments.can_overlap`` with every text,
    at once): none ends inside it or with its start, and it ends inside none."""

    def __init__(self, texts: Sequence[str]) -> None:
        goto: list[dict[str, int]] = [{}]
        self._node = {text: grown(goto, text)[-1] for text in texts}
        fail, order = failures(goto)
        ends = set(self._node.values())
        within = [False] * len(goto)  # a text ends here: the node's or a suffix of it
        reached = [False] * len(goto)  # the failure of another node: it ends inside a longer start
        for node in order:
            within[node] = node in ends or within[fail[node]]
            reached[fail[node]] = True
        tails = [False] * len(goto)  # a proper suffix of a whole text
        for end in ends:
            node = fail[end]
            while node and not tails[node]:
                tails[node] = True
                node = fail[node]
        self._goto, self._fail, self._within, self._reached, self._tails = goto, fail, within, reached, tails

    def alone(self, text: str) -> bool:
        """Whether no occurrence of a text (``text`` itself included) can overlap one of
        ``text`` (one of the texts)."""
        node = self._node[text]
        if self._goto[node] or self._fail[node] or self._reached[node]:
            return False  # (a longer text starts with it; it ends with a start; it ends inside one)
        at = 0
        for char in text[:-1]:  # (its proper starts: a text ends there, or a whole text ends with one)
            at = self._goto[at][char]
            if self._within[at] or self._tails[at]:
                return False
        return True
