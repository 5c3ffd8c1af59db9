"""The Ray Serve request router that sends each conversation to the replica holding it.

The front deployment names a request's conversation (``keys.conversation_key``) as the handle's
``session_id``. Replicas report the conversations they hold (``record_routing_stats``:
``{"conversations": [...]}``), and the router ranks the replicas for a key by
``keys.preferred``: a holder first, else the key's rendezvous owner, then the rest in rank
order, each rank one replica, so Ray's retry loop walks them in order when one rejects (a full
queue). A request whose owner already has ``busy_threshold`` requests in flight goes to the
least-loaded replica instead (the conversation then moves with its state, as any turn that
lands elsewhere does). Ray's own ``ConsistentHashRouter`` supplies the retry loop.
"""

from __future__ import annotations

from typing import Any

from ray.serve.experimental.consistent_hash_router import ConsistentHashRouter
from ray.serve.request_router import PendingRequest, RunningReplica

from llmsession.cluster.keys import parsed_session, preferred

BUSY_THRESHOLD = 8  # requests in flight on the owner before a turn goes elsewhere
STRICT_ATTEMPTS = 8  # routing rounds (with Ray's backoff) on the first choice before the others
MAX_TRACKED = 10_000  # requests whose routing rounds are counted


class ConversationRouter(ConsistentHashRouter):
    """Conversation affinity on what replicas hold, rendezvous hashing, then load."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        self.busy_threshold = BUSY_THRESHOLD
        self._attempts: dict[str, int] = {}  # routing rounds of requests not yet completed

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
        holders = [name for name, replica in by_name.items() if key in _held(replica) or name == last]
        order = [by_name[name] for name in preferred(key, list(by_name), holders)]
        if pinned in by_name:  # (it stored the response the request reads or continues: never moved)
            order.remove(by_name[pinned])
            order.insert(0, by_name[pinned])
        elif self._in_flight(order[0]) >= self.busy_threshold:
            order.sort(key=self._in_flight)  # (stable: the preferred order among equals)
        ranks = [[replica] for replica in order]
        # The first choice alone while it may still answer: Ray moves on to the next rank when a
        # replica is slow to answer its queue-length probe (0.1 s), which a replica busy with a
        # prefill often is, and the conversation would land cold elsewhere. A replica that died
        # leaves the candidates; one that never answers is given up after STRICT_ATTEMPTS.
        return ranks[:1] if self._attempt(pending_request) <= STRICT_ATTEMPTS else ranks

    def _attempt(self, pending_request: PendingRequest | None) -> int:
        if pending_request is None:
            return STRICT_ATTEMPTS + 1
        ident = pending_request.metadata.internal_request_id
        self._attempts[ident] = self._attempts.pop(ident, 0) + 1  # (most recent last)
        while len(self._attempts) > MAX_TRACKED:
            del self._attempts[next(iter(self._attempts))]
        return self._attempts[ident]

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        self._attempts.pop(internal_request_id, None)

    def _in_flight(self, replica: RunningReplica) -> int:
        """Requests in flight on a replica: Ray's count, or the replica's own last report when
        Ray's has expired (after 10 s without a request: a long generation, say)."""
        known = self.replica_queue_len_cache.get(replica.replica_id)
        if known is not None:
            return int(known)
        reported = (replica.routing_stats or {}).get("in_flight", 0)
        return reported if isinstance(reported, int) else 0


def _held(replica: RunningReplica) -> frozenset[str]:
    stats = replica.routing_stats or {}
    held = stats.get("conversations", ())
    return frozenset(held) if isinstance(held, list | tuple | set | frozenset) else frozenset()
