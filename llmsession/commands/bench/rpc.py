"""``llmsession bench rpc``: a model's layers on RPC servers against the same model local, and
what the worker process (``isolated``) costs, in one run.

Four contenders, one after another (a server takes one client at a time): local in this process,
local in a worker process, RPC in a worker (the default with servers), RPC in this process. Each
runs the same greedy multi-turn chat; the table gives the median time to first token over the
turns after the first (prefix reuse at work), generation tokens/s, and how each compares with
local in-process. Without ``--rpc``, two servers are started on this machine's loopback: they
share its cores with the client, so their speed is a floor for a real network's compute, not a
measure of one (there every token also pays a round trip per server).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

from llmsession.api.model import Model
from llmsession.commands.argtypes import positive_int
from llmsession.commands.bench.common import common_arguments, machine, progress, publish, table
from llmsession.commands.bench.report import exchange
from llmsession.native.rpc import local_servers
from llmsession.options import GenerationOptions

QUESTIONS = (
    "What is the capital of France?", "What is it famous for?", "Name one river that flows through it.",
    "Which sea does it flow into?", "Suggest a museum to visit there.",
)  # fmt: skip
ROUND_TRIPS = 500
CONTENDERS = (("local", False, False), ("local, worker", False, True), ("rpc, worker", True, True),
              ("rpc, in-process", True, False))  # fmt: skip


def chat(model: Model, options: GenerationOptions, turns: int) -> dict[str, Any]:
    """One chat, each exchange streamed: its TTFTs, generation rates and reply texts; and the
    time of a call that does nothing (a worker's round trip: each streamed token pays one)."""
    model.session().respond("Hello", GenerationOptions(max_tokens=4, temperature=0))  # warm up
    session = model.session(system="You are a helpful assistant.")
    began = time.perf_counter()
    for _ in range(ROUND_TRIPS):
        _ = session.cached_tokens
    call_s = (time.perf_counter() - began) / ROUND_TRIPS
    ttft, rates, texts = [], [], []
    for question in QUESTIONS[:turns]:
        turn, text = exchange(session, question, options)
        ttft.append(turn.ttft_s)
        rates.append(turn.generation_tokens_per_s)
        texts.append(text)
    return {"ttft_s": ttft, "tokens_per_s": rates, "texts": texts, "call_s": call_s}


@contextlib.contextmanager
def endpoints(given: list[str] | None, threads: int | None) -> Iterator[list[str]]:
    if given:
        yield given
        return
    with local_servers(2, threads=threads) as started:
        yield [endpoint for endpoint, _ in started]


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    options = GenerationOptions(max_tokens=args.max_tokens, temperature=0)
    results: dict[str, Any] = {"model": args.model.name, "max_tokens": args.max_tokens, "contenders": {}}
    with endpoints(args.rpc, args.server_threads) as servers:
        results["servers"] = servers if args.rpc else f"2 on this machine's loopback ({servers})"
        for round_ in range(args.repeats):  # contenders in turn, so a noisy minute hits them all
            for name, remote, isolated in CONTENDERS:
                progress(f"{name} (round {round_ + 1})", started)
                extra: dict[str, Any] = {"rpc_servers": servers} if remote else {}
                with Model(args.model, threads=args.threads, isolated=isolated, **extra) as model:
                    results["machine"] = machine(model.threads)
                    runs = results["contenders"].setdefault(name, [])
                    runs.append(chat(model, options, args.turns))
    return results


def report(results: dict[str, Any]) -> None:
    contenders = results["contenders"]
    base = contenders["local"]

    def ttft(runs: list[dict[str, Any]]) -> float:
        return float(statistics.median(t for run in runs for t in run["ttft_s"][1:]))

    def rate(runs: list[dict[str, Any]]) -> float:
        return float(statistics.median(r for run in runs for r in run["tokens_per_s"]))

    def call(runs: list[dict[str, Any]]) -> float:
        return float(statistics.median(run["call_s"] for run in runs))

    def same(runs: list[dict[str, Any]]) -> bool:
        return all(run["texts"] == base[0]["texts"] for run in runs)

    rows = [
        [name, f"{ttft(c) * 1000:.1f}", f"{ttft(c) / ttft(base):.2f}", f"{rate(c):.1f}",
         f"{rate(c) / rate(base):.2f}", f"{call(c) * 1e6:.0f}",
         f"{call(c) * rate(base) * 100:.1f} %", "yes" if same(c) else "no"]
        for name, c in contenders.items()
    ]  # fmt: skip
    title = (
        f"{results['model']}, servers: {results['servers']}, {results['max_tokens']} greedy tokens a "
        f"turn, {len(base)} rounds (medians)"
    )
    header = ["contender", "TTFT ms (turns 2+)", "x local", "gen tok/s", "x local", "call us",
              "call / local token", "same replies"]  # fmt: skip
    table(title, header, rows)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="llmsession bench rpc", description=__doc__.splitlines()[0])
    parser.add_argument("--rpc", action="append", metavar="HOST:PORT", help="servers (default: 2 local ones)")
    parser.add_argument("--server-threads", type=positive_int, default=1, help="threads of each local server")
    parser.add_argument("--max-tokens", type=positive_int, default=64)
    parser.add_argument("--turns", type=int, default=len(QUESTIONS), choices=range(2, len(QUESTIONS) + 1))
    parser.add_argument("--repeats", type=positive_int, default=3, help="rounds of every contender in turn")
    common_arguments(parser)
    args = parser.parse_args(argv)
    return publish(run(args), report, args.json)
