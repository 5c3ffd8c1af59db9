"""``/metrics`` of a cluster: every replica's exposition text merged, each sample labelled with
its replica, and how many replicas reported. Pure: no Ray.

Replicas post their text to a board (``deployment.Board``) as Ray asks them for routing stats
(every second); a replica that stopped posting is left out after ``STALE_S``. Sum a counter over
the cluster with ``sum without (replica) (...)``.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping

STALE_S = 10.0
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)$")


class Arrivals:
    """A replica's requests, by whether it held their conversation when they came (the
    affinity the router kept) or not (a new conversation, or one that moved here)."""

    def __init__(self) -> None:
        self.counts: Counter[bool] = Counter()

    def add(self, held: bool) -> None:
        self.counts[held] += 1

    def render(self) -> str:
        lines = [
            "# HELP llmsession_cluster_requests_total Requests, by whether the replica held the conversation",
            "# TYPE llmsession_cluster_requests_total counter",
            f'llmsession_cluster_requests_total{{held="true"}} {self.counts[True]}',
            f'llmsession_cluster_requests_total{{held="false"}} {self.counts[False]}',
        ]
        return "\n".join(lines) + "\n"


class Moves:
    """A replica's conversations moved with their state (``handoff``): given up, by why
    (``drained``: the replica was stopping; ``handed``: another replica asked for it), restored
    here from the shared folder, and refused (a file whose seal or state did not fit); and the
    asks for one that came past the asker's wait (queued that long, or the hosts' clocks that
    far apart: ``peers.Mover.surrender``)."""

    def __init__(self) -> None:
        self.given: Counter[str] = Counter()
        self.restored = 0
        self.refused = 0
        self.late = 0

    def render(self, refused_seals: int = 0) -> str:
        lines = [
            "# HELP llmsession_cluster_conversations_moved_total Conversations saved for another replica",
            "# TYPE llmsession_cluster_conversations_moved_total counter",
            *(
                f'llmsession_cluster_conversations_moved_total{{why="{why}"}} {self.given[why]}'
                for why in ("drained", "handed")
            ),
            "# HELP llmsession_cluster_conversations_restored_total Conversations moved in, restored",
            "# TYPE llmsession_cluster_conversations_restored_total counter",
            f"llmsession_cluster_conversations_restored_total {self.restored}",
            "# HELP llmsession_cluster_conversations_refused_total Moved conversations' files refused",
            "# TYPE llmsession_cluster_conversations_refused_total counter",
            f"llmsession_cluster_conversations_refused_total {self.refused + refused_seals}",
            "# HELP llmsession_cluster_asks_late_total Asks for a conversation past the asker's wait",
            "# TYPE llmsession_cluster_asks_late_total counter",
            f"llmsession_cluster_asks_late_total {self.late}",
        ]
        return "\n".join(lines) + "\n"


class Tally:
    """A count the front's process keeps (its request router runs there)."""

    def __init__(self) -> None:
        self.count = 0

    def add(self) -> None:
        self.count += 1


SENT_AWAY = Tally()  # requests the router sent past their busy first choice (``router``)


def front_metrics(replicas: int) -> str:
    """The front's own series: the replicas that reported, and the requests sent away."""
    return replicas_gauge(replicas) + (
        "# HELP llmsession_cluster_routed_for_load_total Requests sent past a busy first choice\n"
        "# TYPE llmsession_cluster_routed_for_load_total counter\n"
        f"llmsession_cluster_routed_for_load_total {SENT_AWAY.count}\n"
    )


def replicas_gauge(replicas: int) -> str:
    return (
        "# HELP llmsession_cluster_replicas Replicas whose metrics are fresh\n"
        "# TYPE llmsession_cluster_replicas gauge\n"
        f"llmsession_cluster_replicas {replicas}\n"
    )


def merged(texts: Mapping[str, str]) -> str:
    """The replicas' exposition texts as one: each family's HELP and TYPE once, then every
    replica's samples with a ``replica`` label (names are quoted, so any name is safe)."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    family = ""
    for replica, text in sorted(texts.items()):
        label = 'replica="' + replica.replace("\\", "\\\\").replace('"', '\\"') + '"'
        for line in text.splitlines():
            if line.startswith("# "):
                parts = line.split(" ", 3)
                if len(parts) >= 3:
                    family = parts[2]
                    headers.setdefault(family, [])
                    if line not in headers[family]:
                        headers[family].append(line)
                continue
            match = SAMPLE.match(line)
            if match is None:
                continue
            name, labels, value = match.groups()
            inner = labels[1:-1] + "," if labels else ""
            samples.setdefault(family or name, []).append(f"{name}{{{inner}{label}}} {value}")
    lines: list[str] = []
    for name in [*headers, *(n for n in samples if n not in headers)]:
        lines += headers.get(name, []) + samples.get(name, [])
    return "\n".join(lines) + ("\n" if lines else "")
