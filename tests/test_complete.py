"""Raw completions (``Model.complete``): the prompt continued as it is, without the chat
template, routed and reused as stateless chat calls are, tenants kept apart."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmsession import GenerationOptions, Model

GREEDY = GenerationOptions(max_tokens=8, temperature=0)


def test_a_prompt_is_continued_without_the_template(smollm2: Model) -> None:
    prompt = "The capital of France is"
    reply = smollm2.complete(prompt, GREEDY)
    assert reply.usage.prompt_tokens == len(smollm2.tokenize(prompt))  # no template around it
    assert reply.usage.completion_tokens > 0 and reply.finish_reason in ("length", "stop")
    # the same continuation as a session given those exact tokens would decode: greedy, fresh
    fresh = Model(smollm2.path, threads=2, anticipate=False)
    try:
        again = fresh.complete(prompt, GREEDY)
    finally:
        fresh.close()
    assert again.text == reply.text


def test_a_growing_prompt_decodes_only_its_end_and_tenants_stay_apart(smollm2: Model) -> None:
    story = "Once upon a time, a lighthouse keeper lived alone on a rock in the sea."
    first = smollm2.complete(story, GREEDY, tenant="a", share_prefix=False)
    grown = story + first.text + " One night,"
    second = smollm2.complete(grown, GREEDY, tenant="a", share_prefix=False)
    assert second.usage.reused_tokens >= first.usage.prompt_tokens, second.usage
    other = smollm2.complete(grown, GREEDY, tenant="b", share_prefix=False)
    assert other.usage.reused_tokens == 0 and other.usage.decoded_prompt_tokens == other.usage.prompt_tokens


@pytest.mark.parametrize(
    ("prompt", "options", "error"),
    [
        ("", GREEDY, ValueError),
        ("a\x00b", GREEDY, ValueError),
        (["a"], GREEDY, TypeError),
        ("Hi", GenerationOptions(tools=[{"type": "function", "function": {"name": "f"}}]), ValueError),
    ],
)
def test_bad_prompts_are_refused_before_anything_decodes(
    smollm2: Model, prompt: object, options: GenerationOptions, error: type[Exception]
) -> None:
    with pytest.raises(error):
        smollm2.complete(prompt, options)  # type: ignore[arg-type]


def test_an_isolated_model_completes_too(smollm2_path: Path) -> None:
    with Model(smollm2_path, threads=2, isolated=True) as model:
        reply = model.complete("The capital of France is", GREEDY)
        assert reply.usage.completion_tokens > 0
        with pytest.raises(TypeError):
            model.complete(["a"], GREEDY)  # type: ignore[arg-type]
