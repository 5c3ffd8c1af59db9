"""Smoke-test a llama.cpp build: load the libraries and, given a model, decode a few tokens.

Run in a subprocess by ``llmsession setup`` (``python -m llmsession.native.smoke LIB_DIR [MODEL]``),
so a crashing build fails set-up with a clear message.
Prints the build's commit on the last line.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from llama_cffi import load


def decode_a_few_tokens(lib: Any, ffi: Any, model_path: str) -> None:
    params = lib.llama_model_default_params()
    model = lib.llama_model_load_from_file(model_path.encode(), params)
    assert model != ffi.NULL, "model failed to load"
    cparams = lib.llama_context_default_params()
    threads = min(2, len(os.sched_getaffinity(0)))  # (never more threads than cores: they spin)
    cparams.n_ctx, cparams.n_batch, cparams.n_threads, cparams.n_threads_batch = 256, 64, threads, threads
    ctx = lib.llama_init_from_model(model, cparams)
    assert ctx != ffi.NULL, "context failed to initialise"
    vocab = lib.llama_model_get_vocab(model)
    text = b"The capital of France is"
    tokens = ffi.new("llama_token[64]")
    n = lib.llama_tokenize(vocab, text, len(text), tokens, 64, True, False)
    assert n > 0, "tokenize failed"
    for step in range(4):
        batch = lib.llama_batch_get_one(tokens, n)
        assert lib.llama_decode(ctx, batch) == 0, f"decode failed at step {step}"
        logits = lib.llama_get_logits_ith(ctx, -1)
        n_vocab = lib.llama_vocab_n_tokens(vocab)
        best = max(range(n_vocab), key=lambda i: logits[i])
        assert all(abs(logits[i]) < 1e6 for i in range(0, n_vocab, 97)), "non-finite logits"
        tokens[0], n = best, 1
    lib.llama_free(ctx)
    lib.llama_model_free(model)


def main() -> int:
    lib, ffi = load(sys.argv[1])
    if len(sys.argv) > 2:
        decode_a_few_tokens(lib, ffi, sys.argv[2])
        print("decoded 4 tokens", file=sys.stderr)
    print(ffi.string(lib.ggml_commit()).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
