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
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from .bench_common import (
    common_arguments,
    flash_attn_option,
    llama_bench,
    machine,
    progress,
    publish,
    run_worker,
    table,
)
from .model import Model
from .options import GenerationOptions
from .prefix import common_prefix
from .replies import Message
from .session import Session

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
LONG_PROMPT = "Write a long, detailed story about a lighthouse keeper who befriends a whale."
SESSIONS, SESSION_TURNS = 4, 5


@dataclass
class Turn:
    """One exchange as one contender saw it (``library_ttft_s`` leaves out rendering and tokenizing)."""

    ttft_s: float
    prompt_tokens: int
    reused_tokens: int
    decoded_prompt_tokens: int
    completion_tokens: int
    generation_tokens_per_s: float
    library_ttft_s: float = 0.0
    render_s: float = 0.0  # the split of our TTFT (see Timings)
    tokenize_s: float = 0.0
    plan_s: float = 0.0
    prefill_s: float = 0.0
    first_sample_s: float = 0.0


def exchange(session: Session, question: str, options: GenerationOptions) -> tuple[Turn, str]:
    """One streamed exchange; the first snapshot marks the first token."""
    began, first = time.perf_counter(), 0.0
    stream = session.stream(question, options)
    for _ in stream:
        first = first or time.perf_counter()
    assert stream.reply is not None
    u, t = stream.reply.usage, stream.reply.timings
    counts = (u.prompt_tokens, u.reused_tokens, u.decoded_prompt_tokens, u.completion_tokens)
    ttft = (first or time.perf_counter()) - began
    split = (t.render_s, t.tokenize_s, t.plan_s, t.prefill_s, t.first_sample_s)
    return Turn(ttft, *counts, t.generation_tokens_per_s, t.time_to_first_token_s, *split), stream.reply.text


def fresh_exchange(shadow: Session, history: list[Message], text: str, options: GenerationOptions) -> Turn:
    """The upstream "before": the same transcript decoded from scratch in a new context."""
    shadow.messages = [dict(m) for m in history]
    shadow.clear_cached_context()
    turn, _ = exchange(shadow, text, options)
    if turn.reused_tokens:
        raise RuntimeError(f"a fresh context reused {turn.reused_tokens} tokens")
    return turn


def totals(turns: list[Turn]) -> dict[str, float]:
    """Sums over one contender's chat; the reused fraction leaves out turn 1 (nothing to reuse)."""
    later = turns[1:]
    return {
        "ttft_last_over_first": turns[-1].ttft_s / turns[0].ttft_s,
        "mean_ttft_s": statistics.fmean(t.ttft_s for t in turns),
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        "decoded_prompt_tokens": sum(t.decoded_prompt_tokens for t in turns),
        "reused_fraction": sum(t.reused_tokens for t in later) / max(1, sum(t.prompt_tokens for t in later)),
    }


def multi_turn(model: Model, questions: list[str], options: GenerationOptions) -> dict[str, Any]:
    """One chat with the cache; each turn is also replayed fresh on the identical transcript.

    "New" tokens are what a perfect cache would decode: the prompt minus its common prefix with
    the previous prompt followed by the previous reply, tokenized on its own.
    """
    cache, shadow = model.session(SYSTEM), model.session(SYSTEM)
    cached, fresh, new, held, diverged = [], [], [], list[int](), 0
    for question in questions:
        history = list(cache.messages)
        prompt = model.prompt_tokens([*history, {"role": "user", "content": question}])
        new.append(len(prompt) - common_prefix(held, prompt))
        turn, text = exchange(cache, question, options)
        cached.append(turn)
        fresh.append(fresh_exchange(shadow, history, question, options))
        diverged += shadow.messages[-1]["content"] != text
        held = prompt + model.tokenize(text, add_special=False)
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
    return {"cache": _rows(cached), "fresh": _rows(fresh), "new_tokens": new, "summary": summary}


def compute_limits(exe: Path, model: Model, turns: list[Turn]) -> list[float | None]:
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


