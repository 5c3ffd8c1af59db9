"""The pure half of ``logprobs``: a reply's scored tokens line up with its text."""

from __future__ import annotations

from llmsession.replies import TokenLogprob
from llmsession.text.detokenize import IncrementalDetokenizer
from llmsession.text.logprobs import LogprobTrail


def trail_of(pieces: list[bytes]) -> tuple[LogprobTrail, str]:
    detokenizer, trail, text = IncrementalDetokenizer(), LogprobTrail(), ""
    for piece in pieces:
        said = detokenizer.push(piece)
        trail.push(TokenLogprob(said, piece, -1.0))
        text += said
    return trail, text


def test_split_characters_join_up_exactly() -> None:
    pieces = ["é".encode()[:1], "é".encode()[1:] + b"t", "é".encode(), b" \xf0\x9f", b"\x98\x80!"]
    trail, text = trail_of(pieces)
    assert text == "été 😀!"
    entries = trail.reply(text)
    assert "".join(e.token for e in entries) == text
    assert [e.token for e in entries] == ["", "ét", "é", " ", "😀!"]
    assert b"".join(e.bytes for e in entries) == text.encode()


def test_release_waits_for_the_text_shown() -> None:
    trail, _ = trail_of([b"Hel", b"lo", b" wor", b"ld"])
    assert [e.token for e in trail.release(4)] == ["Hel"]
    assert trail.release(4) == ()
    assert [e.token for e in trail.release(11)] == ["lo", " wor", "ld"]


def test_a_reply_cut_by_a_stop_string_keeps_the_tokens_of_its_text_the_last_trimmed() -> None:
    trail, generated = trail_of([b"Yes", b". Then", b" more"])
    entries = trail.reply("Yes.")  # the stop string ". Then" (the text before it kept: "Yes" + ".")
    assert [e.token for e in entries] == ["Yes", "."]
    assert entries[1].bytes == b". Then"  # (its bytes are the token's)
    assert [e.token for e in trail.reply(generated)] == ["Yes", ". Then", " more"]
    assert trail.reply("No") == ()  # (a text that is not the generated one: nothing lines up)


def test_tokens_past_the_text_are_left_out() -> None:
    trail, _ = trail_of([b"Caf", "é".encode()[:1], "é".encode()[1:]])  # a stop string "é" matched
    assert [e.token for e in trail.reply("Caf")] == ["Caf"]
    trail, _ = trail_of([b"Hi", b" \xf0\x9f"])  # cut by max_tokens inside a character
    assert [e.token for e in trail.reply("Hi ")] == ["Hi", " "]
    assert trail.reply("") == ()
