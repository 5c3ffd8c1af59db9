"""Embeddings from an embedding model (a tiny BERT-style fixture: mean pooling read from its
GGUF): ``Model.embed`` batched over sequences equals llama.cpp's own embedding of each text
alone (``data/embed_reference.c``, compiled against the same libraries) within float noise, and
so does ``/v1/embeddings`` through the official ``openai`` client, on a server of several models
beside a chat model. A chat model asked for embeddings, or an embedding model asked to chat,
is refused naming the reason."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import internals
import numpy as np
import openai
import pytest
from llama_cffi import include_dir, lib_dir
from plain_http import HTTP
from serve_helpers import KEY, OTHER_KEY, running

from llmsession import (
    ContextOverflowError,
    Model,
    ModelClosedError,
    ModelOutputError,
    Models,
    UnsupportedFeatureError,
)
from llmsession.runtime.embedding import SEQUENCES
from llmsession.serve.app import create_app

TEXTS = ["hello world", "a different sentence", "the quick brown fox jumps over the lazy dog", "cat"]
NOISE = 1e-4  # (batched with others against alone: the sums run in another order)


@pytest.fixture(scope="module")
def bert_path(fixture_path: Callable[[str], Path]) -> Path:
    return fixture_path("bert-tiny.gguf")


@pytest.fixture(scope="module")
def bert(bert_path: Path) -> Iterator[Model]:
    with Model(bert_path, threads=1) as model:
        yield model


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, bert_path: Path) -> np.ndarray:
    """llama.cpp's own embeddings of ``TEXTS``, one process, each text alone."""
    exe = tmp_path_factory.mktemp("reference") / "embed_reference"
    source = Path(__file__).parent / "data" / "embed_reference.c"
    libs = ["-lllama", "-lggml", "-lggml-base", "-lm", f"-Wl,-rpath,{lib_dir()}"]
    subprocess.run(
        ["gcc", "-O1", "-o", str(exe), str(source), f"-I{include_dir()}", f"-L{lib_dir()}", *libs], check=True
    )
    out = subprocess.run(
        [str(exe), str(bert_path), *TEXTS], check=True, capture_output=True, text=True
    ).stdout
    return np.array([[float(x) for x in line.split()] for line in out.splitlines()], dtype=np.float32)


def test_embed_equals_llama_cpps_own_embedding_of_each_text(bert: Model, reference: np.ndarray) -> None:
    vectors = bert.embed(TEXTS)
    assert vectors.shape == (len(TEXTS), 64) and vectors.dtype == np.float32
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert np.abs(vectors - reference).max() < NOISE
    assert np.abs(vectors[0] - vectors[1]).max() > 0.1  # (texts that differ embed apart)


def test_an_embedding_model_holds_its_context_from_load_and_no_chat_cells(bert_path: Path) -> None:
    with Model(bert_path, threads=1) as model:
        at_load = model.memory()
        assert at_load.kv_bytes == 0 and internals.reported_buffers(model) > 0, at_load
        model.embed(TEXTS)
        assert model.memory().buffer_bytes == at_load.buffer_bytes  # (nothing made later)


def test_a_model_without_cells_gets_a_batch_of_rows_whatever_is_asked(bert_path: Path) -> None:
    """A BERT-style model decodes through its encoder, every token an output: a context asked to
    reserve fewer rows (a chat context's, the flash-attention probe's) reserves a batch of them
    instead of letting llama.cpp abort the process (in a child: an abort would end the tests)."""
    code = f"""
        from llmsession.native.llama import NativeModel
        from llmsession.native.context import NativeContext
        native = NativeModel({str(bert_path)!r})
        context = NativeContext(native, n_ctx=300, n_batch=32, threads=1, outputs_per_seq=1)
        context.decode(list(range(100, 116)), 0)
        assert context.batch.max_outputs == 32
        print("decoded")
    """
    ran = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0 and "decoded" in ran.stdout, ran.stderr[-2000:]


def test_more_inputs_than_a_batch_holds_equal_each_alone(bert: Model) -> None:
    long = " ".join(TEXTS[2].split() * 12)  # (about 110 tokens: five fill a batch of 512)
    many = [f"{TEXTS[i % len(TEXTS)]} {i}" for i in range(SEQUENCES * 2 + 3)] + [long, f"{long} cat"] * 4
    batched = bert.embed(many)
    alone = np.stack([bert.embed(text)[0] for text in many])
    assert batched.shape == (len(many), 64) and np.abs(batched - alone).max() < NOISE
    assert np.array_equal(bert.embed([bert.tokenize("cat")]), bert.embed("cat"))  # (ids as text)
    raw = bert.embed("cat", normalize=False)
    assert np.allclose(raw / np.linalg.norm(raw), bert.embed("cat"), atol=1e-6)


