"""``llmsession bench memory``: many sessions answered round-robin under one memory budget.

N sessions each open with a long message (about 1,000 tokens of notes), then ask short questions,
in rotation. Side by side in one process (one machine, one moment): the engine (a shared context
of ``kv_tokens`` cells, idle sessions parked in RAM, then on disk) and wave 1 (a context of
``context_size`` per session, for life); llama-cpp-python (one ``Llama`` with ``LlamaRAMCache``)
runs in a worker. Reported per contender: resident memory once the sessions are idle, time to
first token (TTFT) of live, restored and cold exchanges, prompt tokens decoded against new ones.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from llmsession.api.model import Model, local_model
from llmsession.commands.argtypes import positive_int, positive_ints
from llmsession.commands.bench.common import common_arguments, machine, progress, publish, run_worker, table
from llmsession.engine.prefix import PrefixCache
from llmsession.engine.seat import SequenceMemory
from llmsession.native.context import NativeContext
from llmsession.native.sampler import Sampler
from llmsession.options import GenerationOptions

GREEDY = GenerationOptions(max_tokens=16, temperature=0)
WORDS = ("river", "bridge", "lantern", "harbour", "meadow", "orchard", "tower", "valley", "garden")
QUESTIONS = ("Summarize my notes in one sentence.", "Which word came up most?", "Name one more.")
SYSTEM = "You are a helpful, concise assistant."
MIB = 1 << 20


def notes(model: Model, seed: int, n_tokens: int) -> str:
    """A first message of about ``n_tokens`` tokens, different for every session."""
    rng, text = np.random.default_rng(seed), "My notes: "
    while len(model.tokenize(text, add_special=False)) < n_tokens:
        text += " ".join(rng.choice(WORDS, 12)) + ". "
    return text + QUESTIONS[0]


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class ContextPerSession:
    """Wave 1 as it was: a session owns a context of its ``context_size`` for as long as it lives."""

    def __init__(self, model: Model, n_ctx: int) -> None:
        self.model, self.messages = model, [{"role": "system", "content": SYSTEM}]
        self.context = NativeContext(
            local_model(model).native,
            n_ctx=n_ctx,
            n_batch=512,
            threads=model.threads,
            flash_attention=model.flash_attention,
            kv_type=model.kv_type,
        )
        self.cache = PrefixCache()

    def respond(self, content: str) -> dict[str, Any]:
        began, model, context = time.perf_counter(), self.model, self.context
        user = {"role": "user", "content": content}
        prompt = model.prompt_tokens([*self.messages, user])
        pos = reused = self.cache.prepare(prompt, SequenceMemory(context, 0)).reused
        for i in range(reused, len(prompt), 512):
            context.decode(prompt[i : i + 512], pos)
            self.cache.extend(prompt[i : i + 512])
            pos += len(prompt[i : i + 512])
        sampler = Sampler.from_options(GREEDY, n_vocab=local_model(model).native.n_vocab, last_n=0)
        token, first = sampler.sample(context), time.perf_counter()
        ttft, generated = first - began, list[int]()
        while len(generated) < GREEDY.max_tokens and not local_model(model).native.is_eog(token):
            generated.append(token)
            context.decode([token], pos)
            self.cache.extend([token])
            pos, token = pos + 1, sampler.sample(context)
        sampler.close()
        rate = len(generated) / (time.perf_counter() - first) if generated else 0.0
        self.messages += [user, {"role": "assistant", "content": model.detokenize(generated)}]
        kind = "live" if reused else "cold"
        return {"ttft_s": ttft, "kind": kind, "decoded": len(prompt) - reused, "tokens_per_s": rate}


def engine_contender(model: Model) -> Callable[[], Callable[[str], dict[str, Any]]]:
    """Sessions of the engine; an exchange is "restored" when the model counted a restore."""

    def new_session() -> Callable[[str], dict[str, Any]]:
        session = model.session(SYSTEM, context_size=2048)

        def respond(content: str) -> dict[str, Any]:
            restores, began = model.memory().counters.restores, time.perf_counter()
            stream = session.stream(content, GREEDY)
            ttft = 0.0
            for _ in stream:
                ttft = ttft or time.perf_counter() - began
            assert stream.reply is not None
            u = stream.reply.usage
            kind = "restored" if model.memory().counters.restores > restores else "live"
            own = u.reused_tokens - u.shared_tokens  # (a first exchange shares the system prompt's opening)
            return {
                "ttft_s": ttft,
                "kind": kind if own else "cold",
                "decoded": u.decoded_prompt_tokens,
                "tokens_per_s": stream.reply.timings.generation_tokens_per_s,
            }

        return respond

    return new_session


def wave_one(model: Model) -> Callable[[], Callable[[str], dict[str, Any]]]:
    return lambda: ContextPerSession(model, 2048).respond


def round_robin(
    model: Model,
    new_session: Callable[[], Callable[[str], dict[str, Any]]],
    n: int,
    rounds: int,
    first_tokens: int,
) -> dict[str, Any]:
    """``n`` sessions, ``rounds`` exchanges each in rotation; resident memory once they are idle."""
    base = rss_mib()
    sessions = [new_session() for _ in range(n)]
    exchanges: list[dict[str, Any]] = []
    for r in range(rounds):
        for i, respond in enumerate(sessions):
            exchanges.append(
                respond(notes(model, i, first_tokens) if r == 0 else QUESTIONS[r % len(QUESTIONS)])
                | {"round": r}
            )
        if r > 0:  # the session that just answered is live: a live exchange at the same occupancy
            exchanges.append(sessions[-1]("And one more?") | {"round": r, "probe": True})
    report = model.memory()  # while the sessions live (a collected session's state is freed)
    memory = {"parked_mib": report.parked_bytes / MIB, "disk_mib": report.disk_bytes / MIB}
    return {"resident_mib": rss_mib() - base, "exchanges": exchanges, "memory": memory}


def summary(result: dict[str, Any]) -> dict[str, Any]:
    by_kind: dict[str, list[float]] = {}
    for e in result["exchanges"]:
        by_kind.setdefault(e["kind"], []).append(e["ttft_s"])
    later = [e for e in result["exchanges"] if e["round"] > 0]
    return {
        "resident_mib": result["resident_mib"],
        "ttft_ms": {k: 1000 * statistics.median(v) for k, v in by_kind.items()},
        "counts": {k: len(v) for k, v in by_kind.items()},
        "decoded_later_rounds": sum(e["decoded"] for e in later),
        "max_decoded_later": max((e["decoded"] for e in later), default=0),
        "tokens_per_s": statistics.median(
            [e["tokens_per_s"] for e in result["exchanges"] if e.get("tokens_per_s")] or [0]
        ),
    }


# The engine in each KV layout, with 8,192 cells: 4 live sessions of 2,048 cells of their own
# each (the default), or 8 sharing one pool; wave 1 a context per session (each a lone session).
CONTENDERS: dict[str, dict[str, Any]] = {
    "engine": {"kv_layout": "per_session", "max_live_sessions": 4},
    "engine-shared": {"kv_layout": "shared", "max_live_sessions": 8},
    "wave-1": {"kv_layout": "shared", "max_live_sessions": 8},
}


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "sizes": args.sessions}
    host_bytes = 1 << 30
    with tempfile.TemporaryDirectory(prefix="llmsession-bench-") as disk:
        for n in args.sessions:
            for name, layout in CONTENDERS.items():
                progress(f"memory: {n} sessions, {name}", started)
                with Model(
                    args.model,
                    threads=args.threads,
                    kv_tokens=8192,
                    host_cache_bytes=host_bytes,
                    disk_cache_dir=disk,
                    **layout,
                ) as model:
                    model.session().respond(
                        "Hello", GenerationOptions(max_tokens=4, temperature=0)
                    )  # warm up
                    results.setdefault("machine", machine(model.threads))
                    results.setdefault("model_mib", rss_mib())
                    contender = wave_one(model) if name == "wave-1" else engine_contender(model)
                    outcome = round_robin(model, contender, n, args.rounds, args.first_tokens)
                    if name != "wave-1":
                        outcome["counters"] = vars(model.memory().counters)
                results.setdefault(name, {})[str(n)] = outcome | {"summary": summary(outcome)}
    if args.peer:
        progress(f"memory: peer {args.peer}", started)
        config = {"mode": "memory", "model": str(args.model), "threads": results["machine"]["threads"]}
        config |= {"sizes": args.sessions, "rounds": args.rounds, "system": SYSTEM, "n_ctx": 2048}
        config |= {"max_tokens": GREEDY.max_tokens, "cache_bytes": host_bytes}
        with Model(args.model, threads=args.threads) as model:
            config["first_messages"] = [notes(model, i, args.first_tokens) for i in range(max(args.sessions))]
        config["questions"] = list(QUESTIONS)
        peer = run_worker(args.peer_python, config)
        if "memory" in peer:
            peer["memory"] = {n: r | {"summary": summary(r)} for n, r in peer["memory"].items()}
        results["peer"] = peer
    progress("done", started)
    return results


def report(results: dict[str, Any]) -> None:
    m = results["machine"]
    print(f"\nmemory: {m['cpu']}, {m['threads']} threads; model loaded: {results['model_mib']:.0f} MiB RSS")
    peer = results.get("peer", {}).get("memory", {})
    header = [
        "sessions",
        "contender",
        "resident MiB",
        "TTFT live",
        "TTFT restored",
        "TTFT cold",
        "exchanges l/r/c",
        "decoded (rounds 2+)",
        "max per exchange",
        "gen tok/s",
        "÷ wave-1",
    ]
    rows = []
    for n in results["sizes"]:
        for name, result in [
            *((name, results[name][str(n)]) for name in CONTENDERS if name in results),
            ("llama-cpp-python", peer.get(str(n))),
        ]:
            if result is None:
                continue
            s = result["summary"]
            t, c = s["ttft_ms"], s["counts"]
            row = [str(n), name, f"{s['resident_mib']:.0f}"] + [
                f"{t[k]:.0f}" if k in t else "-" for k in ("live", "restored", "cold")
            ]
            row += [
                "/".join(str(c.get(k, 0)) for k in ("live", "restored", "cold")),
                str(s["decoded_later_rounds"]),
                str(s["max_decoded_later"]),
                f"{s['tokens_per_s']:.0f}",
                f"{s['tokens_per_s'] / lone:.2f}" if (lone := wave_rate(results, n)) else "-",
            ]
            rows.append(row)
    table("memory: N sessions round-robin (TTFT median, ms; resident = RSS growth once idle)", header, rows)
    if "skipped" in results.get("peer", {}):
        print(f"peer skipped: {results['peer']['skipped']}")


def wave_rate(results: dict[str, Any], n: int) -> float:
    """Generation speed of wave 1's contexts (each session's own, as a lone session's)."""
    return float(results.get("wave-1", {}).get(str(n), {}).get("summary", {}).get("tokens_per_s", 0.0))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="llmsession bench memory", description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=positive_ints, default=[4, 16, 64], help="counts, comma-separated")
    parser.add_argument("--rounds", type=positive_int, default=3, help="exchanges per session")
    parser.add_argument("--first-tokens", type=positive_int, default=1000, help="size of each first message")
    common_arguments(parser)
    args = parser.parse_args(argv)
    return publish(run(args), report, args.json)
