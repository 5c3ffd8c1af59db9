"""Prompts arriving while the model is busy (``llmsession bench concurrent``'s two arrival
scenarios).

(a) Three streams generating when a long prompt arrives in a fourth session: the streams'
largest gap between two tokens while it is decoded against their median gap in the half second
before it came, and the prompt's
time to first token against the same length alone. (b) Four prompts of ~200 tokens arriving
together: their mean time to first token against ``llama-batched-bench``'s prefill of four such
prompts in one batch.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from llmsession.api.model import Model, local_model
from llmsession.commands.bench.common import batched_bench, flash_attn_option
from llmsession.options import GenerationOptions

WORDS = ("river", "bridge", "lantern", "harbour", "meadow", "orchard", "tower", "valley", "garden")
STORIES = (
    "Tell me a long story about a lighthouse.",
    "Describe the sea at night, at length.",
    "Write a long poem about winter.",
)
FIRST_TOKEN = GenerationOptions(max_tokens=1, temperature=0)


def text_of(model: Model, seed: int, n_tokens: int) -> str:
    """A user message of about ``n_tokens`` tokens, different for each seed (nothing shared)."""
    words, text, i = [], "", seed
    while len(model.tokenize(text, add_special=False)) < n_tokens:
        words += [WORDS[(i * 7 + j * (seed + 3)) % len(WORDS)] for j in range(12)]
        text, i = " ".join(words) + ".", i + 1
    return text


def first_token_s(model: Model, prompt: str) -> float:
    """Seconds to the first token of ``prompt`` in a fresh session that shares nothing."""
    session = model.session(share_prefix=False)
    began = time.perf_counter()
    for _ in session.stream(prompt, FIRST_TOKEN):
        break
    elapsed = time.perf_counter() - began
    session.close()
    return elapsed


def long_prompt_mid_stream(model: Model, prompt_tokens: int, seed: int) -> dict[str, Any]:
    """Scenario (a) once: the streams' gaps around a long prompt's prefill, and its TTFT."""
    prompt = text_of(model, seed, prompt_tokens)
    alone = first_token_s(model, text_of(model, seed + 100, prompt_tokens))
    sessions = [model.session(share_prefix=False) for _ in STORIES]
    times: list[list[float]] = [[] for _ in STORIES]
    ready, done = threading.Barrier(len(STORIES) + 1), threading.Event()
    options = GenerationOptions(max_tokens=4096, temperature=0)

    def stream(i: int) -> None:
        for count, _ in enumerate(sessions[i].stream(STORIES[i], options)):
            times[i].append(time.perf_counter())
            if count == 8:
                ready.wait()
            if done.is_set() and count > 8:
                break

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(STORIES))]
    for thread in threads:
        thread.start()
    ready.wait()
    time.sleep(0.5)  # the streams' steady state, measured before the prompt arrives
    arrived = time.perf_counter()
    mixed = first_token_s(model, prompt)
    time.sleep(0.5)
    done.set()
    for thread in threads:
        thread.join()
    for session in sessions:
        session.close()
    pairs = [pair for each in times for pair in itertools.pairwise(each)]
    before = [b - a for a, b in pairs if arrived - 0.5 <= a and b <= arrived]  # the streams' own pace
    during = [b - a for a, b in pairs if b > arrived and a < arrived + mixed]  # while it was decoded
    return {
        "max_gap_s": max(during),
        "median_gap_s": statistics.median(before),
        "gap_ratio": max(during) / statistics.median(before),
        "ttft_s": mixed,
        "alone_ttft_s": alone,
        "ttft_ratio": mixed / alone,
    }


def prompts_together(model: Model, n: int, prompt_tokens: int, seed: int) -> dict[str, Any]:
    """Scenario (b) once: ``n`` fresh sessions' prompts at once; each one's time to first token."""
    prompts = [text_of(model, seed + i, prompt_tokens) for i in range(n)]
    ttft = [0.0] * n
    start = threading.Barrier(n)

    def one(i: int) -> None:
        start.wait()
        ttft[i] = first_token_s(model, prompts[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"ttft_s": ttft, "mean_ttft_s": statistics.fmean(ttft)}


def arrivals(model: Model, exe: Path, repeats: int, long_tokens: int = 2000) -> dict[str, Any]:
    """Both scenarios, ``repeats`` runs each (medians), and the llama-batched-bench reference."""
    mid = [long_prompt_mid_stream(model, long_tokens, seed) for seed in range(repeats)]
    together = [prompts_together(model, 4, 200, 10 * seed + 1000) for seed in range(repeats)]
    n_prompt = len(model.prompt_tokens([{"role": "user", "content": text_of(model, 1000, 200)}]))
    c = local_model(model).engine.config
    options = ["-c", str(c.kv_tokens), "-b", str(c.batch_size), "-ub", str(c.batch_size)]
    options += (
        [] if local_model(model).engine.own_cells(True) else ["-kvu"]
    )  # (our layout: streams, or one pool)
    options += [
        "-npp",
        str(n_prompt),
        "-ntg",
        "1",
        "-npl",
        "4",
        "-fa",
        flash_attn_option(model.flash_attention),
    ]
    runs = [batched_bench(exe, model.path, model.threads, *options) for _ in range(repeats)]
    reference: dict[str, Any] = next((run for run in runs if "error" in run), {})
    if not reference:
        reference = {"t_pp_s": statistics.median(run["rows"][0]["t_pp"] for run in runs), "runs": runs}
    mean = statistics.median(run["mean_ttft_s"] for run in together)
    return {
        "long_prompt_mid_stream": {"prompt_tokens": long_tokens, "runs": mid} | medians(mid),
        "prompts_together": {"prompts": 4, "prompt_tokens": n_prompt, "runs": together, "mean_ttft_s": mean}
        | ({"ratio": mean / reference["t_pp_s"]} if "t_pp_s" in reference else {}),
        "batched_bench_prefill": reference,
    }


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def report(results: dict[str, Any]) -> None:
    mid, together = results["long_prompt_mid_stream"], results["prompts_together"]
    print(
        f"\na {mid['prompt_tokens']}-token prompt arriving while {len(STORIES)} streams generate (medians):"
    )
    largest, median = mid["max_gap_s"] * 1e3, mid["median_gap_s"] * 1e3
    print(f"  the streams' largest gap {largest:.0f} ms, their median before {median:.0f} ms:", end="")
    print(f" {mid['gap_ratio']:.1f}x (target <= 3)")
    print(
        f"  its first token after {mid['ttft_s'] * 1e3:.0f} ms, alone {mid['alone_ttft_s'] * 1e3:.0f} ms:",
        end="",
    )
    print(f" {mid['ttft_ratio']:.2f}x (target <= 1.3)")
    print(
        f"{together['prompts']} prompts of {together['prompt_tokens']} tokens at once: mean first token",
        end="",
    )
    print(f" {together['mean_ttft_s'] * 1e3:.0f} ms", end="")
    reference = results["batched_bench_prefill"]
    if "t_pp_s" in reference:
        print(
            f", llama-batched-bench's prefill {reference['t_pp_s'] * 1e3:.0f} ms: {together['ratio']:.2f}x",
            end="",
        )
        print(" (target <= 1.15)")
    else:
        print(f"; llama-batched-bench: {reference.get('error')}")
