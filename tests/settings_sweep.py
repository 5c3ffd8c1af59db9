"""The child of ``test_settings_sweep``: loads a model with each setting of a list in turn and
chats with it, printing one JSON line per setting as it starts and as it ends, so the parent
knows which setting a process died in (llama.cpp aborts the process on some misuse)."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

from llmsession import GenerationOptions, LlmSessionError, Model

HI = [{"role": "user", "content": "Hi"}]
OPTIONS = GenerationOptions(max_tokens=3, temperature=0.0)


def exercise(path: Path, case: dict[str, Any]) -> str:
    """Load with ``case["model"]``, open a session with ``case["session"]``, chat once, and with
    ``case["streams"]`` that many streams at once (a batched step over several sequences)."""
    with Model(path, **case.get("model", {})) as model:
        session = model.session(**case.get("session", {}))
        session.respond("Hi", OPTIONS)
        streams = case.get("streams", 0)
        errors: list[BaseException] = []

        def chat(i: int) -> None:
            try:
                model.chat([{"role": "user", "content": f"Count to {i}"}], OPTIONS)
            except BaseException as error:  # (reported by the parent's check)
                errors.append(error)

        threads = [threading.Thread(target=chat, args=(i,)) for i in range(streams)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
    return "ok"


def main() -> None:
    path, cases, start = Path(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
    for index in range(start, len(cases)):
        print(json.dumps({"start": index}), flush=True)
        try:
            outcome = exercise(path, cases[index])
        except (LlmSessionError, TypeError, ValueError) as error:
            outcome = f"{type(error).__name__}: {error}"
        print(json.dumps({"end": index, "outcome": outcome}), flush=True)


if __name__ == "__main__":
    main()
