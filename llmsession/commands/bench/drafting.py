"""``llmsession bench drafting``: generation speed with drafted tokens (prompt lookup) against
without, side by side in one run.

Two kinds of work: replies that copy their prompt (repeat a paragraph with one word changed, fix
a typo in code: what the model makes of it, since a small model may rewrite the code rather than
copy it) and plain chat. Each reply is greedy, from a fresh session, with drafts off and
on in turn, ``--repeats`` times; speed is the reply's tokens over its generation time (the
first token waits for the prompt). It reports whether the two replies were the same tokens.

    llmsession bench drafting [--repeats 3] [--max-tokens 160] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from typing import Any

from llmsession.api.model import Model
from llmsession.commands.argtypes import positive_int
from llmsession.commands.bench.common import common_arguments, machine, progress, publish, table
from llmsession.options import GenerationOptions

PARAGRAPHS = (
    "The lighthouse keeper climbed the narrow stairs every evening at dusk. He cleaned the great "
    "lens, trimmed the wick and wound the clockwork that turned the light. Ships passing the rocks "
    "at night trusted that beam more than any chart, and the keeper knew it. In winter the storms "
    "came from the west and the spray reached the gallery windows, but the light never failed. "
    "When the keeper grew old, his daughter learned the work, and she kept the lamp for forty years.",
    "The old bridge over the river was built of grey stone in the year the town was founded. Carts "
    "crossed it every morning on their way to the market, and children fished from its arches in "
    "the summer. When the great flood came, the water rose to the top of the arches, but the bridge "
    "held, and the people said it would stand for another thousand years.",
)
CODE = (
    "def average(values):\n    total = 0\n    count = 0\n    for value in values:\n"
    "        total += vlaue\n        count += 1\n    if count == 0:\n        return 0\n"
    "    return total / count\n"
)
WORKLOADS: dict[str, tuple[str, ...]] = {
    "paragraph": (
        f"Rewrite the following text, replacing 'evening' with 'night'. Output only the rewritten "
        f"text.\n\n{PARAGRAPHS[0]}",
        f"{PARAGRAPHS[1]}\n\nRepeat the text above word for word, with 'grey' changed to 'white'.",
    ),
    "code": (f"Here is some code with a typo:\n```python\n{CODE}```\nRewrite the code with the typo fixed.",),
    "chat": (
        "Tell me about the history of bridges.",
        "What should I pack for a week of hiking in the mountains?",
    ),
}


def one_reply(model: Model, prompt: str, options: GenerationOptions) -> dict[str, Any]:
    session = model.session(share_prefix=False)
    reply = session.respond(prompt, options)
    session.close()
    tokens = reply.usage.completion_tokens
    return {
        "tokens": tokens,
        "tokens_per_s": tokens / max(reply.timings.generation_s, 1e-9),
        "text": reply.text,
    }


def workload(model: Model, prompts: tuple[str, ...], max_tokens: int, repeats: int) -> dict[str, Any]:
    """Each prompt with drafts off and on, alternately, ``repeats`` times: median speeds."""
    sides: dict[str, list[float]] = {"plain": [], "drafted": []}
    same, compared = 0, 0
    for _ in range(repeats):
        for prompt in prompts:
            plain = one_reply(model, prompt, GenerationOptions(max_tokens=max_tokens, temperature=0))
            drafted = one_reply(
                model, prompt, GenerationOptions(max_tokens=max_tokens, temperature=0, draft="prompt_lookup")
            )
            sides["plain"].append(plain["tokens_per_s"])
            sides["drafted"].append(drafted["tokens_per_s"])
            same, compared = same + (plain["text"] == drafted["text"]), compared + 1
    plain_s, drafted_s = statistics.median(sides["plain"]), statistics.median(sides["drafted"])
    return {
        "plain_tokens_per_s": plain_s,
        "drafted_tokens_per_s": drafted_s,
        "speedup": drafted_s / plain_s,
        "same_replies": f"{same}/{compared}",
        "samples": sides,
    }


def report(results: dict[str, Any]) -> None:
    m = results["machine"]
    print(f"\n{results['model']} on {m['cpu']}: {m['threads']} threads, llama.cpp {m['llama_cpp_commit']}")
    targets = {"paragraph": ">= 1.5", "code": ">= 1.5", "chat": ">= 0.97"}
    rows = [
        [
            name,
            f"{r['plain_tokens_per_s']:.1f}",
            f"{r['drafted_tokens_per_s']:.1f}",
            f"{r['speedup']:.2f}",
            targets.get(name, "-"),
            r["same_replies"],
        ]
        for name, r in results["workloads"].items()
    ]
    header = ["workload", "tok/s plain", "tok/s drafted", "drafted / plain", "target", "same greedy replies"]
    table("drafted tokens from the prompt, greedy, medians", header, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llmsession bench drafting", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=positive_int, default=3, help="runs of each prompt and side")
    parser.add_argument("--max-tokens", type=positive_int, default=160, help="per reply")
    common_arguments(parser)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    with Model(args.model, threads=args.threads, anticipate=False) as model:
        model.session().respond("Hello", GenerationOptions(max_tokens=4, temperature=0))  # warm up
        date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        results: dict[str, Any] = {"date": date, "machine": machine(model.threads), "model": args.model.name}
        results["workloads"] = {}
        for name, prompts in WORKLOADS.items():
            progress(f"{name}: drafts off and on", started)
            results["workloads"][name] = workload(model, prompts, args.max_tokens, args.repeats)
    progress("done", started)
    return publish(results, report, args.json)
