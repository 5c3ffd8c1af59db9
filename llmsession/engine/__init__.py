"""The engine: a model's shared contexts and where every session's KV state lives (``engine``),
a session's sequence for one exchange (``seat``, ``lease``), concurrent streams batched
(``batching``), prefills (``prefill``, ``prompt``), anticipatory prefills (``anticipate``), and
the pure planners it applies: prefix reuse (``prefix``), the live/parked/cold ledger
(``residency``, ``budget``), parked states (``parking``), checkpoints, saved-session files."""
