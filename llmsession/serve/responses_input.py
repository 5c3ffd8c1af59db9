"""A Responses body's ``input`` items as chat messages: ``message`` (text and ``input_image``
parts), ``function_call`` joined to its assistant turn, ``function_call_output`` as a ``tool``
message (the images among its parts after the outputs, as the user's), and ``reasoning`` as the
reasoning of the assistant turn that follows it. Pure."""

from __future__ import annotations

from typing import Any

from llmsession.serve.body import kind_of, string
from llmsession.serve.chat_messages import check_parts
from llmsession.serve.errors import ApiError
from llmsession.serve.schema import MAX_MESSAGES

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def input_messages(value: object, images: bool = True) -> list[dict[str, Any]]:
    """The input items as chat messages. The images function call outputs hold (Codex's
    ``view_image``) follow the outputs as a user message's, before what the user says next (a
    tool message holds text)."""
    if isinstance(value, str):
        if not value:
            raise ApiError("input must be a non-empty string or a list of items", "input")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ApiError("input must be a non-empty string or a list of items", "input")
    if len(value) > MAX_MESSAGES:
        raise ApiError(f"input: at most {MAX_MESSAGES} items, got {len(value)}", "input")
    out: list[dict[str, Any]] = []
    thought: dict[str, Any] | None = None  # a reasoning item's stand-in (last), before its turn
    shown: list[dict[str, Any]] = []  # the images of the outputs just read
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(f"{where} must be an object, got {kind_of(item)}", where)
        kind = item.get("type", "message")
        added: dict[str, Any] | None = None  # (a reasoning item's stand-in, if it adds one)
        pictures = None  # (the outputs' images, as a user message: one that follows joins them)
        if shown and kind != "function_call_output":
            pictures, shown = {"role": "user", "content": shown}, []
            out.append(pictures)
        if thought is not None and kind not in ("message", "function_call"):
            out.pop()  # (reasoning no assistant turn followed: nothing to render it with)
        if kind == "message":
            message = _message(item, where)
            if pictures is not None and message["role"] == "user":
                message = {"role": "user", "content": [*out.pop()["content"], *_parts(message)]}
            if thought is not None:
                out.pop()  # (the stand-in, last: its reasoning goes with an assistant turn)
                if message["role"] == "assistant":
                    message = {**message, "reasoning_content": thought["reasoning_content"]}
            out.append(message)
        elif kind == "function_call":
            _call(item, where, out)  # (joined to the reasoning's stand-in: its turn now)
        elif kind == "function_call_output":
            out.append(_output(item, where, images, shown))
        elif kind == "reasoning":
            added = _thought(item, where, out)  # (None: it held nothing to render)
        else:
            raise ApiError(f"{where}: items of type {kind!r:.40} are not supported here", f"{where}.type")
        thought = added
    if thought is not None:
        out.pop()  # (reasoning nothing followed: no turn to render it with)
    if shown:
        out.append({"role": "user", "content": shown})
    if not out:
        raise ApiError("input holds nothing to answer", "input")
    return out


def _thought(item: dict[str, Any], where: str, out: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A reasoning item sent back: the reasoning of the assistant turn that follows it (its
    ``reasoning_text`` parts, else its summary; an encrypted one alone is nothing here), as a
    stand-in added to ``out`` (returned; None where it added none)."""
    texts: list[str] = []
    for name, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(name) or []
        if not isinstance(parts, list):
            raise ApiError(f"{where}.{name} must be a list", f"{where}.{name}")
        found = [p.get("text") for p in parts if isinstance(p, dict) and p.get("type") == kind]
        texts = [text for text in found if isinstance(text, str)]
        if len(texts) != len(found):
            raise ApiError(f"{where}.{name}: a part's text must be a string", f"{where}.{name}")
        if texts:
            break
    if not texts:
        return None
    out.append({"role": "assistant", "content": "", "reasoning_content": "\n".join(texts)})
    return out[-1]


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise ApiError(f"{where}.role must be one of {sorted(ROLES)}, got {role!r:.40}", f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": ROLES[role], "content": content}
    if not isinstance(content, list):
        raise ApiError(f"{where}.content must be a string or a list of parts", f"{where}.content")
    check_parts(content, f"{where}.content")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS:
            parts.append(
                {"type": "text", "text": string(part.get("text", part.get("refusal")), f"{at}.text")}
            )
        elif kind == "input_image":
            parts.append(_image_part(part, at))
        else:
            raise ApiError(f"{at}: only text and input_image parts are supported here, got {kind!r:.40}", at)
    if ROLES[role] != "user" and all(p["type"] == "text" for p in parts):  # (images: the check's)
        return {"role": ROLES[role], "content": "".join(p["text"] for p in parts)}
    return {"role": ROLES[role], "content": parts}


def _image_part(part: dict[str, Any], at: str) -> dict[str, Any]:
    url = part.get("image_url")
    if not isinstance(url, str):
        raise ApiError(f"{at}: an image must be a base64 data: URL (nothing is fetched)", at)
    return {"type": "image_url", "image_url": {"url": url}}


def _call(item: dict[str, Any], where: str, out: list[dict[str, Any]]) -> None:
    """A call the model made: joined to the assistant message just before it, if it has one."""
    ident, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
    if not (isinstance(ident, str) and isinstance(name, str) and isinstance(arguments, str)):
        raise ApiError(f"{where}: a function_call needs a call_id, a name and arguments as JSON text", where)
    call = {"id": ident, "type": "function", "function": {"name": name, "arguments": arguments}}
    last = out[-1] if out else None
    if last is not None and last["role"] == "assistant" and isinstance(last["content"], str):
        last.setdefault("tool_calls", []).append(call)
    else:
        out.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _parts(message: dict[str, Any]) -> list[dict[str, Any]]:
    content = message["content"]
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


def _output(item: dict[str, Any], where: str, images: bool, shown: list[dict[str, Any]]) -> dict[str, Any]:
    """A function call's output as a ``tool`` message; the images among its parts go to
    ``shown`` (a line in the text says where), or, for a model without images, a line says one
    was left out (a file, likewise: nothing reads it here)."""
    ident, output = item.get("call_id"), item.get("output")
    if isinstance(output, list):
        texts = []
        for k, part in enumerate(output):
            at = f"{where}.output[{k}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in TEXT_PARTS:
                texts.append(string(part.get("text"), f"{at}.text"))
            elif kind == "input_image" and images:
                shown.append(_image_part(part, at))
                texts.append("[image: below]")
            elif kind in ("input_image", "input_file"):
                texts.append(f"[{kind} part: not shown to this model]")
            else:
                raise ApiError(f"{at}: an output holds text, image and file parts, got {kind!r:.40}", at)
        output = "\n".join(texts)
    if not (isinstance(ident, str) and isinstance(output, str)):
        raise ApiError(f"{where}: a function_call_output needs a call_id and an output string", where)
    return {"role": "tool", "tool_call_id": ident, "content": output}
