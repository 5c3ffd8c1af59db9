#!/usr/bin/env python3
"""The README's main job: a short scripted multi-turn chat on the default model.

Each reply streams as it decodes; after it, one line shows what the session cache saved.
Sampling is the model card's (SmolLM2: temperature 0.2, top_p 0.9) with a fixed seed and a
mild repetition penalty, and the system prompt is the model's own (its template's default):
greedy decoding sat on near-ties that a CPU's kernels break either way (on an AVX2 EPYC it
answered in a loop of "le Grand-Bien-Ami"), and these settings were measured to keep the
answers sensible under such perturbations (README, "Two commands").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llmsession import GenerationOptions, Model
from llmsession.commands import paths

QUESTIONS = (
    "What is the capital of France?",
    "What is it famous for? Answer in one sentence.",
    "Name one river that flows through it.",
    "Thanks! Which museum should I visit first?",
)
OPTIONS = GenerationOptions(max_tokens=64, temperature=0.2, top_p=0.9, seed=42, repeat_penalty=1.1)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=paths.default_model_path())
    parser.add_argument("--max-tokens", type=int, default=OPTIONS.max_tokens)
    parser.add_argument(
        "--json", type=Path, metavar="FILE", help="also write the answers and their usage here"
    )
    args = parser.parse_args()
    options = dataclasses.replace(OPTIONS, max_tokens=args.max_tokens)
    turns = []
    with Model(args.model) as model:
        session = model.session()  # (the template's own system prompt)
        print(f"model: {args.model.name}\n{model.memory().kv_sizing}; prompts: {model.renderer}\n")
        for question in QUESTIONS:
            print(f"> {question}")
            began = time.perf_counter()
            stream = session.stream(question, options)
            for snapshot in stream:
                print(snapshot.delta, end="", flush=True)
            reply = stream.reply
            assert reply is not None
            usage, timings = reply.usage, reply.timings
            print(
                f"\n  [prompt {usage.prompt_tokens} tokens: reused {usage.reused_tokens}, "
                f"decoded {usage.decoded_prompt_tokens} | first token {timings.time_to_first_token_s:.3f}s | "
                f"{timings.generation_tokens_per_s:.0f} tok/s | {time.perf_counter() - began:.2f}s]\n"
            )
            turns.append({"question": question, "answer": reply.text, "reused_tokens": usage.reused_tokens})
    if args.json is not None:
        args.json.write_text(json.dumps({"model": args.model.name, "turns": turns}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
