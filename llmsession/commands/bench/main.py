"""What the session cache buys over a fresh context per exchange, and what our decode loop costs.

Every scenario runs side by side in one process, so machine noise hits all contenders alike:

* multi-turn: one scripted chat with the session cache; each turn is replayed in a fresh context;
* interleaved: several sessions on one model answered round-robin, each keeping its own cache;
* generation: our decode loop's tokens/s against llama.cpp's own ``llama-bench`` on the same build;
* ``--peer llama-cpp-python``: the same chats through llama-cpp-python, in a worker process.

Times to first token (TTFT) are wall clock from the call, so rendering and tokenizing count.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from llmsession.api.model import Model
from llmsession.commands.argtypes import output_file, seconds
from llmsession.commands.bench.common import (
    common_arguments,
    flash_attn_option,
    llama_bench,
    machine,
    progress,
    publish,
    run_worker,
)
from llmsession.commands.bench.report import MeasuredTurn, exchange, plot, report, rows_of, totals, turns_of
from llmsession.engine.prefix import common_prefix
from llmsession.options import GenerationOptions
from llmsession.replies import Message
from llmsession.runtime.face import Session

SYSTEM = "You are a helpful, concise assistant."
QUESTIONS = (
    "What is the capital of France?", "What is it famous for? Answer in one sentence.",
    "Name one river that flows through it.", "How long is that river, roughly?",
    "Which sea does it flow into?", "Suggest a museum to visit there.",
    "What is a famous painting in that museum?", "Who painted it?",
    "When did that painter live?", "Name another work by the same painter.",
    "What is a typical French breakfast?", "And a typical dessert?",
    "How do you say 'thank you' in French?", "What is the population of the city, approximately?",
    "Which famous tower stands there?", "When was it built?",
    "How tall is it?", "Can visitors climb it?",
    "What is a good time of year to visit?", "Thanks! Say goodbye in French.",
)  # fmt: skip
WARM_UP = "Hello"
LONG_PROMPT = "Write a long, detailed story about a lighthouse keeper who befriends a whale."
SESSIONS, SESSION_TURNS = 4, 5


def ttft_on_forks(session: Session, question: str, options: GenerationOptions, n: int) -> list[float]:
    """The coming turn's time to first token on ``n`` forks of the session taken just before it:
    each holds the same cells (a fork shares them), so it decodes the same new tokens at the same
    depth. With the turn's own, their median is the turn's TTFT without one sample's noise (this
    machine's speed moves by a fifth within minutes, and the limit is a median of three too)."""
    samples = []
    for _ in range(n):
        twin = session.fork()
        began = time.perf_counter()
        with twin.stream(question, options) as stream:
            next(stream, None)
            samples.append(time.perf_counter() - began)
        twin.close()
    return samples


def fresh_exchange(
    shadow: Session, history: list[Message], text: str, options: GenerationOptions
) -> MeasuredTurn:
    """The upstream "before": the same transcript decoded from scratch in a new context (the
    shadow shares no prefix with other sessions)."""
    shadow.messages = [m.copy() for m in history]
    shadow.clear_cached_context()
    turn, _ = exchange(shadow, text, options)
    shadow.clear_cached_context()  # (and stop its anticipation: only the cached chat goes on)
    if turn.reused_tokens:
        raise RuntimeError(f"a fresh context reused {turn.reused_tokens} tokens")
    return turn


def multi_turn(
    model: Model,
    questions: list[str],
    options: GenerationOptions,
    think: float,
    exe: Path | None = None,
    samples: int = 1,
) -> dict[str, Any]:
    """One chat with the cache; each turn is also replayed fresh on the identical transcript,
    after the user "thought" for ``think`` seconds (what anticipatory prefill has to work in),
    and, with llama-bench's ``exe``, measured against the compute limit right after (this
    machine's speed drifts by a fifth within minutes: a limit measured later is another one's).
    With ``samples`` > 1 each turn's TTFT is also taken on forks (``ttft_on_forks``): the median.

    "New" tokens are what a perfect cache would decode: the prompt minus its common prefix with
    the previous prompt followed by the previous reply, tokenized on its own.
    """
    cache, shadow = model.session(SYSTEM), model.session(SYSTEM, share_prefix=False)
    cached, fresh, new, held, diverged, limits = [], [], [], list[int](), 0, list[float | None]()
    medians = []
    for question in questions:
        history = list(cache.messages)
        prompt = model.prompt_tokens([*history, {"role": "user", "content": question}])
        new.append(len(prompt) - common_prefix(held, prompt))
        forked = ttft_on_forks(cache, question, options, samples - 1)
        turn, text = exchange(cache, question, options)
        cached.append(turn)
        medians.append(statistics.median([*forked, turn.ttft_s]))
        time.sleep(think)
        fresh.append(fresh_exchange(shadow, history, question, options))
        diverged += shadow.messages[-1]["content"] != text
        held = prompt + model.tokenize(text, add_special=False)
        if exe is not None:
            limits += compute_limits(exe, model, [turn])
    cache.close()
    shadow.close()
    summary = {
        "cache": totals(cached),
        "fresh": totals(fresh),
        "new_tokens": sum(new),
        "cache_decoded_over_new": sum(t.decoded_prompt_tokens for t in cached) / sum(new),
        "cache_over_fresh_ttft_last": cached[-1].ttft_s / fresh[-1].ttft_s,
        "replies_differing_from_fresh": diverged,
    }
    result = {"cache": rows_of(cached), "fresh": rows_of(fresh), "new_tokens": new, "summary": summary}
    result["ttft_median_s"], result["ttft_samples"] = medians, samples
    return result | ({"compute_limit_s": limits} if exe is not None else {})


