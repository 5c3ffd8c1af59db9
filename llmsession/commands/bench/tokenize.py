"""``llmsession bench tokenize``: what tokenizing a prompt costs as a chat grows, against
tokenizing its whole text (what every turn cost before prompts were spliced and segmented).

Two ways a prompt comes: a session's next turn (its replies spliced as generated, the text
between remembered) and a client's transcript whose replies this model did not generate (a
stateless call: tokenized in segments at the template's special tokens, each remembered; a
second model instance, so none of the chat's replies are known to it).

    llmsession bench tokenize [--turns 20] [--model PATH] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import statistics
import time
from typing import Any

from llmsession.api.model import Model
from llmsession.commands.argtypes import positive_int
from llmsession.commands.bench.common import common_arguments, machine, progress, publish, table
from llmsession.commands.bench.main import QUESTIONS, SYSTEM
from llmsession.options import GenerationOptions
from llmsession.runtime.face import Session

REPLY = GenerationOptions(max_tokens=48, temperature=0)


def ms_to(call: Any, *args: Any) -> float:
    began = time.perf_counter()
    call(*args)
    return (time.perf_counter() - began) * 1e3


def chat(model: Model, client: Model, turns: int) -> list[dict[str, float]]:
    """Per turn: the session's prompt tokenize time, the client transcript's, and the whole text's."""
    session, rows = model.session(SYSTEM), []
    with contextlib.closing(session):
        for turn in range(turns):
            rows.append(measured_turn(model, client, session, QUESTIONS[turn % len(QUESTIONS)]))
    return rows


def measured_turn(model: Model, client: Model, session: Session, question: str) -> dict[str, float]:
    """One turn's three times (the whole text's, the median of three)."""
    transcript = [*session.messages, {"role": "user", "content": question}]
    text = model.render(transcript)
    whole = statistics.median(ms_to(model.tokenize, text) for _ in range(3))
    client_ms = ms_to(client.prompt_tokens, transcript)
    reply = session.respond(question, REPLY)
    return {
        "prompt_tokens": reply.usage.prompt_tokens,
        "session_ms": reply.timings.tokenize_s * 1e3,
        "client_ms": client_ms,
        "whole_ms": whole,
    }


def report(results: dict[str, Any]) -> None:
    m = results["machine"]
    print(f"\ntokenizing prompts: {results['model']} on {m['cpu']}, {m['threads']} threads")
    header = ["turn", "prompt", "session ms", "client ms", "whole text ms"]
    times = ("session_ms", "client_ms", "whole_ms")
    rows = [
        [str(i), str(r["prompt_tokens"]), *(f"{r[name]:.2f}" for name in times)]
        for i, r in enumerate(results["turns"], 1)
    ]
    table("", header, rows)
    late = results["turns"][-5:]
    for name in times:
        print(f"last 5 turns, median {name}: {statistics.median(r[name] for r in late):.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llmsession bench tokenize", description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=positive_int, default=20, help="turns of the chat")
    common_arguments(parser)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    with Model(args.model, threads=args.threads) as model, Model(args.model, threads=args.threads) as client:
        date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        results: dict[str, Any] = {"date": date, "machine": machine(model.threads), "model": args.model.name}
        progress(f"a {args.turns}-turn chat", started)
        results["turns"] = chat(model, client, args.turns)
    progress("done", started)
    return publish(results, report, args.json)
