"""The ``llmsession`` command end to end: a real process on a real pseudo-terminal, or on pipes.

The terminal tests type into a pty the way a user would (Ctrl-C is the byte 0x03, which the
line discipline turns into SIGINT), so they exercise signals, streaming and readline for real.
"""

from __future__ import annotations

import codecs
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import pytest

from llmsession import GenerationOptions, Model
from llmsession.commands import paths

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 180.0  # per step: the machine is slow and shared
STATS = re.compile(
    r"\[prompt (\d+) tokens: reused (\d+), decoded (\d+) \| "
    r"first token [\d.]+s \| (\d+) tokens, [\d.]+ tok/s\]"
)


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "llmsession", *args]


@dataclass
class Turn:
    reply: str
    prompt: int
    reused: int
    decoded: int
    completion: int


class Terminal:
    """``llmsession`` running on a pseudo-terminal, read with deadlines so a hang fails the test."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "TERM": "dumb", "COLUMNS": "200"}
        pid, fd = pty.fork()
        if pid == 0:  # the child: never return into pytest
            try:
                # A terminal delivers Ctrl-C to a process with the default disposition, even when
                # this suite runs in the background of a shell that ignores SIGINT.
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.chdir(REPO)
                os.execve(sys.executable, command(*args), env)
            finally:
                os._exit(127)
        self.pid, self.fd = pid, fd
        self.text = ""  # everything the program wrote
        self.pos = 0  # where the next expect() starts looking
        self.status: int | None = None
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def _read(self, timeout: float) -> bool:
        """Append what arrives within timeout; False once the program closed the terminal."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return True
        try:
            chunk = os.read(self.fd, 4096)
        except OSError:  # EIO: the child is gone
            chunk = b""
        self.text += self._decoder.decode(chunk)
        return bool(chunk)

    def expect(self, pattern: str | re.Pattern[str], timeout: float = TIMEOUT) -> re.Match[str]:
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while not (match := regex.search(self.text, self.pos)):
            remaining = deadline - time.monotonic()
            alive = remaining > 0 and self._read(min(remaining, 1.0))
            if not alive:
                why = "timed out" if remaining <= 0 else "the program ended"
                tail = self.text[-4000:]
                raise AssertionError(f"{why} waiting for {regex.pattern!r}; output so far:\n{tail}")
        self.pos = match.end()
        return match

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)

    def enter(self, line: str) -> None:
        """Wait for the prompt, type a line and wait for its echo."""
        self.expect(r"> ")
        self.send(line.encode() + b"\r")
        self.expect(re.escape(line) + r"\r?\n")

    def ask(self, message: str) -> Turn:
        """Type a message, wait for its reply and the stats line after it."""
        self.enter(message)
        start = self.pos
        stats = self.expect(STATS)
        reply = re.sub(r"\x1b\[[0-9;]*m", "", self.text[start : stats.start()]).strip()
        prompt, reused, decoded, completion = (int(g) for g in stats.groups())
        return Turn(reply, prompt, reused, decoded, completion)

    def wait(self, timeout: float = TIMEOUT) -> int:
        deadline = time.monotonic() + timeout
        while self.status is None and time.monotonic() < deadline:
            self._read(0.2)
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
        assert self.status is not None, f"the program did not exit; output:\n{self.text[-4000:]}"
        return self.status

    def close(self) -> None:
        if self.status is None:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        os.close(self.fd)


@pytest.fixture
def terminal(smollm2_path: Path) -> Iterator[Callable[..., Terminal]]:
    """A Terminal factory whose processes are killed if a test fails halfway."""
    started: list[Terminal] = []

    def start(*args: str) -> Terminal:
        started.append(Terminal(*args))
        return started[-1]

    yield start
    for term in started:
        term.close()


