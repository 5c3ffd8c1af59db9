"""The benchmark's multi-turn scenario on a tiny budget: its numbers' shape, not their speed."""

from __future__ import annotations

import json

from llmsession import GenerationOptions, Model
from llmsession.bench import QUESTIONS, Turn, multi_turn


def test_multi_turn_reports_every_turn_and_reuses_the_cache(smollm2: Model) -> None:
    result = multi_turn(smollm2, list(QUESTIONS[:3]), GenerationOptions(max_tokens=4, temperature=0))
    json.dumps(result)  # everything lands in --json as is
    assert len(result["cache"]) == len(result["fresh"]) == len(result["new_tokens"]) == 3
    cached = [Turn(**row) for row in result["cache"]]
    fresh = [Turn(**row) for row in result["fresh"]]
    assert cached[0].reused_tokens == 0
    assert cached[1].reused_tokens > 0
    assert all(t.reused_tokens == 0 and t.decoded_prompt_tokens == t.prompt_tokens for t in fresh)
    assert [t.prompt_tokens for t in cached] == [t.prompt_tokens for t in fresh]
    summary = result["summary"]
    assert {"cache", "fresh", "cache_decoded_over_new", "cache_over_fresh_ttft_last"} <= set(summary)
    assert summary["new_tokens"] == sum(result["new_tokens"]) > 0
