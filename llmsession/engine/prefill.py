"""An exchange's prefill: the prompt's tail decoded in batches into the session's sequence (stopping
where a recurrent memory's checkpoint is due), or an encoder-decoder model's prompt encoded whole;
both end with the first reply token sampled from the last logits."""

from __future__ import annotations

from contextlib import closing

from llmsession.engine.prompt import Prompt
from llmsession.engine.seat import Feeder, Seat
from llmsession.native.context import DecodeAborted
from llmsession.native.projector import ImageChunk
from llmsession.native.sampler import TokenSampler
from llmsession.replies import Usage


def prefill(
    seat: Seat, prompt: Prompt, reused: int, sampler: TokenSampler, *, usage: Usage, batch_size: int
) -> tuple[int, int] | None:
    """Decode the prompt after its first ``reused`` items and sample the first reply token
    from the last one's logits; (next position, that token), or None if cancelled. On a
    recurrent memory, stop where a checkpoint is due and take it."""
    if seat.single_use:
        return encode(seat, prompt, sampler, usage=usage)
    # ``done`` counts items (what the record holds), ``pos`` positions: an M-RoPE image spans
    # fewer positions than items.
    with closing(seat.feeder()) as feed:
        return _feed(seat, feed, prompt, reused, sampler, usage=usage, batch_size=batch_size)


def _feed(
    seat: Seat,
    feed: Feeder,
    prompt: Prompt,
    reused: int,
    sampler: TokenSampler,
    *,
    usage: Usage,
    batch_size: int,
) -> tuple[int, int] | None:
    """``prefill`` past the encoder-decoder case: each piece after ``reused`` fed in chunks."""
    items, done, pos, end, token = prompt.items, reused, reused, 0, -1
    stops = set(seat.checkpoint_stops(len(items)))
    for piece in prompt.pieces:
        size = piece.n_tokens if isinstance(piece, ImageChunk) else len(piece)
        start, end = end, end + size  # this piece holds items[start:end]
        if end <= reused:
            continue
        last = end == len(items)
        try:
            if isinstance(piece, ImageChunk):
                if seat.cancelled.is_set():
                    return None
                if done in stops:
                    seat.checkpoint()
                pos, token = seat.eval_image(
                    piece, pos, items[start:end], sampler=sampler if last else None, tracker=feed.tracker
                )
                done = end
                usage.decoded_prompt_tokens += size
                continue
            while done < end:
                if seat.cancelled.is_set():
                    return None
                if done in stops:
                    seat.checkpoint()
                stop = min([end, done + batch_size, *(p for p in stops if p > done)])
                chunk = piece[done - start : stop - start]
                final = last and stop == end
                token = feed(chunk, pos, sampler if final else None)
                pos, done = pos + len(chunk), done + len(chunk)
                usage.decoded_prompt_tokens += len(chunk)
        except DecodeAborted as aborted:
            if aborted.cause is not None:
                raise  # _generate restores memory to the record and raises the cause
            usage.decoded_prompt_tokens += len(seat.items) - done  # (slices decoded before the cancel)
            if not aborted.clean:  # (stopped mid-batch: memory may hold part of it)
                seat.after_abort()
            return None
    return pos, token


def encode(seat: Seat, prompt: Prompt, sampler: TokenSampler, *, usage: Usage) -> tuple[int, int] | None:
    """An encoder-decoder model's prefill: the whole prompt through the encoder, then the
    decoder's start token; (next position, the first reply token), or None if cancelled."""
    try:
        if seat.cancelled.is_set():
            return None
        seat.encode(prompt.tokens())
        usage.decoded_prompt_tokens = len(prompt.items)
        return 1, seat.decode([seat.decoder_start], 0, abortable=True, sampler=sampler)
    except DecodeAborted as aborted:
        if aborted.cause is not None:
            raise
        return None
