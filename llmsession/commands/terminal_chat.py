"""The interactive chat of ``llmsession chat``: one message per line from a terminal or a pipe,
replies streamed as they decode, tool calls answered by the user, and a few slash commands.
Ctrl-C cancels the reply (prefill included), not the program; Ctrl-C or Ctrl-D at the prompt
quits."""

from __future__ import annotations

import codecs
import contextlib
import io
import json
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

from llmsession.api.model import Model, local_model
from llmsession.commands.doctor import error
from llmsession.errors import LlmSessionError
from llmsession.options import GenerationOptions
from llmsession.replies import Reply, ToolCall
from llmsession.runtime.face import Session

MAX_ROUNDS = 8  # tool rounds after one message
HELP = """commands:
  /image PATH   attach an image to the next message (needs --mmproj)
  /json FILE    hold the next reply to the JSON schema in FILE
  /undo         drop the last exchange
  /reset        start over (keeps the system message)
  /stats        session totals
  /help         this help
Ctrl-C cancels a reply; Ctrl-C or Ctrl-D at the prompt quits."""


@dataclass
class Totals:
    """What the session has cost so far, for ``/stats``."""

    turns: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    decoded_prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0

    def add(self, reply: Reply, seconds: float) -> None:
        usage = reply.usage
        self.turns += 1
        self.prompt_tokens += usage.prompt_tokens
        self.reused_tokens += usage.reused_tokens
        self.decoded_prompt_tokens += usage.decoded_prompt_tokens
        self.completion_tokens += usage.completion_tokens
        self.seconds += seconds

    def __str__(self) -> str:
        return (
            f"turns {self.turns} | prompt tokens {self.prompt_tokens} (reused {self.reused_tokens}, "
            f"decoded {self.decoded_prompt_tokens}) | completion tokens {self.completion_tokens} | "
            f"total {self.seconds:.2f}s"
        )