def interleaved(model: Model, plans: list[list[str]], options: GenerationOptions) -> list[dict[str, Any]]:
    """Sessions answered round-robin on one model; each turn is also replayed in a fresh context."""
    sessions = [model.session(SYSTEM) for _ in plans]
    shadow = model.session(SYSTEM)
    cached: list[list[Turn]] = [[] for _ in plans]
    fresh: list[list[Turn]] = [[] for _ in plans]
    for t in range(max(len(p) for p in plans)):
        for i, (session, plan) in enumerate(zip(sessions, plans, strict=True)):
            if t < len(plan):
                history = list(session.messages)
                cached[i].append(exchange(session, plan[t], options)[0])
                fresh[i].append(fresh_exchange(shadow, history, plan[t], options))
    for session in [*sessions, shadow]:
        session.close()
    return [
        {"cache": _rows(c), "fresh": _rows(f), "summary": {"cache": totals(c), "fresh": totals(f)}}
        for c, f in zip(cached, fresh, strict=True)
    ]


def speeds(samples: list[float]) -> dict[str, Any]:
    """Tokens/s of repeated runs: the median, and the best (noise on a busy machine only slows down)."""
    return {"median": statistics.median(samples), "best": max(samples), "samples": samples}


def generation(model: Model, n_tokens: int, exe: Path, repeats: int = 5) -> dict[str, Any]:
    """Our decode loop (sampling and detokenizing included) against llama-bench's tg, run by run
    in alternation so that a busy spell on the machine hits both; pp512 is there for reference."""
    options = GenerationOptions(max_tokens=n_tokens, temperature=0)
    pp = llama_bench(exe, model.path, model.threads, "-p", "512", "-n", "0", "-r", str(repeats))
    ours, lengths, tg = [], [], []
    for _ in range(repeats):
        session = model.session()
        reply = session.respond(LONG_PROMPT, options)
        session.close()
        ours.append(reply.timings.generation_tokens_per_s)
        lengths.append(reply.usage.completion_tokens)
        run = llama_bench(exe, model.path, model.threads, "-p", "0", "-n", str(n_tokens), "-r", "1")
        tg += run.get("samples_ts", [])
    mine = speeds(ours)
    result: dict[str, Any] = {"llmsession": mine, "completion_tokens": lengths}
    if "error" in pp or not tg:
        return result | {"llama_bench": {"error": pp.get("error") or run.get("error")}}
    theirs = speeds(tg)
    ratio = {k: mine[k] / theirs[k] for k in ("median", "best")}
    reference = {"pp512": speeds(pp["samples_ts"]), f"tg{n_tokens}": theirs, "command": run["command"]}
    return result | {"llama_bench": reference | {"build_commit": pp["build_commit"]}, "ratio": ratio}


def run_peer(python: str, config: dict[str, Any]) -> dict[str, Any]:
    """The peer's chats, with their totals."""
    peer = run_worker(python, config)
    if "skipped" not in peer:
        sessions = [totals(_turns(s)) for s in peer["interleaved"]]
        peer["summary"] = {"multi_turn": totals(_turns(peer["multi_turn"])), "interleaved": sessions}
    return peer


def _rows(turns: list[Turn]) -> list[dict[str, Any]]:
    return [asdict(t) for t in turns]


