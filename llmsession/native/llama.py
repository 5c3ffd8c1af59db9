"""The thin layer over the cffi bindings: every native call llmsession makes goes through here
(this module: loading, return codes, the model and its vocabulary; ``context``: contexts,
decoding, memory and state; ``projector``: libmtmd; ``sampler``: sampler chains; ``cancel``).

Each native object (model, context, batch, sampler) has exactly one owner object here, freed by a
``weakref.finalize`` on every path: ``close()``, garbage collection or interpreter exit. A child's
finalizer holds its parent (a context its model), so a parent is never freed under a child, and no
owner sits in a reference cycle: dropping it frees the native memory at once, not at the next
cyclic GC. Return codes are checked by ``check`` and ``not_null``; token ids from callers are
range-checked before llama.cpp sees them; outside the native layer nothing touches ``lib``
(``smoke`` does, in the subprocess that checks a fresh build).

An exception that a native callback raised (Ctrl-C during a decode) is re-raised here once the
native call returns; a decode it interrupted raises ``DecodeAborted`` carrying it.
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from llmsession.errors import ModelClosedError, ModelLoadError, NativeError, TemplateError
from llmsession.native.inuse import InUse, free_model, holding
from llmsession.native.metadata import check_gguf_file
from llmsession.native.stateblob import Shape
from llmsession.text.detokenize import shown

_loaded: tuple[Any, Any] | None = None


def bindings() -> tuple[Any, Any]:
    """The loaded libraries and the ffi, opened on first use (importing llmsession loads nothing)."""
    global _loaded
    if _loaded is None:
        from llama_cffi import LibraryNotFoundError, load

        try:
            _loaded = load()
        except LibraryNotFoundError as error:
            raise ModelLoadError(str(error)) from error
    return _loaded


def check(code: int, what: str, ok: Callable[[int], bool] = lambda c: c == 0) -> int:
    """Raise NativeError unless a native return code means success."""
    if not ok(code):
        raise NativeError(f"{what} failed (return code {code})")
    return code


def not_null(pointer: Any, what: str, error: type[Exception] = NativeError) -> Any:
    _, ffi = bindings()
    if pointer == ffi.NULL:
        raise error(f"{what} failed")
    return pointer


def c_string(text: str, what: str) -> bytes:
    """UTF-8 bytes for a NUL-terminated C string; a NUL inside would silently truncate it."""
    if "\0" in text:
        raise ValueError(f"{what} contains a NUL character, which C strings cannot carry")
    return text.encode("utf-8")


def raise_pending() -> None:
    """Re-raise an exception a native callback raised on this thread during the last call."""
    from llama_cffi import take_pending_error

    error = take_pending_error()
    if error is not None:
        raise error


class Owner:
    """One native object's owner: ``ptr`` while it lives, ``ModelClosedError`` after ``close()``
    (a freed pointer handed to llama.cpp would crash the process)."""

    _free: weakref.finalize[Any, Any]
    _ptr: Any = None
    # The host memory llama.cpp allocated for this object beyond weights and KV cells (a context's
    # compute and output buffers, a projector's compute buffer), in bytes (``buffer_bytes``).
    buffers: int = 0

    @property
    def ptr(self) -> Any:
        if self._ptr is None or not self._free.alive:
            raise ModelClosedError(f"this {type(self).__name__} is closed (its model was closed)")
        return self._ptr

    @property
    def closed(self) -> bool:
        return self._ptr is None or not self._free.alive

    def close(self) -> None:
        if self._ptr is not None:
            self._free()


def rpc_devices(endpoints: Sequence[str]) -> list[Any]:
    """The devices the RPC servers at ``endpoints`` offer, in order."""
    lib, _ = bindings()
    devices = []
    for endpoint in endpoints:
        registry = not_null(
            lib.ggml_backend_rpc_add_server(c_string(endpoint, "RPC endpoint")),
            f"adding RPC server {endpoint}",
            ModelLoadError,
        )
        count = lib.ggml_backend_reg_dev_count(registry)
        devices += [
            not_null(lib.ggml_backend_reg_dev_get(registry, i), "an RPC device") for i in range(count)
        ]
    return devices


def device_names(endpoints: Sequence[str]) -> list[str]:
    """``name: description`` of each RPC server's devices (``llmsession doctor --rpc``)."""
    lib, ffi = bindings()
    return [
        f"{ffi.string(lib.ggml_backend_dev_name(d)).decode()}: "
        f"{ffi.string(lib.ggml_backend_dev_description(d)).decode()}"
        for d in rpc_devices(endpoints)
    ]


