"""A whole answer rendered in slices (pure): the same bytes as Starlette's ``JSONResponse``,
whatever the value, no long list encoded in one call (one call holds the GIL: the event loop
stood still for 0.4 s of a 4,096-token reply's scores), and a reply's scores as JSON text read
back exactly as the dicts a stream sends."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.responses import JSONResponse

from llmsession.replies import Alternative, TokenLogprob
from llmsession.serve import rendering, sse
from llmsession.serve.rendering import SLICE, Fragment, rendered

TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=6) | st.sampled_from(
    ["\u2028", "\x00", '"', "\\", "é", "😀", "</script>"]
)
LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | TEXT
)
VALUES = st.recursive(
    LEAVES,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.lists(inner, min_size=SLICE - 2, max_size=3 * SLICE + 1)
        | st.dictionaries(TEXT, inner, max_size=4)
    ),
    max_leaves=400,
)


@settings(max_examples=60, deadline=None)
@given(VALUES)
def test_the_bytes_are_those_jsonresponse_renders(value: Any) -> None:
    assert rendered(value) == JSONResponse(value).body


def test_a_long_list_is_encoded_a_slice_at_a_call(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes: list[int] = []
    dumps = rendering._dumps  # (the one call that encodes)

    def counted(value: Any) -> str:
        sizes.append(len(value) if isinstance(value, list) else 1)
        return dumps(value)

    monkeypatch.setattr(rendering, "_dumps", counted)
    body = {"choices": [{"index": 0, "logprobs": {"content": [{"token": "a"}] * (10 * SLICE + 3)}}]}
    assert json.loads(rendered(body)) == body
    assert max(sizes) == SLICE and sum(sizes) > 10 * SLICE


def test_a_fragment_is_placed_as_it_is_and_plain_json_refuses_it() -> None:
    assert rendered({"a": Fragment('[1,{"b":2}]'), "c": [Fragment("3")]}) == b'{"a":[1,{"b":2}],"c":[3]}'
    with pytest.raises(TypeError):
        json.dumps({"a": Fragment("1")})


ALTERNATIVES = st.builds(
    Alternative, TEXT, st.binary(max_size=4), st.floats(-1e6, 0.0) | st.just(-0.0) | st.just(-1e-320)
)
ENTRIES = st.lists(
    st.builds(
        TokenLogprob, TEXT, st.binary(max_size=4), st.floats(-1e6, 0.0), st.tuples(*[ALTERNATIVES] * 3)
    ),
    max_size=5,
)


@settings(max_examples=200, deadline=None)
@given(ENTRIES, st.integers(0, 50))
def test_a_whole_bodys_scores_read_back_as_the_streams_dicts(
    entries: list[TokenLogprob], offset: int
) -> None:
    assert json.loads(rendered(sse.whole_chat_logprobs(entries))) == sse.chat_logprobs(entries)
    assert json.loads(rendered(sse.whole_text_logprobs(entries, offset))) == sse.text_logprobs(
        entries, offset
    )


def test_a_score_that_is_not_finite_is_refused_as_json_refuses_it() -> None:
    broken = [TokenLogprob("a", b"a", math.nan)]
    with pytest.raises(ValueError):
        sse.whole_chat_logprobs(broken)
    with pytest.raises(ValueError):
        rendered(sse.whole_text_logprobs(broken))
