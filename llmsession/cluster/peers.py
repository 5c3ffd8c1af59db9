"""A replica's moves among its peers on Ray: asking the replica that answered a conversation last
to hand it over, and answering such asks (``deployment.Engine`` calls these; ``handoff`` does
the blocking work, in threads).

A conversation is brought here only for a request that continues one (a POST to a chat,
completion, Responses or Messages endpoint, from a caller the server lets in, of the tenant the
conversation is kept for) and only when this replica does not hold it; it is asked of another
replica only when that one answered it last, and only under our request router (Ray's would not
deliver the ask to it). The ask carries a time budget: a holder that cannot save the
conversation within it (busy) keeps it, taking back a file it saved too late. The asker then
restores whatever the shared folder has (``handoff.restore``), which is also where a replica
that stopped, or an ask the asker gave up on, left it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from ray import serve

from llmsession.cluster.handoff import Handoff, Tenant
from llmsession.cluster.keys import PIN, conversational

log = logging.getLogger("llmsession.cluster")
ASK_S = 30.0  # for the replica that answered a conversation last to save it for another
ASK_MARGIN_S = 5.0  # of that, left for the answer to come back


class Mover:
    """One replica's side of moving conversations: ``name`` is its own, ``peers`` its deployment
    and application (for a handle to the others)."""

    def __init__(self, handoff: Handoff, name: str, peers: tuple[str, str], asks: bool = True) -> None:
        """``asks``: whether to ask the replica that answered a conversation last for it (our
        request router delivers such asks; Ray's do not)."""
        self.handoff, self.name, self.peers, self.asks = handoff, name, peers, asks
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}  # a conversation's arrivals, one at a time
        self._lookup: asyncio.Future[Any] | None = None  # the peers' handle (``_peers``)
        handoff.spill.announce()

    def wants(self, scope: Mapping[str, Any], previous: str | None, held: bool) -> bool:
        """Whether a request should bring its conversation here first: it continues one that
        this replica does not hold, or that another replica answered last."""
        if not conversational(scope):
            return False
        return not held or previous not in (None, self.name)

    async def arrive(
        self, key: str, previous: str | None, tenant: Tenant, late: Callable[[], object] = lambda: None
    ) -> bool:
        """Bring conversation ``key`` here with its state: asked of ``previous`` (the replica
        that answered it last), then restored from the shared folder; only if it is ``tenant``'s
        (the request's). True if it was. Cancelled (its client gone) while it is restored, the
        restore goes on, and ``late()`` is called once it succeeded (the previous replica let the
        conversation go: this one holds it now, and must say so)."""
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        orphaned = False  # (a restore left on its own holds the lock until it is done)
        try:
            await lock.acquire()
            try:
                if self.asks and previous not in (None, self.name):
                    await self._ask(key, str(previous), tenant)
                restoring = asyncio.ensure_future(asyncio.to_thread(self.handoff.restore, key, tenant))
                try:
                    return await asyncio.shield(restoring)
                except asyncio.CancelledError:
                    orphaned = True
                    restoring.add_done_callback(lambda done: self._orphan_done(done, key, late))
                    raise
                except Exception as error:  # (the turn goes on without it: a longer prefill)
                    log.warning("a conversation could not be restored here: %r", error)
                    return False
            finally:
                if not orphaned:
                    lock.release()
        finally:
            if not orphaned:
                self._let_go(key)

    def _orphan_done(self, done: asyncio.Future[bool], key: str, late: Callable[[], object]) -> None:
        """A restore its request left: said to be here if it came, then the next arrival's turn
        (a retry at once found the file claimed by it, and began cold)."""
        try:
            if _restored(done):
                late()
        finally:
            self._locks[key][0].release()
            self._let_go(key)

    def _let_go(self, key: str) -> None:
        lock, users = self._locks[key]
        if users == 1:
            del self._locks[key]
        else:
            self._locks[key] = (lock, users - 1)

    async def _ask(self, key: str, previous: str, tenant: Tenant) -> None:
        """Ask ``previous`` to save ``key`` for this replica (it declines if it is not the one
        that holds it: Ray routes a call for a replica that is gone to another)."""
        call: Any = None
        began = time.time()  # (one wait for the lookup and the ask)
        until = began + ASK_S - ASK_MARGIN_S  # (from the ask, not from when the holder reads it)
        try:
            pinned = (await self._peers(began + ASK_S)).options(session_id=f"{key}{PIN}{previous}")
            call = pinned.surrender.remote(key, previous, self.name, until, tenant)
            await asyncio.wait_for(_awaited(call), max(0.0, began + ASK_S - time.time()))
        except asyncio.CancelledError:  # (the client left: the holder is told, if it is not too late)
            if call is not None:
                call.cancel()
            raise
        except asyncio.TimeoutError:  # (on 3.10, not the builtin)
            if call is not None:
                call.cancel()
            log.info("the replica that held a conversation did not hand it on in %.0f s", ASK_S)
        except Exception as error:  # (gone, or failed: what the folder has is restored)
            log.info("the replica that held a conversation did not hand it on: %r", error)

    async def _peers(self, deadline: float) -> Any:
        """The peers' handle, looked up once, in a thread (it reads Ray's controller, with no
        timeout of its own), waited for until ``deadline`` only: a slow controller held the
        conversation's lock, and every request of it here. One lookup under way serves every
        ask (each began another, and the blocked threads filled the loop's pool)."""
        lookup = self._lookup
        if lookup is None or (lookup.done() and (lookup.cancelled() or lookup.exception() is not None)):
            lookup = self._lookup = asyncio.ensure_future(
                asyncio.to_thread(serve.get_deployment_handle, *self.peers)
            )
        return await asyncio.wait_for(asyncio.shield(lookup), max(0.0, deadline - time.time()))

    def surrender(self, key: str, replica: str, asker: str, until: float, tenant: Tenant) -> bool:
        """``asker`` was given conversation ``key`` by a request of ``tenant``: save it for that
        one and let it go here, if this is ``replica`` (the one that answered it last), the
        conversation is that tenant's, the asker sees the folder, and it is done by ``until``
        (on ``time.time()``'s clock: the asker's wait, counted from its ask, which may have
        queued here; at most the whole wait from now, should the asker's clock run ahead)
        (blocking: run it in a thread)."""
        deadline = min(until, time.time() + ASK_S - ASK_MARGIN_S)
        if replica != self.name or not isinstance(tenant, Tenant) or not self.handoff.spill.sees(asker):
            return False
        return self.handoff.give(key, "handed", deadline, tenant)

    def maintain(self) -> None:
        """Announce this replica again, and remove the folder's files nobody claimed (blocking)."""
        self.handoff.spill.announce()
        self.handoff.spill.sweep()


def _restored(done: asyncio.Future[bool]) -> bool:
    """Whether a restore left on its own (its request cancelled) brought its conversation."""
    if done.cancelled() or done.exception() is not None:
        return False
    return done.result()


async def _awaited(call: Any) -> Any:
    return await call