def test_bad_inputs_are_refused_before_anything_runs(bert: Model, smollm2: Model) -> None:
    for bad in ([], [""], [[-1]], [[10**6]], [3.5], [[]], b"cat", [b"cat", "dog"], (bytearray(b"cat"),)):
        with pytest.raises(ValueError):
            bert.embed(bad)  # type: ignore[arg-type]
    with pytest.raises(ContextOverflowError, match="input 1 has"):
        bert.embed(["cat", "dog " * 600])
    with pytest.raises(ContextOverflowError, match="input 0 has 3000 tokens"):  # (one input, as ids)
        bert.embed([5] * 3000)
    with pytest.raises(UnsupportedFeatureError, match="chat model"):
        smollm2.embed("hello")
    for flag in ("no", 0, None):  # ("no" normalized: a non-empty string is true)
        with pytest.raises(TypeError, match="normalize must be a bool"):
            bert.embed("cat", normalize=flag)  # type: ignore[arg-type]
    asked = [{"role": "user", "content": "Hi"}]
    for thinking in ("yes", "hihg", 1):  # (read as true; an effort is "low", "medium" or "high")
        with pytest.raises(TypeError, match="thinking must be"):
            smollm2.render(asked, thinking=thinking)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="thinking must be"):
            smollm2.prompt_tokens(asked, thinking=thinking)  # type: ignore[arg-type]
    assert smollm2.render(asked, thinking="low") == smollm2.render(asked, thinking=True)  # (no switch)
    with pytest.raises(UnsupportedFeatureError, match="embedding model"):
        bert.chat([{"role": "user", "content": "Hi."}])


@pytest.fixture(scope="module")
def served(smollm2_path: Path, bert_path: Path) -> Iterator[str]:
    models = Models({"smol": smollm2_path, "bert": bert_path}, threads=1)
    with models, running(create_app(models, api_key=KEY)) as url:
        yield url


def test_the_embeddings_endpoint_equals_embed_and_refuses_a_chat_model(
    served: str, bert: Model, reference: np.ndarray
) -> None:
    client = openai.OpenAI(base_url=served, api_key=KEY, max_retries=0, timeout=60)
    answer = client.embeddings.create(model="bert", input=TEXTS)  # (the client asks for base64)
    got = np.array([item.embedding for item in sorted(answer.data, key=lambda d: d.index)], dtype=np.float32)
    assert np.abs(got - bert.embed(TEXTS)).max() == 0 and np.abs(got - reference).max() < NOISE
    assert answer.model == "bert"
    assert answer.usage.prompt_tokens == sum(len(bert.tokenize(t)) for t in TEXTS)
    floats = client.embeddings.create(model="bert", input="cat", encoding_format="float")
    assert np.allclose(floats.data[0].embedding, bert.embed("cat")[0], atol=1e-6)
    with pytest.raises(openai.BadRequestError, match="chat model"):
        client.embeddings.create(model="smol", input="cat")
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.chat.completions.create(model="bert", messages=[{"role": "user", "content": "Hi."}])
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model="bert", input="cat", dimensions=8)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="cat")
    ids = client.embeddings.create(model="bert", input=[bert.tokenize("cat")], encoding_format="float")
    assert np.allclose(ids.data[0].embedding, bert.embed("cat")[0], atol=1e-6)
    with pytest.raises(openai.BadRequestError, match="token ids must be in"):
        client.embeddings.create(model="bert", input=[[10**6]])


