"""``llmsession serve`` with several models, over real HTTP with the official clients: each
request answered by the model it names (an unknown one: 404 in each API's body), loaded on
demand under ``--max-loaded-models 1``, a Claude Code conversation that resumes from its state
after its model unloaded and reloaded, ``keep_alive: 0``, and a 503 when no room is left."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from plain_http import HTTP
from serve_helpers import KEY, OTHER_KEY, running, three_models
from starlette.requests import Request

from llmsession import Models, SessionConfig
from llmsession.commands import served_models
from llmsession.commands.cli import parser
from llmsession.commands.serve_models import model_files, several
from llmsession.serve import operators
from llmsession.serve.app import Server, create_app
from llmsession.serve.bodies import Bodies
from llmsession.serve.errors import ApiError
from llmsession.serve.hosts import ManyModels
from llmsession.serve.metrics import Metrics

CONTEXT = SessionConfig(context_size=2048)  # (the server's: smaller than the models' own)
SYSTEM = "You are a careful assistant. " + "Answer in a few words, plainly. " * 10
ARGMAX = {"temperature": 0}


@pytest.fixture(scope="module")
def served(
    smollm2_path: Path, gemma3_path: Path, fixture_path: Callable[[str], Path]
) -> Iterator[tuple[Models, str]]:
    with three_models(
        smollm2_path, gemma3_path, fixture_path("bert-tiny.gguf"), api_key=KEY, session=CONTEXT
    ) as served:
        yield served


def chat(url: str, model: str, text: str, **extra: Any) -> Any:
    client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=120)
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=4, temperature=0, **extra
    )


def abilities(url: str) -> dict[str, dict[str, Any]]:
    listed = HTTP.get(f"{url}/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    return {card["id"]: card["capabilities"] for card in listed["data"]}


def states(url: str) -> dict[str, str]:
    listed = HTTP.get(f"{url}/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    return {card["id"]: card["status"]["value"] for card in listed["data"]}


def test_each_request_is_answered_by_the_model_it_names(served: tuple[Models, str]) -> None:
    _, url = served
    assert states(url) == {"smol": "unloaded", "gemma": "unloaded", "bert": "unloaded"}
    assert chat(url, "smol", "Hi.").model == "smol"
    assert states(url) == {"smol": "loaded", "gemma": "unloaded", "bert": "unloaded"}
    assert chat(url, "gemma", "Hi.").model == "gemma"
    assert states(url) == {"smol": "unloaded", "gemma": "loaded", "bert": "unloaded"}  # (one at a time)
    with pytest.raises(openai.NotFoundError, match="no model named 'gpt-4'"):
        chat(url, "gpt-4", "Hi.")
    client = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as raised:
        client.messages.create(model="claude-x", max_tokens=4, messages=[{"role": "user", "content": "Hi."}])
    assert raised.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": raised.value.body["error"]["message"]},
    }


def test_concurrent_first_requests_share_one_load(served: tuple[Models, str]) -> None:
    models, url = served
    models.unload("smol")
    models.unload("gemma")
    answers: list[str] = []
    threads = [
        threading.Thread(target=lambda: answers.append(chat(url, "smol", "Hi.").model)) for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert answers == ["smol"] * 3
    assert models.status()[0].users == 0  # (every request let it go)


def test_a_claude_code_conversation_resumes_after_its_model_reloads(served: tuple[Models, str]) -> None:
    """Its first turn on smol, a request to gemma (smol unloads, the conversation parked), its
    second turn on smol again: read from its parked state, only the new turn decoded."""
    _, url = served
    headers = {"X-Claude-Code-Session-Id": "resumes"}
    client = anthropic.Anthropic(
        base_url=url.removesuffix("/v1"), api_key=KEY, max_retries=0, timeout=120, default_headers=headers
    )
    said: list[Any] = [{"role": "user", "content": "Hi."}]
    first = client.messages.create(
        model="smol", max_tokens=6, system=SYSTEM, messages=said, extra_body=ARGMAX
    )
    chat(url, "gemma", "Hello?")
    assert states(url)["smol"] == "unloaded"
    text = "".join(block.text for block in first.content if block.type == "text")
    said += [{"role": "assistant", "content": text}, {"role": "user", "content": "Why?"}]
    second = client.messages.create(
        model="smol", max_tokens=6, system=SYSTEM, messages=said, extra_body=ARGMAX
    )
    whole_first = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    assert (second.usage.cache_read_input_tokens or 0) >= whole_first, (second.usage, first.usage)


def test_keep_alive_zero_unloads_once_the_request_is_done(served: tuple[Models, str]) -> None:
    """On every API that answers with a model (Messages, its count_tokens and Responses take
    Ollama's field as chat does)."""
    _, url = served
    base, auth = url.removesuffix("/v1"), {"Authorization": f"Bearer {KEY}"}
    said = [{"role": "user", "content": "Hi."}]
    asks: list[tuple[str, dict[str, Any]]] = [
        ("/v1/chat/completions", {"messages": said, "max_tokens": 4}),
        ("/v1/messages", {"messages": said, "max_tokens": 4}),
        ("/v1/messages/count_tokens", {"messages": said}),
        ("/v1/responses", {"input": "Hi.", "max_output_tokens": 4}),
    ]
    for path, body in asks:
        chat(url, "smol", "Hi.", extra_body={"keep_alive": -1})  # (loaded, kept)
        answered = HTTP.post(
            f"{base}{path}", json={**body, "model": "smol", "keep_alive": 0}, headers=auth, timeout=60
        )
        assert answered.status_code == 200, (path, answered.text)
        deadline = time.monotonic() + 10
        while states(url)["smol"] != "unloaded" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert states(url)["smol"] == "unloaded", path
        refused = HTTP.post(
            f"{base}{path}", json={**body, "model": "smol", "keep_alive": "soon"}, headers=auth, timeout=60
        )
        assert refused.status_code == 400 and "keep_alive" in refused.text, (path, refused.text)
    with pytest.raises(openai.BadRequestError, match="keep_alive"):
        chat(url, "smol", "Hi.", extra_body={"keep_alive": "soon"})


def test_a_load_with_no_room_is_a_503_and_the_server_stays_up(smollm2_path: Path, gemma3_path: Path) -> None:
    limit = gemma3_path.stat().st_size // 2  # (less than the model itself)
    models = Models({"smol": smollm2_path, "gemma": gemma3_path}, memory_limit=limit, threads=2)
    with models, running(create_app(models, api_key=KEY)) as url:
        with pytest.raises(openai.InternalServerError) as raised:
            chat(url, "gemma", "Hi.")
        assert raised.value.status_code == 503 and "memory limit" in raised.value.message
        assert raised.value.code == "model_too_large" and "retry-after" not in raised.value.response.headers
        assert HTTP.get(f"{url.removesuffix('/v1')}/health", timeout=10).json()["status"] == "ok"
        assert states(url) == {"smol": "unloaded", "gemma": "unloaded"}


def test_the_command_line_names_several_models(smollm2_path: Path, gemma3_path: Path, tmp_path: Path) -> None:
    args = parser().parse_args(
        ["serve", "--model", f"a={smollm2_path}", "--model", str(gemma3_path), "--max-loaded-models", "1"]
    )
    assert several(args) and args.max_loaded_models == 1
    files = model_files(args)
    assert list(files) == ["a", gemma3_path.stem] and files["a"].path == smollm2_path
    single = parser().parse_args(["serve", "--model", str(smollm2_path)])
    assert not several(single)
    twice = parser().parse_args(["serve", "--model", f"a={smollm2_path}", "--model", f"a={gemma3_path}"])
    with pytest.raises(ValueError, match="two models named 'a'"):
        model_files(twice)
    (tmp_path / "chat.gguf").symlink_to(smollm2_path)
    folder = parser().parse_args(["serve", "--models-dir", str(tmp_path)])
    assert several(folder) and list(model_files(folder)) == ["chat"]


def test_operators_load_unload_and_list_what_is_loaded(served: tuple[Models, str]) -> None:
    models, url = served
    base, auth = url.removesuffix("/v1"), {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=base, headers=auth, timeout=120) as http:
        assert http.post("/models/unload", json={"model": "gemma"}).json() == {
            "model": "gemma",
            "status": "unloaded",
        }
        assert http.post("/models/load", json={"model": "smol"}).json() == {
            "model": "smol",
            "status": "loaded",
        }
        listed = http.get("/api/ps").json()["models"]
        assert [(m["name"], m["in_use"], m["expires_at"]) for m in listed] == [("smol", 0, None)]
        assert listed[0]["size"] > smol_bytes(models) and listed[0]["context_length"] == CONTEXT.context_size
        card = http.get("/v1/models/smol").json()  # (what a request gets: not the model's own 8,192)
        assert card["context_size"] == CONTEXT.context_size, card
        models.acquire("smol")  # (a request of it still running)
        try:
            refused = http.post("/models/unload", json={"model": "smol"})
            assert refused.status_code == 409 and refused.json()["error"]["code"] == "model_in_use"
        finally:
            models.release("smol")
        assert http.post("/models/load", json={"model": "nope"}).status_code == 404
        for named in ({"model": None}, {"model": ["smol"]}, {}):  # (none named: the request's fault)
            assert http.post("/models/load", json=named).status_code == 400, named
            said = {**named, "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 1}
            answered = http.post("/v1/chat/completions", json=said)
            assert answered.status_code == 400 and answered.json()["error"]["param"] == "model", answered.text
        padded = b'{"model": "smol", "pad": [' + b",".join([b"1"] * (40 << 10)) + b"]}"  # (80 KiB)
        assert http.post("/models/unload", content=padded).status_code == 413  # (parsed: seconds at 8 MiB)
        assert HTTP.post(f"{base}/models/load", json={"model": "smol"}, timeout=10).status_code == 401
    assert states(url)["smol"] == "loaded"


@pytest.mark.parametrize(("max_body", "bound"), [(8 << 20, 64 << 10), (1000, 1000)])
def test_an_operators_body_declared_too_large_is_refused_without_waiting_for_a_parser(
    max_body: int, bound: int
) -> None:
    """Pure logic of the route (the server's parts it reads, the real ``Server.parsed_body``): with
    every parser slot held by slow uploads, a body whose ``Content-Length`` is over the bound
    (the operators' 64 KiB, or the server's limit if tighter) is a 413 at once, not after the
    uploads, and says that bound."""

    class Parts:
        hosts = ManyModels.__new__(ManyModels)  # (only its type is read before the body)
        embedding, max_body_bytes = asyncio.Semaphore(1), max_body
        bodies = Bodies(max_body)
        parsing = bodies.parsing
        parsed_body = Server.parsed_body

    async def refused() -> tuple[int, str]:
        parts = Parts()
        await parts.parsing.acquire()  # (a slow upload)
        headers = [(b"content-length", str(10 << 20).encode())]
        scope = {
            "type": "http",
            "method": "POST",
            "path": "/models/load",
            "headers": headers,
            "query_string": b"",
        }

        async def receive() -> dict[str, Any]:
            await asyncio.sleep(3600)
            return {}

        with pytest.raises(ApiError) as raised:
            await asyncio.wait_for(operators.named(parts, Request(scope, receive)), 2)
        return raised.value.status, str(raised.value)

    status, message = asyncio.run(refused())
    assert status == 413 and f"limit of {bound} bytes" in message, message


def smol_bytes(models: Models) -> int:
    return models.file("smol").path.stat().st_size


def test_a_server_of_one_model_neither_loads_nor_unloads(smollm2_path: Path) -> None:
    from llmsession import Model

    with Model(smollm2_path, threads=1) as model, running(create_app(model)) as url:
        refused = HTTP.post(f"{url.removesuffix('/v1')}/models/unload", json={"model": "x"}, timeout=10)
        assert refused.status_code == 400 and "one model" in refused.json()["error"]["message"]


def test_the_models_command_lists_a_servers_models_and_what_it_holds(
    served: tuple[Models, str], capsys: pytest.CaptureFixture[str]
) -> None:
    from llmsession.commands.cli import main

    models, url = served
    models.load("smol")
    assert main(["models", "--url", url, "--api-key", KEY]) == 0
    printed = capsys.readouterr().out
    assert "smol" in printed and "gemma" in printed and "loaded: smol" in printed, printed
    assert main(["models", "--url", f"{url}/models", "--api-key", KEY]) == 0  # (the listing's own address)
    assert "loaded: smol" in capsys.readouterr().out
    assert main(["models", "--url", url, "--api-key", "wrong"]) == 1
    assert "401" in capsys.readouterr().err


def test_the_models_command_follows_no_redirect_and_reads_odd_answers_as_errors(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``llmsession models --url``: a redirect is an error (urllib would send the key where it
    points), and an answer of another shape is "cannot read", never a traceback."""
    import http.server
    import json

    from llmsession.commands.cli import main

    seen: list[str | None] = []
    answers = {"/v1/models": b"{}"}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization"))
            if self.path == "/moved/v1/models":
                self.send_response(302)
                self.send_header("Location", f"http://127.0.0.1:{port}/stolen")
                self.end_headers()
                return
            body = answers.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *_: object) -> None:
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler) as server:
        port = server.server_address[1]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            assert main(["models", "--url", f"http://127.0.0.1:{port}/moved", "--api-key", "sk-x"]) == 1
            assert "302" in capsys.readouterr().err
            assert seen == ["Bearer sk-x"]  # (asked once; the redirect's target never was)
            for odd in ({"data": [1]}, {"data": {"id": "m"}}, {"data": "m"}):
                answers["/v1/models"] = json.dumps(odd).encode()
                assert main(["models", "--url", f"http://127.0.0.1:{port}"]) == 1, odd
                assert "cannot read" in capsys.readouterr().err
            answers["/v1/models"] = json.dumps({"data": [{"id": "m", "status": {"value": None}}]}).encode()
            answers["/api/ps"] = json.dumps({"models": [{"name": "m", "size": "big"}]}).encode()
            assert main(["models", "--url", f"http://127.0.0.1:{port}"]) == 0
            printed = capsys.readouterr().out
            assert "m" in printed and "loaded" in printed and "0.0 MiB" in printed, printed
        finally:
            server.shutdown()


def test_the_models_command_reads_a_port_that_is_not_http_or_a_bad_address_as_an_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``llmsession models --url`` at a port that answers something else (an SSH server's
    banner; an answer cut short) or at an address urllib cannot parse (a port that is no
    number): "cannot read", exit 1, never a traceback (http.client's errors are no OSError)."""
    import socket

    from llmsession.commands.cli import main

    replies = [b"SSH-2.0-OpenSSH_9.2\r\n", b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"da']
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def answer() -> None:
            for reply in replies:
                connection, _ = listener.accept()
                with connection:
                    connection.recv(65536)
                    connection.sendall(reply)

        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        for _ in replies:
            assert main(["models", "--url", f"http://127.0.0.1:{port}"]) == 1
            assert "cannot read" in capsys.readouterr().err
        thread.join(10)
    for address in ("http://localhost:abc", "http://exa mple"):
        assert main(["models", "--url", address]) == 1, address
        assert "cannot read" in capsys.readouterr().err


def test_an_embedding_model_beside_the_chat_models_embeds_and_says_so(served: tuple[Models, str]) -> None:
    _, url = served
    client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=120)
    answer = client.embeddings.create(model="bert", input=["hello world", "cat"], encoding_format="float")
    assert [len(item.embedding) for item in answer.data] == [64, 64] and answer.model == "bert"
    capabilities = abilities(url)
    assert capabilities["bert"]["embeddings"] is True and capabilities["bert"]["chat"] is False
    with pytest.raises(openai.BadRequestError, match="embedding model") as refused:
        chat(url, "bert", "Hi.")
    with pytest.raises(openai.BadRequestError, match="chat model") as other:
        client.embeddings.create(model="smol", input="cat")
    for said in (refused.value.message, other.value.message):  # (the alias hides the file's name)
        assert ".gguf" not in said and "SmolLM2" not in said, said
    capabilities = {
        c["id"]: c["capabilities"]
        for c in HTTP.get(f"{url}/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()[
            "data"
        ]
    }
    assert capabilities["smol"]["chat"] is True and capabilities["smol"]["embeddings"] is False


def test_an_embedding_model_embeds_whatever_context_the_chat_sessions_are_given(
    smollm2_path: Path, fixture_path: Callable[[str], Path]
) -> None:
    """The server's session settings are checked against each chat model it loads; an
    embedding model's inputs take its own context, yet it was checked too: with
    ``--context-size 8192`` (bert's own is 512, made 2048) every embedding request was a 500,
    remembered as long as the models beside it stayed loaded."""
    models = Models({"smol": smollm2_path, "bert": fixture_path("bert-tiny.gguf")}, max_loaded=1, threads=1)
    with models, running(create_app(models, session=SessionConfig(context_size=8192))) as url:
        client = openai.OpenAI(base_url=url, api_key="-", max_retries=0, timeout=120)
        answer = client.embeddings.create(model="bert", input="cat", encoding_format="float")
        assert len(answer.data[0].embedding) == 64
        assert client.embeddings.create(model="bert", input="dog").data  # (nothing remembered)


def test_a_card_says_what_its_model_does_once_it_is_known() -> None:
    from llmsession.api.modelfiles import kind_of
    from llmsession.serve.hosts import card

    assert [kind_of(p) for p in (None, "mean", "cls", "last", "rank")] == [
        "chat",
        *["embedding"] * 3,
        "reranker",
    ]
    said = {
        kind: card("m", False, True, kind=kind)["capabilities"]
        for kind in ("chat", "embedding", "reranker", None)
    }
    assert [(said[k]["chat"], said[k]["embeddings"]) for k in said] == [
        (True, False),
        (False, True),
        (False, False),
        (None, None),
    ]
    # Tools and schemas are a chat model's: claimed once it is known to be one, not before.
    assert [(said[k]["tools"], said[k]["json_schema"]) for k in said] == [
        (True, True),
        (False, False),
        (False, False),
        (None, None),
    ]


def test_a_model_the_servers_settings_do_not_fit_is_a_500_once_loaded_then_without_loading(
    smollm2_path: Path, gemma3_path: Path
) -> None:
    """A context SmolLM2's cells cannot hold (Gemma 3's can): its first request loads it (the
    settings are checked against the model loaded) and is a 500 naming them; later ones are
    refused as they come, never loading it again nor unloading the model that works."""
    models = Models({"smol": smollm2_path, "gemma": gemma3_path}, max_loaded=1, threads=1)
    app = create_app(models, api_key=KEY, session=SessionConfig(context_size=16384))
    with models, running(app) as url:
        assert chat(url, "gemma", "Hi.").choices
        with pytest.raises(openai.InternalServerError) as raised:
            chat(url, "smol", "Hi.")
        assert raised.value.status_code == 500 and "do not fit" in raised.value.message
        assert raised.value.body["type"] == "server_error"  # type: ignore[index]
        assert states(url) == {"smol": "unloaded", "gemma": "unloaded"}  # (not kept for nothing)
        assert chat(url, "gemma", "Hi.").choices
        loads = {status.name: status.loads for status in models.status()}
        with pytest.raises(openai.InternalServerError, match="do not fit"):
            chat(url, "smol", "Hi.")
        assert {status.name: status.loads for status in models.status()} == loads
        assert states(url) == {"smol": "unloaded", "gemma": "loaded"}


OPERATOR = "sk-operator-only"


def test_with_operator_keys_a_tenant_neither_unloads_nor_reads_what_others_do(smollm2_path: Path) -> None:
    """Tenants' keys chat; only an operator's loads and unloads models, lists them with their
    use (``/api/ps``), reads ``/metrics`` (other tenants' traffic, request by request) and sets a
    model's ``keep_alive``: a tenant's ``keep_alive: 0`` unloaded the model under everyone."""
    models = Models({"smol": smollm2_path}, max_loaded=1, threads=2)
    app = create_app(models, api_key=[KEY, OTHER_KEY], operator_key=OPERATOR, session=CONTEXT)
    with models, running(app) as url:
        base = url.removesuffix("/v1")

        def ask(key: str | None, method: str, path: str, **body: Any) -> httpx.Response:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            return HTTP.request(method, f"{base}{path}", json=body or None, headers=headers, timeout=60)

        said = {"model": "smol", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2}
        assert ask(OTHER_KEY, "POST", "/v1/chat/completions", **said, keep_alive=0).status_code == 200
        time.sleep(0.5)
        assert [s.name for s in models.status() if s.loaded] == ["smol"]  # (its keep_alive: not heeded)
        for method, path, body in (
            ("POST", "/models/unload", {"model": "smol"}),
            ("POST", "/models/load", {"model": "smol"}),
            ("GET", "/api/ps", {}),
            ("GET", "/metrics", {}),
        ):
            refused = ask(OTHER_KEY, method, path, **body)
            assert refused.status_code == 403 and "operator key" in refused.text, (path, refused.text)
            assert ask(None, method, path, **body).status_code == 401
        assert served_models.served(url, OTHER_KEY) == 0  # (``llmsession models``: /api/ps is optional)
        listed = ask(OTHER_KEY, "GET", "/v1/models").json()["data"]  # (loaded, loading: others' doing)
        assert [card["id"] for card in listed] == ["smol"] and "status" not in listed[0], listed
        assert "status" not in ask(OTHER_KEY, "GET", "/v1/models/smol").json()
        assert ask(OPERATOR, "GET", "/v1/models").json()["data"][0]["status"] == {"value": "loaded"}
        assert ask(None, "GET", "/health").json() == {"status": "ok"}  # (no model named to anyone)
        assert ask(OPERATOR, "GET", "/api/ps").json()["models"][0]["name"] == "smol"
        assert "llmsession_requests_total" in ask(OPERATOR, "GET", "/metrics").text
        assert ask(OPERATOR, "POST", "/v1/chat/completions", **said, keep_alive=0).status_code == 200
        deadline = time.monotonic() + 10
        while any(s.loaded for s in models.status()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(s.loaded for s in models.status())  # (an operator's keep_alive: heeded)


def test_a_tenants_model_card_is_the_same_loaded_or_not(smollm2_path: Path) -> None:
    """Without the server's own context size, a card's ``context_size`` was the model's while
    it was loaded and null after: a tenant's ``/v1/models`` showed the others' loads and
    unloads. Once known it is kept (its first load still shows, as its kind does)."""
    models = Models({"smol": smollm2_path}, threads=2)
    with models, running(create_app(models, api_key=[KEY, OTHER_KEY], operator_key="sk-op")) as url:
        headers = {"Authorization": f"Bearer {OTHER_KEY}"}
        said = {"model": "smol", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2}
        assert HTTP.post(f"{url}/chat/completions", json=said, headers=headers, timeout=60).status_code == 200
        loaded = HTTP.get(f"{url}/models/smol", headers=headers, timeout=60).json()
        models.unload("smol")
        assert not any(s.loaded for s in models.status())
        assert HTTP.get(f"{url}/models/smol", headers=headers, timeout=60).json() == loaded
        assert loaded["context_size"] == 8192 and "status" not in loaded, loaded


def test_a_model_that_cannot_load_now_tells_a_tenant_nothing_of_the_others() -> None:
    """Why a model cannot load now is which others are held, their sizes and whether in use:
    another tenant's activity, the operators' to read (``/api/ps``, the log), not the 503's."""
    from llmsession.api._parking import full_message
    from llmsession.errors import ModelsFullError
    from llmsession.serve.hosts import no_room

    held = [("secret-model", 300 << 20, False)]
    error = no_room(ModelsFullError(full_message("chat", 100 << 20, None, held)), "chat")
    assert error.status == 503 and error.retry_after == 5 and "cannot load now" in error.message
    assert "secret-model" not in error.message and "MiB" not in error.message, error.message


def test_a_model_whose_file_fails_to_load_unloads_no_other_again(
    smollm2_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A configured file that does not load (corrupt, truncated) made every request for it
    unload the least recently used idle models first, then fail: a 500 that said nothing. Its
    failure is remembered for a while (its file unchanged): the next request unloads nothing
    and is not logged again; the client gets a typed 500 naming no path; a file replaced since
    is loaded again."""
    caplog.set_level(logging.ERROR, logger="llmsession.serve")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 4096)
    # (flash attention set: the file mended below is new, and a probe of it would take seconds)
    models = Models({"smol": smollm2_path, "bad": bad}, max_loaded=1, threads=1, flash_attention=False)
    with models, running(create_app(models, api_key=KEY)) as url:
        for attempt in range(2):
            assert chat(url, "smol", "Hi.").choices  # (loaded, then idle)
            with pytest.raises(openai.InternalServerError) as failed:
                chat(url, "bad", "Hi.")
            assert failed.value.code == "model_load_failed" and str(tmp_path) not in failed.value.message
            assert states(url)["smol"] == ("unloaded" if attempt == 0 else "loaded"), attempt
        assert len([r for r in caplog.records if r.name == "llmsession.serve"]) == 1
        bad.write_bytes(smollm2_path.read_bytes())  # (mended: tried again at once)
        assert chat(url, "bad", "Hi.").choices and states(url)["smol"] == "unloaded"


class LoadingModels:
    """A stand-in for ``Models`` (pure logic) whose one model loads until ``loaded`` is set,
    then finds no room, as a load behind models in use does."""

    def __init__(self) -> None:
        self.names, self.loaded = ["big"], threading.Event()

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def acquire(self, name: str, keep_alive: float | None = None) -> Any:
        from llmsession.errors import ModelsFullError

        self.loaded.wait(30)
        raise ModelsFullError("the models loaded are in use")


def test_requests_waiting_for_a_model_to_load_are_bounded_and_shared_by_key() -> None:
    """Every request for a model that loads waits for the load, holding its parsed request
    (up to 8 MiB of body): one key could keep thousands waiting. At most ``queue`` wait for one
    model, a quarter of them one key's (503s past that); one that leaves frees its place."""
    models = LoadingModels()
    hosts = ManyModels(models, SessionConfig(), 8, Metrics())  # type: ignore[arg-type]

    async def scenario() -> tuple[list[str], list[str]]:
        def wait(key: str) -> asyncio.Task[Any]:
            return asyncio.ensure_future(hosts.held("big", None, key))

        async def refused(key: str) -> str:
            with pytest.raises(ApiError) as caught:
                await hosts.held("big", None, key)
            assert caught.value.status == 503
            return caught.value.message

        waiting = [wait("a"), wait("a")]
        await asyncio.sleep(0.05)
        said = [await refused("a")]  # (a quarter of 8 are one key's)
        waiting[0].cancel()
        await asyncio.sleep(0.05)
        waiting[0] = wait("a")  # (a place given back)
        waiting += [wait(key) for key in "bbccdd"]
        await asyncio.sleep(0.05)
        said.append(await refused("e"))  # (8 wait)
        models.loaded.set()
        ends = await asyncio.gather(*waiting, return_exceptions=True)
        return said, [str(end) for end in ends if isinstance(end, ApiError)]

    said, ends = asyncio.run(scenario())
    assert "this key's" in said[0] and "too many requests wait" in said[1], said
    assert len(ends) == 8 and all("cannot load now" in end for end in ends), ends
