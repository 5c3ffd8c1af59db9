"""A tokenized prompt: what an exchange decodes, piece by piece, and the item at each position."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmsession.engine.prefix import Item, image_items
from llmsession.native.projector import Chunks, ImageChunk, Piece


@dataclass
class Prompt:
    """A tokenized prompt: text-token runs and image chunks, and the item at each position."""

    pieces: list[Piece]
    chunks: Chunks | None = None  # owns the image chunks' native memory
    items: list[Item] = field(init=False)
    render_s: float = 0.0  # what making it cost: rendering the transcript, then tokenizing it
    tokenize_s: float = 0.0
    raw: bool = False  # a raw completion's (no chat template: no reasoning markup to read)

    def __post_init__(self) -> None:
        self.items = []
        for piece in self.pieces:
            self.items += (
                image_items(piece.digest, piece.n_tokens) if isinstance(piece, ImageChunk) else piece
            )

    @property
    def images(self) -> list[ImageChunk]:
        return [piece for piece in self.pieces if isinstance(piece, ImageChunk)]

    @property
    def n_positions(self) -> int:
        """Context positions the prompt fills (an image may take other than one per token)."""
        return len(self.items) + sum(image.n_pos - image.n_tokens for image in self.images)

    @property
    def unsafe_reuse(self) -> str:
        """Why this prompt's KV state cannot be reused position by position ("" when it can)."""
        if any(image.n_pos != image.n_tokens for image in self.images):
            return "the projector's image positions are not one per token (M-RoPE)"
        if any(image.non_causal for image in self.images):
            return "the projector decodes images with non-causal attention"
        return ""

    def extend(self, tokens: list[int]) -> None:
        """Text tokens after its last piece (a prefill's: ``runtime.continuing``); the pieces it
        had are not changed (a remembered stretch may be one)."""
        last = self.pieces[-1] if self.pieces else None
        if isinstance(last, list):
            self.pieces[-1] = [*last, *tokens]
        else:
            self.pieces.append(list(tokens))
        self.items += tokens

    def tokens(self) -> list[int]:
        """The text tokens, in order (for repetition penalties)."""
        return [item for item in self.items if isinstance(item, int)]

    def close(self) -> None:
        if self.chunks is not None:
            self.chunks.close()