class Chat:
    """The chat loop's state: the session, images waiting for the next message, and totals."""

    def __init__(
        self, model: Model, session: Session, options: GenerationOptions, has_projector: bool
    ) -> None:
        self.model, self.session = model, session
        self.options = options
        self.after_results = replace(options, tool_choice="auto")  # (a forced call, then the answer)
        self.has_projector = has_projector
        self.images: list[Any] = []
        self.schema: dict[str, Any] | None = None  # for the next reply only
        self.totals = Totals()
        self.out: TextIO = sys.stdout
        self.dim = sys.stdout.isatty()

    def note(self, text: str) -> None:
        """A line that is not part of a reply: dim on a terminal, plain in a pipe or file."""
        print(f"\x1b[2m{text}\x1b[0m" if self.dim else text, file=self.out, flush=True)

    def command(self, line: str) -> None:
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name == "/image":
            self.attach(arg)
        elif name == "/json":
            self.constrain(arg)
        elif name == "/undo":
            self.undo()
        elif name == "/reset":
            self.session.messages[:] = [m for m in self.session.messages[:1] if m["role"] == "system"]
            self.session.clear_cached_context()
            self.images.clear()
            self.totals = Totals()
            self.note("[reset]")
        elif name == "/stats":
            self.note(str(self.totals))
            self.note(str(self.model.memory()))
        elif name == "/help":
            print(HELP, file=self.out)
        else:
            error(f"unknown command {name}; /help lists them")

    def attach(self, path: str) -> None:
        if not self.has_projector:
            error("images need a projector: start the chat with --mmproj PATH")
            return
        if not path:
            error("usage: /image PATH")
            return
        if "\0" in path:
            error("an image path cannot contain a NUL character")
            return
        from llmsession.text.images import Image  # loads PIL: only when an image is used

        self.images.append(Image(path))
        self.note(f"[image {path} attached to the next message]")

    def constrain(self, path: str) -> None:
        if not path:
            error("usage: /json SCHEMA_FILE")
            return
        try:
            schema = json.loads(Path(path).read_text())
        except (OSError, ValueError, RecursionError) as problem:  # (nested too deep for json)
            error(f"cannot read a JSON schema from {path}: {problem or type(problem).__name__}")
            return
        local_model(self.model).constraint(GenerationOptions(json_schema=schema))  # GrammarError now
        self.schema = schema
        self.note(f"[the next reply follows the schema in {path}]")

    def undo(self) -> None:
        """Drop the last user message and everything after it; the cache keeps the common prefix."""
        messages = self.session.messages
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not users:
            error("nothing to undo")
            return
        del messages[users[-1] :]
        self.note("[undone]")

    def send(self, text: str) -> None:
        """Stream one reply, and the rounds of tool results it asks for."""
        (images, self.images), (schema, self.schema) = (self.images, []), (self.schema, None)
        content: Any = [*images, text] if images else text  # (sent or refused, they do not carry over)
        options = (
            replace(self.options, json_schema=schema, tools=None, tool_choice="auto")
            if schema
            else self.options
        )
        reply = self.reply_to(content, options)
        for _ in range(MAX_ROUNDS):  # as long as the replies call tools, or until input ends
            if reply is None or not reply.tool_calls:
                return
            results = self.results_of(reply.tool_calls)
            if results is None:
                print(file=self.out)
                return
            reply = self.reply_to(results, self.after_results)
        if reply is not None and reply.tool_calls:
            self.note(f"[stopped after {MAX_ROUNDS} rounds of tool calls]")

    def reply_to(self, content: Any, options: GenerationOptions) -> Reply | None:
        """Stream one reply; SIGINT cancels it through the abort flag rather than an exception."""
        began = time.perf_counter()
        stream = self.session.stream(content, options)
        previous = signal.signal(signal.SIGINT, lambda *_: stream.cancel())
        try:
            for snapshot in stream:
                self.out.write(snapshot.delta)
                self.out.flush()
        finally:
            signal.signal(signal.SIGINT, previous)
            stream.close()
        if stream.reply is not None:
            self.report(stream.reply, options, began)
        return stream.reply

    def results_of(self, calls: Sequence[ToolCall]) -> list[Any] | None:
        """Each call printed and its result read (a line); None once input ends."""
        results: list[Any] = []
        for call in calls:
            self.note(f"[call {call.name}({call.arguments}), id {call.id}]")
            try:
                result = input(f"result of {call.name}> " if sys.stdin.isatty() else "")
            except EOFError:
                return None
            results.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return results

    def report(self, reply: Reply, options: GenerationOptions, began: float) -> None:
        """The line after a reply: how it ended, and what it cost."""
        self.out.write("\n" if reply.text and not reply.text.endswith("\n") else "")
        if reply.finish_reason == "cancelled":
            self.note("[cancelled]")
        elif options.json_schema is not None:
            complete = reply.finish_reason == "complete"
            self.note("[valid JSON for the schema]" if complete else "[cut short: the JSON is incomplete]")
        seconds = time.perf_counter() - began
        self.totals.add(reply, seconds)
        usage, timings = reply.usage, reply.timings
        self.note(
            f"[prompt {usage.prompt_tokens} tokens: reused {usage.reused_tokens}, "
            f"decoded {usage.decoded_prompt_tokens} | first token {timings.time_to_first_token_s:.2f}s | "
            f"{usage.completion_tokens} tokens, {timings.generation_tokens_per_s:.1f} tok/s]"
        )

    def run(self) -> int:
        """Read and handle lines until end of input; a bad line is reported and the chat goes on."""
        interactive = sys.stdin.isatty()
        if interactive:
            with contextlib.suppress(ImportError):
                import readline  # noqa: F401  (line editing and history for input())
        if isinstance(sys.stdin, io.TextIOWrapper):  # undecodable bytes become surrogates, not an error
            sys.stdin.reconfigure(errors="surrogateescape")
        while True:
            try:
                line = input("> " if interactive else "").strip()
            except (EOFError, KeyboardInterrupt):
                if interactive:
                    print(file=self.out)
                return 0
            except UnicodeDecodeError:  # a stdin that could not be told to escape bad bytes
                error(f"{not_decodable()}; line skipped")
                continue
            if not line:
                continue
            try:
                self.handle(line)
            except (LlmSessionError, ValueError, TypeError) as e:  # this line failed, not the chat
                error(str(e))
            except KeyboardInterrupt:  # between turns, before the reply's own handler
                self.note("[cancelled]")

    def handle(self, line: str) -> None:
        if any("\ud800" <= c <= "\udfff" for c in line):  # escaped bytes (or lone surrogates)
            raise ValueError(f"{not_decodable()}; line skipped")
        if line.startswith("/"):
            self.command(line)
        else:
            self.send(line)


def not_decodable() -> str:
    """What is wrong with a line of bytes that stdin's encoding cannot decode."""
    encoding = getattr(sys.stdin, "encoding", None) or "utf-8"
    return f"input is not valid {codecs.lookup(encoding).name.upper()}"
