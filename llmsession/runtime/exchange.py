"""One exchange, as one pipeline: the prompt (rendered, tokenized and spliced by the session's
model before it gets here) is planned against the session's memory, its tail prefilled, the reply
generated token by token, and the exchange finished, in that order and in this module.

``Exchange.run`` is a generator: each ``next`` decodes up to the next token's text, on the
consumer's thread, so nothing decodes between two of them and an abandoned exchange costs
nothing. Its ``phase`` says where it is; once ``FINISHED`` its ``reply`` holds what was said.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator, Sequence
from contextlib import AbstractContextManager, closing
from dataclasses import dataclass, field, replace
from enum import Enum
from functools import partial
from typing import TYPE_CHECKING

from llmsession.engine.drafting import Drafter, unhold
from llmsession.engine.prefill import prefill
from llmsession.engine.prefix import starts_a_chunk
from llmsession.engine.prompt import Prompt
from llmsession.engine.seat import GROWTH, Seat
from llmsession.engine.work import Tracker
from llmsession.errors import MemoryBudgetError, ReplyMismatchError
from llmsession.native.cancel import CancelFlag
from llmsession.native.sampler import TokenSampler
from llmsession.options import GenerationOptions
from llmsession.replies import FinishReason, Message, Reply, Snapshot, Timings, ToolCall, Usage
from llmsession.runtime.calling import Calling, stop_matcher
from llmsession.runtime.place import Place
from llmsession.runtime.scoring import Scoring, sampler_for
from llmsession.runtime.thinking import Thinking
from llmsession.text.detokenize import IncrementalDetokenizer
from llmsession.text.stops import StopMatcher

if TYPE_CHECKING:
    from llmsession.native.constraints import Constraint

log = logging.getLogger("llmsession")


class Phase(Enum):
    """Where an exchange is: made (prompt and constraint ready, nothing decoded), planning and
    prefilling its prompt, generating its reply, or finished (its reply recorded)."""

    READY = "ready"
    PREFILL = "prefill"
    GENERATE = "generate"
    FINISHED = "finished"


@dataclass(eq=False)
class Exchange:
    """One exchange's state. ``finished`` records the reply in the session (called once, in the
    consumer's thread); nothing here holds the ``Stream`` that reads it."""

    place: Place
    said: list[Message]  # the messages this exchange answers (a user's, or tool results)
    prompt: Prompt
    options: GenerationOptions
    constraint: Constraint | None
    finished: Callable[[Exchange, Reply], None]
    began: float = 0.0  # perf_counter() when it was asked for (its prompt made since)
    tokens: list[int] = field(default_factory=list)  # the reply's, as sampled or forced
    cancelled: threading.Event = field(default_factory=CancelFlag)  # (native code reads it too)
    phase: Phase = Phase.READY
    finish: FinishReason = "length"
    stop_sequence: str | None = None  # the stop string the reply was cut at
    context_full: bool = False  # its "length" was the context's, not ``max_tokens``
    reply: Reply | None = None
    model_closed: bool = False  # its model was closed before it finished
    calling: Calling | None = None  # its tools, when the reply may call them
    text: str = ""  # the reply as generated (its calls included)
    scoring: Scoring | None = None  # its tokens' scores, when ``logprobs`` are asked for
    thinking: Thinking | None = None  # its reasoning split from its content (a thinking template)
    _tracker: Tracker | None = None  # its stream in the model's loop, while it generates

    @property
    def done(self) -> bool:
        return self.phase is Phase.FINISHED

    @property
    def spelled(self) -> frozenset[int]:
        """Special tokens whose text the reply keeps (a tool format's markers, reasoning's)."""
        calls = self.calling.spelled if self.calling is not None else frozenset()
        return calls | (self.thinking.spelled if self.thinking is not None else frozenset())

    # -- the pipeline ---------------------------------------------------------------------------
    def run(self) -> Generator[Snapshot, None, None]:
        """Plan, prefill, generate, finish; a snapshot per token's text."""
        started, prompt = time.perf_counter(), self.prompt
        usage = Usage(prompt_tokens=len(prompt.items))
        timings = Timings(render_s=prompt.render_s, tokenize_s=prompt.tokenize_s)
        carry = self.place.carry
        if carry.load_note is not None:
            (usage.restored_tokens, usage.cache_note), carry.load_note = carry.load_note, None
        text, cancelled = "", False
        self.phase = Phase.PREFILL
        try:
            with closing(self._sampler()) as sampler, self._seat() as seat:
                try:
                    first = self._plan_and_prefill(seat, sampler, usage, timings, started)
                    cancelled = first is None
                    if first is not None:
                        with closing(self._generate(seat, *first, sampler, usage, timings)) as deltas:
                            opening = True  # (the first snapshot carries the prompt's usage)
                            for delta in deltas:
                                text += delta
                                snapshot = self._snapshot(delta, text)
                                if opening:
                                    snapshot, opening = replace(snapshot, usage=replace(usage)), False
                                yield snapshot
                                if self.calling is not None and self.calling.ended:
                                    break  # at a call that repeats one: the reply ends before it
                            if self.calling is not None and (tail := self.calling.tail()) is not None:
                                yield tail if self.scoring is None else self.scoring.snapshot(tail)
                except GeneratorExit:  # closed or dropped mid-stream: keep what was generated
                    cancelled = True
                except BaseException as error:
                    seat.after_failure(error)
                    raise
                finally:
                    if prompt.unsafe_reuse:
                        seat.clear()
        except BaseException:
            self.phase = Phase.FINISHED  # failed: the transcript stays as it was
            prompt.close()
            raise
        self._conclude(text, "cancelled" if cancelled else self.finish, usage, timings)

    def _snapshot(self, delta: str, text: str) -> Snapshot:
        snapshot = Snapshot(delta, text) if self.calling is None else self.calling.snapshot(delta)
        if self.thinking is not None and self.thinking.pending:
            snapshot = replace(snapshot, reasoning_delta=self.thinking.take())
        return snapshot if self.scoring is None else self.scoring.snapshot(snapshot)

    def _seat(self) -> AbstractContextManager[Seat]:
        """The session's sequence, with room for the prompt and the reply's first stretch (an
        encoder-decoder model's exchange takes a context of its own)."""
        place, engine = self.place, self.place.engine
        if place.native.has_encoder:
            return engine.single_use(place.lease, place.context_size, self.cancelled)
        held = max(len(place.lease.cache.items), len(self.prompt.items))
        cells = min(place.context_size, held + min(self.options.max_tokens, GROWTH))
        return engine.seat(place.lease, cells, self.cancelled, joins=True)

    def _plan_and_prefill(
        self, seat: Seat, sampler: TokenSampler, usage: Usage, timings: Timings, started: float
    ) -> tuple[int, int] | None:
        """Keep the longest reusable prefix, decode the rest and sample the first token: (its
        position, the token), or None if cancelled."""
        prompt, carry = self.prompt, self.place.carry
        if prompt.unsafe_reuse:  # upstream's rule for such prompts: from scratch
            log.debug("no prefix reuse for this prompt: %s", prompt.unsafe_reuse)
            seat.clear()
        can_cut = partial(starts_a_chunk, prompt.items)
        plan = seat.prepare(prompt.items, can_cut, share=not prompt.unsafe_reuse)
        usage.reused_tokens, usage.from_checkpoint = plan.reused, plan.from_checkpoint
        usage.restored_tokens = min(usage.restored_tokens, plan.reused)  # what was used
        usage.shared_tokens = min(seat.shared, plan.reused)
        ahead, carry.anticipated = carry.anticipated, None
        usage.anticipated_tokens = ahead.reused_of(plan.reused) if ahead else 0
        timings.plan_s = time.perf_counter() - started
        first = prefill(seat, prompt, plan.reused, sampler, usage=usage, batch_size=self.place.batch_size)
        timings.prefill_s, timings.first_sample_s = seat.decode_s, seat.sample_s
        return first

    def _generate(
        self, seat: Seat, pos: int, token: int, sampler: TokenSampler, usage: Usage, timings: Timings
    ) -> Generator[str, None, None]:
        """The reply from its first sampled ``token`` on: each token's text, then the tokens
        since the last decode (the sampled one and any a constraint forces after it) decoded,
        and the next one sampled, in one step, batched with other streams' (``batching``)."""
        self.phase, self.finish = Phase.GENERATE, "length"
        first_token_at = time.perf_counter()
        timings.time_to_first_token_s = first_token_at - self.began
        with self.place.engine.batcher.generating(seat.context) as tracker:
            self._tracker = tracker  # (its own forced tokens do not wait for it: ``_keep_forced``)
            detokenizer, stops = IncrementalDetokenizer(), stop_matcher(self.options.stop, self.calling)
            cut, drafter = self._cut(usage, 0, sampler, token), self._drafter(seat, usage)
            pending = cut or [token, *sampler.forced()]
            held = 0  # how many of ``pending`` memory holds already (drafts the last step kept)
            while pending:
                batch: list[int] = []
                ended = yield from self._emit(
                    pending, held, batch, seat, pos, sampler, usage, detokenizer, stops
                )
                if ended:
                    break
                pos, kept, token = self._decode_step(seat, batch, pos + held, sampler, tracker, drafter)
                cut = self._cut(usage, len(kept), sampler, token)  # (the sampled token gives way)
                pending, held = [*kept, *(cut or [token, *sampler.forced()])], len(kept)
                timings.generation_s = time.perf_counter() - first_token_at
                timings._tokens = usage.completion_tokens
            # The detokenizer may still hold the first bytes of a character the reply was cut
            # inside of (max_tokens, cancel): they stay in the token record, not in the text.
            if self.thinking is not None and not stops.stopped:
                kept_back = self.thinking.flush()
                if self.scoring is not None:
                    self.scoring.flushed(kept_back)  # (the tokens of the text it held: content?)
                more = stops.push(kept_back)
                if more or self.thinking.pending:
                    yield more
            tail = "" if stops.stopped else stops.flush()
            self.stop_sequence = stops.matched
            if self.stop_sequence is not None and self.finish == "length":
                self.finish = "stop"  # (the flush found a stop the last tokens had held back)
            if tail:
                yield tail

    def _emit(
        self,
        pending: Sequence[int],
        held: int,
        batch: list[int],
        seat: Seat,
        pos: int,
        sampler: TokenSampler,
        usage: Usage,
        detokenizer: IncrementalDetokenizer,
        stops: StopMatcher,
    ) -> Generator[str, None, bool]:
        """Each pending token's text (from ``pos``; memory holds the first ``held`` already), the
        tokens gathered into ``batch`` for the next decode; True once the reply ends here
        (``finish`` says why)."""
        native, options = self.place.native, self.options
        for index, token in enumerate(pending):
            ended = native.is_eog(token) or (self.thinking is not None and self.thinking.ends(token))
            if self.cancelled.is_set() or ended:
                self.finish = (
                    "cancelled" if self.cancelled.is_set() else "complete" if sampler.complete else "stop"
                )
                unhold(seat, held - index, usage, said=False)
                return True
            usage.completion_tokens += 1
            text = self._text(token, index, usage, sampler, detokenizer)
            delta = stops.push(text)
            if delta or (self.thinking is not None and self.thinking.pending):
                try:
                    yield delta
                except GeneratorExit:  # closed here: the reply keeps this token, memory all but it
                    self.tokens.append(token)
                    unhold(seat, held - index, usage, said=True)
                    raise
            if index >= held:
                batch.append(token)
            self.tokens.append(token)
            if stops.stopped:
                self.finish = "stop"
            elif usage.completion_tokens < options.max_tokens and pos + index + 1 < self.place.context_size:
                continue
            elif sampler.finished and all(native.is_eog(t) for t in pending[index + 1 :]):
                self.finish = "complete"  # finished by the last token it was allowed
            else:  # "length": the last token needs no decode; forced ones before it do
                self.context_full = usage.completion_tokens < options.max_tokens
            if index < held:
                unhold(seat, held - index, usage, said=True)
            else:
                self._keep_forced(seat, batch[:-1], pos + held)
            return True
        return False

    def _text(
        self, token: int, index: int, usage: Usage, sampler: TokenSampler, detok: IncrementalDetokenizer
    ) -> str:
        """The reply's text the ``index``-th pending token completes, less the reasoning it
        holds; scored if logprobs are asked for (``Scoring.noted``)."""
        piece = self.place.native.piece(token, special=token in self.spelled)
        completed = text = detok.push(piece)
        if self.thinking is not None:
            text = self.thinking.split(completed, usage, counted=not self.thinking.forced(index))
            if self.thinking.after_close and self.constraint is not None:  # (before it began)
                written = self.thinking.after_close
                sampler.catch_up(self.place.native.tokenize(written, add_special=False, parse_special=False))
        if self.scoring is not None:
            self.scoring.noted(token, piece, completed, text, detok.before, index == 0, self.thinking)
        return text

    def _cut(self, usage: Usage, at: int, sampler: TokenSampler, token: int) -> list[int]:
        return [] if self.thinking is None else self.thinking.instead(usage, at, token, sampler)

    def _decode_step(
        self,
        seat: Seat,
        batch: list[int],
        pos: int,
        sampler: TokenSampler,
        tracker: Tracker,
        drafter: Drafter | None,
    ) -> tuple[int, list[int], int]:
        """Decode ``batch`` from ``pos`` (with drafts after it) and sample the next token: (the
        next position, the drafts kept, the token after them)."""
        size, kept, token = self.place.batch_size, list[int](), -1
        for i in range(0, len(batch), size):  # forced tokens may be many
            chunk, last = batch[i : i + size], i + size >= len(batch)
            if not last:
                seat.decode(chunk, pos + i, tracker=tracker)  # (its own stream: not waited for)
                continue
            drafts, began = self._drafts(drafter, chunk, pos + i), time.perf_counter()
            kept, token = seat.step(chunk, pos + i, sampler, tracker, drafts)
            if drafter is not None:
                drafter.record(len(drafts), kept, time.perf_counter() - began)
        return pos + len(batch), kept, token

    def _drafts(self, drafter: Drafter | None, chunk: list[int], pos: int) -> list[int]:
        """Tokens to draft after ``chunk``, within the reply's, the context's and a batch's room,
        none past an end of generation nor into a block under a budget (``Thinking.draftable``)."""
        if drafter is None:
            return []
        done = len(self.tokens)  # (the reply's tokens so far, ``chunk`` included)
        room = min(
            self.options.max_tokens - done - 1,
            self.place.context_size - (pos + len(chunk)) - 1,
            self.place.batch_size - len(chunk),
        )
        drafts = drafter.propose(chunk, room)
        native = self.place.native  # (the reply would end there: nothing after it pays)
        drafts = next((drafts[:i] for i, token in enumerate(drafts) if native.is_eog(token)), drafts)
        return drafts if self.thinking is None else self.thinking.draftable(drafts)  # (a budget)

    def _drafter(self, seat: Seat, usage: Usage) -> Drafter | None:
        """Drafts for this exchange, if asked and sound here: not under a constraint or with
        scores (their samplers see one row at a time), nor on recurrent states (a rejected draft
        cannot leave them), encoder-decoder models or prompts with images."""
        native = self.place.native
        if self.options.draft is None or self.constraint is not None or self.scoring is not None:
            return None
        if native.is_recurrent or native.has_encoder or seat.single_use or self.prompt.images:
            return None
        return Drafter(self.prompt.tokens(), usage)

    def _keep_forced(self, seat: Seat, tokens: list[int], pos: int) -> None:
        """Decode the tokens of a reply that ended inside a forced run, all but its last, so the
        next exchange keeps them; a bonus, skipped when memory is short."""
        size = self.place.batch_size
        try:
            for i in range(0, len(tokens), size):
                seat.decode(tokens[i : i + size], pos + i, tracker=self._tracker)
        except MemoryBudgetError:
            log.debug("the reply's forced tokens were left undecoded: no room")

    def _sampler(self) -> TokenSampler:
        """The exchange's sampler chain (``scoring.sampler_for``); its scores kept if asked for."""
        native, context_size = self.place.native, self.place.context_size
        waits = self.thinking.waits if self.thinking is not None else None
        sampler, self.scoring = sampler_for(
            self.options, native, context_size, self.prompt, self.constraint, waits
        )
        return sampler

    # -- the end ----------------------------------------------------------------------------------
    def _conclude(self, text: str, finish: FinishReason, usage: Usage, timings: Timings) -> None:
        """Record the reply; a constrained one that is complete is parsed (a GrammarError if the
        matcher let through what does not parse, raised once the reply is recorded)."""
        self.text = text
        parsed, error = None, None
        calls: tuple[ToolCall, ...] = ()
        if self.calling is not None:
            text, calls, finish, error = self.calling.conclude(text, finish)
        elif self.constraint is not None and finish == "complete":
            try:  # (what the constraint held: the block too, if the reply opened it)
                thinking = self.thinking
                block = ""
                if thinking is not None and not (thinking.prompted or self.constraint.opened):
                    block = thinking.preamble
                parsed = self.constraint.parse(block + text)
            except ValueError as problem:
                error = ReplyMismatchError(f"the reply does not match its schema: {problem}")
        logprobs = None if self.scoring is None else self.scoring.reply(text)
        stop = self.stop_sequence if finish == "stop" else None  # (not a call's, not a cancel's)
        if self.thinking is not None:
            self.text = self.thinking.preamble + self.text  # (as generated: its reasoning first)
        reasoning = "" if self.thinking is None else self.thinking.reasoning
        full = self.context_full and finish == "length"
        self._record(Reply(text, finish, usage, timings, parsed, calls, logprobs, stop, reasoning, full))
        if error is not None:
            raise error

    @property
    def block(self) -> str:
        """The reply's reasoning block as generated, before its content ("": none)."""
        return "" if self.thinking is None else self.thinking.preamble

    def _record(self, reply: Reply) -> None:
        self.prompt.close()
        self.reply, self.phase = reply, Phase.FINISHED
        self.finished(self, reply)

    def abandon(self, steps: Generator[Snapshot, None, None]) -> None:
        """Finish an exchange its stream gave up on (closed, dropped, or superseded): a started
        one finishes itself, as cancelled, when ``steps`` closes; one never started decoded
        nothing."""
        self.cancelled.set()
        steps.close()
        if not self.done:
            self._record(Reply("", "cancelled", Usage(prompt_tokens=len(self.prompt.items)), Timings()))
