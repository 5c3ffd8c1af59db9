"""Flash attention on or off, chosen from a measurement of this model on this machine (pure: the
measuring is ``runtime.attention``'s).

Which is faster depends on the CPU and on the depth a batch attends over: on an AMD EPYC with
AVX2 only, flash attention cost about a quarter of the prefill at depth ~1,000 (``llama-bench
-fa 0,1 -p 29 -d 993``: 246 vs 182 tokens/s); on an AMD EPYC with AVX-512 it was faster at every
depth measured, 1.4x at 256 tokens (``llmsession bench prefill``). The probe times one batch of
``PROBE_TOKENS`` tokens at depth 0 and one at depth ``PROBE_TOKENS`` with each setting: a batch's
time at depth d is taken as the first plus the difference times d / ``PROBE_TOKENS`` (each
token's attention grows with the positions before it, its other work does not). Flash attention
is chosen where it is cheaper by ``MARGIN`` at the depth a model's sessions reach halfway
through their context.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PROBE_TOKENS = 128  # a probe batch: long enough to time within a few percent, short enough to be cheap
VERSION = 2  # of the probe's method: a measurement by another is measured again
MARGIN = 0.05  # flash attention is chosen only this much cheaper (the older default is off)


@dataclass(frozen=True)
class AttentionProbe:
    """Seconds for a batch of ``tokens`` at depth 0, then at depth ``tokens``, with flash
    attention off and on (each the faster of two runs, taken in turn)."""

    off: tuple[float, float]
    on: tuple[float, float]
    tokens: int = PROBE_TOKENS

    def batch_s(self, flash: bool, depth: int) -> float:
        """A batch's estimated time at ``depth`` (linear in the depth)."""
        shallow, deep = self.on if flash else self.off
        return shallow + max(0.0, deep - shallow) * depth / self.tokens

    def choose(self, context: int) -> bool:
        """Flash attention for sessions of ``context`` positions: on where it is cheaper by
        ``MARGIN`` at half of it."""
        depth = context // 2
        return self.batch_s(True, depth) < (1.0 - MARGIN) * self.batch_s(False, depth)

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
        tokens, off, on = data.get("tokens"), _pair(data.get("off")), _pair(data.get("on"))
        if type(tokens) is not int or not 0 < tokens <= 1 << 20 or off is None or on is None:
            return None
        return cls(off, on, tokens)


def _pair(value: Any) -> tuple[float, float] | None:
    """Two finite positive seconds (a JSON list of numbers), else None."""
    if not isinstance(value, list) or len(value) != 2:
        return None
    if not all(type(x) in (int, float) and 0 < x < 1e6 for x in value):  # (NaN fails the comparison)
        return None
    return float(value[0]), float(value[1])


def probe_key(**facts: Any) -> str:
    """What a measurement stands for (the model file, the build, the CPU, the threads), as a
    short key."""
    text = json.dumps(facts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]
