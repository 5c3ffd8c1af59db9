"""Flash attention on or off, chosen from a measurement of this model on this machine (pure: the
measuring is ``runtime.attention``'s).

Which is faster depends on the CPU and on the depth a batch attends over: on an AMD EPYC with
AVX2 only, flash attention cost about a quarter of the prefill at depth ~1,000 (``llama-bench
-fa 0,1 -p 29 -d 993``: 246 vs 182 tokens/s); on an AMD EPYC with AVX-512 it was faster at every
depth measured, 1.4x at 256 tokens (``llmsession bench prefill``). The probe times one batch of
``PROBE_TOKENS`` tokens at depth 0 and one at depth ``PROBE_TOKENS`` with each setting: a batch's
time at depth d is taken as the first plus the difference times d / ``PROBE_TOKENS`` (each
token's attention grows with the positions before it, its other work does not). The setting
chosen is the cheaper one at the depth a model's sessions reach halfway through their context.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PROBE_TOKENS = 128  # a probe batch: long enough to time within a few percent, short enough to be cheap
VERSION = 1  # of the probe's method: a measurement by another is measured again


@dataclass(frozen=True)
class AttentionProbe:
    """Seconds for a batch of ``PROBE_TOKENS`` at depth 0, then at depth ``PROBE_TOKENS``, with
    flash attention off and on."""

    off: tuple[float, float]
    on: tuple[float, float]

    def batch_s(self, flash: bool, depth: int) -> float:
        """A batch's estimated time at ``depth`` (linear in the depth)."""
        shallow, deep = self.on if flash else self.off
        return shallow + max(0.0, deep - shallow) * depth / PROBE_TOKENS

    def choose(self, context: int) -> bool:
        """Flash attention for sessions of ``context`` positions: the cheaper at half of it."""
        depth = context // 2
        return self.batch_s(True, depth) < self.batch_s(False, depth)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"version": VERSION}

    @classmethod
    def from_json(cls, data: Any) -> AttentionProbe | None:
        """A probe read back, or None where it is not one of this version's."""
        if not isinstance(data, Mapping) or data.get("version") != VERSION:
            return None
        try:
            off, on = (tuple(float(x) for x in data[k]) for k in ("off", "on"))
        except (KeyError, TypeError, ValueError):
            return None
        if len(off) != 2 or len(on) != 2 or min(*off, *on) <= 0:
            return None
        return cls((off[0], off[1]), (on[0], on[1]))


def probe_key(**facts: Any) -> str:
    """What a measurement stands for (the model file, the build, the CPU, the threads), as a
    short key."""
    text = json.dumps(facts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]