def _turns(rows: list[dict[str, Any]]) -> list[Turn]:
    names = {f.name for f in fields(Turn)}
    return [Turn(**{k: v for k, v in row.items() if k in names}) for row in rows]


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def report_multi_turn(result: dict[str, Any], peer: list[Turn]) -> None:
    cached, fresh, s = _turns(result["cache"]), _turns(result["fresh"]), result["summary"]
    limits = result.get("compute_limit_s") or [None] * len(cached)
    header = ["turn", "prompt", "reused", "decoded", "new", "TTFT cache", "TTFT fresh", "cache/fresh"]
    header += ["tok/s", "render+tok", "plan", "prefill", "sample", "limit", "TTFT/limit"]
    rows = []
    for i, (c, f) in enumerate(zip(cached, fresh, strict=True)):
        row = [str(i + 1), str(c.prompt_tokens), str(c.reused_tokens), str(c.decoded_prompt_tokens)]
        row += [str(result["new_tokens"][i]), _ms(c.ttft_s), _ms(f.ttft_s), f"{c.ttft_s / f.ttft_s:.3f}"]
        row += [f"{c.generation_tokens_per_s:.0f}", _ms(c.render_s + c.tokenize_s), _ms(c.plan_s)]
        row += [_ms(c.prefill_s), _ms(c.first_sample_s)]
        limit = limits[i]
        row += [_ms(limit), f"{c.ttft_s / limit:.2f}"] if limit else ["-", "-"]
        if peer:
            row += ["|", str(peer[i].prompt_tokens), str(peer[i].reused_tokens), _ms(peer[i].ttft_s)]
        rows.append(row)
    header += ["|", "peer prompt", "peer reused", "TTFT peer"] if peer else []
    table("multi-turn chat (TTFT in ms, wall clock from the call)", header, rows)
    n, cache = len(cached), s["cache"]
    print(f"cache TTFT turn {n} / turn 1: {cache['ttft_last_over_first']:.2f}  (target <= 1.5)")
    ratio = s["cache_over_fresh_ttft_last"]
    print(f"cache / fresh TTFT at turn {n}: {ratio:.3f}  ({1 / ratio:.1f}x faster)")
    decoded = f"cache {cache['decoded_prompt_tokens']}, fresh {s['fresh']['decoded_prompt_tokens']}"
    print(f"prompt tokens decoded: {decoded}, new in the transcript {s['new_tokens']}")
    print(f"cache decoded / new: {s['cache_decoded_over_new']:.3f}  (target <= 1.05)")
    print(f"greedy replies that differ between cache and fresh: {s['replies_differing_from_fresh']} of {n}")
    if peer:
        theirs = totals(peer)
        print(f"peer: TTFT turn {n} / turn 1 {theirs['ttft_last_over_first']:.2f}", end="")
        print(f", prompt tokens decoded {theirs['decoded_prompt_tokens']}")
        print(f"llmsession / peer TTFT at turn {n}: {cached[-1].ttft_s / peer[-1].ttft_s:.3f}")


def report_interleaved(result: list[dict[str, Any]], peer: list[dict[str, float]]) -> None:
    header = ["session", "reused (turns 2+)", "TTFT cache", "TTFT fresh", "cache/fresh"]
    rows = []
    for i, s in enumerate(result):
        c, f = s["summary"]["cache"], s["summary"]["fresh"]
        row = [str(i + 1), f"{c['reused_fraction']:.1%}", _ms(c["mean_ttft_s"]), _ms(f["mean_ttft_s"])]
        row.append(f"{c['mean_ttft_s'] / f['mean_ttft_s']:.3f}")
        if peer:
            row += ["|", f"{peer[i]['reused_fraction']:.1%}", _ms(peer[i]["mean_ttft_s"])]
        rows.append(row)
    header += ["|", "peer reused", "TTFT peer"] if peer else []
    table(f"interleaved: {len(result)} sessions on one model, round-robin (mean TTFT in ms)", header, rows)


def report_generation(result: dict[str, Any], n_tokens: int) -> None:
    ref, ours, runs = result["llama_bench"], result["llmsession"], len(result["completion_tokens"])
    print(f"\ngeneration: {n_tokens} tokens, temperature 0, {runs} runs each (tok/s: median, best)")
    print(f"llmsession decode loop: {ours['median']:.1f}, {ours['best']:.1f}", end="")
    print(f" (tokens per run: {result['completion_tokens']})")
    if "error" in ref:
        print(f"llama-bench: {ref['error']}")
        return
    tg, pp, ratio = ref[f"tg{n_tokens}"], ref["pp512"], result["ratio"]
    print(f"llama-bench tg{n_tokens}: {tg['median']:.1f}, {tg['best']:.1f}", end="")
    print(f" (pp512: {pp['median']:.1f}, {pp['best']:.1f})")
    print(f"llmsession / llama-bench: {ratio['median']:.3f}, {ratio['best']:.3f}  (target >= 0.95)")


