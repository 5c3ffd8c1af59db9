"""What the tool-calling tests share: two tools, the transformers-style oracle render, and
samplers scripted or steered by the test (a trigger forced by the test, not by luck)."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import internals
import jinja2
import jinja2.ext
import pytest

from llmsession import Model

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}, "days": {"type": "integer"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}


def hf_render(model: Model, messages: list[dict[str, Any]], tools: list[Any]) -> str:
    """The oracle: the template as transformers renders it (arguments as objects)."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)  # (transformers' too)
    hf = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
        hf.append(m)
    native = internals.local(model).native
    bos, eos = native.token_text(native.bos()), native.token_text(native.eos())
    assert model.template is not None
    return env.from_string(model.template).render(
        messages=hf, tools=tools, add_generation_prompt=True, bos_token=bos, eos_token=eos
    )


def scripted_start(monkeypatch: pytest.MonkeyPatch, script: list[int]) -> None:
    """The reply's first tokens are ``script`` (each checked by the constraint's matcher), the
    rest sampled: the trigger forced by the test, not by luck."""
    from llmsession.native.constraints import GuidedSampler

    original = GuidedSampler.sample

    def scripted(self: GuidedSampler, context: Any, index: int = -1) -> int:
        if not script:
            return original(self, context, index)
        token = script.pop(0)
        assert self.matcher.consume_token(token), "the script left the grammar"
        return token

    monkeypatch.setattr(GuidedSampler, "sample", scripted)


def steered(monkeypatch: pytest.MonkeyPatch, model: Model, target: str) -> None:
    """Constrained sampling steered to write ``target``: each sampled token is the allowed one
    whose text is the longest prefix of what is left (tokens the constraint forces advance it
    too); once ``target`` is written, or the constraint allows none of it, sampling goes on as
    usual."""
    import numpy as np

    from llmsession.native.constraints import GuidedSampler

    left, sample, forced = [target], GuidedSampler.sample, GuidedSampler.forced
    pieces = [
        internals.local(model).native.piece(t).decode("utf-8", "replace")
        for t in range(internals.local(model).native.n_vocab)
    ]

    def advance(tokens: list[int]) -> None:
        for token in tokens:
            left[0] = left[0][len(pieces[token]) :] if left[0].startswith(pieces[token]) else ""

    def steered_sample(self: GuidedSampler, context: Any, index: int = -1) -> int:
        if not left[0]:
            return sample(self, context, index)
        logits = np.zeros(self.n_vocab, np.float32)
        self.restrict(logits)
        allowed = [t for t in np.flatnonzero(logits == 0) if pieces[t] and left[0].startswith(pieces[t])]
        if not allowed:  # the constraint will not write the rest: it goes its own way
            left[0] = ""
            return sample(self, context, index)
        token = int(max(allowed, key=lambda t: len(pieces[t])))
        assert self.matcher.consume_token(token)
        self.chain.accept(token)
        advance([token])
        return token

    def steered_forced(self: GuidedSampler) -> list[int]:
        tokens = forced(self)
        advance(tokens)
        return tokens

    monkeypatch.setattr(GuidedSampler, "sample", steered_sample)
    monkeypatch.setattr(GuidedSampler, "forced", steered_forced)
