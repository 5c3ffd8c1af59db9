#!/usr/bin/env python3
"""What other live sessions cost a decode, in each KV layout, on raw llama contexts.

(1) A 1,000-token prefill and 48 one-token steps in the eighth sequence of a context of 8, alone
and beside 7 sequences of 1,000 tokens: one pool of cells (``kv_unified``) against cells of
their own per sequence (llama.cpp's streams), flash attention off and on. (2) Three streams'
batched step with 8 sequences of 500 tokens live, in sequences that follow each other or not
(llama.cpp computes together only consecutive streams). (3) Through the engine: four sessions
live with a story of about 200 tokens each, and the first, third and fourth go on together (64
tokens each, greedy, three threads), with ``engine.placement`` moving them into consecutive
sequences or not; rounds alternate so both see the same machine.

python scripts/bench_kv_layout.py [--json PATH] [--only others|steps|engine]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llmsession import GenerationOptions, Model, Session
from llmsession.commands import paths
from llmsession.engine import placement
from llmsession.native.context import NativeContext
from llmsession.native.llama import NativeModel

RNG = random.Random(0)


def tokens(n: int) -> list[int]:
    return [RNG.randrange(1000, 40000) for _ in range(n)]


def fill(context: NativeContext, seq: int, n: int) -> float:
    began = time.perf_counter()
    prompt = tokens(n)
    for i in range(0, n, 512):
        context.decode(prompt[i : i + 512], i, seq=seq)
    return time.perf_counter() - began


def beside_others(model: NativeModel, own: bool, flash: bool, others: int) -> dict[str, float]:
    context = NativeContext(
        model,
        n_ctx=16384 if own else 8192,
        n_batch=512,
        threads=2,
        n_seq_max=8,
        flash_attention=flash,
        own_cells=own,
    )
    try:
        for seq in range(others):
            fill(context, seq, 1000)
        prefill = fill(context, 7, 1000)
        began = time.perf_counter()
        for step in range(48):
            context.decode([1234], 1000 + step, seq=7)
        return {"prefill_ms": 1000 * prefill, "tokens_per_s": 48 / (time.perf_counter() - began)}
    finally:
        context.close()


def batched_steps(model: NativeModel, own: bool) -> dict[str, float]:
    context = NativeContext(
        model, n_ctx=8192, n_batch=512, threads=2, n_seq_max=8, flash_attention=False, own_cells=own
    )
    try:
        for seq in range(8):
            fill(context, seq, 500)
        result = {}
        for seqs in ([0, 1, 2], [0, 2, 3], [0, 2, 4], [0]):
            began = time.perf_counter()
            for step in range(30):
                context.decode_many([([1234], 500 + step, seq) for seq in seqs])
            result[",".join(map(str, seqs))] = 1000 * (time.perf_counter() - began) / 30
            for seq in seqs:
                context.seq_rm(500, seq)
        return result
    finally:
        context.close()


STORIES = ("a lighthouse", "a river town", "an old bridge", "a winter market")
OPENING = GenerationOptions(max_tokens=160, temperature=0)
TURN = GenerationOptions(max_tokens=64, temperature=0)  # each such turn runs to its length


def together(sessions: list[Session]) -> float:
    """The first, third and fourth sessions go on at once; their generated tokens a second."""
    replies: list[int] = []
    start = threading.Barrier(3)

    def one(session: Session) -> None:
        start.wait()
        replies.append(session.respond("Go on with the story, at length.", TURN).usage.completion_tokens)

    threads = [threading.Thread(target=one, args=(s,)) for s in (sessions[0], sessions[2], sessions[3])]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(replies) / (time.perf_counter() - began)


def engine_rounds(rounds: int = 6) -> dict[str, dict[str, object]]:
    """Tokens a second of three sessions going on together among four live (about 200 tokens
    each), placed or not, the two kinds of round alternating."""
    rates: dict[str, list[float]] = {"placed": [], "unplaced": []}
    stay = mock.patch.object(
        placement,
        "choose",
        lambda current, free, *_: placement.Placement(min(free) if current is None else current),
    )
    with Model(paths.default_model_path(), threads=2, anticipate=False) as model:
        for turn in range(rounds):
            name = ("placed", "unplaced")[turn % 2]
            sessions = [model.session() for _ in STORIES]
            for session, story in zip(sessions, STORIES, strict=True):  # live in sequences 0 to 3
                session.respond(f"Write a long story about {story}, with many characters.", OPENING)
            with stay if name == "unplaced" else contextlib.nullcontext():
                rates[name].append(together(sessions))
            for session in sessions:
                session.close()
    return {
        name: {"tokens_per_s": values, "median": statistics.median(values)} for name, values in rates.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--only", choices=["others", "steps", "engine"], help="run only part (1), (2) or (3)")
    args = parser.parse_args()
    results: dict[str, object] = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    model = NativeModel(paths.default_model_path())
    for flash in (False, True) if args.only in (None, "others") else ():
        for own in (False, True):
            for others in (0, 7):
                name = f"{'own' if own else 'pool'}, {others} others, flash {'on' if flash else 'off'}"
                results[name] = row = beside_others(model, own, flash, others)
                prefill, rate = row["prefill_ms"], row["tokens_per_s"]
                print(f"{name:32s} prefill {prefill:7.0f} ms  generation {rate:5.1f} tok/s")
    for own in (False, True) if args.only in (None, "steps") else ():
        results[f"steps, {'own' if own else 'pool'}"] = steps = batched_steps(model, own)
        for seqs, ms in steps.items():
            print(f"{'own' if own else 'pool'} cells, a step of sequences {seqs}: {ms:.1f} ms")
    model.close()
    if args.only in (None, "engine"):
        results["engine"] = rounds = engine_rounds()
        for name, row in rounds.items():
            rates = ", ".join(f"{r:.1f}" for r in row["tokens_per_s"])  # type: ignore[attr-defined]
            median = row["median"]
            print(
                f"three of four live sessions going on together, {name}: {rates} tok/s (median {median:.1f})"
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
