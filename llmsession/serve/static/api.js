// The server: its OpenAI endpoints (/v1/models, /v1/chat/completions), and nothing else. No state
// and no DOM here: the API key is passed in, and failures are thrown.

import { CHOICES, parseSettings } from "./store.js";

// The server answered with an error status (its OpenAI error message, else the status).
export class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.name = "HttpError";
    this.status = status;
  }
}

// The request never reached the server (`fetch` itself failed).
export class Unreachable extends Error {
  constructor(message) {
    super(message);
    this.name = "Unreachable";
  }
}

function headers(key) {
  const out = { "Content-Type": "application/json" };
  if (key) out.Authorization = "Bearer " + key;
  return out;
}

async function errorText(response) {
  try {
    const body = await response.json();
    if (body && body.error && typeof body.error.message === "string") return body.error.message;
  } catch (_) {
    // not JSON: the status says it
  }
  return "HTTP " + response.status;
}

// The cards of the models the server serves (/v1/models): one, or several it loads on demand
// (each with its status: loaded, unloaded, loading, unloading).
export async function modelCards(key) {
  let response;
  try {
    response = await fetch("v1/models", { headers: headers(key) });
  } catch (error) {
    throw new Unreachable(error.message);
  }
  if (!response.ok) throw new HttpError(response.status, await errorText(response));
  const body = await response.json();
  return body.data;
}

// -- a chat completion ---------------------------------------------------------------------------
function wire(m) {
  if (m.role === "tool") return { role: "tool", tool_call_id: m.toolCallId, content: m.content };
  if (m.role === "assistant") {
    const out = { role: "assistant", content: m.content };
    if (m.toolCalls && m.toolCalls.length) {
      out.tool_calls = m.toolCalls.map((c) => ({
        id: c.id,
        type: "function",
        function: { name: c.name, arguments: c.arguments },
      }));
    }
    return out;
  }
  const images = (m.images || []).filter((url) => url.startsWith("data:"));
  if (!images.length) return { role: "user", content: m.content };
  const parts = [{ type: "text", text: m.content }];
  for (const url of images) parts.push({ type: "image_url", image_url: { url } });
  return { role: "user", content: parts };
}

// The request for a reply to `conv` (its history and settings) from `modelId`: {body}, or {error}
// when a setting cannot be used.
export function buildRequest(conv, modelId) {
  const s = conv.settings;
  const parsed = parseSettings(s);
  if (parsed.error) return parsed;
  const messages = [];
  if (s.system.trim()) messages.push({ role: "system", content: s.system });
  for (const m of conv.messages) if (!m.pending && !m.error) messages.push(wire(m));
  const body = { model: modelId, messages, stream: true, stream_options: { include_usage: true } };
  if (Number.isFinite(s.temperature)) body.temperature = s.temperature;
  if (Number.isInteger(s.maxTokens) && s.maxTokens > 0) body.max_tokens = s.maxTokens;
  if (parsed.schema) {
    body.response_format = { type: "json_schema", json_schema: { name: "reply", schema: parsed.schema } };
  }
  if (parsed.tools && parsed.tools.length) {
    body.tools = parsed.tools;
    body.tool_choice = CHOICES.includes(s.toolChoice) ? s.toolChoice : "auto";
    body.parallel_tool_calls = s.parallelCalls;
  }
  return { body };
}

// The data of a server-sent event stream, parsed, until [DONE]. A stream that ends without it
// was cut (the connection dropped): an Error, not a reply taken for whole. However the reading
// ends (an error, the caller leaving the loop), the body is cancelled: the server stops decoding.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) throw new Error("the reply's stream ended before the server finished it");
      buffer += decoder.decode(value, { stream: true });
      let at;
      while ((at = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, at);
        buffer = buffer.slice(at + 2);
        const data = block
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).trimStart())
          .join("\n");
        if (data === "[DONE]") return;
        if (data) yield JSON.parse(data);
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

// A streamed chat completion of `body`, as the deltas of its chunks: {content, reasoning, toolCalls, finish}
// for each choice of a chunk (as they came: absent when the chunk has none), then {usage}. Aborting
// `signal` cancels the request (the server stops decoding) and throws an AbortError; an error
// status is an HttpError, an error in the stream an Error.
export async function* complete(body, { key, signal }) {
  const response = await fetch("v1/chat/completions", {
    method: "POST",
    headers: headers(key),
    body: JSON.stringify(body),
    signal,
  });
  if (!response.ok) throw new HttpError(response.status, await errorText(response));
  for await (const chunk of events(response)) {
    if (chunk.error) throw new Error(chunk.error.message || "the server failed mid-reply");
    for (const choice of chunk.choices || []) {
      const delta = choice.delta || {};
      const reasoning = delta.reasoning_content;
      yield { content: delta.content, reasoning, toolCalls: delta.tool_calls, finish: choice.finish_reason };
    }
    if (chunk.usage) yield { usage: chunk.usage };
  }
}
