"""Conversation routing at a scale no test machine has, on paper: a synthetic agent workload
(thousands of conversations, heavy-tailed lengths and think times, arrivals over an hour)
replayed through four routers against 4-64 simulated replicas, one of which is removed halfway.

Routers: ours as built (``llmsession.cluster.keys``: the replica holding the state, else the
key's rendezvous owner, else the least loaded past a busy threshold), ours as issue 42 designs it
(the same, and a state moves with its conversation: a removed replica's spilled to shared
storage, a turn routed elsewhere for load taking its state along, restored there), Ray's
``ConsistentHashRouter`` (a ring on the session id), Ray's ``PrefixCacheAffinityRouter`` (the
longest cached prefix while queues are balanced, else power of two choices) and least load (power
of two choices). Each row is the mean of ``--seeds`` workloads.

A replica is ``SLOTS`` requests at once, each taking its uncached prompt's prefill then its
reply's decode; it keeps conversation states, least recently used first, up to ``CACHE_TOKENS``,
and a system prompt any of its conversations began with. Costs are SmolLM2-135M's on 2 threads of
a 2-core AMD EPYC with AVX-512 (2026-12-03): prefill 215 tokens/s (``llama-bench -p 512``),
decode 79.5 tokens/s (``tg128``); a state is 23 KiB a token (30 layers, K and V, 3 KV heads of 64
f16), restored from shared storage at 1 GB/s (assumed). It prints a table and writes JSON.

    python scripts/simulate_routing.py [--replicas 4,16,64] [--seeds 3] [--busy 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import bisect
import functools
import hashlib
import heapq
import json
import math
import random
import statistics
import sys
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llmsession.cluster.keys import preferred

PREFILL_S = 1 / 215  # per uncached prompt token
DECODE_S = 1 / 79.5  # per reply token
STATE_BYTES = 23 * 1024  # per token of a conversation's KV state
RESTORE_S = STATE_BYTES / 1e9  # per token, from shared storage
SLOTS = 4  # requests a replica decodes at once (its live sessions)
CACHE_TOKENS = 80_000  # tokens of conversation states a replica keeps (live and parked in RAM)
BUSY = 8  # our router's threshold: requests in flight on the owner before it looks elsewhere
IMBALANCE = 10  # Ray's prefix router: queue-length difference it tolerates (its default)
AGENTS, SYSTEM_TOKENS = 20, 4000  # kinds of agent, each with its own system prompt
CONVERSATIONS_PER_REPLICA, HOURS = 400, 1.0


@dataclass
class Conversation:
    key: str
    agent: int
    turns: list[tuple[float, int, int]]  # (think time before it, new tokens, reply tokens)
    tokens: int = SYSTEM_TOKENS  # its transcript so far


@dataclass
class Replica:
    name: str
    busy_until: list[float] = field(default_factory=lambda: [0.0] * SLOTS)
    states: OrderedDict[str, int] = field(default_factory=OrderedDict)  # key -> tokens held
    systems: set[int] = field(default_factory=set)
    in_flight: list[float] = field(default_factory=list)  # finish times of requests in flight

    def load(self, now: float) -> int:
        self.in_flight = [t for t in self.in_flight if t > now]
        return len(self.in_flight)

    def keep(self, key: str, tokens: int) -> None:
        self.states[key] = tokens
        self.states.move_to_end(key)
        while sum(self.states.values()) > CACHE_TOKENS and len(self.states) > 1:
            self.states.popitem(last=False)


def workload(replicas: int, rng: random.Random) -> list[tuple[float, Conversation]]:
    """Conversations and when each begins: Poisson arrivals over ``HOURS``; turns 1 + Pareto
    (alpha 1.5, at most 60); think times lognormal (median 15 s); new tokens lognormal (median
    150: a user line or a tool's output); replies of 30-120 tokens."""
    out = []
    count = CONVERSATIONS_PER_REPLICA * replicas
    for index in range(count):
        start = rng.uniform(0, HOURS * 3600)
        length = min(60, 1 + int(rng.paretovariate(1.5)))
        turns = [
            (
                0.0 if turn == 0 else rng.lognormvariate(math.log(15), 1.0),
                int(rng.lognormvariate(math.log(150), 1.0)) + 1,
                rng.randint(30, 120),
            )
            for turn in range(length)
        ]
        out.append((start, Conversation(f"c{index}", rng.randrange(AGENTS), turns)))
    return out


Router = Callable[[Conversation, list[Replica], float, random.Random], Replica]
Rng = random.Random


def ours(conversation: Conversation, live: list[Replica], now: float, rng: Rng) -> Replica:
    by_name = {r.name: r for r in live}
    holders = [r.name for r in live if conversation.key in r.states]
    order = [by_name[n] for n in preferred(conversation.key, list(by_name), holders)]
    if order[0].load(now) >= BUSY:
        return min(order, key=lambda r: r.load(now))
    return order[0]


def consistent_hash(conversation: Conversation, live: list[Replica], now: float, rng: Rng) -> Replica:
    ring = _ring(tuple(r.name for r in live))
    point = _hash(conversation.key)
    at = bisect.bisect_left(ring, (point, ""))
    owner = ring[at % len(ring)][1]
    return next(r for r in live if r.name == owner)


@functools.cache
def _ring(names: tuple[str, ...]) -> list[tuple[int, str]]:
    return sorted((_hash(f"{name}:{v}"), name) for name in names for v in range(100))


def prefix_affinity(
    conversation: Conversation, live: list[Replica], now: float, rng: random.Random
) -> Replica:
    loads = [r.load(now) for r in live]
    if max(loads) - min(loads) >= IMBALANCE:
        return least_load(conversation, live, now, rng)

    def match(r: Replica) -> int:
        if conversation.key in r.states:
            return r.states[conversation.key]
        return SYSTEM_TOKENS if conversation.agent in r.systems else 0

    best = max(match(r) for r in live)
    if best < 0.1 * conversation.tokens:  # (below 10 %: the replica holding the least)
        return min(live, key=lambda r: sum(r.states.values()))
    return rng.choice([r for r in live if match(r) == best])


def least_load(conversation: Conversation, live: list[Replica], now: float, rng: Rng) -> Replica:
    a, b = rng.sample(live, 2) if len(live) > 1 else (live[0], live[0])
    return a if a.load(now) <= b.load(now) else b


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@dataclass(frozen=True)
class Policy:
    route: Router
    drain_moves: bool = False  # a removed replica's states spill to shared storage, restorable
    load_moves: bool = False  # a turn routed away from the replica holding it takes its state along


ROUTERS = {
    "ours, as built": Policy(ours),
    "ours, states move": Policy(ours, drain_moves=True, load_moves=True),
    "consistent hash": Policy(consistent_hash),
    "prefix affinity": Policy(prefix_affinity),
    "least load": Policy(least_load),
}


def simulate(count: int, policy: Policy, seed: int) -> dict[str, float]:
    """One run: ``count`` replicas, the last removed at half time."""
    rng = random.Random(seed)
    conversations = workload(count, rng)
    live = [Replica(f"replica-{i}") for i in range(count)]
    spilled: dict[str, int] = {}  # shared storage: key -> tokens
    events = [(start, i, 0) for i, (start, _) in enumerate(conversations)]
    heapq.heapify(events)
    removal = HOURS * 3600 / 2
    removed = False
    ttfts, prompt_later, cached_later, moved_bytes, restored = [], 0, 0, 0, 0
    route_rng = random.Random(seed + 1)
    while events:
        now, index, turn = heapq.heappop(events)
        if not removed and now >= removal and count > 1:
            gone = live.pop()
            removed = True
            if policy.drain_moves:  # a draining replica parks its conversations where others read them
                spilled.update(gone.states)
                moved_bytes += sum(gone.states.values()) * STATE_BYTES
        conversation = conversations[index][1]
        _, new, reply = conversation.turns[turn]
        prompt = conversation.tokens + new
        replica = policy.route(conversation, live, now, route_rng)
        held = replica.states.get(conversation.key, 0)
        restore_s = 0.0
        if policy.load_moves and held < conversation.tokens:  # (its newest state is elsewhere)
            holder = max(live, key=lambda r: r.states.get(conversation.key, 0))
            if holder is not replica and holder.states.get(conversation.key, 0) > held:
                held = holder.states.pop(conversation.key)
                spilled[conversation.key] = held  # (parked where the new replica reads it)
                moved_bytes += held * STATE_BYTES
                held = 0
        if not held and conversation.key in spilled:
            held = spilled.pop(conversation.key)
            restore_s = held * RESTORE_S
            restored += 1
        cached = held if held else (SYSTEM_TOKENS if conversation.agent in replica.systems else 0)
        slot = min(range(SLOTS), key=lambda s: replica.busy_until[s])
        begin = max(now, replica.busy_until[slot])
        first = begin + restore_s + (prompt - cached) * PREFILL_S
        done = first + reply * DECODE_S
        replica.busy_until[slot] = done
        replica.in_flight.append(done)
        conversation.tokens = prompt + reply
        replica.keep(conversation.key, conversation.tokens)
        replica.systems.add(conversation.agent)
        ttfts.append(first - now)
        if turn > 0:
            prompt_later += prompt
            cached_later += cached
        if turn + 1 < len(conversation.turns):
            heapq.heappush(events, (done + conversation.turns[turn + 1][0], index, turn + 1))
    ttfts.sort()
    return {
        "replicas": count,
        "requests": len(ttfts),
        "cached_share_later_turns": cached_later / max(prompt_later, 1),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": ttfts[int(0.99 * (len(ttfts) - 1))],
        "moved_gb": moved_bytes / 1e9,
        "restored": restored,
    }


def main() -> int:
    global BUSY
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--replicas", default="4,16,64")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--busy", type=int, default=BUSY, help="our router's busy threshold")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path, help="a PNG of each router's p99 and cached share (matplotlib)")
    args = parser.parse_args()
    BUSY = args.busy
    results = []
    heads = ("cached (turns 2+)", "TTFT p50", "TTFT p99", "moved")
    print(f"{'replicas':>8} {'router':<18} {heads[0]:>17} {heads[1]:>9} {heads[2]:>9} {heads[3]:>8}")
    for count in (int(n) for n in args.replicas.split(",")):
        for name, policy in ROUTERS.items():
            runs = [simulate(count, policy, seed) for seed in range(1, args.seeds + 1)]
            result = {
                "router": name,
                "busy": BUSY,
                **{k: statistics.fmean(r[k] for r in runs) for k in runs[0]},
            }
            results.append(result)
            print(
                f"{count:>8} {name:<18} {result['cached_share_later_turns']:>17.3f} "
                f"{result['ttft_p50_s']:>8.2f}s {result['ttft_p99_s']:>8.2f}s {result['moved_gb']:>6.2f}GB",
                flush=True,
            )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    if args.plot is not None:
        plot(results, args.plot)
    return 0


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Time to first token p99 and cached share of later turns, per router and replica count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({int(r["replicas"]) for r in results})
    routers = list(dict.fromkeys(r["router"] for r in results))
    found = {(r["router"], int(r["replicas"])): r for r in results}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / len(routers)
    for i, router in enumerate(routers):
        xs = [c + (i - (len(routers) - 1) / 2) * width for c in range(len(counts))]
        axes[0].bar(xs, [found[router, n]["ttft_p99_s"] for n in counts], width, label=router)
        axes[1].bar(xs, [found[router, n]["cached_share_later_turns"] for n in counts], width, label=router)
    for ax, label in zip(axes, ("time to first token, p99 (s)", "cached share, turns 2+"), strict=True):
        ax.set_xticks(range(len(counts)), [f"{n} replicas" for n in counts])
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[1].set_ylim(0.5, 1.0)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(routers), fontsize=8, frameon=False)
    fig.suptitle("simulated agent conversations, one replica removed halfway (scripts/simulate_routing.py)")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
