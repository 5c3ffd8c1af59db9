"""Concurrent streams on one model: aggregate tokens/s and each stream's time to first token for
1, 2, 4 and 8 streams run at once (one thread each, their generation steps batched), against the
same streams run one after another, and what llama.cpp itself gains from the same work, all in
one run; and what a prefill's cancel check costs in a worker thread while another Python thread
is busy, native against a Python callback.

llama.cpp's gain is ``llama-batched-bench``'s: N sequences of the streams' mean prompt length
prefilled, then generating as many tokens in one batch per step (``-kvu``: one cell pool, as the
engine's), its N × t(1) / t(N), prefills included as in ours; also its generation alone. The
older reference, ``llama-bench -p 1,N -d 100``, is kept beside it: a batch of N tokens of one
sequence over a single cold decode (``pp1`` times one decode right after the depth is restored,
not a decode in a stream's steady state), which flatters batching.

Then the two arrival scenarios (``arrivals``): a long prompt arriving while three streams
generate, and four prompts arriving together.

    llmsession bench concurrent [--streams 1,2,4,8] [--max-tokens 64] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from llama_cffi import python_abort_checks

from llmsession.api.model import Model, local_model
from llmsession.commands.argtypes import positive_int, positive_ints
from llmsession.commands.bench import arrivals
from llmsession.commands.bench.common import (
    batched_bench,
    common_arguments,
    flash_attn_option,
    llama_bench,
    machine,
    progress,
    publish,
    table,
)
from llmsession.options import KV_LAYOUTS, GenerationOptions

PROMPTS = (
    "Tell me a story about a lighthouse.", "Describe the sea at night.", "Write a poem about winter.",
    "Explain how bridges are built.", "Tell me about rivers.", "Describe a garden in spring.",
    "What is a harbour for?", "Write about an old tower.",
)  # fmt: skip


def streams(model: Model, n: int, options: GenerationOptions, *, together: bool) -> dict[str, Any]:
    """n fresh sessions, one prompt each, at once (threads) or one after another."""
    sessions = [model.session() for _ in range(n)]
    ttft, tokens = [0.0] * n, [0] * n
    gate = threading.Barrier(n if together else 1)

    def one(i: int) -> None:
        gate.wait()
        began, first = time.perf_counter(), 0.0
        stream = sessions[i].stream(PROMPTS[i % len(PROMPTS)], options)
        for _ in stream:
            first = first or time.perf_counter()
        assert stream.reply is not None
        ttft[i], tokens[i] = first - began, stream.reply.usage.completion_tokens

    batcher = local_model(model).engine.batcher
    batches, steps, began = batcher.batches, batcher.steps, time.perf_counter()
    if together:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    else:
        for i in range(n):
            one(i)
    wall = time.perf_counter() - began
    for session in sessions:
        session.close()
    per_batch = (batcher.steps - steps) / max(1, batcher.batches - batches)
    return {
        "tokens_per_s": sum(tokens) / wall,
        "ttft_s": ttft,
        "tokens": tokens,
        "steps_per_batch": per_batch,
    }


def scenario(
    model: Model, counts: list[int], options: GenerationOptions, exe: Any, repeats: int = 3
) -> dict[str, Any]:
    """Each count's streams one by one and together, in turn, ``repeats`` times (the machine's
    speed moves by a fifth within minutes: medians of runs taken in turn), then the references."""
    results: dict[str, Any] = {}
    for n in counts:
        runs: dict[str, list[dict[str, Any]]] = {"sequential": [], "concurrent": []}
        for _ in range(repeats):
            for side, together in (("sequential", False), ("concurrent", True)):
                runs[side].append(streams(model, n, options, together=together))
        results[str(n)] = {side: median_run(samples) for side, samples in runs.items()}
    sizes = ",".join(str(n) for n in sorted({1, *counts}))
    fa = flash_attn_option(model.flash_attention)
    reference = llama_bench(exe, model.path, model.threads, "-p", sizes, "-n", "0", "-d", "100", "-fa", fa)
    if "error" not in reference:
        rates = [statistics.median(t) for t in reference["tests"]]
        gains = {str(n): rate / rates[0] for n, rate in zip(sorted({1, *counts}), rates, strict=True)}
        reference |= {"batch_gain": gains}
    batched = batched_reference(
        model, sizes, options.max_tokens, Path(exe).with_name("llama-batched-bench"), repeats
    )
    return {"streams": results, "llama_bench": reference, "batched_bench": batched}


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median tokens/s (its TTFTs and batches with it), and every run's rate."""
    ranked = sorted(runs, key=lambda run: run["tokens_per_s"])
    return ranked[len(ranked) // 2] | {"runs_tokens_per_s": [run["tokens_per_s"] for run in runs]}


def batched_reference(model: Model, sizes: str, max_tokens: int, exe: Path, repeats: int) -> dict[str, Any]:
    """llama.cpp's own gain from N streams: ``llama-batched-bench`` with the streams' mean prompt
    length, ``max_tokens`` each, the engine's cells and batch size; medians of ``repeats`` runs."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(max(int(n) for n in sizes.split(",")))]
    npp = round(statistics.fmean(len(model.prompt_tokens([{"role": "user", "content": p}])) for p in prompts))
    c = local_model(model).engine.config
    options = ["-c", str(c.kv_tokens), "-b", str(c.batch_size), "-ub", str(c.batch_size)]
    options += (
        [] if local_model(model).engine.own_cells(True) else ["-kvu"]
    )  # (our layout: streams, or one pool)
    options += ["-npp", str(npp), "-ntg", str(max_tokens), "-npl", sizes]
    options += ["-fa", flash_attn_option(model.flash_attention)]
    runs = [batched_bench(exe, model.path, model.threads, *options) for _ in range(repeats)]
    if any("error" in run for run in runs):
        return next(run for run in runs if "error" in run)
    times: dict[str, list[float]] = {}
    generation: dict[str, list[float]] = {}
    for run in runs:
        for row in run["rows"]:
            times.setdefault(str(row["pl"]), []).append(row["t"])
            generation.setdefault(str(row["pl"]), []).append(row["speed_tg"])
    one, one_tg = statistics.median(times["1"]), statistics.median(generation["1"])
    return {
        "prompt_tokens": npp,
        "gain": {n: int(n) * one / statistics.median(t) for n, t in times.items()},
        "generation_gain": {n: statistics.median(g) / one_tg for n, g in generation.items()},
        "runs": runs,
    }


def prefill_checks(model: Model, repeats: int = 3) -> dict[str, Any]:
    """A 600-token prefill in a worker thread (as ``astream`` runs it) with another Python thread
    busy (a web server's event loop, say): the native cancel check against the Python callback."""
    prompt = " ".join(["The lighthouse keeper counted the waves again."] * 60)
    options = GenerationOptions(max_tokens=1, temperature=0)
    busy, times = threading.Event(), {"native": list[float](), "python": list[float]()}

    def spin() -> None:
        while not busy.is_set():
            pass

    def prefill(into: list[float]) -> None:
        session = model.session()
        into.append(session.respond(prompt, options).timings.prefill_s)
        session.close()

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    try:
        for _ in range(repeats):
            for name, checks in (("native", nullcontext()), ("python", python_abort_checks())):
                with checks:
                    worker = threading.Thread(target=prefill, args=(times[name],))
                    worker.start()
                    worker.join()
    finally:
        busy.set()
    return {name: statistics.median(samples) for name, samples in times.items()} | {"samples": times}


def report(results: dict[str, Any]) -> None:
    m, ref, batched = results["machine"], results["llama_bench"], results["batched_bench"]
    print(
        f"\n{results['model']} on {m['cpu']}: {m['cores']} cores, {m['threads']} threads, llama.cpp", end=""
    )
    print(f" {m['llama_cpp_commit']}; {results['max_tokens']} tokens per stream")
    pp_gains, gains = ref.get("batch_gain", {}), batched.get("gain", {})
    header = ["streams", "tok/s together", "tok/s one by one", "gain", "llama.cpp gain", "ours / theirs"]
    header += ["llama.cpp generation gain", "pN / p1", "steps/batch"]
    header += ["TTFT together (mean, max)", "TTFT one by one (mean, max)"]
    rows = []
    for n, r in results["streams"].items():
        con, seq = r["concurrent"], r["sequential"]
        gain = con["tokens_per_s"] / seq["tokens_per_s"]
        row = [n, f"{con['tokens_per_s']:.1f}", f"{seq['tokens_per_s']:.1f}", f"{gain:.2f}"]
        row += [f"{gains[n]:.2f}", f"{gain / gains[n]:.2f}"] if n in gains else ["-", "-"]
        row += [f"{batched['generation_gain'][n]:.2f}" if n in gains else "-"]
        row += [f"{pp_gains[n]:.2f}" if n in pp_gains else "-", f"{con['steps_per_batch']:.2f}"]
        for side in (con, seq):
            row.append(f"{statistics.fmean(side['ttft_s']) * 1e3:.0f}, {max(side['ttft_s']) * 1e3:.0f} ms")
        rows.append(row)
    title = "concurrent streams, medians of each side's runs (llama.cpp gain: llama-batched-bench, N streams"
    title += f" of {batched.get('prompt_tokens', '?')} prompt tokens, prefills included; pN / p1: llama-bench"
    title += " at depth 100)"
    table(title, header, rows)
    for name, reference in (("llama-bench", ref), ("llama-batched-bench", batched)):
        if "error" in reference:
            print(f"{name}: {reference['error']}")
    checks = results["prefill_checks"]
    print("\n600-token prefill in a worker thread, another Python thread busy: native cancel check")
    print(f"{checks['native'] * 1e3:.0f} ms, Python callback {checks['python'] * 1e3:.0f} ms", end="")
    print(f" ({checks['python'] / checks['native']:.2f}x)")
    arrivals.report(results["arrivals"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llmsession bench concurrent", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--streams", type=positive_ints, default=[1, 2, 4, 8], help="stream counts, comma-separated"
    )
    parser.add_argument("--max-tokens", type=positive_int, default=64, help="per stream")
    parser.add_argument(
        "--repeats", type=positive_int, default=3, help="runs of each side, and of the reference"
    )
    parser.add_argument("--kv-layout", choices=KV_LAYOUTS, default=KV_LAYOUTS[0], help="the model's")
    common_arguments(parser)
    args = parser.parse_args(argv)
    counts = args.streams
    started = time.perf_counter()
    options = GenerationOptions(max_tokens=args.max_tokens, temperature=0)
    live = max(8, *counts)  # each session room for the 2,000-token arrival and its reply
    memory = {"max_live_sessions": live, "kv_tokens": 3072 * live, "kv_layout": args.kv_layout}
    with Model(args.model, threads=args.threads, **memory) as model:
        model.session().respond("Hello", GenerationOptions(max_tokens=4, temperature=0))  # warm up
        date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        results: dict[str, Any] = {"date": date, "machine": machine(model.threads), "model": args.model.name}
        results |= {"max_tokens": args.max_tokens}
        progress(f"streams {counts}, together and one by one", started)
        results |= scenario(model, counts, options, args.llama_bench, args.repeats)
        progress("prefill cancel checks with a busy Python thread", started)
        results["prefill_checks"] = prefill_checks(model)
        progress("prompts arriving mid-stream and together", started)
        batched = Path(args.llama_bench).with_name("llama-batched-bench")
        results["arrivals"] = arrivals.arrivals(model, batched, args.repeats)
    progress("done", started)
    return publish(results, report, args.json)
