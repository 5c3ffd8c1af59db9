"""The ggml thread pool a context decodes with, and what a forked child does without its
threads. Part of the native layer (see ``native``)."""

from __future__ import annotations

import os
import weakref
from typing import Any

from llmsession.native.llama import Owner, bindings, not_null

POLL = 1  # how long a thread pool's workers spin for the next graph before they sleep (a few ms)


class ThreadPool:
    """Owns the ggml thread pool a context decodes with. Without one, the CPU backend starts and
    joins its worker threads for every graph it computes, which cost 3-4 % of a generated token
    here (llama-bench and llama-server keep one too). Its workers spin ``POLL`` for the next graph
    (a stream's next token comes within a millisecond), then sleep. A forked child has none of
    its threads: there the context decodes without it (``_forget_pools``) and it is never freed."""

    def __init__(self, threads: int) -> None:
        lib, ffi = bindings()
        params = ffi.new("struct ggml_threadpool_params *", lib.ggml_threadpool_params_default(threads))
        params.poll = POLL
        self.ptr = not_null(lib.ggml_threadpool_new(params), "creating a ggml thread pool")
        self.pid = os.getpid()

    def free(self) -> None:
        if self.ptr is not None and self.pid == os.getpid():
            bindings()[0].ggml_threadpool_free(self.ptr)
        self.ptr = None


POOLED: weakref.WeakSet[Owner] = weakref.WeakSet()  # the contexts with a thread pool


def _forget_pools() -> None:
    """In a forked child: the pools' worker threads are the parent's, so decode without them."""
    lib: Any = bindings()[0]
    for context in list(POOLED):
        if not context.closed:
            lib.llama_detach_threadpool(context.ptr)


os.register_at_fork(after_in_child=_forget_pools)