def run(*args: str, stdin: str = "", env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command(*args),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=TIMEOUT * 2,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def test_a_reply_streams_in_a_terminal_and_ctrl_d_quits(
    terminal: Callable[..., Terminal], smollm2_path: Path
) -> None:
    term = terminal(
        "chat", "--max-tokens", "32", "--temperature", "0", "--system", "Be brief.", "--threads", "2"
    )
    turn = term.ask("What is the capital of France?")
    with Model(smollm2_path, threads=2, max_live_sessions=1) as model:  # (as the CLI: same cells)
        greedy = GenerationOptions(max_tokens=32, temperature=0)
        expected = model.session(system="Be brief.").respond("What is the capital of France?", greedy)
    assert turn.reply == expected.text.strip()  # what the library answers, as it streamed
    assert 0 < turn.completion <= 32
    assert turn.reused == 0 and turn.decoded == turn.prompt  # the first turn decodes everything
    assert "\x1b[2m[prompt" in term.text  # the stats line is dim on a terminal
    term.expect(r"> ")
    term.send(b"\x04")
    assert term.wait() == 0
    assert "Traceback" not in term.text


def test_ctrl_c_cancels_the_reply_not_the_chat(terminal: Callable[..., Terminal]) -> None:
    term = terminal("chat", "--max-tokens", "400", "--temperature", "0")
    term.enter("Write a very long story about a dragon who learns to fly. Use many chapters.")
    term.expect(r"(?s)\S.{60}")  # part of the reply is on screen: it streams
    term.send(b"\x03")
    term.expect(r"\[cancelled\]")
    cancelled = term.expect(STATS)
    assert int(cancelled.group(4)) < 400  # stopped early, not at max-tokens
    turn = term.ask("Say hello.")  # the session is still usable
    assert turn.reply
    assert turn.reused > 0  # the cancelled exchange stayed in the cache
    term.expect(r"> ")
    # A person cannot press a key within microseconds of the prompt appearing; a test can, and then the
    # signal lands before input() blocks in select(), where CPython only notices it on the next key.
    time.sleep(1.0)
    term.send(b"\x03")  # Ctrl-C at an empty prompt quits cleanly
    assert term.wait() == 0
    assert "Traceback" not in term.text


def test_ctrl_c_stops_a_long_prefill(terminal: Callable[..., Terminal]) -> None:
    system = " ".join(f"Note {i}: the lighthouse keeper counts ships." for i in range(350))  # ~4100 tokens
    args = ("--max-tokens", "8", "--temperature", "0", "--context-size", "8192", "--system", system)
    term = terminal("chat", *args)
    term.enter("Hi")
    time.sleep(0.5)  # well inside the prefill, which takes seconds even on a fast machine
    sent = time.monotonic()
    term.send(b"\x03")
    term.expect(r"\[cancelled\]")
    stats = term.expect(STATS)
    prompt, decoded, completion = int(stats.group(1)), int(stats.group(3)), int(stats.group(4))
    assert decoded < prompt and completion == 0  # the prompt was not decoded to the end
    assert time.monotonic() - sent < 30  # the abort flag stops it between graph nodes, not at the end
    term.expect(r"> ")
    term.send(b"\x04")
    assert term.wait() == 0


def test_undo_then_the_same_message_reuses_the_cache(terminal: Callable[..., Terminal]) -> None:
    term = terminal("chat", "--max-tokens", "24", "--temperature", "0")
    term.ask("Name a fruit.")
    second = term.ask("Name a colour.")
    term.enter("/undo")
    term.expect(r"\[undone\]")
    again = term.ask("Name a colour.")
    # Without the undo the prompt would also hold the first "Name a colour." exchange.
    assert again.prompt == second.prompt
    assert again.reply == second.reply  # greedy: the same transcript gives the same reply
    assert again.reused > 0 and again.decoded <= 4
    assert again.reused + again.decoded == again.prompt
    term.enter("/stats")
    term.expect(r"turns 3 \| prompt tokens \d+ \(reused \d+, decoded \d+\) \| completion tokens \d+")
    term.expect(r"memory: 1/1 sessions live holding \d+/8192 KV cells \(\d+ MiB; .*\).* restores \d+")
    term.expect(r"prompts: jinja \(the file.s template\)")


def test_image_command_with_a_projector(terminal: Callable[..., Terminal]) -> None:
    fixtures = paths.fixtures_dir()
    projector, red = fixtures / "mmproj-tiny.gguf", fixtures / "image-red.png"
    for path in (projector, red):
        if not path.exists():
            pytest.fail(f"{path} is missing: run `make setup` first", pytrace=False)  # conftest skips first
    term = terminal("chat", "--mmproj", str(projector), "--max-tokens", "8", "--temperature", "0")
    term.enter("/image /no/such/image.png")
    term.expect(r"error: .*image")
    term.enter(f"/image {red}")
    term.expect(r"\[image .* attached")
    with_image = term.ask("Describe it.")
    term.enter("/reset")
    term.expect(r"\[reset\]")
    without_image = term.ask("Describe it.")
    assert with_image.prompt > without_image.prompt  # the image's tokens were in the prompt
    assert without_image.reused == 0  # /reset dropped the cache too
    assert "Traceback" not in term.text


def test_a_line_of_invalid_utf8_in_a_terminal_is_skipped(terminal: Callable[..., Terminal]) -> None:
    term = terminal("chat", "--max-tokens", "8", "--temperature", "0")
    term.expect(r"> ")
    term.send(b"\xff\xfe caf\xe9\r")
    term.expect(r"error: input is not valid UTF-8")
    turn = term.ask("Say hi")  # the chat goes on
    assert turn.reply and turn.reused == 0 and turn.decoded == turn.prompt
    term.expect(r"> ")
    term.send(b"\x04")
    assert term.wait() == 0
    assert "Traceback" not in term.text


def test_piped_input_one_message_per_line(smollm2_path: Path) -> None:
    lines = ["What is 2 + 2?", "", "/image red.png", "Name a colour.", "/stats", "/undo", "/reset", "/stats"]
    out = run("chat", "--max-tokens", "16", "--temperature", "0", stdin="\n".join(lines) + "\n")
    assert out.returncode == 0, out.stderr
    assert "\x1b" not in out.stdout and not re.search(r"^> ", out.stdout, re.M)  # no decorations in a pipe
    stats = STATS.findall(out.stdout)
    assert len(stats) == 2
    assert int(stats[1][1]) > 0  # the second message reused the first exchange
    assert re.search(r"^turns 2 \|", out.stdout, re.M) and re.search(r"^turns 0 \|", out.stdout, re.M)
    assert "[undone]" in out.stdout and "[reset]" in out.stdout
    assert "error: images need a projector" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("bad", "complaint"),
    [(b"a\0b", "NUL"), (b"\xff\xfe caf\xe9", "not valid UTF-8")],
    ids=["nul", "invalid-utf8"],
)
def test_a_bad_line_is_reported_and_the_chat_goes_on(smollm2_path: Path, bad: bytes, complaint: str) -> None:
    stdin = bad + b"\nSay hi\n/stats\n"
    out = subprocess.run(
        command("chat", "--max-tokens", "8", "--temperature", "0"),
        input=stdin,
        capture_output=True,
        timeout=TIMEOUT * 2,
        cwd=REPO,
        env={**os.environ, "PYTHONIOENCODING": "utf-8:strict"},  # as in a UTF-8 locale, not UTF-8 mode
    )
    stdout, stderr = out.stdout.decode(), out.stderr.decode(errors="replace")
    assert out.returncode == 0, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and complaint in errors[0], stderr
    assert "Traceback" not in stderr
    stats = STATS.findall(stdout)
    assert len(stats) == 1  # "Say hi" got its reply; the bad line none
    prompt, reused, decoded, completion = (int(g) for g in stats[0])
    assert reused == 0 and decoded == prompt and 0 < completion <= 8
    assert re.search(r"^turns 1 \|", stdout, re.M)  # one exchange: the bad line left no trace


