"""Which kept session a stateless call takes, and which ones go past capacity, when calls name
their conversation (a session key: Claude Code's ``X-Claude-Code-Session-Id``, Codex's
``session_id``). Pure: sessions are seen as ``Kept`` records, in least-recently-used order.

A conversation's **main** session is the one of its sessions that holds the most (ties: the most
recently used): its long transcript, not the short side requests (titles, summaries, quota
checks) a client sends under the same key. Side requests and unnamed calls never take or evict
a main while anything else can go:
- a named call takes its own conversation's session that shares its prompt (a fork of it if the
  call branches off); another conversation's only as a fork, so that one stays whole;
- with nothing similar and no room, it reuses the least recently used idle session that is no
  conversation's main; a main only for a call that is itself a conversation's first (no main yet);
- past capacity, idle non-mains go first, least recently used first; mains wait for as many
  sessions as side requests are still answering in (the count stays over capacity by those
  until they are idle and the next call is kept). Among the spares, and among the mains, an
  owner's over its share (capacity over the owners kept) go before anyone else's. A tenant named
  ``owner/name`` is its owner's (a server's API key owns the users it names: a key that sends many
  user names has one share, not one for each); any other name is its own owner.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

SIMILARITY = 0.5  # of a session's cache that must be the call's prefix for it to be taken
BRANCH = 16  # cached items past the shared prefix above which a call takes a fork instead


@dataclass(frozen=True)
class Kept:
    """A kept session as the choice sees it."""

    label: str | None  # the conversation it answered last, if named
    cached: int  # items in its cache
    idle: bool  # no stream of it running
    fitting: bool  # the call's tenant and settings: a session the call may take
    tenant: str | None = None  # whose calls it serves (a conversation is named within its tenant)


@dataclass(frozen=True)
class Choice:
    """The session a call takes (an index into the kept ones), and whether as a fork."""

    index: int
    fork: bool


def mains(kept: Sequence[Kept]) -> set[int]:
    """The indices of each named conversation's main session (the most cached, latest on ties),
    a conversation being a name within a tenant."""
    best: dict[tuple[str | None, str], int] = {}
    for index, session in enumerate(kept):
        if session.label is None:
            continue
        name = (session.tenant, session.label)
        if name not in best or session.cached >= kept[best[name]].cached:
            best[name] = index
    return set(best.values())


def choose(
    kept: Sequence[Kept], shared: Sequence[int], label: str | None, capacity: int, tenant: str | None = None
) -> Choice | None:
    """The session a call of ``tenant`` takes, given how many of its prompt's items each kept
    session's cache shares as a prefix (``shared``); None for a new session."""
    fitting = [i for i, s in enumerate(kept) if s.fitting and s.idle]
    similar = [i for i in fitting if shared[i] > 0 and shared[i] >= SIMILARITY * kept[i].cached]
    own = [i for i in similar if label is None or kept[i].label in (label, None)]
    pool = own or similar
    if pool:
        index = max(pool, key=lambda i: shared[i])  # (the first, least recently used, on ties)
        branches = kept[index].cached - shared[index] > BRANCH
        others = label is not None and kept[index].label not in (label, None)
        return Choice(index, fork=branches or others)
    if len(kept) < capacity:
        return None
    main = mains(kept)
    spare = [i for i in fitting if i not in main]
    if spare:
        return Choice(spare[0], fork=False)
    side = label is not None and any(kept[i].label == label and kept[i].tenant == tenant for i in main)
    if fitting and not side:
        return Choice(fitting[0], fork=False)
    return None


def evicted(kept: Sequence[Kept], capacity: int) -> list[int]:
    """The indices of the sessions to close so that at most ``capacity`` stay: spares first,
    then mains, which wait for as many side requests as are busy; in each, a tenant's over its
    share (``capacity`` over the tenants kept) before anyone else's, least recently used first
    (one tenant's many conversations evicted the others')."""
    excess = len(kept) - capacity
    if excess <= 0:
        return []
    main = mains(kept)
    held = Counter(owner(s.tenant) for s in kept)
    share = capacity / len(held)
    # Those of a tenant over its share that are busy go once idle: none of a tenant within its
    # share goes for them meanwhile (a tenant's many concurrent calls evicted the others').
    over_busy = sum(1 for s in kept if not s.idle and held[owner(s.tenant)] > share)
    innocent = max(0, excess - over_busy)  # (how many of tenants within their share may go)
    spares = [i for i, s in enumerate(kept) if s.idle and i not in main]
    spare, innocent = _fairly(spares, kept, held, share, excess, innocent)
    busy_sides = sum(1 for i, s in enumerate(kept) if not s.idle and i not in main)
    idle_mains = [i for i, s in enumerate(kept) if s.idle and i in main]
    room = max(0, excess - len(spare) - busy_sides)
    return spare + _fairly(idle_mains, kept, held, share, room, innocent)[0]


def owner(tenant: str | None) -> str | None:
    """Whose share a tenant's sessions count in: ``owner`` of ``owner/name``, else the tenant."""
    return tenant.split("/", 1)[0] if tenant is not None else None


def _fairly(
    candidates: list[int],
    kept: Sequence[Kept],
    held: Counter[str | None],
    share: float,
    n: int,
    innocent: int,
) -> tuple[list[int], int]:
    """``n`` of ``candidates`` (least recently used first), each the first whose tenant holds
    more than ``share`` (``held``, counted down as they go), else the first while ``innocent``
    allows; and how many of tenants within their share may still go. (One tenant alone is
    always over its share: all of it, as before.)"""
    chosen: list[int] = []
    left = list(candidates)
    while left and len(chosen) < n:
        pick = next((i for i in left if held[owner(kept[i].tenant)] > share), None)
        if pick is None:
            if innocent <= 0:
                break
            pick, innocent = left[0], innocent - 1
        left.remove(pick)
        held[owner(kept[pick].tenant)] -= 1
        chosen.append(pick)
    return chosen, innocent