def compute_limits(exe: Path, model: Model, turns: list[MeasuredTurn]) -> list[float | None]:
    """What llama.cpp itself needs for each turn's prefill: ``llama-bench -p <decoded> -d <reused>``
    on the same libraries, threads and flash-attention choice (None where it cannot run)."""
    fa = flash_attn_option(model.flash_attention)
    limits: list[float | None] = []
    for t in turns:
        n, depth = str(t.decoded_prompt_tokens), str(t.reused_tokens)
        run = llama_bench(
            exe, model.path, model.threads, "-p", n, "-n", "0", "-d", depth, "-r", "3", "-fa", fa
        )
        rate = statistics.median(run["samples_ts"]) if "error" not in run else 0.0
        limits.append(t.decoded_prompt_tokens / rate if rate > 0 else None)
    return limits


def session_plans() -> list[list[str]]:
    """SESSIONS conversations of SESSION_TURNS questions each, cut from the script."""
    n = len(QUESTIONS)
    return [[QUESTIONS[(i * SESSION_TURNS + t) % n] for t in range(SESSION_TURNS)] for i in range(SESSIONS)]


def interleaved(
    model: Model, plans: list[list[str]], options: GenerationOptions, think: float
) -> list[dict[str, Any]]:
    """Sessions answered round-robin on one model; each turn is also replayed in a fresh context
    after a pause of ``think`` seconds."""
    sessions = [model.session(SYSTEM) for _ in plans]
    shadow = model.session(SYSTEM, share_prefix=False)
    cached: list[list[MeasuredTurn]] = [[] for _ in plans]
    fresh: list[list[MeasuredTurn]] = [[] for _ in plans]
    for t in range(max(len(p) for p in plans)):
        for i, (session, plan) in enumerate(zip(sessions, plans, strict=True)):
            if t < len(plan):
                history = list(session.messages)
                cached[i].append(exchange(session, plan[t], options)[0])
                time.sleep(think)
                fresh[i].append(fresh_exchange(shadow, history, plan[t], options))
    for session in [*sessions, shadow]:
        session.close()
    return [
        {"cache": rows_of(c), "fresh": rows_of(f), "summary": {"cache": totals(c), "fresh": totals(f)}}
        for c, f in zip(cached, fresh, strict=True)
    ]


def speeds(samples: list[float]) -> dict[str, Any]:
    """Tokens/s of repeated runs: the median, and the best (noise on a busy machine only slows down)."""
    return {"median": statistics.median(samples), "best": max(samples), "samples": samples}


def generation(model: Model, n_tokens: int, exe: Path, repeats: int = 5) -> dict[str, Any]:
    """Our decode loop (sampling and detokenizing included) against llama-bench's tg, run by run
    in alternation so that a busy spell on the machine hits both; pp512 is there for reference.
    llama-bench generates at depth 0 and at our prompt's depth (its ``-d``): the same positions
    as ours (each token attends to those before it, so a deeper one costs more)."""
    options = GenerationOptions(max_tokens=n_tokens, temperature=0)
    fa = ("-fa", flash_attn_option(model.flash_attention))  # (llama-bench's default is auto: on)
    pp = llama_bench(exe, model.path, model.threads, "-p", "512", "-n", "0", "-r", str(repeats), *fa)
    depth = len(model.prompt_tokens([{"role": "user", "content": LONG_PROMPT}]))
    ours, lengths, tg, at_depth = [], [], list[float](), list[float]()
    for _ in range(repeats):
        session = model.session()
        reply = session.respond(LONG_PROMPT, options)
        session.close()
        ours.append(reply.timings.generation_tokens_per_s)
        lengths.append(reply.usage.completion_tokens)
        run = llama_bench(
            exe, model.path, model.threads, "-p", "0", "-n", str(n_tokens), "-d", f"0,{depth}", "-r", "1", *fa
        )
        tests = run.get("tests", [[], []])
        tg, at_depth = tg + tests[0], at_depth + tests[-1]
    mine = speeds(ours)
    result: dict[str, Any] = {"llmsession": mine, "completion_tokens": lengths, "depth": depth}
    if "error" in pp or not tg:
        return result | {"llama_bench": {"error": pp.get("error") or run.get("error")}}
    theirs, deep = speeds(tg), speeds(at_depth)
    ratio = {k: mine[k] / deep[k] for k in ("median", "best")}
    reference = {"pp512": speeds(pp["samples_ts"]), f"tg{n_tokens}": theirs, "command": run["command"]}
    reference |= {f"tg{n_tokens}_at_depth": deep}
    ratio_d0 = {k: mine[k] / theirs[k] for k in ("median", "best")}
    return result | {
        "llama_bench": reference | {"build_commit": pp["build_commit"]},
        "ratio": ratio,
        "ratio_depth_0": ratio_d0,
    }


