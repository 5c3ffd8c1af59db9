"""``llmsession bench tools``: what tool calling costs a reply, and what a tool conversation decodes.

Side by side in one run, per format (the generic one on SmolLM2's ChatML; Hermes on Qwen 2.5's
template and Gemma 4's own syntax on the test fixtures, when they are there):

* speed: the same text reply generated with ``tool_choice="auto"`` (the lazy constraint watches
  for the trigger) and with ``"none"`` (no constraint, same prompt), alternated, greedy;
* cache: a conversation of forced calls, their results and short replies; decoded prompt tokens
  over new prompt tokens (1.00: nothing was decoded twice).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from llmsession.api.model import Model, local_model
from llmsession.commands import paths
from llmsession.commands.argtypes import output_file, positive_int
from llmsession.commands.bench.common import machine, mask_cost, progress, publish, table
from llmsession.errors import GrammarError
from llmsession.options import GenerationOptions
from llmsession.replies import Reply
from llmsession.runtime.face import Session, drain
from llmsession.text.tool_formats import CallIds
from llmsession.text.tools import options_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "days": {"type": "integer", "minimum": 1, "maximum": 16},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = (WEATHER, TIME)
STORY = "Tell me a short story about a lighthouse keeper."
CITIES = ("Paris", "Oslo", "Rome", "Lima", "Kyiv", "Doha", "Bern", "Riga", "Baku", "Quito")
FIXTURES = {"hermes": "smollm2-qwen25-template.gguf", "gemma4": "smollm2-gemma4-special.gguf"}


def formats(model: Path) -> dict[str, tuple[Path, bool]]:
    """Each format's model and whether jinja renders its template; the fixtures' when built."""
    found = {"generic": (model, False)}
    for name, fixture in FIXTURES.items():
        path = paths.fixtures_dir() / fixture
        if path.is_file():
            found[name] = (path, name == "hermes")
    return found


def speed(model: Model, repeats: int, max_tokens: int) -> dict[str, Any]:
    """Generation tokens/s of the same text reply, without and with the "auto" constraint, and
    the mask's own cost per token along it."""
    rates: dict[str, Any] = {"none": [], "auto": []}
    for _ in range(repeats):
        for choice in ("none", "auto"):
            options = GenerationOptions(max_tokens=max_tokens, temperature=0, tools=TOOLS, tool_choice=choice)
            reply = model.session().respond(STORY, options)
            if reply.tool_calls:
                raise RuntimeError(f"the story made a call: {reply.tool_calls}")
            rates[choice].append(reply.timings.generation_tokens_per_s)
            rates["tokens"], rates["text"] = reply.usage.completion_tokens, reply.text
    rates["mask_ms"] = auto_mask_cost(model, rates["text"] or STORY)
    return rates


def conversation(model: Model, turns: int) -> dict[str, int]:
    """Decoded and new prompt tokens over ``turns`` rounds of a call, its result and a reply (a
    call cut short by its token limit is counted: its tokens are in the cache, not the transcript;
    so is one whose arguments break a bound the grammar leaves to the check after the reply)."""
    session = model.session("You are a weather assistant.")
    call = GenerationOptions(
        max_tokens=96, temperature=0, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
    )
    answer = GenerationOptions(max_tokens=16, temperature=0, tools=TOOLS, tool_choice="none")
    counts = {"decoded": 0, "new": 0, "cut": 0, "invalid": 0}
    for turn in range(turns):
        said: Any = f"Weather in {CITIES[turn % len(CITIES)]}?"
        for options in (call, answer):
            held = session.cached_tokens
            reply, invalid = respond(session, said, options)
            counts["decoded"] += reply.usage.decoded_prompt_tokens
            counts["new"] += reply.usage.prompt_tokens - held
            if options is call and not reply.tool_calls:
                counts["invalid" if invalid else "cut"] += 1
                break
            result = json.dumps({"temp_c": 20 + turn})
            said = (
                {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": result}
                if reply.tool_calls
                else ""
            )
    return counts


def respond(session: Session, said: Any, options: GenerationOptions) -> tuple[Reply, bool]:
    """The reply, and whether its call broke its schema (recorded all the same)."""
    stream = session.stream(said, options)
    try:
        return drain(stream), False
    except GrammarError:
        assert stream.reply is not None
        return stream.reply, True


def auto_mask_cost(model: Model, text: str) -> float:
    """The "auto" constraint's mask cost per token along ``text`` (a reply that stays text)."""
    options = GenerationOptions(tools=TOOLS)
    ids = CallIds(local_model(model).tool_format())
    constraint = local_model(model).constraint(options, options_tools(options), [ids(k) for k in range(8)])
    assert constraint is not None
    return mask_cost(model, constraint, text)


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "formats": {}}
    for name, (path, jinja) in formats(args.model).items():
        progress(f"tools: {name}", started)
        with Model(path, threads=args.threads, use_jinja=jinja, anticipate=False) as model:
            results.setdefault("machine", machine(model.threads))
            model.session().respond("Hello", GenerationOptions(max_tokens=4, temperature=0))  # warm up
            results["formats"][name] = {
                "speed": speed(model, args.repeats, args.max_tokens),
                "conversation": conversation(model, args.turns),
            }
    progress("done", started)
    return results


def report(results: dict[str, Any]) -> None:
    m = results["machine"]
    print(f"\ntool calling: {m['cpu']}, {m['threads']} threads")
    rows = []
    for name, result in results["formats"].items():
        rates, talk = result["speed"], result["conversation"]
        none, auto = statistics.median(rates["none"]), statistics.median(rates["auto"])
        cost = f"{none / auto - 1:+.1%}" if auto > 0 and none > 0 else "-"
        ratio = f"{talk['decoded'] / talk['new']:.2f}" if talk["new"] else "-"
        speeds = [f"{none:.1f}", f"{auto:.1f}", cost, f"{rates['mask_ms']:.3f}"]
        talked = [f"{talk['decoded']}/{talk['new']}", ratio, str(talk["cut"]), str(talk.get("invalid", 0))]
        rows.append([name, str(rates["tokens"]), *speeds, *talked])
    header = ["format", "tokens", "none tok/s", "auto tok/s", "auto's cost", "mask ms/token"]
    header += ["decoded/new", "ratio", "calls cut", "invalid"]
    table("a text reply with tools, and a tool conversation (medians, greedy)", header, rows)
    print("(a reply of one token has no generation rate: '-'; the mask's cost is measured apart)")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="llmsession bench tools", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--max-tokens", type=positive_int, default=64)
    parser.add_argument("--turns", type=positive_int, default=10)
    parser.add_argument("--model", type=Path, default=paths.default_model_path(), help="the generic format's")
    parser.add_argument("--threads", type=positive_int, default=None, help="default: llmsession's default")
    parser.add_argument("--json", type=output_file, help="write every number here")
    args = parser.parse_args(argv)
    return publish(run(args), report, args.json)