def test_the_answer_is_written_off_the_event_loop(served: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """2,048 vectors of floats are tens of MB of JSON (1.6 s for 1,024 dimensions): written on
    the event loop, they stopped every stream and health check meanwhile."""
    from llmsession.serve import embeddings

    loops: list[bool] = []

    def answer(*args: Any) -> Any:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            loops.append(False)
        else:
            loops.append(True)
        return written(*args)

    written = embeddings.answer
    monkeypatch.setattr(embeddings, "answer", answer)
    client = openai.OpenAI(base_url=served, api_key=KEY, max_retries=0, timeout=60)
    assert len(client.embeddings.create(model="bert", input=["a"] * 3, encoding_format="float").data) == 3
    assert loops == [False]


def test_closing_the_model_while_it_embeds_waits_for_the_run(bert_path: Path) -> None:
    model = Model(bert_path, threads=1)
    got: list[object] = []

    def embed() -> None:
        try:
            got.append(model.embed([[5, 6, 7] * 30] * 2000))
        except ModelClosedError as error:  # (closed before the run began: a typed error)
            got.append(error)

    thread = threading.Thread(target=embed)
    thread.start()
    time.sleep(0.05)
    model.close()  # (the embedding context goes once the run is over, not under it)
    thread.join(60)
    done = got[0] if len(got) == 1 else None
    assert isinstance(done, ModelClosedError) or (isinstance(done, np.ndarray) and done.shape == (2000, 64))
    with pytest.raises(ModelClosedError):
        model.embed("cat")


def test_embedding_requests_past_the_waiting_bound_are_a_503(
    bert_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One run at a time, and at most ``KEYS_WAITING`` of a key's requests waiting for it (each
    holds its inputs, up to 2,048 of them): the key's next is refused with a 503 the client may
    retry, another key's waits, and the waiting ones are answered once the run ends (one key's
    requests took every place: ``MAX_WAITING``, the bound of all, is theirs and another's)."""
    from llmsession.serve import embeddings

    release = threading.Event()
    real = embeddings.embedded

    def held_up(model: Model, ask: Any, stop: threading.Event) -> Any:
        release.wait(60)
        return real(model, ask, stop)

    monkeypatch.setattr(embeddings, "embedded", held_up)
    with Model(bert_path, threads=1) as bert:
        app = create_app(bert, api_key=[KEY, OTHER_KEY])
        server = app.state.server
        with running(app) as url:
            statuses: list[int] = []

            def ask(key: str = KEY) -> None:
                answer = HTTP.post(
                    f"{url}/embeddings",
                    json={"model": "bert", "input": "cat"},
                    headers={"Authorization": f"Bearer {key}"},
                    timeout=60,
                )
                statuses.append(answer.status_code)

            def waiting(n: int) -> None:
                deadline = time.monotonic() + 30
                while server.waiting[embeddings.WAITING] < n:
                    assert time.monotonic() < deadline, server.waiting.counts
                    time.sleep(0.01)

            threads = [threading.Thread(target=ask) for _ in range(1 + embeddings.KEYS_WAITING)]
            for thread in threads:
                thread.start()
            waiting(embeddings.KEYS_WAITING)
            ask()  # (one more of the key's: past its bound)
            assert statuses == [503]
            threads.append(threading.Thread(target=ask, args=(OTHER_KEY,)))  # (another key's: it waits)
            threads[-1].start()
            waiting(embeddings.KEYS_WAITING + 1)
            assert embeddings.KEYS_WAITING + 1 <= embeddings.MAX_WAITING and statuses == [503]
            release.set()
            for thread in threads:
                thread.join(60)
    assert statuses == [503] + [200] * (2 + embeddings.KEYS_WAITING)


def test_an_embed_that_begins_as_its_model_closes_makes_no_context(bert_path: Path) -> None:
    """``Model.close`` frees the embedding context, then the model: an embed that passed the
    model's open check just before made a new context that the model's free then pulled out
    from under it (a use after free). Once its context is closed, no embed makes another."""
    with Model(bert_path, threads=1) as model:
        embedder = internals.local(model).embedder
        embedder.close()  # (where ``close`` is when the embed takes the lock)
        with pytest.raises(ModelClosedError):
            embedder.embed("cat", model.tokenize)
        assert embedder._context is None


def test_a_model_that_computes_nan_is_a_typed_error_not_a_vector(bert_path: Path, tmp_path: Path) -> None:
    """A broken file (a NaN in its last norm): ``embed`` raises ``ModelOutputError`` naming the
    input, never NaN arrays; the server answers a 500 saying so (it was a bare one: JSON holds
    no NaN), which the client is told not to send again."""
    broken = tmp_path / "bert-nan.gguf"
    shutil.copyfile(bert_path, broken)
    reader = gguf.GGUFReader(broken, "r+")
    next(t for t in reader.tensors if t.name == "blk.1.layer_output_norm.bias").data[:] = np.nan
    del reader  # (its map written back)
    with Model(broken, threads=1) as model:
        with pytest.raises(ModelOutputError, match="input 0 is not finite"):
            model.embed(["cat", "dog"])
        with running(create_app(model, api_key=KEY)) as url:
            client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60)
            with pytest.raises(openai.InternalServerError, match="not finite") as failed:
                client.embeddings.create(model=client.models.list().data[0].id, input="cat")
    assert failed.value.code == "model_output_invalid"
    assert failed.value.response.headers["x-should-retry"] == "false"


