"""A replica's side of moving conversations with their state (``moving``): restoring one that
arrives from another replica, and giving one up, when another replica asks for it or when this
one stops. Blocking: run in threads. No Ray: the replica asks its peers (``deployment.Engine``).

A conversation's session is taken out of the model's kept ones (``Model.take_conversation``),
saved to the shared folder and closed; the replica it goes to loads it (``Model.load_session``)
and keeps it for the same tenant (``Model.keep_conversation``), so its next turn decodes only
what is new. A file that cannot be restored (another model, build or layout; a changed file) is
refused and counted; the turn then decodes its whole prompt, as a conversation never spilled does.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmsession.cluster.metrics import Moves
from llmsession.cluster.moving import SharedSpill
from llmsession.errors import LlmSessionError

if TYPE_CHECKING:
    from llmsession.api.model import Model

log = logging.getLogger("llmsession.cluster")


@dataclass(frozen=True)
class Tenant:
    """The tenant a request is the server's (``serve.naming.tenant_name``: its key and its user): a
    conversation moves only for a request of the tenant it is kept for (another tenant who had
    seen a response's id could send its requests anywhere)."""

    name: str | None


class Handoff:
    """Conversations moving in and out of one replica's ``model`` through ``spill``."""

    def __init__(self, model: Model, spill: SharedSpill) -> None:
        self.model, self.spill = model, spill
        self.moves = Moves()

    def give(self, key: str, why: str, deadline: float | None = None, asking: Tenant | None = None) -> bool:
        """Save conversation ``key`` for another replica and let it go here (True), or keep it
        (False: not kept here, or not for ``asking`` (the tenant of the request that asks),
        answering a call now, past ``deadline`` on ``time.time()``'s clock, when the asker
        stops waiting, or it could not be saved)."""
        if deadline is not None and time.time() > deadline:
            self.moves.late += 1
            return False
        taken = self.model.take_conversation(key, tenants=None if asking is None else (asking.name,))
        if taken is None:
            return False
        session, tenant = taken
        try:
            saved = self.spill.put(key, tenant, session.save)
            if saved and deadline is not None and time.time() > deadline:  # (saved too late: the
                saved = not self.spill.withdraw(key)  # asker stopped waiting; taken back, unless claimed)
        except Exception as error:  # (a full disk, a closed model: it stays here, as it was)
            log.warning("a conversation could not be saved for another replica: %r", error)
            saved = False
        if not saved:
            try:
                self.model.keep_conversation(session, tenant=tenant, conversation=key)
            except Exception:
                session.close()
                raise
            return False
        session.close()
        self.moves.given[why] += 1
        return True

    def restore(self, key: str, tenant: Tenant | None = None) -> bool:
        """Restore conversation ``key`` from the shared folder if it is there (True), and saved
        for ``tenant``, the arriving request's, unless that is None."""
        claimed = self.spill.claim(key, None if tenant is None else (tenant.name,))
        if claimed is None:
            return False
        try:
            session = self.model.load_session(claimed.path)
        except LlmSessionError as error:
            self.moves.refused += 1
            log.warning("a conversation's file could not be loaded: %s", error)
            return False
        finally:
            claimed.path.unlink(missing_ok=True)
        if session.cached_tokens == 0:  # (its state did not fit this model, or no memory was free)
            session.close()
            self.moves.refused += 1
            return False
        try:
            self.model.keep_conversation(session, tenant=claimed.tenant, conversation=key)
        except Exception:  # (a model closing as an abandoned restore ends: the session is freed)
            session.close()
            raise
        if key not in self.model.conversations():  # (calls like its keep no session here)
            self.moves.refused += 1
            return False
        self.moves.restored += 1
        return True

    def drain(self, seconds: float) -> int:
        """Give up every conversation kept here, the most recent first, for at most ``seconds``
        (the replica is stopping); how many were saved."""
        deadline = time.monotonic() + seconds
        given = 0
        for key in reversed(self.model.conversations()):
            if time.monotonic() > deadline:
                log.warning("a stopping replica ran out of time to save its conversations")
                break
            try:
                given += self.give(key, "drained")
            except Exception as error:  # (the next ones are still saved)
                log.warning("a stopping replica could not save a conversation: %r", error)
        return given

    def render(self) -> str:
        return self.moves.render(self.spill.refused)
