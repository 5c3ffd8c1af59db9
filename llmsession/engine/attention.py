"""Flash attention on or off, chosen from a measurement of this model on this machine (pure: the
measuring is ``runtime.attention``'s).

Which is faster depends on the CPU, the depth a batch attends over and the batch's size. On an
AMD EPYC with AVX-512 (``llama-bench -fa 0,1 -t 2``, SmolLM2): flash attention is about even at
depth 0 and faster for 512-token batches at depth 4,096 (223 against 177 tokens/s), but a
32-token batch at depth 5,600 runs at 69 against 155 tokens/s and a generated token at 33
against 57 a second; on an AMD EPYC with AVX2 only it cost about a quarter of a short prefill at
depth ~1,000 (``-p 29 -d 993``: 246 vs 182 tokens/s). What a session does on most turns is the
short kind: a few tens of new tokens, then a reply's steps, deep in its context. So the probe
times, with each setting, a ``BATCH``-token batch and a generated token at depth 0 and at depth
``PROBE_DEPTH``; each grows linearly with the depth (each token's attention grows with the
positions before it, its other work does not). Flash attention is chosen where a turn (one such
batch and ``STEPS`` generated tokens) is cheaper by ``MARGIN`` at the depth a model's sessions
reach halfway through their context. A long first prompt is the exception it does not weigh: on
the AVX-512 EPYC flash attention reads it up to a quarter faster.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

BATCH = 32  # a turn's new tokens, as the probe times them
STEPS = 32  # the tokens a turn's reply generates, as the choice weighs them
PROBE_DEPTH = 512  # the deeper point: deep enough that the attention term stands out of the noise
VERSION = 3  # of the probe's method: a measurement by another is measured again
MARGIN = 0.05  # flash attention is chosen only this much cheaper (the older default is off)

Timings = tuple[float, float, float, float]  # batch at 0, batch at depth, step at 0, step at depth


@dataclass(frozen=True)
class AttentionProbe:
    """Seconds, with flash attention off and on, for a ``BATCH``-token batch at depth 0 and at
    ``depth``, then one generated token at each (each the fastest of a few runs)."""

    off: Timings
    on: Timings
    depth: int = PROBE_DEPTH

    def turn_s(self, flash: bool, depth: int) -> float:
        """A turn's estimated time at ``depth``: a batch and ``STEPS`` steps, each linear in it."""
        batch, batch_deep, step, step_deep = self.on if flash else self.off
        grows = depth / self.depth
        batch_s = batch + max(0.0, batch_deep - batch) * grows
        return batch_s + STEPS * (step + max(0.0, step_deep - step) * grows)

    def choose(self, context: int) -> bool:
        """Flash attention for sessions of ``context`` positions: on where a turn is cheaper by
        ``MARGIN`` at half of it."""
        depth = context // 2
        return self.turn_s(True, depth) < (1.0 - MARGIN) * self.turn_s(False, depth)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"version": VERSION}

    @classmethod
    def from_json(cls, data: Any) -> AttentionProbe | None:
        """A probe read back, or None where it is not one of this version's (whatever it holds)."""
        if (
            not isinstance(data, Mapping)
            or type(data.get("version")) is not int
            or data["version"] != VERSION
        ):
            return None
        depth, off, on = data.get("depth"), _timings(data.get("off")), _timings(data.get("on"))
        if type(depth) is not int or not 0 < depth <= 1 << 20 or off is None or on is None:
            return None
        return cls(off, on, depth)


def _timings(value: Any) -> Timings | None:
    """Four finite positive seconds (a JSON list of numbers), else None."""
    if not isinstance(value, list) or len(value) != 4:
        return None
    if not all(type(x) in (int, float) and 0 < x < 1e6 for x in value):  # (NaN fails the comparison)
        return None
    return float(value[0]), float(value[1]), float(value[2]), float(value[3])


def probe_key(**facts: Any) -> str:
    """What a measurement stands for (the model file, the build, the CPU, the threads), as a
    short key."""
    text = json.dumps(facts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]
