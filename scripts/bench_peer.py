#!/usr/bin/env python3
"""The llama-cpp-python side of ``llmsession bench --peer llama-cpp-python``.

It runs in whatever interpreter has ``llama_cpp`` (often a venv of its own), so it imports nothing
from llmsession: the scenario arrives as JSON on stdin and the numbers leave as JSON on stdout.
Point ``LLAMA_CPP_LIB_PATH`` at llmsession's lib/ folder and both sides run the identical build.

    echo '{"model": "...", "threads": 2, ...}' | python scripts/bench_peer.py
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
from pathlib import Path
from typing import Any

from llama_cpp import Llama
from llama_cpp import llama_cpp as low_level


class RecordingLlama(Llama):  # type: ignore[misc]
    """Llama that notes each prompt, the cache it started from and when tokens were sampled."""

    def generate(self, tokens: Any, *args: Any, **kwargs: Any) -> Any:
        self.prompt = list(tokens)
        self.held_before = self._input_ids.tolist()
        self.sampled_at: list[float] = []
        self.end_of_generation = 0  # sampled like any token, counted by llmsession as no completion token
        vocab = low_level.llama_model_get_vocab(self.model)
        for token in super().generate(tokens, *args, **kwargs):
            self.sampled_at.append(time.perf_counter())
            self.end_of_generation += bool(low_level.llama_vocab_is_eog(vocab, token))
            yield token


def load(config: dict[str, Any]) -> RecordingLlama:
    """The peer's Llama as every scenario uses it, warmed up as the llmsession side is (with the
    scenario's ``warm_up`` messages: a conversation before the measured ones), with the flash
    attention choice llmsession made (``flash_attn``: off on the CPU, as llama-cpp-python's own
    default; both sides then decode with the same kernels and greedy replies alike)."""
    threads = config["threads"]
    llm = RecordingLlama(
        config["model"],
        n_ctx=config["n_ctx"],
        n_threads=threads,
        n_threads_batch=threads,
        flash_attn=bool(config.get("flash_attn", False)),
        verbose=False,
    )
    exchange(llm, config.get("warm_up", [{"role": "user", "content": "Hello"}]), 4)
    return llm


def common_prefix(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def exchange(
    llm: RecordingLlama, messages: list[dict[str, str]], max_tokens: int, grammar: Any = None
) -> dict[str, Any]:
    """One streamed chat completion; time to first token is the first chunk carrying text."""
    began, first, text = time.perf_counter(), 0.0, ""
    chunks = llm.create_chat_completion(
        messages=messages, max_tokens=max_tokens, temperature=0, stream=True, grammar=grammar
    )
    for chunk in chunks:
        delta = chunk["choices"][0]["delta"].get("content") or ""
        if delta and not first:
            first = time.perf_counter()
        text += delta
    ended = time.perf_counter()
    prompt, sampled = llm.prompt, llm.sampled_at
    reused = min(common_prefix(llm.held_before, prompt), len(prompt) - 1)
    rate = (len(sampled) - 1) / (sampled[-1] - sampled[0]) if len(sampled) > 1 else 0.0
    return {
        "ttft_s": (first or ended) - began,
        "prompt_tokens": len(prompt),
        "reused_tokens": reused,
        "decoded_prompt_tokens": len(prompt) - reused,
        "completion_tokens": len(sampled) - llm.end_of_generation,
        "generation_tokens_per_s": rate,
        "text": text,
    }


def chat(llm: RecordingLlama, system: str, questions: list[str], max_tokens: int) -> list[dict[str, Any]]:
    messages, turns = [{"role": "system", "content": system}], []
    for question in questions:
        messages.append({"role": "user", "content": question})
        turn = exchange(llm, messages, max_tokens)
        messages.append({"role": "assistant", "content": turn["text"]})
        turns.append(turn)
    return turns


def round_robin(llm: RecordingLlama, system: str, plans: list[list[str]], max_tokens: int) -> list[list[Any]]:
    """Several conversations on one Llama (one model, one context), answered in turn."""
    transcripts = [[{"role": "system", "content": system}] for _ in plans]
    turns: list[list[Any]] = [[] for _ in plans]
    for t in range(max(len(p) for p in plans)):
        for i, plan in enumerate(plans):
            if t < len(plan):
                transcripts[i].append({"role": "user", "content": plan[t]})
                turn = exchange(llm, transcripts[i], max_tokens)
                transcripts[i].append({"role": "assistant", "content": turn["text"]})
                turns[i].append(turn)
    return turns


def loaded_commit() -> str:
    """The llama.cpp commit of the libllama llama_cpp loaded (ggml_commit lives next to it)."""
    ggml = ctypes.CDLL(str(Path(low_level._lib._name).with_name("libggml-base.so")))
    ggml.ggml_commit.restype = ctypes.c_char_p
    return str(ggml.ggml_commit().decode())


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def memory(config: dict[str, Any]) -> dict[str, Any]:
    """N conversations round-robin on one Llama with a LlamaRAMCache (its answer to many chats):
    each exchange's TTFT, whether the cache or the context held its prefix, and RSS once idle."""
    from llama_cpp import LlamaRAMCache

    results = {}
    for n in config["sizes"]:
        llm = load(config)
        base = rss_mib()
        llm.set_cache(LlamaRAMCache(capacity_bytes=config["cache_bytes"]))
        transcripts = [[{"role": "system", "content": config["system"]}] for _ in range(n)]
        exchanges = []
        for r in range(config["rounds"]):
            for i, messages in enumerate(transcripts):
                questions = config["questions"]
                content = config["first_messages"][i] if r == 0 else questions[r % len(questions)]
                messages.append({"role": "user", "content": content})
                turn = exchange(llm, messages, config["max_tokens"])
                messages.append({"role": "assistant", "content": turn["text"]})
                kind = "cold" if r == 0 else "restored"  # a later round's prefix: from the cache
                exchanges.append(
                    {
                        "ttft_s": turn["ttft_s"],
                        "kind": kind,
                        "decoded": turn["decoded_prompt_tokens"],
                        "tokens_per_s": turn["generation_tokens_per_s"],
                        "round": r,
                    }
                )
        results[str(n)] = {"resident_mib": rss_mib() - base, "exchanges": exchanges}
        del llm
    return results


