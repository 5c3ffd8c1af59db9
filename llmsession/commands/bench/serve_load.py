"""The one HTTP client of ``llmsession bench serve``: every server is driven by this code, so the
differences measured are the servers'.

``conversations`` chats share one long system prompt; ``clients`` threads each own every
``clients``-th chat and take turns over them (turn 1 of each, then turn 2 of each, ...), as users
of one app do, so a chat's next turn comes after the other chats' turns. Each turn resends the
whole history and a new question, streamed, greedy, the reply capped; the reply is appended as
the server returned it. Per request: the time to the first content chunk from the send, the
prompt and cached tokens the server reports (``usage.prompt_tokens_details.cached_tokens`` asked
with ``stream_options.include_usage``, else llama-server's ``timings.cache_n``; None if neither).
Each request opens a connection of its own (loopback: well under a millisecond): llama-server
closes a connection after a streamed reply though it announces keep-alive, and a client that
reuses it fails ("Server disconnected without sending a response").
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx

# About 570 tokens in SmolLM2's vocabulary: a long system prompt every chat starts with.
SYSTEM = " ".join(
    (
        "You are Atlas, the travel assistant of a small agency that plans city trips for families,",
        "students and retired travellers. Follow these house rules in every answer.",
        "1. Be brief: two or three sentences unless the traveller asks for more detail.",
        "2. Be concrete: name the place, the street or the district, and say when it opens if you",
        "know it. Never invent prices, phone numbers or opening hours you are not sure of.",
        "3. Be safe: mention the usual precautions for pickpockets on crowded lines, for heat in",
        "summer and for ice in winter, but do not frighten anyone.",
        "4. Be fair: do not favour one company, hotel chain or restaurant over another; when you",
        "name a place, say why it suits this traveller.",
        "5. Respect budgets: a student on a budget wants free museums, cheap bakeries and walking",
        "routes; a family wants short distances, parks and toilets; a retired couple wants benches,",
        "quiet cafes and step-free access. Ask about the budget if you do not know it.",
        "6. Transport: prefer trains, trams and buses over taxis; explain how to buy a ticket and",
        "whether a day pass pays off. Say how long a walk takes rather than how far it is.",
        "7. Food: suggest one local dish and where ordinary people eat it; mention vegetarian",
        "options; warn about common allergens such as nuts, shellfish and gluten.",
        "8. Culture: explain local customs briefly, such as tipping, greetings, dress codes in",
        "churches, mosques and temples, and quiet hours in residential streets.",
        "9. Weather: say what the season is usually like and what to pack, without promising",
        "anything about a given day.",
        "10. Language: teach one useful phrase in the local language when it helps, with a simple",
        "pronunciation, and say whether English is widely spoken.",
        "11. Accessibility: mention lifts, ramps and step-free stations when the traveller needs",
        "them, and say honestly when a place is hard to reach with a wheelchair or a pram.",
        "12. Honesty: if you do not know, say so and suggest where the traveller can find out,",
        "such as the tourist office, the station desk or the museum's own website.",
        "13. Tone: friendly, calm and plain; no exclamation marks, no emojis, no lists longer than",
        "three items, and never more than one question back to the traveller per answer.",
        "14. Privacy: never ask for passport numbers, card numbers or home addresses, and remind",
        "travellers not to share them in chat.",
        "15. Continuity: remember what the traveller told you earlier in this conversation, such",
        "as the city, the dates, the budget and who is travelling, and build on it.",
    )
)
CITIES = ("Lisbon", "Kyoto", "Nairobi", "Oslo", "Lima", "Hanoi", "Porto", "Quebec", "Seville", "Tbilisi",
          "Cusco", "Riga", "Dakar", "Bergen", "Krakow", "Hobart")  # fmt: skip
QUESTIONS = (
    "I am going to {city} next month with my family. What should we see first?",
    "What is a local dish we should try there?",
    "How do we get around the city?",
    "Any tip for a quiet evening?",
    "What should we pack?",
    "Is there a good day trip nearby?",
)
WARM_UP = [{"role": "user", "content": "Hello"}]


def http_client() -> httpx.Client:
    """A client that keeps no connection open between requests (see above)."""
    return httpx.Client(timeout=600, limits=httpx.Limits(max_keepalive_connections=0))


@dataclass
class Request:
    """One measured turn."""

    conversation: int
    turn: int  # from 1
    client: int
    sent_s: float  # since the run began
    ttft_s: float  # send to the first content chunk (to the end when the reply had no content)
    total_s: float
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    reply: str
    replica: str | None = None  # (a cluster's ``x-llmsession-replica``)


def question(conversation: int, turn: int) -> str:
    """Turn ``turn`` (from 0) of chat ``conversation``: its city named in the first question."""
    city = CITIES[conversation % len(CITIES)]
    if conversation >= len(CITIES):  # (no two chats alike: one could reuse the other's cache)
        city += f" (trip {conversation // len(CITIES) + 1})"
    return QUESTIONS[turn % len(QUESTIONS)].format(city=city)


def cached_of(chunk: dict[str, Any]) -> int | None:
    """The cached prompt tokens a chunk reports: OpenAI's field, else llama-server's timings."""
    details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
    if isinstance(details.get("cached_tokens"), int):
        return int(details["cached_tokens"])
    cache_n = (chunk.get("timings") or {}).get("cache_n")
    return int(cache_n) if isinstance(cache_n, int) else None


def chat(client: httpx.Client, url: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """One streamed chat completion: its text, timings and the token counts reported."""
    body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    text, first, usage, cached = "", 0.0, dict[str, Any](), None
    began = time.perf_counter()
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.read().decode()[:300]}")
        replica = response.headers.get("x-llmsession-replica")
        for line in response.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            delta = (chunk.get("choices") or [{}])[0].get("delta", {}).get("content") or ""
            if delta and not first:
                first = time.perf_counter()
            text += delta
            usage = chunk.get("usage") or usage
            reported = cached_of(chunk)
            cached = cached if reported is None else reported
    ended = time.perf_counter()
    return {"text": text, "ttft_s": (first or ended) - began, "total_s": ended - began} | {
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "cached_tokens": cached,
        "replica": replica,
    }


def warm_up(url: str, max_tokens: int = 4) -> None:
    """Page the weights in and start the threads: a request of its own, without the system
    prompt (so that the chats' first turns find no part of it decoded)."""
    with http_client() as client:
        chat(client, url, WARM_UP, max_tokens)


def drive(url: str, conversations: int, turns: int, clients: int, max_tokens: int) -> dict[str, Any]:
    """Every chat's turns through ``clients`` threads started together: each request, the wall
    time from the start to the last reply."""
    done: list[Request] = []
    errors: list[BaseException] = []
    lock, start = threading.Lock(), threading.Barrier(clients + 1)
    began = 0.0

    def client(index: int) -> None:
        mine = list(range(index, conversations, clients))
        histories = {c: [{"role": "system", "content": SYSTEM}] for c in mine}
        with http_client() as http:
            start.wait()
            try:
                for turn in range(turns):
                    for c in mine:
                        histories[c].append({"role": "user", "content": question(c, turn)})
                        sent = time.perf_counter() - began
                        try:
                            got = chat(http, url, histories[c], max_tokens)
                        except Exception as error:
                            raise RuntimeError(
                                f"chat {c}, turn {turn + 1}, at {sent:.1f} s: {error!r}"
                            ) from error
                        histories[c].append({"role": "assistant", "content": got["text"]})
                        measured = Request(c, turn + 1, index, sent, got["ttft_s"], got["total_s"],
                                           got["prompt_tokens"], got["cached_tokens"],
                                           got["completion_tokens"], got["text"], got["replica"])  # fmt: skip
                        with lock:
                            done.append(measured)
            except BaseException as error:  # reported by the caller, with the others' results
                errors.append(error)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    began = time.perf_counter()
    start.wait()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began
    if errors:
        raise errors[0]
    done.sort(key=lambda r: (r.turn, r.conversation))
    return {"wall_s": wall, "requests": [asdict(r) for r in done], "turns": per_turn(done, turns)}


def per_turn(requests: list[Request], turns: int) -> list[dict[str, Any]]:
    """Each turn's mean and median TTFT, mean prompt tokens and the share of its prompt tokens
    served from cache (None when the server reports no counts)."""
    rows = []
    for turn in range(1, turns + 1):
        these = [r for r in requests if r.turn == turn]
        ttft = [r.ttft_s for r in these]
        counted = all(r.prompt_tokens is not None and r.cached_tokens is not None for r in these)
        prompt = sum(r.prompt_tokens or 0 for r in these)
        cached = sum(r.cached_tokens or 0 for r in these)
        rows.append({
            "turn": turn, "requests": len(these), "ttft_mean_s": statistics.fmean(ttft),
            "ttft_median_s": statistics.median(ttft), "ttft_max_s": max(ttft),
            "prompt_tokens_mean": prompt / len(these) if counted else None,
            "cached_share": cached / prompt if counted and prompt else None,
        })  # fmt: skip
    return rows


def later_turns(result: dict[str, Any]) -> dict[str, float | None]:
    """Turns 2 and after, all requests together: mean TTFT and cached share."""
    later = [r for r in result["requests"] if r["turn"] >= 2]
    counted = all(r["prompt_tokens"] is not None and r["cached_tokens"] is not None for r in later)
    prompt = sum(r["prompt_tokens"] or 0 for r in later)
    share = sum(r["cached_tokens"] or 0 for r in later) / prompt if counted and prompt else None
    return {"ttft_mean_s": statistics.fmean(r["ttft_s"] for r in later), "cached_share": share}
