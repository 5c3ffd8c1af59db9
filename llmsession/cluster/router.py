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

from llmsession.cluster.keys import PIN, preferred

BUSY_THRESHOLD = 8  # requests in flight on the owner before a turn goes elsewhere


class ConversationRouter(ConsistentHashRouter):
    """Conversation affinity on what replicas hold, rendezvous hashing, then load."""

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
        key, _, pinned = session.partition(PIN)
        by_name = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        holders = [name for name, replica in by_name.items() if key in _held(replica)]
        order = [by_name[name] for name in preferred(key, list(by_name), holders)]
        if pinned in by_name:  # (it stored the response the request reads or continues: never moved)
            order.remove(by_name[pinned])
            return [[by_name[pinned]], *([replica] for replica in order)]
        if self._in_flight(order[0]) >= self.busy_threshold:
            order.sort(key=self._in_flight)  # (stable: the preferred order among equals)
        return [[replica] for replica in order]

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
