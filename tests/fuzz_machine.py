"""The hypothesis state machine: three sessions on one model (of 1024, 512 and 64-128 positions)
driven through every public call, valid and invalid, each checked by the oracle."""

from __future__ import annotations

import copy
import dataclasses
import functools
import weakref
from typing import Any

import internals
from fuzz_env import STATS, env
from fuzz_exchange import in_threads
from fuzz_hostile import HostileRules
from fuzz_inputs import (
    BAD_CONTENT_KINDS,
    BAD_FIELDS,
    BAD_SESSION_VALUES,
    BAD_TOKEN_IDS,
    BAD_TRANSCRIPT_KINDS,
    CONTENTS,
    EDITS,
    GREEDY_ONE,
    GREEDY_SHORT,
    MISUSES,
    NOT_OPTIONS,
    OPTIONS,
    SESSION,
    SESSION_ARGUMENTS,
    STREAM_MODES,
    TEXTS,
    TYPED,
    invalid_content,
    invalid_transcript,
)
from fuzz_oracle import Taken, check_first_logits, check_reply, check_settled, copy_message
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from llmsession import GenerationOptions

CONTEXT_SIZES = (1024, 512)  # sessions 0 and 1; session 2 gets 64-128 positions


class SessionFuzzer(HostileRules, RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        STATS.examples += 1

    # -- setup, teardown and the invariant ------------------------------------------------
    @initialize(
        systems=st.lists(
            st.sampled_from([None, "You are terse.", "", "Réponds en français 🙂"]), min_size=3, max_size=3
        ),
        batches=st.tuples(
            st.sampled_from([16, 64, 512]), st.sampled_from([16, 64, 512]), st.sampled_from([1, 7, 16, 512])
        ),
        small=st.integers(64, 128),
        thinking=st.booleans(),
        apart=st.sampled_from([None, 0, 1, 2]),
    )
    def open_sessions(
        self,
        systems: list[str | None],
        batches: tuple[int, int, int],
        small: int,
        thinking: bool,
        apart: int | None,
    ) -> None:
        """Three sessions; ``apart`` (if any) shares no prefix with the others."""
        self.note(
            "open_sessions", systems=systems, batches=batches, small=small, thinking=thinking, apart=apart
        )
        sizes = [*CONTEXT_SIZES, small]
        for i, (system, batch, size) in enumerate(zip(systems, batches, sizes, strict=True)):
            session = env().model.session(
                system, context_size=size, batch_size=batch, thinking=thinking, share_prefix=i != apart
            )
            self.sessions.append(session)
            self.expected.append([] if system is None else [{"role": "system", "content": system}])
            self.pending.append(None)

    def teardown(self) -> None:
        for i, session in enumerate(self.sessions):
            pending = self.pending[i]
            if pending is not None:
                pending.stream.close()
            session.close()

    @invariant()
    def consistent(self) -> None:
        self.end_step()
        for i, session in enumerate(self.sessions):
            assert session.messages == self.expected[i], (
                f"session {i}: transcript {session.messages!r} != expected {self.expected[i]!r}"
            )
            pending = self.pending[i]
            if pending is not None:
                assert pending.stream.reply is None
            assert 0 <= session.cached_tokens <= session.context_size
            context, (_, seq) = internals.live_context(session), internals.placement(session)
            if context is not None:
                assert context.pos_max(seq) == session.cached_tokens - 1, (
                    f"session {i}: memory holds up to position {context.pos_max(seq)}, "
                    f"the record {session.cached_tokens} positions"
                )

    # -- calls ----------------------------------------------------------------------------
    @rule(i=SESSION, content=CONTENTS, options=OPTIONS)
    def respond(self, i: int, content: Any, options: GenerationOptions) -> None:
        self.note("respond", i=i, content=content, options=options)
        self.exchange(i, content, options)

    @rule(i=SESSION, content=CONTENTS, options=OPTIONS, mode=STREAM_MODES, k=st.integers(0, 6))
    def stream(self, i: int, content: Any, options: GenerationOptions, mode: str, k: int) -> None:
        """Take k snapshots, then break (left pending), close, drop, exit a with block, clear
        the session's cache, or answer on another session meanwhile; or take them all."""
        self.note("stream", i=i, content=content, options=options, mode=mode, k=k)
        self.exchange(i, content, options, mode=mode, k=k, other=k)

    @rule(
        i=SESSION,
        content=CONTENTS,
        options=OPTIONS,
        k=st.integers(0, 6),
        delay=st.one_of(st.none(), st.sampled_from([0.0, 0.001, 0.005, 0.02, 0.05])),
    )
    def cancel(self, i: int, content: Any, options: GenerationOptions, k: int, delay: float | None) -> None:
        """``cancel()`` after k snapshots, or from a timer thread (prefill included) at ``delay``."""
        self.note("cancel", i=i, content=content, options=options, k=k, delay=delay)
        if delay is None:
            self.exchange(i, content, options, mode="cancel", k=k)
        else:
            self.exchange(i, content, options, mode="timer", delay=delay)

    @rule(i=SESSION, other=st.integers(1, 2), first=CONTENTS, second=CONTENTS, options=OPTIONS)
    def concurrent(self, i: int, other: int, first: Any, second: Any, options: GenerationOptions) -> None:
        """Two sessions of the one model answer at the same time, from two threads."""
        j = (i + other) % len(self.sessions)
        self.note("concurrent", i=i, j=j, first=first, second=second, options=options)
        ours, theirs = self.prompt_items(i, first), self.prompt_items(j, second)
        in_threads(
            functools.partial(self.exchange, i, first, options, alongside=theirs, beside=j),
            functools.partial(self.exchange, j, second, options, mode="exhaust", alongside=ours, beside=i),
        )

    def prompt_items(self, i: int, content: Any) -> tuple[object, ...]:
        """The prompt a call on session i would decode (none where it cannot be built)."""
        messages = [*self.expected[i], {"role": "user", "content": content}]
        try:
            prompt = internals.local(env().model).prompt(messages, thinking=self.sessions[i].thinking)
        except TYPED:
            return ()
        try:
            return tuple(prompt.items)
        finally:
            prompt.close()

    @precondition(lambda self: any(p is not None for p in self.pending))
    @rule(how=st.sampled_from(["close", "drop", "resume"]))
    def finish_pending(self, how: str) -> None:
        i = next(j for j, p in enumerate(self.pending) if p is not None)
        pending = self.pending[i]
        assert pending is not None
        self.note("finish_pending", i=i, how=how)
        if how == "close":
            self.close_pending(i)
            return
        self.pending[i] = None
        user, options, expectation, cached_before = (
            pending.user,
            pending.options,
            pending.expectation,
            pending.cached_before,
        )
        text: str | None = pending.text
        if how == "drop":
            turn = pending.stream.exchange
            gone = weakref.ref(pending.stream)
            del pending
            assert gone() is None, "something still holds the dropped stream"
            reply = turn.reply
            assert reply is not None, "dropping a pending stream did not finish its exchange"
            finishes: tuple[str, ...] = ("cancelled",)
        else:
            taken = Taken(pending.stream, pending.text)
            taken.take(None)
            reply = pending.stream.reply
            assert reply is not None, "a resumed stream ran out without a reply"
            text, finishes = taken.text, ("stop", "length")
        check_reply(
            self.sessions[i],
            reply,
            options,
            expectation,
            text=text,
            finishes=finishes,
            cached_before=cached_before,
        )
        self.expected[i] += [user, {"role": "assistant", "content": reply.text}]

    @rule(i=SESSION, images=st.integers(0, 40), options=GREEDY_SHORT)
    def overflow(self, i: int, images: int, options: GenerationOptions) -> None:
        """A prompt beyond the context (words, or many images on the small session)."""
        session = self.sessions[i]
        content: Any = "lantern " * (session.context_size + 8)
        if i == 2 and images:
            content = ["Look:", *[env().images["red"]] * images]
        self.note("overflow", i=i, images=images)
        self.exchange(i, content, options)

    @rule(content=TEXTS, options=OPTIONS, clear=st.booleans())
    def fill_small_context(self, content: str, options: GenerationOptions, clear: bool) -> None:
        """No max_tokens limit on the 64-128 position session: the context bounds the reply."""
        self.note("fill_small_context", content=content, options=options, clear=clear)
        if clear:
            self.expected[2] = []
            self.sessions[2].messages = []
        unbounded = dataclasses.replace(options, max_tokens=2**31 - 1)
        self.exchange(2, content, unbounded)

    @rule(i=SESSION, content=CONTENTS, fresh_batch=st.sampled_from([None, 64, 512]))
    def differential(self, i: int, content: Any, fresh_batch: int | None) -> None:
        """The cached session's first-token logits equal a fresh session's, within split noise.
        Neither decodes ahead for this exchange: its anticipatory prefill would leave the logits
        after the reply's token and the next prompt's opening, and a token that differs at a near
        tie (within the noise) would then compare two other texts' logits (seen: 2.5 apart)."""
        self.note("differential", i=i, content=content, fresh_batch=fresh_batch)
        self.close_pending(i)
        before = copy.deepcopy(self.expected[i])
        session = self.sessions[i]
        ahead, session.looks_ahead = session.looks_ahead, False  # type: ignore[attr-defined]
        try:
            cached = self.exchange(i, content, GREEDY_ONE)
        finally:
            session.looks_ahead = ahead  # type: ignore[attr-defined]
        check_first_logits(session, before, content, cached, fresh_batch)

    # -- transcript edits -----------------------------------------------------------------
    @rule(i=SESSION, edit=EDITS, m=st.integers(0, 50), text=TEXTS, other=st.integers(0, 2))
    def edit_transcript(self, i: int, edit: str, m: int, text: str, other: int) -> None:
        self.note("edit_transcript", i=i, edit=edit, m=m, text=text, other=other)
        session = self.sessions[i]
        real, shadow = session.messages, self.expected[i]
        assert real is not shadow
        if edit == "clear cached context":
            pending = self.settle(i)
            session.clear_cached_context()
            check_settled(pending)
            assert session.cached_tokens == 0 and internals.placement(session)[0] == "cold"
        elif edit == "pop exchange":
            del real[-2:], shadow[-2:]
        elif edit == "pop last":
            del real[-1:], shadow[-1:]
        elif edit in ("edit text in place", "replace message") and shadow:
            j = m % len(shadow)
            if edit == "edit text in place":
                real[j]["content"] = text
                shadow[j]["content"] = text
            else:
                real[j] = {"role": real[j]["role"], "content": [text]}
                shadow[j] = {"role": shadow[j]["role"], "content": [text]}
        elif edit == "truncate":
            n = m % (len(shadow) + 1)
            session.messages = real[:n]
            self.expected[i] = shadow[:n]
        elif edit == "clear":
            session.messages = []
            self.expected[i] = []
        elif edit == "append pair":
            for messages in (real, shadow):
                messages += [{"role": "user", "content": text}, {"role": "assistant", "content": text[::-1]}]
        elif edit == "append assistant":
            real.append({"role": "assistant", "content": text})
            shadow.append({"role": "assistant", "content": text})
        elif edit == "odd role":
            real.append({"role": "tool", "content": text})
            shadow.append({"role": "tool", "content": text})
        elif edit == "system":
            if shadow and shadow[0]["role"] == "system":
                real[0]["content"] = text
                shadow[0]["content"] = text
            else:
                real.insert(0, {"role": "system", "content": text})
                shadow.insert(0, {"role": "system", "content": text})
        elif edit == "image in an old message" and shadow:
            j = m % len(shadow)
            parts = [text, env().images["blue" if m % 2 else "red"]]
            real[j] = {"role": real[j]["role"], "content": list(parts)}
            shadow[j] = {"role": shadow[j]["role"], "content": list(parts)}
        elif edit == "extra key" and shadow:
            j = m % len(shadow)
            real[j]["name"] = text
            shadow[j]["name"] = text
        elif edit == "transplant":
            source = self.expected[other]
            session.messages = copy.deepcopy(source)
            self.expected[i] = [copy_message(message) for message in source]

    # -- invalid input --------------------------------------------------------------------
    @rule(i=SESSION, kind=MISUSES, data=st.data())
    def misuse(self, i: int, kind: str, data: st.DataObject) -> None:
        """Invalid input of every kind: each must raise a typed error and change nothing."""
        if kind == "bad content":
            self.bad_content(i, data.draw(BAD_CONTENT_KINDS), data.draw(TEXTS), data.draw(OPTIONS))
        elif kind == "bad options":
            how = data.draw(st.sampled_from(["mutated", "not options"]))
            which = data.draw(st.integers(0, len(NOT_OPTIONS) - 1))
            self.bad_options(i, data.draw(st.sampled_from(BAD_FIELDS)), how, which)
        elif kind == "bad transcript":
            self.bad_transcript(i, data.draw(BAD_TRANSCRIPT_KINDS), data.draw(TEXTS))
        elif kind == "bad token ids":
            self.bad_token_ids(data.draw(BAD_TOKEN_IDS))
        else:
            self.bad_session_arguments(data.draw(SESSION_ARGUMENTS), data.draw(BAD_SESSION_VALUES))

    def bad_content(self, i: int, kind: str, text: str, options: GenerationOptions) -> None:
        content, errors = invalid_content(kind, text)
        self.note("misuse: bad content", i=i, kind=kind, text=text)
        session = self.sessions[i]
        pending = self.settle(i)
        cached_before, context_before = session.cached_tokens, internals.placement(session)
        try:
            session.respond(content, options)
        except TYPED as error:
            STATS.outcomes[f"error {type(error).__name__}"] += 1
            assert isinstance(error, errors), f"{kind}: {error!r} is not one of {errors}"
        else:
            raise AssertionError(f"an invalid content ({kind}: {content!r}) was accepted")
        check_settled(pending)
        assert session.cached_tokens == cached_before and internals.placement(session) == context_before

    def bad_options(self, i: int, bad: tuple[str, Any], how: str, which: int) -> None:
        name, value = bad
        self.note("misuse: bad options", i=i, name=name, value=value, how=how, which=which)
        try:
            GenerationOptions(**{name: value})
        except (TypeError, ValueError):
            pass
        else:
            raise AssertionError(f"GenerationOptions({name}={value!r}) was accepted")
        options: Any
        if how == "mutated":  # a frozen dataclass forced: respond validates again
            options = GenerationOptions(max_tokens=3)
            object.__setattr__(options, name, value)
        else:
            options = NOT_OPTIONS[which]
        session = self.sessions[i]
        cached_before, context_before = session.cached_tokens, internals.placement(session)
        pending = self.pending[i]
        try:
            session.respond("Hello", options)
        except (TypeError, ValueError) as error:
            STATS.outcomes[f"error {type(error).__name__}"] += 1
        else:
            raise AssertionError(f"respond accepted bad options {options!r}")
        # Nothing happened: not even the pending stream was finished.
        assert session.cached_tokens == cached_before and internals.placement(session) == context_before
        if pending is not None:
            assert pending.stream.reply is None

    def bad_transcript(self, i: int, kind: str, text: str) -> None:
        self.note("misuse: bad transcript", i=i, kind=kind)
        session = self.sessions[i]
        self.close_pending(i)
        valid = session.messages
        bad = invalid_transcript(kind, valid)
        shown = copy.deepcopy(bad)
        cached_before, context_before = session.cached_tokens, internals.placement(session)
        session.messages = bad
        try:
            session.respond(text or "Hello", GREEDY_ONE)
        except TYPED as error:
            STATS.outcomes[f"error {type(error).__name__}"] += 1
        else:
            raise AssertionError(f"an invalid transcript ({kind}) was accepted")
        finally:
            after = session.messages
            session.messages = valid  # restore a valid transcript whatever happened
        assert after is bad and after == shown, f"a failed call changed the transcript: {after!r}"
        assert session.cached_tokens == cached_before and internals.placement(session) == context_before

    def bad_token_ids(self, ids: list[int]) -> None:
        self.note("misuse: bad token ids", ids=ids)
        model = env().model
        valid = all(0 <= t < internals.local(model).native.n_vocab for t in ids)
        try:
            text = model.detokenize(ids)
        except ValueError:
            assert not valid, f"detokenize refused valid ids {ids}"
        else:
            assert valid and isinstance(text, str), f"detokenize accepted {ids}"

    def bad_session_arguments(self, name: str, value: Any) -> None:
        self.note("misuse: bad session arguments", name=name, value=value)
        if name == "batch_size" and value == 15:  # too small a context, a fine batch
            value = 0
        if name == "context_size" and value is None:  # the default size: a fine one
            value = 0
        try:
            env().model.session(**{name: value})
        except (TypeError, ValueError):
            pass
        else:
            raise AssertionError(f"Model.session({name}={value!r}) was accepted")