def report(results: dict[str, Any], n_tokens: int) -> None:
    m, peer = results["machine"], results.get("peer", {})
    print(f"\n{results['model']} on {m['cpu']}: {m['cores']} cores, {m['threads']} threads", end="")
    print(f", llama.cpp {m['llama_cpp_commit']}")
    if "skipped" in peer:
        print(f"peer skipped: {peer['skipped']}")
    elif peer:
        print(f"peer: llama-cpp-python {peer['version']}, llama.cpp {peer['commit']} ({peer['library']})")
    report_multi_turn(results["multi_turn"], _turns(peer.get("multi_turn", [])))
    report_interleaved(results["interleaved"], peer.get("summary", {}).get("interleaved", []))
    report_generation(results["generation"], n_tokens)


def plot(results: dict[str, Any], path: Path) -> None:
    """Time to first token per turn for each contender (matplotlib is the optional ``bench`` extra)."""
    try:
        plt = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        print(f"--plot: matplotlib is not installed (pip install 'llmsession[bench]'); {path} not written")
        return
    chat, peer = results["multi_turn"], results.get("peer", {})
    lines = {"llmsession (session cache)": chat["cache"], "fresh context per exchange": chat["fresh"]}
    if "multi_turn" in peer:
        lines[f"llama-cpp-python {peer['version']}"] = peer["multi_turn"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, rows in lines.items():
        ax.plot(range(1, len(rows) + 1), [r["ttft_s"] * 1000 for r in rows], marker="o", label=label)
    title = f"{results['model']}, {results['threads']} threads"
    ax.set(xlabel="turn", ylabel="time to first token (ms)", title=title, ylim=(0, None))
    ax.set_xticks(range(1, len(chat["cache"]) + 1))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="llmsession bench", description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=20, help="turns of the multi-turn chat")
    parser.add_argument("--max-tokens", type=int, default=48, help="per reply in the chats")
    parser.add_argument("--gen-tokens", type=int, default=128, help="tokens of the generation scenario")
    common_arguments(parser)
    parser.add_argument("--plot", type=Path, help="write a PNG of time to first token per turn")
    args = parser.parse_args(argv)
    if args.turns < 2 or args.max_tokens < 1 or args.gen_tokens < 2:
        parser.error("--turns must be at least 2, --max-tokens at least 1, --gen-tokens at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    if argv and argv[0] == "memory":
        from .bench_memory import main as memory_main

        return memory_main(argv[1:])
    if argv and argv[0] == "concurrent":
        from .bench_concurrent import main as concurrent_main

        return concurrent_main(argv[1:])
    if argv and argv[0] == "structured":
        from .bench_structured import main as structured_main

        return structured_main(argv[1:])
    args, started = parse_args(argv), time.perf_counter()
    options = GenerationOptions(max_tokens=args.max_tokens, temperature=0)
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.turns)]
    plans = session_plans()
    with Model(args.model, threads=args.threads) as model:
        warm_up = model.session()  # page the weights in and start the threads before timing anything
        warm_up.respond("Hello", GenerationOptions(max_tokens=4, temperature=0))
        warm_up.close()
        date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        results: dict[str, Any] = {"date": date, "machine": machine(model.threads), "model": args.model.name}
        results |= {"threads": model.threads, "max_tokens": args.max_tokens}
        progress(f"multi-turn chat ({args.turns} turns)", started)
        results["multi_turn"] = multi_turn(model, questions, options)
        progress("compute limit per turn (llama-bench)", started)
        limits = compute_limits(args.llama_bench, model, _turns(results["multi_turn"]["cache"]))
        results["multi_turn"]["compute_limit_s"] = limits
        progress("interleaved sessions", started)
        results["interleaved"] = interleaved(model, plans, options)
        progress("generation and llama-bench", started)
        results["generation"] = generation(model, args.gen_tokens, args.llama_bench)
    if args.peer:
        progress(f"peer {args.peer} ({args.peer_python})", started)
        config = {"model": str(args.model), "threads": results["threads"], "n_ctx": 4096, "system": SYSTEM}
        config |= {"max_tokens": args.max_tokens, "questions": questions, "interleaved": plans}
        results["peer"] = run_peer(args.peer_python, config)
    progress("done", started)
    publish(results, lambda r: report(r, args.gen_tokens), args.json)
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