def test_a_missing_default_model_names_the_setup_command(tmp_path: Path) -> None:
    out = run("chat", stdin="hi\n", env={"LLMSESSION_CACHE": str(tmp_path)})
    assert out.returncode == 2
    assert "`llmsession setup`" in out.stderr and "llmsession models" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_bad_model_file_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a model")
    out = run("chat", "--model", str(bogus), stdin="hi\n")
    assert out.returncode == 1
    assert out.stderr.startswith("error:") and "bogus.gguf" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_model_is_named_from_the_cache_and_listed(smollm2_path: Path) -> None:
    out = run("models")
    assert out.returncode == 0 and smollm2_path.name in out.stdout and "MiB" in out.stdout
    out = run("chat", "--model", "smollm2", "--max-tokens", "4", "--temperature", "0", stdin="Hi\n")
    assert out.returncode == 0 and STATS.search(out.stdout), out.stderr
    out = run("chat", "--model", "no-such-model", stdin="Hi\n")
    assert out.returncode == 2 and "not a file or a cached model" in out.stderr


def test_an_ambiguous_model_name_lists_the_candidates(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    for name in ("alpha-one.gguf", "alpha-two.gguf"):
        (tmp_path / "models" / name).write_bytes(b"not a model")
    env = {"LLMSESSION_CACHE": str(tmp_path)}
    out = run("chat", "--model", "alpha", env=env, stdin="Hi\n")
    assert out.returncode == 2 and "could mean alpha-one.gguf, alpha-two.gguf" in out.stderr, out.stderr
    out = run("chat", "--model", "alpha-two", env=env, stdin="Hi\n")  # one: resolved, then refused
    assert out.returncode == 1 and "alpha-two.gguf is not a GGUF file" in out.stderr, out.stderr


def test_a_dangling_link_in_the_cache_and_an_unreadable_model_path_are_errors_not_tracebacks(
    tmp_path: Path,
) -> None:
    """A link in the models folder whose file is gone (a drive unmounted) is not listed (it was
    a traceback from ``models`` and ``doctor``); a ``--model`` path the system refuses to check
    (a name longer than a file name may be) is an error naming why, exit 2."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "kept.gguf").write_bytes(b"not a model")
    (tmp_path / "models" / "gone.gguf").symlink_to(tmp_path / "unmounted" / "gone.gguf")
    env = {"LLMSESSION_CACHE": str(tmp_path)}
    out = run("models", env=env)
    assert out.returncode == 0 and "kept.gguf" in out.stdout and "gone" not in out.stdout, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    out = run("chat", "--model", str(tmp_path / ("x" * 300 + ".gguf")), env=env, stdin="Hi\n")
    assert out.returncode == 2 and "cannot be read" in out.stderr and "Traceback" not in out.stderr, (
        out.stderr
    )
    out = run("chat", "--model", "gone", env=env, stdin="Hi\n")  # (not a candidate: not found)
    assert out.returncode == 2 and "not a file or a cached model" in out.stderr, out.stderr


def test_serve_given_paths_the_system_refuses_to_check_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    """``serve --model NAME=PATH`` or ``--models-dir`` naming what the system will not look at
    (a name longer than a file name may be; a folder it may not read is alike): an error line."""
    long = str(tmp_path / ("x" * 300))
    for given in (["--model", "smol=" + "x" * 300 + ".gguf"], ["--models-dir", long]):
        out = run("serve", *given, "--port", "1")
        assert out.returncode in (1, 2) and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.startswith("error:") and "too long" in out.stderr, out.stderr


def test_doctor_reports_the_build(smollm2_path: Path) -> None:
    out = run("doctor")
    assert out.returncode == 0, out.stderr
    assert f"llama.cpp commit: {paths.LLAMA_CPP_COMMIT[:7]}" in out.stdout
    assert "build-info.json" in out.stdout
    assert smollm2_path.name in out.stdout
    assert re.search(r"system info: .*CPU", out.stdout)
    assert "projector fixture:" in out.stdout


def test_doctor_fails_clearly_without_the_libraries(tmp_path: Path) -> None:
    out = run("doctor", env={"LLMSESSION_LIB_DIR": str(tmp_path)})
    assert out.returncode != 0
    assert "error: the llama.cpp libraries do not load" in out.stderr and "`llmsession setup`" in out.stderr
    assert "Traceback" not in out.stderr


def test_json_constrains_the_next_reply_only(smollm2_path: Path, tmp_path: Path) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}, "rank": {"type": "integer"}},
        "required": ["city", "rank"],
        "additionalProperties": False,
    }
    (tmp_path / "city.json").write_text(json.dumps(schema))
    (tmp_path / "bad.json").write_text('{"type": "strin"}')
    lines = [f"/json {tmp_path / 'bad.json'}", f"/json {tmp_path / 'city.json'}", "Name a city.", "Thanks!"]
    out = run("chat", "--max-tokens", "48", "--temperature", "0", stdin="\n".join(lines) + "\n")
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "strin" in errors[0], out.stderr
    replies = [line for line in out.stdout.splitlines() if line and not line.startswith("[")]
    jsonschema.validate(json.loads(replies[0]), schema)
    assert out.stdout.count("[valid JSON for the schema]") == 1  # the schema held for one reply only
    assert len(STATS.findall(out.stdout)) == 2


def test_tools_calls_are_printed_and_results_read(smollm2_path: Path, tmp_path: Path) -> None:
    """``--tools FILE``: each call is printed with its id, its result is the next line, and the
    reply to the results may call again (here input ends there: the chat ends cleanly)."""
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 16}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    (tmp_path / "tools.json").write_text(json.dumps([weather]))
    tools = ["--tools", str(tmp_path / "tools.json")]
    chat = ["chat", "--max-tokens", "48", "--temperature", "0", *tools, "--tool-choice", "required"]
    out = run(*chat, stdin='Weather in Paris?\n{"temp_c": 21}\n')
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    calls = re.findall(r"^\[call get_weather\((.*)\), id (call_\w+)\]$", out.stdout, re.M)
    assert calls, out.stdout
    jsonschema.validate(json.loads(calls[0][0]), weather["function"]["parameters"])
    unknown = run("chat", *tools, "--tool-choice", "get_time", stdin="hi\n")
    assert unknown.returncode == 1 and "get_time" in unknown.stderr and "Traceback" not in unknown.stderr
    lonely = run("chat", "--tool-choice", "required", stdin="hi\n")
    assert lonely.returncode == 1 and "--tool-choice needs --tools" in lonely.stderr
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
    }
    (tmp_path / "city.json").write_text(json.dumps(schema))
    held = run(*chat, stdin=f"/json {tmp_path / 'city.json'}\nName a city.\n")  # (a forced call's options)
    assert held.returncode == 0 and "error" not in held.stderr, held.stderr
    assert "[valid JSON for the schema]" in held.stdout and "[call " not in held.stdout


def test_the_prompt_flags_choose_the_renderer(gemma3_path: Path, tmp_path: Path) -> None:
    """``--chat-template-file``, ``--chat-template`` and ``--jinja`` reach the model, and
    ``/stats`` says what renders the prompts; the two template flags exclude each other."""
    template = tmp_path / "turns.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] ")
    model = ["--model", str(gemma3_path), "--max-tokens", "4", "--temperature", "0"]
    for flags, says in (
        (["--chat-template-file", str(template)], "prompts: jinja (chat_template given)"),
        (
            ["--chat-template", "chatml"],
            "prompts: llama.cpp's built-in 'chatml' template (chat_template given)",
        ),
        ([], "prompts: llama.cpp's built-in 'gemma' template (the file has no template"),
    ):
        out = run("chat", *model, *flags, stdin="Hi\n/stats\n")
        assert out.returncode == 0 and says in out.stdout, (flags, out.stdout[-800:], out.stderr[-800:])
    out = run("chat", *model, "--jinja", "on", stdin="Hi\n")
    assert out.returncode == 1 and "use_jinja needs a jinja chat template" in out.stderr
    both = run("chat", "--chat-template", "chatml", "--chat-template-file", str(template), stdin="")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