@holding(  # (the methods using the model or its vocabulary: ``close`` waits for them)
    "memory_shape chat_template token_text bos eos tokenize_bytes vocabulary piece cuts_in_segments"
    " special_tokens is_special detokenize is_eog apply_template"
)
class NativeModel(Owner):
    """Owns a ``llama_model``; ``close()`` closes its contexts and projector first."""

    def __init__(self, path: str | Path, *, gpu_layers: int = 0, rpc_servers: Sequence[str] = ()) -> None:
        """``rpc_servers``: endpoints that answered ``rpc.preflight`` (llama.cpp aborts the
        process on one that does not); their devices take the ``gpu_layers`` offloaded layers."""
        path = Path(path)
        check_gguf_file(path)  # the caller's mistake first, whether or not the libraries load
        lib, ffi = bindings()
        self.uses = InUse()  # (``in_use``: the calls under way, which ``close`` waits for)
        params = lib.llama_model_default_params()
        params.n_gpu_layers = gpu_layers
        devices = rpc_devices(rpc_servers)
        listed = ffi.new("ggml_backend_dev_t[]", [*devices, ffi.NULL])  # alive until the load ends
        if devices:
            params.devices = listed
        pointer = lib.llama_model_load_from_file(c_string(str(path), "model path"), params)
        if pointer != ffi.NULL:
            self._free = weakref.finalize(self, free_model, lib, pointer, self.uses)
        raise_pending()  # Ctrl-C while loading: the finalizer above frees what was loaded
        self._ptr = not_null(pointer, f"loading model {path}", ModelLoadError)
        self._vocab = lib.llama_model_get_vocab(self.ptr)
        self._children: weakref.WeakSet[Owner] = weakref.WeakSet()
        self._adopting = threading.Lock()  # (contexts are made on several threads)
        self.n_vocab: int = lib.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train: int = lib.llama_model_n_ctx_train(self.ptr)
        self.n_embd_out: int = lib.llama_model_n_embd_out(self.ptr)  # (a pooled vector's width)
        self.n_swa: int = lib.llama_model_n_swa(self.ptr)
        self.is_recurrent = bool(
            lib.llama_model_is_recurrent(self.ptr) or lib.llama_model_is_hybrid(self.ptr)
        )
        self.has_encoder = bool(lib.llama_model_has_encoder(self.ptr))
        self.has_decoder = bool(lib.llama_model_has_decoder(self.ptr))
        start = int(lib.llama_model_decoder_start_token(self.ptr))  # -1: BOS, as llama.cpp's tools do
        self.decoder_start: int = start if start >= 0 else int(lib.llama_vocab_bos(self._vocab))
        self.add_bos = bool(lib.llama_vocab_get_add_bos(self.vocab))

    def memory_shape(self) -> Shape:
        """What its memory's saved states depend on (``stateblob.layout``): its architecture,
        layers, window, kinds of memory, MLA (no V cache) and M-RoPE (cells with 2D positions)."""
        lib, ffi = bindings()
        ptr, buf = self.ptr, ffi.new("char[256]")
        found = lib.llama_model_meta_val_str(ptr, b"general.architecture", buf, 256) >= 0
        arch = ffi.string(buf).decode("utf-8", "replace") if found else ""
        mla = lib.llama_model_meta_val_str(ptr, f"{arch}.attention.key_length_mla".encode(), buf, 256) >= 0
        mrope = lib.llama_model_rope_type(ptr) in (lib.LLAMA_ROPE_TYPE_MROPE, lib.LLAMA_ROPE_TYPE_IMROPE)
        kinds = bool(lib.llama_model_is_recurrent(ptr)), bool(lib.llama_model_is_hybrid(ptr))
        return Shape(arch, int(lib.llama_model_n_layer(ptr)), self.n_swa, *kinds, mla=mla, mrope=mrope)

    @property
    def vocab(self) -> Any:
        self.ptr  # noqa: B018  (raises once the model is closed)
        return self._vocab

    def adopt(self, child: Owner) -> None:
        """Register a context or projector made from this model, to be closed before it."""
        with self._adopting:
            self._children.add(child)

    def children(self) -> list[Owner]:
        """The contexts and projector made from it and not yet collected (closed ones too)."""
        with self._adopting:
            return list(self._children)

    def held_buffers(self) -> int:
        """The bytes its open contexts and projector hold in buffers (``Owner.buffers``)."""
        return sum(child.buffers for child in self.children() if not child.closed)

    def close(self) -> None:
        self.uses.close()  # (new calls refused, those under way waited for: ``inuse``)
        for child in self.children():
            child.close()
        super().close()

    def chat_template(self) -> str | None:
        lib, ffi = bindings()
        text = lib.llama_model_chat_template(self.ptr, ffi.NULL)
        return None if text == ffi.NULL else ffi.string(text).decode("utf-8", "replace")

    def check_token(self, token: object) -> int:
        """A caller's token id as an int in range; llama.cpp aborts the process on a bad one."""
        try:
            value = operator.index(token)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(f"a token id must be an int, got {type(token).__name__}") from None
        if not 0 <= value < self.n_vocab:
            raise ValueError(f"token id {value} is out of range: the vocabulary has {self.n_vocab} tokens")
        return value

    def token_text(self, token: int) -> str:
        """The special-token spelling of a token (for BOS/EOS text in templates)."""
        lib, ffi = bindings()
        if token < 0:
            return ""
        token = self.check_token(token)
        return str(ffi.string(lib.llama_vocab_get_text(self.vocab, token)).decode("utf-8", "replace"))

    def bos(self) -> int:
        return int(bindings()[0].llama_vocab_bos(self.vocab))

    def eos(self) -> int:
        return int(bindings()[0].llama_vocab_eos(self.vocab))

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        # llama_tokenize takes a length: NUL characters survive
        return self.tokenize_bytes(text.encode("utf-8"), add_special=add_special, parse_special=parse_special)

    def tokenize_bytes(self, data: bytes, *, add_special: bool, parse_special: bool) -> list[int]:
        lib, ffi = bindings()
        capacity = len(data) + 8
        for _ in range(2):
            out = ffi.new("llama_token[]", capacity)
            n = lib.llama_tokenize(self.vocab, data, len(data), out, capacity, add_special, parse_special)
            if n >= 0:
                return list(ffi.unpack(out, n))
            capacity = -n
        raise NativeError("llama_tokenize failed")

    def vocabulary(self) -> tuple[list[bytes], list[bool], list[int]]:
        """What a grammar matcher needs: every token's bytes with special tokens spelled out,
        which tokens are control tokens (or user-defined ones spelled like ``<...>``), and every
        end-of-generation id."""
        lib, ffi = bindings()
        buf, pieces, control, eog = ffi.new("char[256]"), [], [], []
        for token in range(self.n_vocab):
            piece = self._piece(token, buf, special=True)
            pieces.append(piece)
            control.append(self._marked(token, piece))
            if lib.llama_vocab_is_eog(self.vocab, token):
                eog.append(token)
        return pieces, control, eog

    def piece(self, token: int, *, special: bool = False) -> bytes:
        """A token's bytes (generation output), special-token text only with ``special``."""
        buf = bindings()[1].new("char[64]")  # per call: the GIL is released while llama.cpp writes it
        return self._piece(self.check_token(token), buf, special=special)

    def cuts_in_segments(self) -> bool:
        """Whether a text's tokens are its segments' (``text.segments``) as llama.cpp tokenizes
        the vocabulary: SentencePiece and BPE ones (each fragment between special tokens alone),
        where tokenizing adds no EOS at the end."""
        lib = bindings()[0]
        kind = lib.llama_vocab_type(self.vocab)
        fragments = kind in (lib.LLAMA_VOCAB_TYPE_SPM, lib.LLAMA_VOCAB_TYPE_BPE)
        return bool(fragments and not lib.llama_vocab_get_add_eos(self.vocab))

    def special_tokens(self) -> list[tuple[str, bool, bool, bool]]:
        """The tokens llama.cpp finds in text before it tokenizes the rest (control, user-defined
        and unknown ones, as special tokens are parsed): their text, whether each strips the
        whitespace on its left, on its right, and whether it is found only with special tokens
        parsed (control and unknown ones). One pass over the vocabulary: 262k tokens on Gemma."""
        lib = bindings()[0]
        get_attr, vocab = lib.llama_vocab_get_attr, self.vocab
        only = lib.LLAMA_TOKEN_ATTR_CONTROL | lib.LLAMA_TOKEN_ATTR_UNKNOWN
        left, right = lib.LLAMA_TOKEN_ATTR_LSTRIP, lib.LLAMA_TOKEN_ATTR_RSTRIP
        attrs = ((token, int(get_attr(vocab, token))) for token in range(self.n_vocab))
        found = [(token, attr) for token, attr in attrs if attr & (only | lib.LLAMA_TOKEN_ATTR_USER_DEFINED)]
        return [(self.token_text(t), bool(a & left), bool(a & right), bool(a & only)) for t, a in found]

    def is_special(self, token: int) -> bool:
        """A token the grammar matcher knows as special (``vocabulary``): one a grammar must name
        by id, not spell as text."""
        token = self.check_token(token)
        return self._marked(token, self._piece(token, bindings()[1].new("char[256]"), special=True))

    def _marked(self, token: int, piece: bytes) -> bool:
        """A control token, or a user-defined one spelled like ``<...>``: special to the matcher."""
        lib = bindings()[0]
        attr = int(lib.llama_vocab_get_attr(self.vocab, token))
        spelled = piece.startswith(b"<") and piece.endswith(b">")
        return bool(
            attr & lib.LLAMA_TOKEN_ATTR_CONTROL or (attr & lib.LLAMA_TOKEN_ATTR_USER_DEFINED and spelled)
        )

    def _piece(self, token: int, buf: Any, *, special: bool) -> bytes:
        """``llama_token_to_piece`` into ``buf``, or into a larger buffer when it asks for one."""
        lib, ffi = bindings()
        n = lib.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ffi.new("char[]", -n)
            n = check(
                lib.llama_token_to_piece(self.vocab, token, buf, -n, 0, special),
                "token_to_piece",
                non_negative,
            )
        return bytes(ffi.buffer(buf, n))

    def detokenize(self, tokens: Sequence[int], *, special: bool = False) -> str:
        """The tokens' text, as a reply shows it: an invalid byte, and a NUL, as U+FFFD."""
        lib, ffi = bindings()
        if isinstance(tokens, str | bytes):
            raise TypeError("tokens must be a sequence of token ids")
        tokens = [self.check_token(token) for token in tokens]
        ids = ffi.new("llama_token[]", tokens)
        capacity = max(64, 8 * len(tokens))
        for _ in range(2):
            buf = ffi.new("char[]", capacity)
            n = lib.llama_detokenize(self.vocab, ids, len(tokens), buf, capacity, False, special)
            if n >= 0:
                return shown(bytes(ffi.buffer(buf, n)).decode("utf-8", "replace"))
            capacity = -n
        raise NativeError("llama_detokenize failed")

    def is_eog(self, token: int) -> bool:
        return bool(bindings()[0].llama_vocab_is_eog(self.vocab, self.check_token(token)))

    def apply_template(
        self, template: str | None, messages: Sequence[tuple[str, str]], add_ass: bool
    ) -> str | None:
        """llama_chat_apply_template; None when llama.cpp does not know the template. A NUL in
        a message is a TemplateError (C strings cannot carry one)."""
        lib, ffi = bindings()
        try:
            keep = [(c_string(role, "role"), c_string(content, "message")) for role, content in messages]
        except ValueError as error:
            raise TemplateError(str(error)) from None
        chat = ffi.new("struct llama_chat_message[]", len(keep))
        owned = []
        for i, (role, content) in enumerate(keep):
            owned.append((ffi.new("char[]", role), ffi.new("char[]", content)))
            chat[i].role, chat[i].content = owned[-1]
        tmpl = ffi.NULL if template is None else ffi.new("char[]", c_string(template, "template"))
        capacity = 2 * sum(len(r) + len(c) for r, c in keep) + 256
        for _ in range(2):
            buf = ffi.new("char[]", capacity)
            n = lib.llama_chat_apply_template(tmpl, chat, len(keep), add_ass, buf, capacity)
            if n < 0:
                return None
            if n <= capacity:
                return bytes(ffi.buffer(buf, n)).decode("utf-8")
            capacity = n + 1
        raise NativeError("llama_chat_apply_template kept growing its output")


def non_negative(code: int) -> bool:
    return code >= 0


def state_seq_version() -> int:
    return int(bindings()[0].LLAMA_STATE_SEQ_VERSION)


def system_info() -> str:
    lib, ffi = bindings()
    return str(ffi.string(lib.llama_print_system_info()).decode())


def build_commit() -> str:
    lib, ffi = bindings()
    return str(ffi.string(lib.ggml_commit()).decode())
