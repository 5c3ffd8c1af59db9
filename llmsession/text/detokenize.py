"""Turn streamed token pieces (raw bytes) into text as soon as they form whole characters.

A token piece may end in the middle of a multi-byte UTF-8 character, so decoding each
piece on its own would print U+FFFD for characters that are merely split. The stdlib's
incremental UTF-8 decoder holds back an incomplete but still valid prefix and replaces
truly invalid bytes exactly as decoding the whole stream with ``errors="replace"`` would,
whatever the split (the tests check this property). Its one needless hold-back, an
encoded-surrogate prefix, is released at once. A NUL byte (a token of the byte 0, which a
sampled reply or a caller's pattern may choose) is shown as U+FFFD, as an invalid byte is: no
message may carry a NUL (the next turn's prompt would be refused, and the conversation with it).
"""

from __future__ import annotations

import codecs


class IncrementalDetokenizer:
    """Decodes a stream of byte pieces; the concatenated output is always a prefix of the
    whole-stream decode (a NUL as U+FFFD), and output plus :meth:`flush` equals it."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = b""  # the bytes of a character not yet complete, which the next piece may finish
        self.before = b""  # what was held when the last piece came (``completes`` reads it)

    def push(self, piece: bytes) -> str:
        """Add one piece; return the text it completes (possibly "")."""
        self.before = self._held
        text = self._decoder.decode(piece)
        held, _ = self._decoder.getstate()
        if len(held) == 2 and held[0] == 0xED and held[1] >= 0xA0:
            # CPython keeps an encoded-surrogate prefix in case of "surrogatepass"; under
            # "replace" it is already two U+FFFD, so release it now rather than a piece later.
            text += self._decoder.decode(b"", final=True)
            held = b""
        self._held = bytes(held)
        return shown(text)

    def flush(self) -> str:
        """End of generation: release held bytes, an incomplete tail becoming U+FFFD."""
        return self._decoder.decode(b"", final=True)  # (held bytes: never a NUL)


def shown(text: str) -> str:
    """Decoded text as a reply shows it: a NUL as U+FFFD (as ``errors="replace"`` shows an
    invalid byte), so that no message holds one; ``NativeModel.detokenize`` spells so too."""
    return text.replace("\x00", "\ufffd")


def completes(held: bytes, piece: bytes) -> str:
    """The text ``piece`` would complete after ``held`` (a detokenizer's ``before`` its last
    piece): what a token not chosen would have shown in the chosen one's place."""
    detokenizer = IncrementalDetokenizer()
    detokenizer.push(held)
    return detokenizer.push(piece)