def structured(config: dict[str, Any]) -> dict[str, Any]:
    """Each schema's prompt answered greedily with and without the schema as a grammar
    (``LlamaGrammar.from_json_schema``, llama.cpp's grammar sampler), on a fresh context each time."""
    from llama_cpp import LlamaGrammar

    llm = load(config)
    results: dict[str, Any] = {}
    for name, case in config["cases"].items():
        grammar = LlamaGrammar.from_json_schema(json.dumps(case["schema"]), verbose=False)
        runs: dict[str, list[Any]] = {"plain": [], "schema": []}
        for _ in range(config["repeats"]):
            for kind in runs:
                llm.reset()
                constraint = grammar if kind == "schema" else None
                turn = exchange(llm, case["messages"], config["max_tokens"], constraint)
                runs[kind].append(turn)
        results[name] = runs
    return results


def main() -> int:
    config = json.load(sys.stdin)
    if config.get("mode") == "memory":
        json.dump({"version": __import__("llama_cpp").__version__, "memory": memory(config)}, sys.stdout)
        return 0
    if config.get("mode") == "structured":
        version = __import__("llama_cpp").__version__
        json.dump({"version": version, "structured": structured(config)}, sys.stdout)
        return 0
    llm = load(config)
    max_tokens = config["max_tokens"]
    result = {
        "version": __import__("llama_cpp").__version__,
        "library": str(low_level._lib._name),
        "commit": loaded_commit(),
        "multi_turn": chat(llm, config["system"], config["questions"], max_tokens),
        "interleaved": round_robin(llm, config["system"], config["interleaved"], max_tokens),
    }
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
