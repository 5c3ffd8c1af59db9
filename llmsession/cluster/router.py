"""The Ray Serve request router that sends each conversation to the replica holding it.

The front deployment names a request's conversation (``keys.session_id``) as the handle's
``session_id``: its key, and the replica it must reach (one that stored the response it reads or
continues: only that one) or the one that answered it last. Replicas report the conversations
they hold (``record_routing_stats``: ``{"conversations": [...], "in_flight": n}``). The ranks:
the last replica, then holders, then the key's rendezvous owner, then the rest, each rank one
replica; a request whose first choice already has ``busy_threshold`` requests in flight goes to
the least loaded instead. For its first ``STRICT_S`` a request is offered its first choice alone,
then every rank in order (Ray's retry loop walks them with backoff). Ray's own
``ConsistentHashRouter`` supplies that loop.
"""

from __future__ import annotations

import time
from typing import Any

from ray.serve.experimental.consistent_hash_router import ConsistentHashRouter
from ray.serve.request_router import PendingRequest, RunningReplica

from llmsession.cluster import metrics  # (a module: Ray pickles this router by value, not it)
from llmsession.cluster.keys import parsed_session, preferred

BUSY_THRESHOLD = 8  # requests in flight on the owner before a turn goes elsewhere
STRICT_S = 2.0  # how long a request waits for its first choice alone before the others
MAX_TRACKED = 10_000  # requests whose routing rounds are counted
MAX_REPLICA_SETS = 1024  # replicas whose reported conversations are kept as a set


class ConversationRouter(ConsistentHashRouter):
    """Conversation affinity on what replicas hold, rendezvous hashing, then load."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        self.busy_threshold = BUSY_THRESHOLD
        self._first_round: dict[str, float] = {}  # when each request not yet completed was first routed
        self._sets: dict[Any, tuple[object, frozenset[str]]] = {}  # replica -> (its report, as a set)

    def initialize_state(self, **kwargs: Any) -> None:
        threshold = kwargs.pop("busy_threshold", BUSY_THRESHOLD)
        if not isinstance(threshold, int) or threshold < 1:
            raise ValueError(f"busy_threshold must be a positive int, got {threshold!r}")
        self.busy_threshold = threshold
        super().initialize_state(num_fallback_replicas=kwargs.pop("num_fallback_replicas", 2))

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        session = pending_request.metadata.session_id if pending_request is not None else None
        if not session:
            return [candidate_replicas]
        key, pinned, last = parsed_session(session)
        by_name = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        if pinned in by_name:  # (it stored the response the request reads or continues: never moved)
            return [[by_name[pinned]]]
        holders = [name for name, replica in by_name.items() if key in self._held(replica)]
        order = [by_name[name] for name in preferred(key, list(by_name), holders)]
        if last in by_name:  # (it answered the latest turn: the newest state is there)
            order.remove(by_name[last])
            order.insert(0, by_name[last])
        if self._in_flight(order[0]) >= self.busy_threshold:
            first = order[0]
            order.sort(key=self._in_flight)  # (stable: the preferred order among equals)
            if order[0] is not first and self._new(pending_request):
                metrics.SENT_AWAY.add()
        ranks = [[replica] for replica in order]
        # The first choice alone for a while: Ray moves on to the next rank when a replica is slow
        # to answer its queue-length probe (0.1 s at first), which a replica busy with a prefill
        # often is, and the conversation would land cold elsewhere. A replica that died leaves
        # the candidates; one that does not answer is given up after STRICT_S.
        return ranks[:1] if self._strict(pending_request) else ranks

    def _strict(self, pending_request: PendingRequest | None) -> bool:
        """Whether this request is still within its time on the first choice alone."""
        if pending_request is None:
            return False
        ident = pending_request.metadata.internal_request_id
        now = time.monotonic()
        first = self._first_round.setdefault(ident, now)
        while len(self._first_round) > MAX_TRACKED:
            del self._first_round[next(iter(self._first_round))]
        return now - first < STRICT_S

    def _new(self, pending_request: PendingRequest | None) -> bool:
        """Whether this is a request's first routing round (counted once, however many)."""
        return (
            pending_request is None or pending_request.metadata.internal_request_id not in self._first_round
        )

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        self._first_round.pop(internal_request_id, None)

    def _in_flight(self, replica: RunningReplica) -> int:
        """Requests in flight on a replica: Ray's count, or the replica's own last report when
        Ray's has expired (after 10 s without a request: a long generation, say)."""
        known = self.replica_queue_len_cache.get(replica.replica_id)
        if known is not None:
            return int(known)
        reported = (replica.routing_stats or {}).get("in_flight", 0)
        return reported if isinstance(reported, int) else 0

    def _held(self, replica: RunningReplica) -> frozenset[str]:
        """The conversations a replica last reported holding, as a set made once a report
        (up to 4,096 keys: ~0.1 ms a replica, every routing round, on the front's loop)."""
        stats = replica.routing_stats or {}
        made = self._sets.get(replica.replica_id)
        if made is not None and made[0] is stats:
            return made[1]
        held = stats.get("conversations", ())
        keys = frozenset(held) if isinstance(held, list | tuple | set | frozenset) else frozenset()
        self._sets.pop(replica.replica_id, None)  # (the newest last: the oldest go first)
        self._sets[replica.replica_id] = (stats, keys)
        while len(self._sets) > MAX_REPLICA_SETS:  # (replicas gone: the oldest reports go first)
            del self._sets[next(iter(self._sets))]
        return keys
