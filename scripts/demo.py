#!/usr/bin/env python3
"""The README's main job: a short scripted multi-turn chat on the default model.

Each reply streams as it decodes; after it, one line shows what the session cache saved.
"""

from __future__ import annotations

import argparse
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
    "Thanks! Say goodbye in French.",
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, default=paths.default_model_path())
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    options = GenerationOptions(max_tokens=args.max_tokens, temperature=0)
    with Model(args.model) as model:
        session = model.session(system="You are a helpful, concise assistant.")
        print(f"model: {args.model.name}\n")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
