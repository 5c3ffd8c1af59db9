// The chat page of `llmsession serve`. Vanilla JavaScript, no build step, nothing from elsewhere:
// it talks only to this server's OpenAI endpoints (/v1/models, /v1/chat/completions).
//
// Safety: the DOM is built with createElement and textContent only. Nothing the model writes, nor
// anything read back from localStorage, is ever parsed as HTML; the page's Content-Security-Policy
// refuses inline scripts besides.
//
// Conversations live in localStorage (this browser), the API key in sessionStorage (this tab).
"use strict";

(() => {
  const STORE = "llmsession.chat.v1";
  const KEY = "llmsession.apiKey";
  const UNTITLED = "New chat";
  const DEFAULTS = {
    system: "",
    temperature: 0.7,
    maxTokens: 512,
    schema: "",
    tools: "",
    toolChoice: "auto",
    parallelCalls: true,
  };
  const CHOICES = ["auto", "required", "none"];

  const $ = (id) => document.getElementById(id);
  const state = {
    conversations: [],
    current: null,
    model: null, // the card of /v1/models once connected
    busy: null, // {controller, conv, reply, node} while a reply streams
    attachments: [], // data: URLs of images to send with the next message
    editing: null, // the index of the user message being edited
    ended: 0, // replies ended since the page loaded (in <body data-ended>, for tests and tools)
  };

  // -- DOM helpers: text only ------------------------------------------------------------------
  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(props || {})) {
      if (value === undefined || value === null) continue;
      if (name === "class") node.className = value;
      else if (name === "text") node.textContent = value;
      else if (name === "dataset") Object.assign(node.dataset, value);
      else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
      else node.setAttribute(name, value);
    }
    for (const child of children) if (child !== null && child !== undefined && child !== false) node.append(child);
    return node;
  }

  function showBanner(text) {
    const banner = $("banner");
    banner.textContent = text || "";
    banner.hidden = !text;
  }

  // -- storage -----------------------------------------------------------------------------------
  function newId() {
    return Date.now().toString(36) + Math.random().toString(36).slice(2, 10);
  }

  function str(value, fallback = "") {
    return typeof value === "string" ? value : fallback;
  }

  function normalizeMessage(raw) {
    const m = raw && typeof raw === "object" ? raw : {};
    const role = ["user", "assistant", "tool"].includes(m.role) ? m.role : "user";
    const out = { role, content: str(m.content) };
    if (Array.isArray(m.images)) out.images = m.images.filter((u) => typeof u === "string");
    if (Array.isArray(m.toolCalls)) {
      out.toolCalls = m.toolCalls
        .filter((c) => c && typeof c === "object")
        .map((c) => ({ id: str(c.id), name: str(c.name), arguments: str(c.arguments) }));
    }
    if (role === "tool") Object.assign(out, { toolCallId: str(m.toolCallId), name: str(m.name) });
    if (m.stats && typeof m.stats === "object") out.stats = m.stats;
    if (typeof m.error === "string") out.error = m.error;
    if (m.schema === true) out.schema = true;
    return out;
  }

  function normalize(raw) {
    const c = raw && typeof raw === "object" ? raw : {};
    const settings = { ...DEFAULTS };
    if (c.settings && typeof c.settings === "object") {
      for (const name of Object.keys(DEFAULTS)) {
        if (typeof c.settings[name] === typeof DEFAULTS[name]) settings[name] = c.settings[name];
      }
    }
    const messages = Array.isArray(c.messages) ? c.messages.map(normalizeMessage) : [];
    return { id: str(c.id) || newId(), title: str(c.title, UNTITLED), settings, messages };
  }

  function load() {
    try {
      const raw = JSON.parse(localStorage.getItem(STORE) || "null");
      if (raw && Array.isArray(raw.conversations)) {
        state.conversations = raw.conversations.map(normalize);
        state.current = str(raw.current);
      }
    } catch (error) {
      showBanner("The saved conversations could not be read: " + error.message);
    }
    if (!state.conversations.length) addConversation();
    if (!find(state.current)) state.current = state.conversations[0].id;
  }

  function save() {
    const kept = state.conversations.map((c) => ({
      ...c,
      messages: c.messages.filter((m) => !m.pending),
    }));
    try {
      localStorage.setItem(STORE, JSON.stringify({ conversations: kept, current: state.current }));
    } catch (error) {
      // Over the storage quota (images are kept as data: URLs): keep the text of every
      // conversation, not the images, rather than lose the newest messages on a reload.
      try {
        localStorage.setItem(STORE, JSON.stringify({ conversations: kept.map(withoutImages), current: state.current }));
        showBanner("The browser's storage is full: the conversations were saved without their images.");
      } catch (again) {
        showBanner("Could not save the conversations in this browser's storage: " + again.message);
      }
    }
  }

  function withoutImages(conv) {
    return { ...conv, messages: conv.messages.map(({ images, ...rest }) => rest) };
  }

  function find(id) {
    return state.conversations.find((c) => c.id === id) || null;
  }

  function current() {
    return find(state.current);
  }

  function addConversation() {
    const from = current();
    const conv = {
      id: newId(),
      title: UNTITLED,
      settings: { ...(from ? from.settings : DEFAULTS) }, // a new chat starts with the settings in use
      messages: [],
    };
    state.conversations.unshift(conv);
    state.current = conv.id;
    return conv;
  }

  // -- the server --------------------------------------------------------------------------------
  function headers() {
    const out = { "Content-Type": "application/json" };
    const key = sessionStorage.getItem(KEY);
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

  async function connect() {
    let response;
    try {
      response = await fetch("v1/models", { headers: headers() });
    } catch (error) {
      showBanner("Cannot reach the server: " + error.message);
      return;
    }
    if (response.status === 401) {
      const refused = sessionStorage.getItem(KEY) !== null;
      const message = await errorText(response);
      sessionStorage.removeItem(KEY);
      askKey(refused ? "The API key was refused: " + message : "");
      return;
    }
    if (!response.ok) {
      showBanner("The server answered /v1/models with: " + (await errorText(response)));
      return;
    }
    const body = await response.json();
    state.model = body.data[0];
    $("key-form").hidden = true;
    showBanner("");
    const images = Boolean(state.model.capabilities && state.model.capabilities.images);
    const attach = $("attach");
    if (attach && images) attach.hidden = false;
    else if (attach) attach.remove(); // absent, not just hidden: the server takes no images
    $("model-name").textContent = "model: " + state.model.id + (images ? " (images)" : "");
    document.body.dataset.ready = "1";
    updateComposer();
  }

  function askKey(error) {
    state.model = null;
    document.body.dataset.ready = "0";
    $("key-form").hidden = false;
    showBanner(error);
    $("key-input").value = "";
    $("key-input").focus();
    updateComposer();
  }

  async function* events(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
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
  }

  // -- requests ----------------------------------------------------------------------------------
  function parseSettings(settings) {
    const out = {};
    if (settings.schema.trim()) {
      try {
        out.schema = JSON.parse(settings.schema);
      } catch (error) {
        return { error: "JSON schema: " + error.message };
      }
      if (!out.schema || typeof out.schema !== "object" || Array.isArray(out.schema)) {
        return { error: "JSON schema: must be a JSON object" };
      }
    }
    if (settings.tools.trim()) {
      try {
        out.tools = JSON.parse(settings.tools);
      } catch (error) {
        return { error: "Tools: " + error.message };
      }
      if (!Array.isArray(out.tools)) return { error: "Tools: must be a JSON list of tools" };
    }
    return out;
  }

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

  function buildRequest(conv) {
    const s = conv.settings;
    const parsed = parseSettings(s);
    if (parsed.error) return parsed;
    const messages = [];
    if (s.system.trim()) messages.push({ role: "system", content: s.system });
    for (const m of conv.messages) if (!m.pending && !m.error) messages.push(wire(m));
    const body = { model: state.model.id, messages, stream: true, stream_options: { include_usage: true } };
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

  function mergeCalls(reply, deltas) {
    for (const d of deltas) {
      const index = Number.isInteger(d.index) ? d.index : 0;
      while (reply.toolCalls.length <= index) reply.toolCalls.push({ id: "", name: "", arguments: "" });
      const call = reply.toolCalls[index];
      if (typeof d.id === "string") call.id = d.id;
      const f = d.function || {};
      if (typeof f.name === "string") call.name = f.name;
      if (typeof f.arguments === "string") call.arguments += f.arguments;
    }
  }

  // Streams one reply into `conv` (its history as it is now) and measures it.
  async function complete(conv) {
    if (!state.model) {
      showBanner("Not connected to the server yet.");
      return;
    }
    const built = buildRequest(conv);
    if (built.error) {
      $("settings-error").textContent = built.error;
      openSettings(true);
      return;
    }
    const reply = { role: "assistant", content: "", toolCalls: [], pending: true };
    if (built.body.response_format) reply.schema = true;
    conv.messages.push(reply);
    const controller = new AbortController();
    state.busy = { controller, conv, reply, node: null };
    save();
    render();
    const started = performance.now();
    let first = null;
    let usage = null;
    let finish = null;
    let pieces = 0; // stream chunks with text or calls (about a token each: what a stopped reply has)
    try {
      const response = await fetch("v1/chat/completions", {
        method: "POST",
        headers: headers(),
        body: JSON.stringify(built.body),
        signal: controller.signal,
      });
      if (response.status === 401) {
        sessionStorage.removeItem(KEY);
        throw Object.assign(new Error(await errorText(response)), { unauthorized: true });
      }
      if (!response.ok) throw new Error(await errorText(response));
      for await (const chunk of events(response)) {
        if (chunk.error) throw new Error(chunk.error.message || "the server failed mid-reply");
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const delta = choice.delta || {};
          if (delta.content) reply.content += delta.content;
          if (delta.tool_calls) mergeCalls(reply, delta.tool_calls);
          if (delta.content || delta.tool_calls) {
            pieces += 1;
            if (first === null) first = performance.now();
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
        updateLive();
      }
    } catch (error) {
      // (stopped after the server said the calls were complete: they stand)
      if (error.name === "AbortError") finish = finish === "tool_calls" ? finish : "stopped";
      else reply.error = error.message;
      if (error.unauthorized) askKey("The API key was refused: " + error.message);
    }
    const ended = performance.now();
    delete reply.pending;
    // A reply stopped (or failed) inside a call makes no call, as the server's own cut replies
    // do: half-written arguments would go back with every later turn and be refused there.
    if (finish !== "tool_calls") reply.toolCalls = [];
    if (!reply.toolCalls.length) delete reply.toolCalls;
    reply.stats = stats(started, first, ended, usage, finish, pieces);
    state.busy = null;
    state.ended += 1;
    document.body.dataset.ended = String(state.ended);
    save();
    render();
  }

  function stats(started, first, ended, usage, finish, pieces) {
    const out = { finish: finish || (usage ? "stop" : "unknown") };
    if (first !== null) out.ttft = (first - started) / 1000;
    if (!usage && pieces > 1 && ended > first) {
      // No usage (stopped): the pieces streamed stand in for tokens, marked as an estimate.
      out.approximate = true;
      out.completionTokens = pieces;
      out.tokensPerSecond = (pieces - 1) / ((ended - first) / 1000);
    }
    if (usage) {
      out.promptTokens = usage.prompt_tokens;
      out.cachedTokens = (usage.prompt_tokens_details || {}).cached_tokens || 0;
      out.completionTokens = usage.completion_tokens;
      if (first !== null && usage.completion_tokens > 1 && ended > first) {
        out.tokensPerSecond = (usage.completion_tokens - 1) / ((ended - first) / 1000);
      }
    }
    return out;
  }

  async function send() {
    const input = $("input");
    const conv = current();
    if (state.busy || !state.model || !conv) return;
    const text = input.value;
    if (!text.trim() && !state.attachments.length) return;
    if (parseSettings(conv.settings).error) return complete(conv); // (shows the error)
    const message = { role: "user", content: text };
    if (state.attachments.length) message.images = state.attachments.slice();
    dropFailedTail(conv);
    conv.messages.push(message);
    if (conv.title === UNTITLED) conv.title = titleOf(text);
    input.value = "";
    state.attachments = [];
    renderAttachments();
    await complete(conv);
  }

  function titleOf(text) {
    const line = text.trim().split("\n")[0];
    if (!line) return "Image";
    return line.length > 48 ? line.slice(0, 47) + "…" : line;
  }

  function dropFailedTail(conv) {
    while (conv.messages.length && conv.messages[conv.messages.length - 1].error) conv.messages.pop();
  }

  function stop() {
    if (state.busy) state.busy.controller.abort();
  }

  function regenerate(conv) {
    if (state.busy) return;
    while (conv.messages.length && conv.messages[conv.messages.length - 1].role === "assistant") {
      conv.messages.pop();
    }
    if (conv.messages.length) complete(conv);
  }

  function resendEdited(conv, index, text) {
    if (state.busy) return;
    const edited = { ...conv.messages[index], content: text };
    conv.messages = conv.messages.slice(0, index); // the history up to the edit: its prefix is cached
    conv.messages.push(edited);
    state.editing = null;
    complete(conv);
  }

  // The results the user typed for the calls of the last reply, one tool message each, answered.
  function answerTools(conv, m, inputs) {
    if (state.busy) return;
    m.toolCalls.forEach((call, i) => {
      conv.messages.push({ role: "tool", toolCallId: call.id, name: call.name, content: inputs[i].value });
    });
    complete(conv);
  }

  // -- rendering ---------------------------------------------------------------------------------
  function copyButton(text) {
    const button = el("button", { type: "button", class: "copy", text: "Copy" });
    button.addEventListener("click", async () => {
      try {
        await navigator.clipboard.writeText(text);
      } catch (_) {
        const area = el("textarea", { class: "offscreen" });
        area.value = text;
        document.body.append(area);
        area.select();
        document.execCommand("copy");
        area.remove();
      }
      button.textContent = "Copied";
      setTimeout(() => (button.textContent = "Copy"), 1500);
    });
    return button;
  }

  function codeBlock(code, language) {
    return el(
      "div",
      { class: "code" },
      el("div", { class: "code-bar" }, el("span", { class: "lang", text: language || "code" }), copyButton(code)),
      el("pre", {}, el("code", { text: code })),
    );
  }

  // Text as paragraphs of plain text, and ``` fenced blocks as code (a block still open while
  // the reply streams is code too).
  function renderText(container, text) {
    const fence = /```([^\n`]*)\n?([\s\S]*?)(?:```|$)/g;
    let at = 0;
    for (let match; (match = fence.exec(text)) !== null; ) {
      if (match.index > at) container.append(el("div", { class: "text", text: text.slice(at, match.index) }));
      container.append(codeBlock(match[2].replace(/\n$/, ""), match[1].trim()));
      at = fence.lastIndex;
      if (match[0].length === 0) break;
    }
    if (at < text.length) container.append(el("div", { class: "text", text: text.slice(at) }));
  }

  function renderBody(container, m) {
    container.replaceChildren();
    if (m.schema && !m.pending) {
      try {
        container.append(codeBlock(JSON.stringify(JSON.parse(m.content), null, 2), "json"));
        return;
      } catch (_) {
        // not (yet) JSON: shown as it came
      }
    }
    renderText(container, m.content);
    if (m.pending && !m.content && !(m.toolCalls || []).length) {
      container.append(el("div", { class: "muted", text: "…" }));
    }
  }

  function toolCard(call, input) {
    let args = call.arguments;
    try {
      args = JSON.stringify(JSON.parse(call.arguments), null, 2);
    } catch (_) {
      // partial or not JSON: as it came
    }
    const card = el(
      "div",
      { class: "tool-call" },
      el("div", { class: "tool-name", text: "Tool call: " + call.name }),
      el("pre", { class: "tool-args" }, el("code", { text: args })),
    );
    if (input) card.append(el("div", { class: "row" }, input));
    return card;
  }

  // A reply's calls as cards; when it is the last message, each with a field for its result.
  function toolCards(conv, m) {
    const calls = m.toolCalls || [];
    const asking = calls.length > 0 && !m.pending && !state.busy && conv.messages[conv.messages.length - 1] === m;
    const inputs = calls.map(() =>
      asking ? el("input", { type: "text", class: "tool-result", placeholder: "The result to send back" }) : null,
    );
    const cards = el("div", { class: "cards" }, ...calls.map((call, i) => toolCard(call, inputs[i])));
    if (asking) {
      const label = calls.length > 1 ? "Send results" : "Send result";
      const button = el("button", { type: "button", class: "send-results", text: label });
      button.addEventListener("click", () => answerTools(conv, m, inputs));
      cards.append(button);
    }
    return cards;
  }

  function format(seconds) {
    return seconds < 1 ? Math.round(seconds * 1000) + " ms" : seconds.toFixed(2) + " s";
  }

  function statsLine(s) {
    const parts = [];
    const data = { finish: str(s.finish) };
    if (typeof s.ttft === "number") {
      parts.push("first token " + format(s.ttft));
      data.ttft = s.ttft.toFixed(3);
    }
    if (typeof s.tokensPerSecond === "number") {
      parts.push((s.approximate ? "≈" : "") + s.tokensPerSecond.toFixed(1) + " tok/s");
      data.tps = s.tokensPerSecond.toFixed(2);
    }
    if (typeof s.promptTokens === "number") {
      parts.push("prompt " + s.promptTokens + " tokens (" + s.cachedTokens + " cached)");
      data.prompt = String(s.promptTokens);
      data.cached = String(s.cachedTokens);
    }
    if (typeof s.completionTokens === "number") {
      parts.push((s.approximate ? "≈" : "") + s.completionTokens + " generated");
      data.completion = String(s.completionTokens);
    }
    parts.push("finish: " + str(s.finish));
    return el("div", { class: "stats", dataset: data, text: parts.join(" · ") });
  }

  function editor(conv, index, m) {
    const area = el("textarea", { class: "edit-input", rows: "3" });
    area.value = m.content;
    const saveEdit = () => resendEdited(conv, index, area.value);
    const cancel = () => {
      state.editing = null;
      render();
    };
    area.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        saveEdit();
      } else if (event.key === "Escape") {
        event.stopPropagation();
        cancel();
      }
    });
    setTimeout(() => area.focus(), 0);
    return el(
      "div",
      { class: "editor" },
      area,
      el(
        "div",
        { class: "row" },
        el("button", { type: "button", class: "save-edit", text: "Save & send", onclick: saveEdit }),
        el("button", { type: "button", class: "cancel-edit", text: "Cancel", onclick: cancel }),
      ),
    );
  }

  function messageNode(conv, m, index) {
    const last = index === conv.messages.length - 1;
    const who = { user: "You", assistant: "Assistant", tool: "Tool result" }[m.role];
    const node = el("div", { class: "message " + m.role, dataset: { role: m.role, index: String(index) } });
    node.append(el("div", { class: "who", text: m.role === "tool" && m.name ? who + " (" + m.name + ")" : who }));
    if (m.role === "user" && state.editing === index && !state.busy) {
      node.append(editor(conv, index, m));
      return node;
    }
    const body = el("div", { class: "body" });
    renderBody(body, m);
    node.append(body);
    const images = (m.images || []).filter((url) => url.startsWith("data:image/"));
    if (images.length) node.append(el("div", { class: "images" }, ...images.map((src) => el("img", { src, alt: "attached image" }))));
    node.append(toolCards(conv, m));
    if (m.error) node.append(el("div", { class: "error", text: "Error: " + m.error }));
    if (m.stats) node.append(statsLine(m.stats));
    const actions = el("div", { class: "actions" });
    if (!state.busy && m.role === "user") {
      actions.append(el("button", { type: "button", class: "edit", text: "Edit", onclick: () => {
        state.editing = index;
        render();
      } }));
    }
    if (!state.busy && last && m.role === "assistant") {
      const label = m.error ? "Retry" : "Regenerate";
      actions.append(el("button", { type: "button", class: "regenerate", text: label, onclick: () => regenerate(conv) }));
    }
    node.append(actions);
    return node;
  }

  function updateLive() {
    const busy = state.busy;
    if (!busy || !busy.node || !busy.node.isConnected) return;
    const list = $("messages");
    const atBottom = list.scrollHeight - list.scrollTop - list.clientHeight < 40;
    renderBody(busy.node.querySelector(".body"), busy.reply);
    const cards = busy.node.querySelector(".cards");
    cards.replaceWith(toolCards(busy.conv, busy.reply));
    if (atBottom) list.scrollTop = list.scrollHeight;
  }

  function renderConversations() {
    const list = $("conversations");
    list.replaceChildren();
    for (const conv of state.conversations) {
      const item = el("li", { class: "conversation" + (conv.id === state.current ? " active" : ""), dataset: { id: conv.id } });
      const open = el("button", { type: "button", class: "open", text: conv.title, title: conv.title });
      open.addEventListener("click", () => {
        state.current = conv.id;
        state.editing = null;
        save();
        render();
      });
      const rename = el("button", { type: "button", class: "rename", title: "Rename", text: "✎" });
      rename.addEventListener("click", () => startRename(item, open, conv));
      const remove = el("button", { type: "button", class: "delete", title: "Delete", text: "✕" });
      remove.addEventListener("click", () => deleteConversation(conv));
      item.append(open, rename, remove);
      list.append(item);
    }
  }

  function startRename(item, open, conv) {
    const input = el("input", { type: "text", class: "rename-input" });
    input.value = conv.title;
    let done = false;
    const finish = (keep) => {
      if (done) return;
      done = true;
      if (keep && input.value.trim()) conv.title = input.value.trim();
      save();
      render();
    };
    input.addEventListener("keydown", (event) => {
      if (event.key === "Enter") finish(true);
      else if (event.key === "Escape") {
        event.stopPropagation();
        finish(false);
      }
    });
    input.addEventListener("blur", () => finish(true));
    open.replaceWith(input);
    input.focus();
    input.select();
  }

  function deleteConversation(conv) {
    if (!window.confirm("Delete the conversation “" + conv.title + "”?")) return;
    if (state.busy && state.busy.conv === conv) stop();
    state.conversations = state.conversations.filter((c) => c !== conv);
    if (state.current === conv.id) {
      state.current = state.conversations.length ? state.conversations[0].id : null;
      if (!state.current) addConversation();
    }
    save();
    render();
  }

  function renderSettings() {
    const s = current().settings;
    $("set-system").value = s.system;
    $("set-temperature").value = String(s.temperature);
    $("set-max-tokens").value = String(s.maxTokens);
    $("set-schema").value = s.schema;
    $("set-tools").value = s.tools;
    $("set-tool-choice").value = CHOICES.includes(s.toolChoice) ? s.toolChoice : "auto";
    $("set-parallel").checked = s.parallelCalls;
    $("settings-error").textContent = parseSettings(s).error || "";
  }

  function readSettings() {
    const s = current().settings;
    s.system = $("set-system").value;
    const temperature = parseFloat($("set-temperature").value);
    if (Number.isFinite(temperature)) s.temperature = Math.min(2, Math.max(0, temperature));
    const tokens = parseInt($("set-max-tokens").value, 10);
    if (Number.isInteger(tokens) && tokens > 0) s.maxTokens = tokens;
    s.schema = $("set-schema").value;
    s.tools = $("set-tools").value;
    s.toolChoice = $("set-tool-choice").value;
    s.parallelCalls = $("set-parallel").checked;
    $("settings-error").textContent = parseSettings(s).error || "";
    save();
  }

  function openSettings(open) {
    $("settings").hidden = !open;
    $("settings-toggle").setAttribute("aria-expanded", String(open));
  }

  function renderAttachments() {
    const box = $("attachments");
    box.replaceChildren();
    state.attachments.forEach((url, i) => {
      const remove = el("button", { type: "button", class: "remove", title: "Remove", text: "✕" });
      remove.addEventListener("click", () => {
        state.attachments.splice(i, 1);
        renderAttachments();
      });
      box.append(el("div", { class: "attachment" }, el("img", { src: url, alt: "image to send" }), remove));
    });
  }

  function addFiles(files) {
    if (!state.model || !state.model.capabilities.images) {
      showBanner("This server takes no images (it was started without a projector).");
      return;
    }
    for (const file of files) {
      if (!file.type.startsWith("image/")) {
        showBanner("Not an image: " + file.name);
        continue;
      }
      const reader = new FileReader();
      reader.addEventListener("load", () => {
        state.attachments.push(reader.result);
        renderAttachments();
      });
      reader.readAsDataURL(file);
    }
  }

  function updateComposer() {
    const busy = Boolean(state.busy);
    $("send").hidden = busy;
    $("stop").hidden = !busy;
    $("send").disabled = !state.model;
    document.body.dataset.busy = busy ? "1" : "0";
  }

  function render() {
    const conv = current();
    renderConversations();
    $("title").textContent = conv.title;
    renderSettings();
    const list = $("messages");
    const nodes = conv.messages.map((m, i) => messageNode(conv, m, i));
    list.replaceChildren(...nodes);
    if (state.busy && state.busy.conv === conv) state.busy.node = nodes[conv.messages.indexOf(state.busy.reply)];
    if (!conv.messages.length) list.append(el("div", { class: "empty muted", text: "Say something to start." }));
    list.scrollTop = list.scrollHeight;
    updateComposer();
  }

  // -- events ------------------------------------------------------------------------------------
  function bind() {
    $("new-chat").addEventListener("click", () => {
      const conv = current();
      if (state.busy || conv.messages.length || conv.title !== UNTITLED) addConversation(); // (else: this one)
      state.editing = null;
      save();
      render();
      $("input").focus();
    });
    $("send").addEventListener("click", send);
    $("stop").addEventListener("click", stop);
    $("input").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        send();
      }
    });
    document.addEventListener("keydown", (event) => {
      if (event.key === "Escape" && state.busy) {
        event.preventDefault();
        stop();
      }
    });
    $("settings-toggle").addEventListener("click", () => openSettings($("settings").hidden));
    for (const id of ["set-system", "set-temperature", "set-max-tokens", "set-schema", "set-tools", "set-tool-choice", "set-parallel"]) {
      $(id).addEventListener("input", readSettings);
      $(id).addEventListener("change", readSettings);
    }
    $("key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const key = $("key-input").value.trim();
      if (!key) return;
      sessionStorage.setItem(KEY, key);
      connect();
    });
    $("file-input").addEventListener("change", (event) => {
      addFiles(event.target.files);
      event.target.value = "";
    });
    const main = $("main");
    main.addEventListener("dragover", (event) => {
      event.preventDefault();
      main.classList.add("dragging");
    });
    main.addEventListener("dragleave", () => main.classList.remove("dragging"));
    main.addEventListener("drop", (event) => {
      event.preventDefault(); // (a file dropped anywhere never replaces the page)
      main.classList.remove("dragging");
      if (event.dataTransfer && event.dataTransfer.files.length) addFiles(event.dataTransfer.files);
    });
    window.addEventListener("storage", (event) => {
      if (event.key === STORE && !state.busy) {
        load();
        render();
      }
    });
  }

  document.addEventListener("DOMContentLoaded", () => {
    bind();
    load();
    render();
    connect();
  });
})();