def run_peer(python: str, config: dict[str, Any]) -> dict[str, Any]:
    """The peer's chats, with their totals."""
    peer = run_worker(python, config)
    if "skipped" not in peer:
        sessions = [totals(turns_of(s)) for s in peer["interleaved"]]
        peer["summary"] = {"multi_turn": totals(turns_of(peer["multi_turn"])), "interleaved": sessions}
    return peer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="llmsession bench", description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=20, help="turns of the multi-turn chat")
    parser.add_argument("--max-tokens", type=int, default=48, help="per reply in the chats")
    parser.add_argument("--gen-tokens", type=int, default=128, help="tokens of the generation scenario")
    parser.add_argument(
        "--think", type=seconds, default=0.25, help="seconds between a reply and the next question (0: none)"
    )
    parser.add_argument(
        "--ttft-samples", type=int, default=3, help="each turn's TTFT, also on forks: their median"
    )
    common_arguments(parser)
    parser.add_argument("--plot", type=output_file, help="write a PNG of time to first token per turn")
    args = parser.parse_args(argv)
    if args.turns < 2 or args.max_tokens < 1 or args.gen_tokens < 2 or args.ttft_samples < 1:
        parser.error(
            "--turns must be at least 2, --max-tokens and --ttft-samples at least 1, --gen-tokens at least 2"
        )
    return args


SCENARIOS = {  # ``llmsession bench NAME``: its module here
    "memory": "memory",
    "concurrent": "concurrent",
    "rpc": "rpc",
    "tools": "tools",
    "structured": "structured",
    "drafting": "drafting",
    "tokenize": "tokenize",
    "serve": "serve_bench",
    "agents": "agents",
    "cluster": "cluster",
    "prefill": "prefill",
    "models": "models",
}


def main(argv: list[str] | None = None) -> int:
    if argv and argv[0] in SCENARIOS:  # imported on demand: each pulls in what it measures
        scenario = importlib.import_module(f"llmsession.commands.bench.{SCENARIOS[argv[0]]}")
        return int(scenario.main(argv[1:]))
    if argv and "--rpc" in argv:  # `bench --rpc H:P` too
        from llmsession.commands.bench.rpc import main as rpc_main

        return rpc_main(argv)
    args, started = parse_args(argv), time.perf_counter()
    options = GenerationOptions(max_tokens=args.max_tokens, temperature=0)
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.turns)]
    plans = session_plans()
    with Model(args.model, threads=args.threads) as model:
        # Page the weights in and start the threads before timing anything: a conversation
        # before the measured ones, under the same system prompt, on both sides. It stays open
        # through the chat, as the peer's one context keeps it: both first turns start from its
        # system prompt (the peer's context holds it; ours is another session's, shared).
        warm_up = model.session(SYSTEM)
        warm_up.respond(WARM_UP, GenerationOptions(max_tokens=4, temperature=0))
        date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        results: dict[str, Any] = {"date": date, "machine": machine(model.threads), "model": args.model.name}
        results |= {"threads": model.threads, "max_tokens": args.max_tokens, "think_s": args.think}
        results["flash_attention"] = model.flash_attention is not False  # (None: llama.cpp's, on)
        progress(f"multi-turn chat ({args.turns} turns, each with its compute limit)", started)
        results["multi_turn"] = multi_turn(
            model, questions, options, args.think, args.llama_bench, args.ttft_samples
        )
        warm_up.close()
        progress("interleaved sessions", started)
        results["interleaved"] = interleaved(model, plans, options, args.think)
        progress("generation and llama-bench", started)
        results["generation"] = generation(model, args.gen_tokens, args.llama_bench)
    if args.peer:
        progress(f"peer {args.peer} ({args.peer_python})", started)
        config = {"model": str(args.model), "threads": results["threads"], "n_ctx": 4096, "system": SYSTEM}
        config["warm_up"] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": WARM_UP}]
        config |= {"max_tokens": args.max_tokens, "questions": questions, "interleaved": plans}
        config["flash_attn"] = results["flash_attention"]
        results["peer"] = run_peer(args.peer_python, config)
    progress("done", started)
    publish(results, lambda r: report(r, args.gen_tokens), args.json)
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
