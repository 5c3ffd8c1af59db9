"""IncrementalDetokenizer: any split of any bytes decodes like the whole stream at once (a NUL
byte shown as U+FFFD, as an invalid one is: ``whole``)."""

from __future__ import annotations

from itertools import pairwise

from hypothesis import given
from hypothesis import strategies as st

from llmsession.text.detokenize import IncrementalDetokenizer, completes

# Byte runs that exercise every branch of a UTF-8 decoder: valid 1-4 byte characters,
# stray continuation bytes, overlong forms, encoded surrogates, code points above
# U+10FFFF, bytes that never appear in UTF-8, and truncated sequences.
TRICKY = [
    b"a",
    b"\x00",
    "é".encode(),
    "€".encode(),
    "😀".encode(),
    b"\x80",
    b"\xbf",
    b"\xc0\xaf",
    b"\xc1\xbf",
    b"\xe0\x80\xaf",
    b"\xf0\x80\x80\xaf",
    b"\xed\xa0\x80",
    b"\xed\xbf\xbf",
    b"\xf4\x90\x80\x80",
    b"\xf5\x80\x80\x80",
    b"\xfe",
    b"\xff",
    b"\xc3",
    b"\xe2\x82",
    b"\xf0\x9f",
    b"\xf0\x9f\x98",
]

tricky_bytes = st.one_of(
    st.binary(max_size=24),
    st.lists(st.sampled_from(TRICKY) | st.binary(max_size=3), max_size=12).map(b"".join),
)


@st.composite
def split(draw: st.DrawFn, data: bytes) -> list[bytes]:
    """Cut data into pieces at arbitrary points, empty pieces included."""
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=len(data) + 2)))
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in pairwise(bounds)]


class Recording(IncrementalDetokenizer):
    """The detokenizer, keeping all it emitted (``text``)."""

    def __init__(self) -> None:
        super().__init__()
        self.text = ""

    def push(self, piece: bytes) -> str:
        out = super().push(piece)
        self.text += out
        return out

    def flush(self) -> str:
        out = super().flush()
        self.text += out
        return out


def whole(raw: bytes) -> str:
    """The whole stream's text: decoded with ``errors="replace"``, a NUL replaced too."""
    return raw.decode("utf-8", errors="replace").replace("\x00", "\ufffd")


def run(pieces: list[bytes]) -> tuple[list[str], str, Recording]:
    detok = Recording()
    return [detok.push(p) for p in pieces], detok.flush(), detok


@given(st.data(), tricky_bytes)
def test_any_split_matches_whole_stream_decode(data: st.DataObject, raw: bytes) -> None:
    expected = whole(raw)
    pushed, flushed, detok = run(data.draw(split(raw)))
    emitted = ""
    for out in pushed:
        emitted += out
        # Never ahead of or different from the whole decode: no premature U+FFFD.
        assert expected.startswith(emitted)
    assert emitted + flushed == expected
    assert detok.text == expected


@given(st.data(), st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\ufffd\x00")))
def test_valid_text_never_shows_replacement(data: st.DataObject, text: str) -> None:
    pushed, flushed, _ = run(data.draw(split(text.encode())))
    assert not any("\ufffd" in out for out in pushed)
    assert "".join(pushed) == text
    assert flushed == ""


@given(st.data(), tricky_bytes)
def test_emits_as_soon_as_characters_are_complete(data: st.DataObject, raw: bytes) -> None:
    """After each push, only an incomplete (at most 3 byte) tail may be held back."""
    detok = Recording()
    seen = b""
    for piece in data.draw(split(raw)):
        seen += piece
        detok.push(piece)
        so_far = whole(seen)
        held = len(so_far) - len(detok.text)
        assert 0 <= held <= 1
        if held:
            # The held tail decodes to a single U+FFFD only because it is truncated.
            assert so_far.endswith("\ufffd")


def test_two_byte_char_split_in_two() -> None:
    detok = Recording()
    assert detok.push(b"caf\xc3") == "caf"
    assert detok.push(b"\xa9") == "é"
    assert detok.flush() == ""
    assert detok.text == "café"


def test_emoji_split_into_single_bytes() -> None:
    detok = Recording()
    pieces = [bytes([b]) for b in "😀".encode()]
    assert [detok.push(p) for p in pieces] == ["", "", "", "😀"]
    assert detok.flush() == ""


def test_invalid_bytes_are_replaced_immediately() -> None:
    detok = Recording()
    assert detok.push(b"a\xffb") == "a\ufffdb"
    assert detok.push(b"\xed\xa0\x80") == "\ufffd\ufffd\ufffd"


def test_a_nul_byte_is_replaced_as_an_invalid_one_is() -> None:
    """A token of the byte 0 (SmolLM2's 190, Gemma 3's 238) would put a NUL in the reply, which
    the next turn's prompt refuses: the conversation could not go on."""
    detok = Recording()
    assert detok.push(b"a\x00") == "a\ufffd"
    assert detok.push(b"\x00b") == "\ufffdb"
    assert completes(b"", b"\x00") == "\ufffd"


def test_truncated_tail_becomes_replacement_on_flush() -> None:
    detok = Recording()
    assert detok.push(b"ok\xf0\x9f\x98") == "ok"
    assert detok.flush() == "\ufffd"
    assert detok.text == "ok\ufffd"


def test_broken_sequence_then_ascii() -> None:
    detok = Recording()
    assert detok.push(b"\xe2\x82") == ""
    assert detok.push(b"x") == "\ufffdx"


@given(st.data(), tricky_bytes, st.binary(max_size=6))
def test_a_piece_not_chosen_completes_what_it_would_have_in_the_chosen_ones_place(
    data: st.DataObject, raw: bytes, other: bytes
) -> None:
    """``completes(before, piece)`` (how a scored alternative is spelled, from the bytes held
    when the chosen piece came) is what that piece returned, and what another piece would have
    returned in its place after the whole stream before it."""
    detok, seen = Recording(), []
    for piece in data.draw(split(raw)):
        text = detok.push(piece)
        assert completes(detok.before, piece) == text
        instead = IncrementalDetokenizer()
        for earlier in seen:
            instead.push(earlier)
        assert completes(detok.before, other) == instead.push(other)
        seen.append(piece)


def test_an_alternative_inside_a_character_is_spelled_as_the_chosen_token_is() -> None:
    detok = Recording()
    assert detok.push(b"\xf0\x9f") == "" and detok.before == b""
    assert detok.push(b"\x98\x80") == "\U0001f600" and detok.before == b"\xf0\x9f"
    assert completes(detok.before, b"\x98\x81") == "\U0001f601"
    assert completes(detok.before, b"\x98") == ""  # (still inside it, as the chosen "")
    assert completes(b"", b"\xf0\x9f") == ""  # (not "\ufffd": the first bytes of a character)
    assert completes(detok.before, b"<|im_end|>") == "\ufffd<|im_end|>"
