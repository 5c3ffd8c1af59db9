"""The session benchmark's records and report: one ``MeasuredTurn`` per exchange per contender, the
totals over a chat, and the tables (and optional plot) ``llmsession bench`` prints."""

from __future__ import annotations

import importlib
import statistics
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from llmsession.commands.bench.common import table
from llmsession.options import GenerationOptions
from llmsession.runtime.face import Session


@dataclass
class MeasuredTurn:
    """One exchange as one contender saw it (``library_ttft_s`` leaves out rendering and tokenizing)."""

    ttft_s: float
    prompt_tokens: int
    reused_tokens: int
    decoded_prompt_tokens: int
    completion_tokens: int
    generation_tokens_per_s: float
    library_ttft_s: float = 0.0
    anticipated_tokens: int = 0  # reused positions decoded ahead, while the user "thought"
    render_s: float = 0.0  # the split of our TTFT (see Timings)
    tokenize_s: float = 0.0
    plan_s: float = 0.0
    prefill_s: float = 0.0
    first_sample_s: float = 0.0


def totals(turns: list[MeasuredTurn]) -> dict[str, float]:
    """Sums over one contender's chat; the reused fraction leaves out turn 1 (nothing to reuse)."""
    later = turns[1:]
    return {
        "ttft_last_over_first": turns[-1].ttft_s / turns[0].ttft_s,
        "mean_ttft_s": statistics.fmean(t.ttft_s for t in turns),
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        "decoded_prompt_tokens": sum(t.decoded_prompt_tokens for t in turns),
        "reused_fraction": sum(t.reused_tokens for t in later) / max(1, sum(t.prompt_tokens for t in later)),
    }


def rows_of(turns: list[MeasuredTurn]) -> list[dict[str, Any]]:
    return [asdict(t) for t in turns]


def turns_of(rows: list[dict[str, Any]]) -> list[MeasuredTurn]:
    names = {f.name for f in fields(MeasuredTurn)}
    return [MeasuredTurn(**{k: v for k, v in row.items() if k in names}) for row in rows]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def report_multi_turn(result: dict[str, Any], peer: list[MeasuredTurn]) -> None:
    cached, fresh, s = turns_of(result["cache"]), turns_of(result["fresh"]), result["summary"]
    limits = result.get("compute_limit_s") or [None] * len(cached)
    header = [
        "turn",
        "prompt",
        "reused",
        "ahead",
        "decoded",
        "new",
        "TTFT cache",
        "TTFT fresh",
        "cache/fresh",
    ]
    medians = result.get("ttft_median_s") or [c.ttft_s for c in cached]  # (older records: one sample)
    header += ["tok/s", "render+tok", "plan", "prefill", "sample", "TTFT median", "limit", "median/limit"]
    rows = []
    for i, (c, f) in enumerate(zip(cached, fresh, strict=True)):
        row = [str(i + 1), str(c.prompt_tokens), str(c.reused_tokens), str(c.anticipated_tokens)]
        row.append(str(c.decoded_prompt_tokens))
        row += [str(result["new_tokens"][i]), ms(c.ttft_s), ms(f.ttft_s), f"{c.ttft_s / f.ttft_s:.3f}"]
        row += [f"{c.generation_tokens_per_s:.0f}", ms(c.render_s + c.tokenize_s), ms(c.plan_s)]
        row += [ms(c.prefill_s), ms(c.first_sample_s), ms(medians[i])]
        limit = limits[i]
        row += [ms(limit), f"{medians[i] / limit:.2f}"] if limit else ["-", "-"]
        if peer:
            row += ["|", str(peer[i].prompt_tokens), str(peer[i].reused_tokens), ms(peer[i].ttft_s)]
        rows.append(row)
    header += ["|", "peer prompt", "peer reused", "TTFT peer"] if peer else []
    table("multi-turn chat (TTFT in ms, wall clock from the call)", header, rows)
    n, cache = len(cached), s["cache"]
    cold = cached[-1].ttft_s / fresh[0].ttft_s  # a first turn that shares nothing: the same work
    print(f"cache TTFT turn {n} / turn 1: {cache['ttft_last_over_first']:.2f}", end="")
    print(f"; / a cold turn 1 (fresh): {cold:.2f}  (target <= 1.5)")
    print(
        f"TTFT median: of {result.get('ttft_samples', 1)} per turn (the turn, and forks taken just before it)"
    )
    if any(limits):
        within = sum(m <= 1.1 * x for m, x in zip(medians, limits, strict=True) if x)
        print(f"turns whose median TTFT is within 1.1x the limit: {within} of {sum(1 for x in limits if x)}")
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
        row = [str(i + 1), f"{c['reused_fraction']:.1%}", ms(c["mean_ttft_s"]), ms(f["mean_ttft_s"])]
        row.append(f"{c['mean_ttft_s'] / f['mean_ttft_s']:.3f}")
        if peer:
            row += ["|", f"{peer[i]['reused_fraction']:.1%}", ms(peer[i]["mean_ttft_s"])]
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
    deep, depth = ref.get(f"tg{n_tokens}_at_depth", tg), result.get("depth", 0)
    print(
        f"llama-bench tg{n_tokens} @ d{depth} (our prompt's depth): {deep['median']:.1f}, {deep['best']:.1f}"
    )
    print(f"llama-bench tg{n_tokens}: {tg['median']:.1f}, {tg['best']:.1f}", end="")
    print(f" (pp512: {pp['median']:.1f}, {pp['best']:.1f})")
    print(
        f"llmsession / llama-bench @ d{depth}: {ratio['median']:.3f}, {ratio['best']:.3f}  (target >= 0.98)"
    )
    if "ratio_depth_0" in result:
        d0 = result["ratio_depth_0"]
        print(f"llmsession / llama-bench at depth 0: {d0['median']:.3f}, {d0['best']:.3f}")


def report(results: dict[str, Any], n_tokens: int) -> None:
    m, peer = results["machine"], results.get("peer", {})
    print(f"\n{results['model']} on {m['cpu']}: {m['cores']} cores, {m['threads']} threads", end="")
    print(f", llama.cpp {m['llama_cpp_commit']}")
    if "skipped" in peer:
        print(f"peer skipped: {peer['skipped']}")
    elif peer:
        print(f"peer: llama-cpp-python {peer['version']}, llama.cpp {peer['commit']} ({peer['library']})")
    report_multi_turn(results["multi_turn"], turns_of(peer.get("multi_turn", [])))
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


def exchange(session: Session, question: str, options: GenerationOptions) -> tuple[MeasuredTurn, str]:
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
    turn = MeasuredTurn(
        ttft, *counts, t.generation_tokens_per_s, t.time_to_first_token_s, u.anticipated_tokens, *split
    )
    return turn, stream.reply.text
