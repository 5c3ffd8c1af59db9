"""Stateless calls (``Model.chat``): the caller resends the whole message list every time, as
OpenAI-style clients and most frameworks do, and still gets prefix reuse.

The model keeps a few sessions for these calls. Each call tokenizes its prompt and takes the idle
kept session whose cached items share the longest prefix with it (llama-server's slot similarity,
mlx-lm's prompt cache), gives it the call's history and answers the last message; only the rest
is decoded. A session is reused only if at least half of its cache is such a prefix. A call that
branches off a cached conversation (a regeneration, an edit: more than ``keeping.BRANCH`` cached items
past the shared prefix) takes a fork of it (``seq_cp``: cells shared, or a state copied into
cells of its own), so the original stays whole for the call that continues it. A session is
taken out while its stream runs, so concurrent calls never share one. Past ``capacity`` the
least recently used idle session is closed; the sessions kept are parked and restored by the
model's engine like any other.

A call may name its ``conversation`` (a session id its client sent): the session that answers
it is labelled so, and the conversation's main session (the one holding the most) can be taken
out whole by that name (``take``: a replica handing the conversation on with its state) and kept
again elsewhere (``adopt``). The label never makes a session similar: the prefix does, so a label
cannot reach a session whose cache the call does not share. It orders what the prefix allows
(``keeping``): a named call prefers its own conversation's sessions and takes another's only as
a fork, and side requests (titles, summaries) neither take nor evict a conversation's main.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from functools import partial
from typing import Any

from llmsession.config import SessionConfig
from llmsession.engine.prefix import common_prefix
from llmsession.engine.prompt import Prompt
from llmsession.options import GenerationOptions, checked_options
from llmsession.replies import Message
from llmsession.runtime import counting
from llmsession.runtime.continuing import check_prefill, prefill_of, prefilled
from llmsession.runtime.core import ModelCore
from llmsession.runtime.face import Stream
from llmsession.runtime.keeping import Kept, choose, evicted, mains
from llmsession.runtime.session import LocalSession, resolved_config
from llmsession.runtime.stateless_calls import (
    Call,
    TenantReplies,
    check_stateless,
    check_tenant,
    checked_label,
    keeps,
    split,
)
from llmsession.text.splice import ReplyTokens
from llmsession.text.tools import Tools, options_tools
from llmsession.text.transcript import Transcript


class StatelessSessions:
    """The sessions kept for ``Model.chat``, most recently used last, each with the tenant whose
    calls it serves (None: calls that name none). A call takes only its own tenant's sessions.
    A ``share_prefix=False`` call without a tenant is nobody's to follow: its session is not
    kept, so it neither starts from another call's cells nor leaves any (its engine lease
    neither takes nor gives shared prefixes either)."""

    def __init__(self, model: ModelCore, capacity: int) -> None:
        self.model = model
        self.capacity = capacity
        self._sessions: list[LocalSession] = []
        self._tenants: dict[LocalSession, str | None] = {}  # whose calls each kept session serves
        self._labels: dict[LocalSession, str] = {}  # the conversation each answered last, if named
        self._pending: weakref.WeakKeyDictionary[LocalSession, str] = weakref.WeakKeyDictionary()
        self._records = TenantReplies()
        self._starting: set[LocalSession] = set()  # kept sessions a call took and is starting
        self._closed = False
        self._lock = threading.Lock()

    def stream(
        self,
        messages: Sequence[Mapping[str, Any]],
        options: GenerationOptions | None,
        tenant: str | None,
        config: SessionConfig,
        *,
        pooled: bool = True,
        conversation: str | None = None,
    ) -> Stream:
        """A stateless call (``Model.chat_stream``); ``pooled`` False leaves its session out of
        the kept ones until ``adopt`` (so no other call takes it first: ``choices.Forks``)."""
        check_stateless(config)
        transcript, text = prefill_of(Transcript(messages))  # (checked unless it is one: then read)
        history, said = split(transcript)
        options = checked_options(options)
        tools = options_tools(options)
        if text is not None:
            check_prefill(self.model, text, options, tools, config.thinking)
        record = self._record(tenant, config)
        # Tokenized once: to choose the session, then as the session's prompt.
        prompt = self.model.prompt(
            transcript,
            thinking=config.thinking,
            own=record,
            shared=record is None,
            tools=tools,
            tool_format=options.tool_format,
        )
        try:
            prefill = None if text is None else prefilled(self.model, prompt, text)
        except BaseException:
            prompt.close()
            raise
        call = Call(history, said, options, tools, conversation=checked_label(conversation), prefill=prefill)
        return self._route(prompt, call, tenant, record, config, pooled)

    def tokens(
        self,
        messages: Sequence[Mapping[str, Any]],
        tenant: str | None,
        config: SessionConfig,
        tools: Tools | None,
        tool_format: str | None,
    ) -> list[int]:
        """The tokens a stateless call with these messages would decode as its prompt, spliced
        from the replies its tenant's calls may splice (``Model.prompt_tokens(tenant=...)``)."""
        record = partial(self._record, tenant, config, peek=True)
        return counting.call_tokens(self.model, messages, record, config, tools, tool_format)

    def size(
        self,
        messages: Sequence[Mapping[str, Any]],
        tenant: str | None,
        config: SessionConfig,
        tools: Tools | None,
        tool_format: str | None,
    ) -> int:
        """How many items such a call's prompt has, images too (``Model.prompt_size``)."""
        record = partial(self._record, tenant, config, peek=True)
        return counting.call_size(self.model, messages, record, config, tools, tool_format)

    def complete(
        self,
        text: str,
        options: GenerationOptions | None,
        tenant: str | None,
        config: SessionConfig,
        *,
        pooled: bool = True,
        conversation: str | None = None,
    ) -> Stream:
        """A raw completion (``Model.complete_stream``): ``text`` continued as it is, no chat
        template, routed to a kept session as a chat call is (the same tenants, the same reuse)."""
        check_stateless(config)
        label = checked_label(conversation)
        options = checked_options(options)
        if options_tools(options) is not None:
            raise ValueError("a raw completion cannot call tools (it has no chat template)")
        prompt = self.model.raw_prompt(text)  # (checked before the tenant's record is touched)
        try:
            record = self._record(tenant, config)
        except BaseException:
            prompt.close()
            raise
        said: list[Message] = [{"role": "user", "content": text}]  # (the transcript's stand-in)
        call = Call([], said, options, None, looks_ahead=False, conversation=label)  # (no chat turn follows)
        return self._route(prompt, call, tenant, record, config, pooled)

    def _route(
        self,
        prompt: Prompt,
        call: Call,
        tenant: str | None,
        record: ReplyTokens | None,
        config: SessionConfig,
        pooled: bool,
    ) -> Stream:
        """Start ``call`` on the tenant's session whose cache shares most of ``prompt`` (owned
        from here), or on a new one; keep it for the next calls (``pooled``, else ``adopt``)."""
        keep = keeps(tenant, config)
        with self._lock:  # (chosen under the lock, started without it: ``_start``)
            try:
                taken, undo = (None, None)
                if keep:
                    taken, undo = self._take(tenant, prompt.items, config, call.conversation, pooled)
            except BaseException:
                prompt.close()
                raise
        looks = dataclasses.replace(call, looks_ahead=keep and call.looks_ahead)  # else nothing ahead
        session, stream = self._start(taken, undo, prompt, looks, record, config)
        try:
            with self._lock:
                self._starting.discard(session)
                if self._closed:  # (the model closed meanwhile: kept by no one)
                    session.close()
                elif keep and pooled:  # (one taken has the call's label since ``_take``)
                    self._keep(session, tenant, call.conversation)
                elif call.conversation is not None:
                    self._pending[session] = call.conversation  # (its label, for ``adopt``)
        except BaseException:  # (a Ctrl-C at the lock: the session is no one's starting one)
            stream.close()
            with self._lock:
                self._starting.discard(session)
            raise
        return stream

    def _start(
        self,
        taken: LocalSession | None,
        undo: Callable[[], None] | None,
        prompt: Prompt,
        call: Call,
        record: ReplyTokens | None,
        config: SessionConfig,
    ) -> tuple[LocalSession, Stream]:
        """``call`` started on the session it took (or a new one), outside the kept sessions'
        lock: a start compiles the call's constraint (a large schema's check took a second) and
        every tenant's call would wait. A kept session taken stays among the kept ones, in its
        place, starting (``_starting``: busy to every other call, to eviction and to ``take``)."""
        session = taken
        try:
            session = session or LocalSession(self.model, config)
            if record is not None:
                session.replies = record  # its prompts splice only its tenant's replies
            session.looks_ahead = call.looks_ahead
            session.messages = call.history
            stream = session.start(call.said, call.options, prompt, call.tools, call.prefill)  # owns prompt
        except BaseException:
            prompt.close()  # idempotent: a refused prompt may be closed already
            if undo is not None:  # (a call refused as it started loses no one's kept session)
                with self._lock:
                    undo()
            elif session is not None:  # (a new one, or a fork: no one's)
                session.close()
            raise
        return session, stream

    def adopt(
        self,
        session: LocalSession,
        tenant: str | None,
        config: SessionConfig,
        conversation: str | None = None,
    ) -> None:
        """A session a call left out of the kept ones (``pooled=False``), or one taken from
        another model (``take``, then saved and loaded): kept now, labelled ``conversation`` (or
        the label its call gave it), or closed if calls like it keep none."""
        label = checked_label(conversation)
        with self._lock:
            label = self._pending.pop(session, None) if label is None else label
        if not keeps(tenant, config):
            session.close()
            return
        if session.closed:  # (its model closed, or the budget evicted it)
            return
        with self._lock:
            self._keep(session, tenant, label)

    def conversations(self) -> list[str]:
        """The conversations the kept sessions answered, least recently used first."""
        with self._lock:
            self._forget_closed()
            return list(dict.fromkeys(self._labels[s] for s in self._sessions if s in self._labels))

    def take(
        self, conversation: str, tenants: Collection[str | None] | None = None
    ) -> tuple[LocalSession, str | None] | None:
        """The main session of ``conversation`` (``keeping.mains``: the one of its sessions that
        holds the most, not a side request's), and its tenant, out of the kept ones (the caller
        owns it now); None if none is kept (for one of ``tenants``, unless None), or it is
        answering a call."""
        with self._lock:
            self._forget_closed()
            main = [s for i, s in enumerate(self._sessions) if i in mains(self._seen(lambda s: True))]
            labelled = [
                s
                for s in main
                if self._labels.get(s) == conversation and (tenants is None or self._tenants[s] in tenants)
            ]
            if not labelled or not self._idle(labelled[0]):
                return None
            session = labelled[0]
            return session, self._unkeep(session)

    def _keep(self, session: LocalSession, tenant: str | None, label: str | None) -> None:
        self._forget_closed()  # (a kept session handed over again: ``keep_conversation``)
        if session in self._tenants:  # (kept already: kept once, for its latest tenant and label)
            self._sessions.remove(session)
        self._sessions.append(session)  # busy until its stream is done
        self._tenants[session] = tenant
        session.replies = self._records.joined(tenant, session.replies, apart=not session.share_prefix)
        if label is not None:
            self._labels[session] = label
        self._evict()

    def _unkeep(self, session: LocalSession) -> str | None:
        """Take a kept session out of the kept ones (the lock held): its tenant."""
        self._sessions.remove(session)
        self._labels.pop(session, None)
        return self._tenants.pop(session)

    def _record(self, tenant: str | None, config: SessionConfig, peek: bool = False) -> ReplyTokens | None:
        """The replies a call kept apart may splice: its tenant's (``peek``, counting: as they are,
        ``TenantReplies.of``), none of anyone's without a tenant; None for a call that shares."""
        check_tenant(tenant)
        if config.share_prefix:
            return None
        with self._lock:
            return self._records.of(tenant, peek)

    def _take(
        self,
        tenant: str | None,
        items: Sequence[object],
        config: SessionConfig,
        label: str | None,
        pooled: bool,
    ) -> tuple[LocalSession | None, Callable[[], None] | None]:
        """The kept session a call takes (``keeping.choose``: its tenant's, with its settings,
        idle, sharing at least half its cache with ``items``; a fork where the call branches off
        or the session is another conversation's), else None (a new one); and what puts it back
        if the call fails to start (``_undo_take``). Taken for a call that keeps it (``pooled``),
        it stays in its place, starting, with the call's label (as it will be kept); else it
        leaves the kept ones now (``adopt`` keeps it again)."""
        self._forget_closed()
        wanted = resolved_config(self.model, config)  # (a session loaded elsewhere has its own ``asked``)
        kept = self._seen(lambda s: self._tenants[s] == tenant and s.config == wanted)
        shared = [
            common_prefix(s.lease.cache.items, items) if seen.fitting and seen.idle else 0
            for s, seen in zip(self._sessions, kept, strict=True)
        ]
        choice = choose(kept, shared, label, self.capacity, tenant)
        if choice is None:
            return None, None
        chosen = self._sessions[choice.index]
        if choice.fork:
            return chosen.fork(), None  # the fork's own transcript is replaced by the caller
        undo = self._undo_take(chosen, choice.index, tenant)
        if not pooled:
            self._unkeep(chosen)
            return chosen, undo
        self._starting.add(chosen)
        self._labels.pop(chosen, None)
        if label is not None:
            self._labels[chosen] = label
        return chosen, undo

    def _undo_take(self, session: LocalSession, index: int, tenant: str | None) -> Callable[[], None]:
        """What puts a kept session a call takes back as it is now, where it is among the kept
        ones (``index``), if the call fails to start (a schema that does not compile, a prompt
        too long), the lock held: the conversation keeps its cache."""
        label, was = self._labels.get(session), (session.messages, session.looks_ahead, session.replies)

        def undo() -> None:
            session.messages, session.looks_ahead, session.replies = was
            self._starting.discard(session)
            if session.closed or self._closed:
                return
            if session not in self._tenants:  # (out: ``pooled`` False, or closed and forgotten)
                self._sessions.insert(min(index, len(self._sessions)), session)
                self._tenants[session] = tenant
            self._labels.pop(session, None)
            if label is not None:
                self._labels[session] = label

        return undo

    def _seen(self, fitting: Callable[[LocalSession], bool]) -> list[Kept]:
        """The kept sessions as ``keeping`` sees them, least recently used first."""
        labels, tenants = self._labels, self._tenants
        return [
            Kept(labels.get(s), s.cached_tokens, self._idle(s), fitting(s), tenants[s])
            for s in self._sessions
        ]

    def _idle(self, session: LocalSession) -> bool:
        """No stream of ``session`` running, nor a call starting one (``_start``)."""
        return session.idle and session not in self._starting

    def _forget_closed(self) -> None:
        """Sessions their callers closed (``chat_stream(...).session.close()``) are no one's."""
        for session in [s for s in self._sessions if s.closed]:
            self._unkeep(session)
        for session in [s for s in self._pending if s.closed]:
            del self._pending[session]

    def _evict(self) -> None:
        """Close what is kept past capacity (``keeping.evicted``: no conversation's main while
        anything else can go)."""
        doomed = [self._sessions[i] for i in evicted(self._seen(lambda s: True), self.capacity)]
        for session in doomed:
            self._unkeep(session)
            session.close()

    def close(self) -> None:
        with self._lock:
            self._sessions.clear()
            self._tenants.clear()
            self._labels.clear()
            self._pending.clear()
            self._records.clear()
            self._starting.clear()
            self._closed = True