def test_an_embeddings_request_is_bounded_in_tokens_and_a_chat_model_tokenizes_nothing(
    served: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One request runs at a time, the others waiting behind it: 2,048 inputs of 8,192 token ids
    each fit in a body (16M tokens, minutes of every core, run on past a disconnect). At most
    ``MAX_TOKENS`` in all (OpenAI's 300,000); a chat model refuses before it tokenizes 8 MiB."""
    from llmsession.serve import embeddings

    client = openai.OpenAI(base_url=served, api_key=KEY, max_retries=0, timeout=60)
    monkeypatch.setattr(embeddings, "MAX_TOKENS", 12)
    assert client.embeddings.create(model="bert", input=["cat"] * 4).usage.prompt_tokens <= 12
    with pytest.raises(openai.BadRequestError, match="at most 12 tokens in all"):
        client.embeddings.create(model="bert", input=["the quick brown fox"] * 4)
    tokenized: list[str] = []
    monkeypatch.setattr(Model, "tokenize", lambda model, text, *a, **k: tokenized.append(text) or [1])
    with pytest.raises(openai.BadRequestError, match="chat model"):
        client.embeddings.create(model="smol", input=["cat"] * 100)
    assert tokenized == []


def test_an_embedding_context_is_sized_whatever_length_the_file_says() -> None:
    """A file's trained length of 2**32 - 1 reads as -1 (an int32): the context was -1, a raw
    OverflowError at load. Unknown or absurd, it is taken as the most an input may have."""
    from llmsession.runtime.embedding import MAX_CONTEXT, MIN_BATCH, context_size

    assert context_size(-1, 1000) == context_size(0, 1000) == MAX_CONTEXT
    assert context_size(2**31 - 1, 1000) == MAX_CONTEXT and context_size(600, 1000) == 600
    assert context_size(-1, 30_000) == 2236  # (a batch's logits: 256 MiB of 30,000 floats a row)
    assert context_size(-1, 250_000) == MIN_BATCH == context_size(2**31 - 1, 10**9)


class Unknown:
    """An object of a class the worker cannot import (pickled by reference to this module)."""


def test_bad_inputs_are_the_same_value_error_in_a_worker(bert: Model, bert_path: Path) -> None:
    """An isolated model turned what it was given into plain lists before checking it: a numpy
    array of ids or a bare int was a TypeError there, a ValueError in-process. An object the
    worker could not unpickle ended the worker (the model closed, "died"): refused before it
    is sent, the model goes on."""
    with Model(bert_path, threads=1, isolated=True) as isolated:
        for bad in (np.array([1, 2]), 5, [Unknown()], [[1, Unknown()]]):
            for model in (bert, isolated):
                with pytest.raises(ValueError, match=r"embed takes|a str or a list of token ids"):
                    model.embed(bad)  # type: ignore[arg-type]
        assert np.allclose(isolated.embed(["cat"]), bert.embed(["cat"]), atol=1e-6)


def test_a_client_gone_stops_its_embedding_run_and_a_piece_names_inputs_as_sent(served: str) -> None:
    """A request ran to its end whoever waited: 300,000 tokens are seconds to minutes of every
    core, and every other embedding request waited behind it. It runs a batch's worth at a
    time now, and stops between two once its client is gone; an input refused in a later piece
    is named by its place in the request."""
    import httpx

    client = openai.OpenAI(base_url=served, api_key=KEY, max_retries=0, timeout=60)
    client.embeddings.create(model="bert", input="cat")  # (the model loaded)
    big = {"model": "bert", "input": [[5, 6, 7, 8] * 35] * 2048}  # (286,720 tokens: ~5 s on one core)
    with pytest.raises(httpx.ReadTimeout):
        HTTP.post(f"{served}/embeddings", json=big, headers={"Authorization": f"Bearer {KEY}"}, timeout=0.5)
    begun = time.monotonic()
    client.embeddings.create(model="bert", input="cat")  # (waits for the run before it to stop)
    assert time.monotonic() - begun < 1.5
    with pytest.raises(openai.BadRequestError, match="input 20: token ids must be in"):
        client.embeddings.create(model="bert", input=[[5, 6]] * 20 + [[10**6]])
