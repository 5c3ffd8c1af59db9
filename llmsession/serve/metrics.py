"""The server's counters in Prometheus's text format (``GET /metrics``). Pure and thread-safe:
replies are counted from the threads that decode them, requests from the event loop."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable

from llmsession.replies import Reply, Usage

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
SESSION_STATES = ("live", "parked", "disk", "cold")


class Metrics:
    """Requests by path and status, tokens in and out, cached prompt tokens, replies by finish
    reason, and the time to first token as a histogram."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()
        self.finishes: Counter[str] = Counter()
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0
        self.drafted_tokens = self.accepted_drafts = 0
        self.in_flight = 0
        self._ttft = [0] * len(TTFT_BUCKETS)
        self._ttft_count, self._ttft_sum = 0, 0.0

    def request(self, path: str, status: int) -> None:
        with self._lock:
            self.requests[(path, status)] += 1

    def flight(self, change: int) -> None:
        with self._lock:
            self.in_flight += change

    def reply(self, reply: Reply, *, forked: bool = False, prompt: Usage | None = None) -> None:
        """An exchange that ended (cancelled ones too: their tokens were decoded); ``forked``,
        one choice of several that share a prefill, whose own usage counts the whole prompt as
        reused: the prompt is ``prompt`` (the prefill's, given with one of them only)."""
        usage, ttft = reply.usage, reply.timings.time_to_first_token_s
        asked = prompt if forked else usage
        with self._lock:
            self.finishes[reply.finish_reason] += 1
            self.prompt_tokens += 0 if asked is None else asked.prompt_tokens
            self.completion_tokens += usage.completion_tokens
            self.cached_tokens += 0 if asked is None else asked.reused_tokens
            self.drafted_tokens += usage.drafted_tokens
            self.accepted_drafts += usage.accepted_drafts
            if usage.completion_tokens:  # (a reply cancelled before its first token has none)
                self._ttft_count += 1
                self._ttft_sum += ttft
                for i, bound in enumerate(TTFT_BUCKETS):
                    self._ttft[i] += ttft <= bound

    def render(self, sessions: Iterable[str] = ()) -> str:
        """The exposition text; ``sessions`` the state of each of the model's sessions."""
        states = Counter(sessions)
        with self._lock:
            lines = [
                *_family("requests_total", "counter", "HTTP requests answered, by path and status"),
                *(
                    f'llmsession_requests_total{{path="{path}",status="{status}"}} {n}'
                    for (path, status), n in sorted(self.requests.items())
                ),
                *_family("requests_in_flight", "gauge", "Chat completion requests being answered"),
                f"llmsession_requests_in_flight {self.in_flight}",
                *_family("replies_total", "counter", "Exchanges ended, by the library's finish reason"),
                *(
                    f'llmsession_replies_total{{finish_reason="{k}"}} {n}'
                    for k, n in sorted(self.finishes.items())
                ),
                *_family("prompt_tokens_total", "counter", "Prompt tokens of the exchanges"),
                f"llmsession_prompt_tokens_total {self.prompt_tokens}",
                *_family("cached_prompt_tokens_total", "counter", "Prompt tokens reused from the cache"),
                f"llmsession_cached_prompt_tokens_total {self.cached_tokens}",
                *_family("completion_tokens_total", "counter", "Tokens generated"),
                f"llmsession_completion_tokens_total {self.completion_tokens}",
                *_family("drafted_tokens_total", "counter", "Tokens drafted from the transcript (--draft)"),
                f"llmsession_drafted_tokens_total {self.drafted_tokens}",
                *_family("accepted_drafts_total", "counter", "Drafted tokens the samples confirmed"),
                f"llmsession_accepted_drafts_total {self.accepted_drafts}",
                *self._histogram(),
            ]
        lines += _family("sessions", "gauge", "The model's sessions, by where their state is")
        lines += [f'llmsession_sessions{{state="{s}"}} {states.get(s, 0)}' for s in SESSION_STATES]
        return "\n".join(lines) + "\n"

    def _histogram(self) -> list[str]:
        name = "llmsession_time_to_first_token_seconds"
        lines = _family("time_to_first_token_seconds", "histogram", "Time to the first token")
        lines += [f'{name}_bucket{{le="{b}"}} {n}' for b, n in zip(TTFT_BUCKETS, self._ttft, strict=True)]
        lines += [f'{name}_bucket{{le="+Inf"}} {self._ttft_count}']
        return [*lines, f"{name}_sum {self._ttft_sum}", f"{name}_count {self._ttft_count}"]


def _family(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP llmsession_{name} {help_text}", f"# TYPE llmsession_{name} {kind}"]
