"""``llmsession bench structured``: generation speed with a JSON schema against without one.

Side by side in one run: our replies plain and held to each schema (llguidance masks, forced
tokens decoded in batches), and llama-cpp-python's with ``LlamaGrammar.from_json_schema``
(llama.cpp's grammar sampler) on the same libllama, in a worker. Each reply starts from a fresh
context, greedy, so every contender decodes the same prompt; speed is tokens after the first one
over the time they took (the first waits for the prompt).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from llmsession.api.model import Model, local_model
from llmsession.commands.argtypes import positive_int
from llmsession.commands.bench.common import (
    common_arguments,
    machine,
    mask_cost,
    progress,
    publish,
    run_worker,
    table,
)
from llmsession.options import GenerationOptions

CASES: dict[str, dict[str, Any]] = {
    "person": {
        "ask": "Describe a fictional person as JSON.",
        "schema": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "email": {"type": "string", "format": "email"},
                "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
            },
            "required": ["name", "age", "email", "hobbies"],
            "additionalProperties": False,
        },
    },
    "catalog": {
        "ask": "List three products of a bakery as JSON.",
        "schema": {
            "type": "array",
            "minItems": 3,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "product": {"type": "string"},
                    "price": {"type": "number", "minimum": 0},
                    "kind": {"enum": ["bread", "cake", "pastry"]},
                },
                "required": ["product", "price", "kind"],
                "additionalProperties": False,
            },
        },
    },
}


def ours(model: Model, ask: str, schema: dict[str, Any] | None, max_tokens: int) -> dict[str, Any]:
    options = GenerationOptions(max_tokens=max_tokens, temperature=0, json_schema=schema)
    reply = model.session().respond(ask, options)
    t = reply.timings
    return {
        "tokens": reply.usage.completion_tokens,
        "tokens_per_s": t.generation_tokens_per_s,
        "ttft_s": t.time_to_first_token_s,
        "finish": reply.finish_reason,
        "text": reply.text,
    }


def schema_mask_cost(model: Model, schema: dict[str, Any], text: str) -> float:
    """A JSON schema's mask cost per token along ``text`` (a reply that holds to it)."""
    constraint = local_model(model).constraint(GenerationOptions(json_schema=schema))
    assert constraint is not None
    return mask_cost(model, constraint, text)


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "ours": {}}
    with Model(args.model, threads=args.threads) as model:
        model.session().respond("Hello", GenerationOptions(max_tokens=4, temperature=0))  # warm up
        local_model(model).constraint(
            GenerationOptions(json_schema={"type": "object"})
        )  # build the tokenizer once
        results["machine"] = machine(model.threads)
        for name, case in CASES.items():
            progress(f"structured: {name}", started)
            runs: dict[str, list[Any]] = {"plain": [], "schema": []}
            for _ in range(args.repeats):
                for kind in runs:
                    schema = case["schema"] if kind == "schema" else None
                    runs[kind].append(ours(model, case["ask"], schema, args.max_tokens))
            results["ours"][name] = runs
            results.setdefault("mask", {})[name] = schema_mask_cost(
                model, case["schema"], runs["schema"][0]["text"]
            )
    if args.peer:
        progress(f"structured: peer {args.peer}", started)
        config = {"mode": "structured", "model": str(args.model), "threads": results["machine"]["threads"]}
        config |= {"n_ctx": 2048, "max_tokens": args.max_tokens, "repeats": args.repeats}
        config["cases"] = {
            name: {"schema": c["schema"], "messages": [{"role": "user", "content": c["ask"]}]}
            for name, c in CASES.items()
        }
        results["peer"] = run_worker(args.peer_python, config)
    progress("done", started)
    return results


def median_rate(runs: list[dict[str, Any]]) -> float:
    key = "tokens_per_s" if "tokens_per_s" in runs[0] else "generation_tokens_per_s"
    return float(statistics.median(r[key] for r in runs))


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "-"  # "-": a reply of one token has no generation rate


def report(results: dict[str, Any]) -> None:
    m = results["machine"]
    print(f"\nstructured output: {m['cpu']}, {m['threads']} threads")
    peer = results.get("peer", {}).get("structured", {})
    header = ["schema", "ours plain", "ours schema", "ratio"]
    header += ["peer plain", "peer schema", "ratio", "ours/peer"]
    rows = []
    for name, runs in results["ours"].items():
        plain, schema = median_rate(runs["plain"]), median_rate(runs["schema"])
        row = [name, f"{plain:.0f}", f"{schema:.0f}", ratio(schema, plain)]
        if name in peer:
            p_plain, p_schema = median_rate(peer[name]["plain"]), median_rate(peer[name]["schema"])
            row += [f"{p_plain:.0f}", f"{p_schema:.0f}", ratio(p_schema, p_plain), ratio(schema, p_schema)]
        rows.append(row)
    table("generation tokens/s (median), greedy, fresh context per reply", header, rows)
    for name, cost in results.get("mask", {}).items():
        print(f"{name}: computing and applying the mask takes {cost:.3f} ms per token")
    if "skipped" in results.get("peer", {}):
        print(f"peer skipped: {results['peer']['skipped']}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="llmsession bench structured", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--max-tokens", type=positive_int, default=128)
    common_arguments(parser)
    args = parser.parse_args(argv)
    return publish(run(args), report, args.json)
