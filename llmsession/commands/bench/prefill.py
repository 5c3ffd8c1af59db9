"""``llmsession bench prefill``: long prompts (a coding agent's first turn is 4-20K tokens of
system prompt and tool schemas) with flash attention off and on, against ``llama-bench`` on the
same libraries, threads and batch sizes, in one run.

For each depth D and attention setting: our first turn of D tokens (time to its first token, a
fresh session that shares nothing) against ``llama-bench -p D``; then a second turn of 512
tokens after it (the prefill's speed at depth D) against ``llama-bench -p 512 -d D``.

    llmsession bench prefill [--depths 1024,4096,8192,16384] [--repeats 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path
from typing import Any

from llmsession.api.model import Model
from llmsession.commands.argtypes import positive_int, positive_ints
from llmsession.commands.bench.common import common_arguments, llama_bench, machine, progress, publish, table
from llmsession.options import GenerationOptions
from llmsession.runtime.loading import checked_threads

WORDS = ("river", "bridge", "lantern", "harbour", "meadow", "orchard", "tower", "valley", "garden", "winter")
FIRST_TOKEN = GenerationOptions(max_tokens=1, temperature=0)
TAIL = 512  # the second turn's tokens: llama-bench's pp512 at depth
BATCH = 512  # ours and llama-bench's -b and -ub


def text_of(model: Model, n_tokens: int, seed: int) -> str:
    """A user message of about ``n_tokens`` tokens (its words differ by seed: nothing shared)."""
    words: list[str] = []
    while (count := len(model.tokenize(" ".join(words), add_special=False))) < n_tokens:
        start = len(words)  # (each word is a token or more: a few rounds)
        words += [
            WORDS[(i * 7 + seed * 3 + i // len(WORDS)) % len(WORDS)]
            for i in range(start, start + max(8, n_tokens - count))
        ]
    return " ".join(words)


def ours(path: Path, threads: int | None, depth: int, flash: bool, seed: int) -> dict[str, Any]:
    """A first turn of ``depth`` tokens, then a second of ``TAIL`` tokens after it."""
    kv = depth + TAIL + 256
    with Model(path, threads=threads, flash_attention=flash, kv_tokens=kv, max_live_sessions=1) as model:
        model.session(share_prefix=False).respond("Hi", FIRST_TOKEN)  # the weights paged in, threads up
        session = model.session(context_size=kv, batch_size=BATCH, share_prefix=False)
        first = timed(session, text_of(model, depth, seed))
        second = timed(session, text_of(model, TAIL, seed + 1))
        session.close()
    return {"first": first, "second": second}


def timed(session: Any, prompt: str) -> dict[str, Any]:
    """The turn's time to first token, and its prompt tokens decoded."""
    began = time.perf_counter()
    reply = session.respond(prompt, FIRST_TOKEN)
    seconds = time.perf_counter() - began
    decoded = reply.usage.decoded_prompt_tokens
    return {
        "tokens": decoded,
        "ttft_s": seconds,
        "prefill_s": reply.timings.prefill_s,
        "tps": decoded / seconds,
    }


def reference(exe: Path, model: Path, threads: int, depth: int, flash: bool, repeats: int) -> dict[str, Any]:
    """``llama-bench -p D`` and ``-p 512 -d D`` with the same batch sizes and attention."""
    common = (
        "-n",
        "0",
        "-b",
        str(BATCH),
        "-ub",
        str(BATCH),
        "-fa",
        "1" if flash else "0",
        "-r",
        str(repeats),
    )
    whole = llama_bench(exe, model, threads, "-p", str(depth), *common)
    tail = llama_bench(exe, model, threads, "-p", str(TAIL), "-d", str(depth), *common)
    return {"first": whole, "second": tail}


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    threads, model_name = checked_threads(args.threads), args.model.name
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    results: dict[str, Any] = {"date": date, "machine": machine(threads), "model": model_name, "batch": BATCH}
    rows: list[dict[str, Any]] = []
    for depth in args.depths:
        for flash in (False, True):
            progress(f"depth {depth}, flash attention {'on' if flash else 'off'}", started)
            runs = [ours(args.model, args.threads, depth, flash, seed) for seed in range(args.repeats)]
            peer = reference(args.llama_bench, args.model, threads, depth, flash, args.repeats)
            rows.append({"depth": depth, "flash_attention": flash, "ours": runs, "llama_bench": peer})
    progress("done", started)
    results["rows"] = rows
    return results


def rate(runs: list[dict[str, Any]], turn: str) -> float:
    return statistics.median(float(r[turn]["tps"]) for r in runs)


def bench_rate(peer: dict[str, Any], turn: str) -> float | None:
    samples = peer[turn].get("samples_ts")
    return statistics.median(samples) if samples else None


def report(results: dict[str, Any]) -> None:
    m = results["machine"]
    print(
        f"\nlong prompts: {results['model']} on {m['cpu']}, {m['threads']} threads, batch {results['batch']}"
    )
    header = [
        "depth",
        "FA",
        "first turn tok/s",
        "llama-bench -p D",
        "ratio",
        "512 at depth tok/s",
        "-p 512 -d D",
        "ratio",
    ]
    rows = []
    for row in results["rows"]:
        cells = [str(row["depth"]), "on" if row["flash_attention"] else "off"]
        for turn in ("first", "second"):
            mine, theirs = rate(row["ours"], turn), bench_rate(row["llama_bench"], turn)
            cells += [f"{mine:.1f}", "error" if theirs is None else f"{theirs:.1f}"]
            cells.append("" if theirs is None else f"{mine / theirs:.2f}")
        rows.append(cells)
    table("tokens/s (medians); ratio = ours / llama-bench's", header, rows)
    for row in results["rows"]:
        for turn in ("first", "second"):
            if "error" in row["llama_bench"][turn]:
                print(f"llama-bench: {row['llama_bench'][turn]['error']}")
                break
    best: dict[int, dict[str, Any]] = {}
    for row in results["rows"]:
        theirs = bench_rate(row["llama_bench"], "first") or 0.0
        if theirs > best.get(row["depth"], {}).get("rate", -1.0):
            best[row["depth"]] = {"rate": theirs, "flash": row["flash_attention"]}
    for depth, chosen in best.items():
        ours_best = max(rate(r["ours"], "first") for r in results["rows"] if r["depth"] == depth)
        print(
            f"depth {depth}: llama-bench's best is flash attention {'on' if chosen['flash'] else 'off'} "
            f"({chosen['rate']:.1f} tok/s); our best first turn {ours_best:.1f} tok/s: "
            f"{chosen['rate'] / ours_best:.2f}x its time (target <= 1.1)"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llmsession bench prefill", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--depths", type=positive_ints, default=[1024, 4096, 8192, 16384], help="prompt tokens"
    )
    parser.add_argument("--repeats", type=positive_int, default=1, help="runs of each (medians)")
    common_arguments(parser)
    args = parser.parse_args(argv)
    return publish(run(args), report, args.json)
