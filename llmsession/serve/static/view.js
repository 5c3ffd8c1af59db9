// Rendering: the conversation list, the messages with their tool calls and numbers, the settings
// panel, the attachments and the composer. The view reads the store; what the user does goes to
// the actions main.js hands to `init` (the view changes no state itself).

import { $, codeBlock, el, renderText, showBanner } from "./dom.js";
import * as store from "./store.js";

let actions = null; // {edit, regenerate, resendEdited, answerTools, open, rename, remove, unattach}
let liveNode = null; // the node of the reply streaming, while it is shown

export function init(handlers) {
  actions = handlers;
}

// -- a message -----------------------------------------------------------------------------------
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
  if (m.reasoning) {
    const summary = el("summary", { text: "Reasoning" });
    container.append(el("details", { class: "reasoning", open: "" }, summary, el("div", { class: "muted", text: m.reasoning })));
  }
  renderText(container, m.content);
  if (m.pending && !m.content && !m.reasoning && !(m.toolCalls || []).length) {
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
  const asking = calls.length > 0 && !m.pending && !store.streaming() && conv.messages[conv.messages.length - 1] === m;
  const inputs = calls.map(() =>
    asking ? el("input", { type: "text", class: "tool-result", placeholder: "The result to send back" }) : null,
  );
  const cards = el("div", { class: "cards" }, ...calls.map((call, i) => toolCard(call, inputs[i])));
  if (asking) {
    const label = calls.length > 1 ? "Send results" : "Send result";
    const button = el("button", { type: "button", class: "send-results", text: label });
    button.addEventListener("click", () => actions.answerTools(conv, m, inputs.map((input) => input.value)));
    cards.append(button);
  }
  return cards;
}

function format(seconds) {
  return seconds < 1 ? Math.round(seconds * 1000) + " ms" : seconds.toFixed(2) + " s";
}

function statsLine(s) {
  const parts = [];
  const data = { finish: store.str(s.finish) };
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
  parts.push("finish: " + store.str(s.finish));
  return el("div", { class: "stats", dataset: data, text: parts.join(" · ") });
}

function editor(conv, index, m) {
  const area = el("textarea", { class: "edit-input", rows: "3" });
  area.value = m.content;
  const saveEdit = () => actions.resendEdited(conv, index, area.value);
  const cancel = () => actions.edit(null);
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
  const busy = store.streaming();
  const last = index === conv.messages.length - 1;
  const who = { user: "You", assistant: "Assistant", tool: "Tool result" }[m.role];
  const node = el("div", { class: "message " + m.role, dataset: { role: m.role, index: String(index) } });
  node.append(el("div", { class: "who", text: m.role === "tool" && m.name ? who + " (" + m.name + ")" : who }));
  if (m.role === "user" && store.editedIndex() === index && !busy) {
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
  const actionsRow = el("div", { class: "actions" });
  if (!busy && m.role === "user") {
    actionsRow.append(el("button", { type: "button", class: "edit", text: "Edit", onclick: () => actions.edit(index) }));
  }
  if (!busy && last && m.role === "assistant") {
    const label = m.error ? "Retry" : "Regenerate";
    actionsRow.append(el("button", { type: "button", class: "regenerate", text: label, onclick: () => actions.regenerate(conv) }));
  }
  node.append(actionsRow);
  return node;
}

// The streaming reply redrawn in place (the list kept at the bottom if it was there).
export function updateLive() {
  const busy = store.streaming();
  if (!busy || !liveNode || !liveNode.isConnected) return;
  const list = $("messages");
  const atBottom = list.scrollHeight - list.scrollTop - list.clientHeight < 40;
  renderBody(liveNode.querySelector(".body"), busy.reply);
  const cards = liveNode.querySelector(".cards");
  cards.replaceWith(toolCards(busy.conv, busy.reply));
  if (atBottom) list.scrollTop = list.scrollHeight;
}

// -- the conversation list -----------------------------------------------------------------------
function renderConversations() {
  const list = $("conversations");
  list.replaceChildren();
  for (const conv of store.allConversations()) {
    const item = el("li", { class: "conversation" + (store.isCurrent(conv) ? " active" : ""), dataset: { id: conv.id } });
    const open = el("button", { type: "button", class: "open", text: conv.title, title: conv.title });
    open.addEventListener("click", () => actions.open(conv));
    const rename = el("button", { type: "button", class: "rename", title: "Rename", text: "✎" });
    rename.addEventListener("click", () => startRename(open, conv));
    const remove = el("button", { type: "button", class: "delete", title: "Delete", text: "✕" });
    remove.addEventListener("click", () => actions.remove(conv));
    item.append(open, rename, remove);
    list.append(item);
  }
}

function startRename(open, conv) {
  const input = el("input", { type: "text", class: "rename-input" });
  input.value = conv.title;
  let done = false;
  const finish = (keep) => {
    if (done) return;
    done = true;
    actions.rename(conv, keep ? input.value : "");
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

// -- the settings panel --------------------------------------------------------------------------
const FIELDS = ["set-system", "set-temperature", "set-max-tokens", "set-schema", "set-tools", "set-tool-choice", "set-parallel"];
export const settingsFields = () => FIELDS.map($);

function renderSettings() {
  const s = store.current().settings;
  $("set-system").value = s.system;
  $("set-temperature").value = String(s.temperature);
  $("set-max-tokens").value = String(s.maxTokens);
  $("set-schema").value = s.schema;
  $("set-tools").value = s.tools;
  $("set-tool-choice").value = store.CHOICES.includes(s.toolChoice) ? s.toolChoice : "auto";
  $("set-parallel").checked = s.parallelCalls;
  showSettingsError(store.parseSettings(s).error);
}

// The settings as the panel's fields hold them (a number that is not one left out).
export function readSettings() {
  const values = {
    system: $("set-system").value,
    schema: $("set-schema").value,
    tools: $("set-tools").value,
    toolChoice: $("set-tool-choice").value,
    parallelCalls: $("set-parallel").checked,
  };
  const temperature = parseFloat($("set-temperature").value);
  if (Number.isFinite(temperature)) values.temperature = Math.min(2, Math.max(0, temperature));
  const tokens = parseInt($("set-max-tokens").value, 10);
  if (Number.isInteger(tokens) && tokens > 0) values.maxTokens = tokens;
  return values;
}

export function showSettingsError(text) {
  $("settings-error").textContent = text || "";
}

export function openSettings(open) {
  $("settings").hidden = !open;
  $("settings-toggle").setAttribute("aria-expanded", String(open));
}

// -- the composer and the connection -------------------------------------------------------------
export function renderAttachments() {
  const box = $("attachments");
  box.replaceChildren();
  store.pendingImages().forEach((src, i) => {
    const remove = el("button", { type: "button", class: "remove", title: "Remove", text: "✕" });
    remove.addEventListener("click", () => actions.unattach(i));
    box.append(el("div", { class: "attachment" }, el("img", { src, alt: "image to send" }), remove));
  });
}

export function updateComposer() {
  const busy = Boolean(store.streaming());
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("send").disabled = !store.connectedModel();
  document.body.dataset.busy = busy ? "1" : "0";
}

export function showConnected(card, cards) {
  $("key-form").hidden = true;
  showBanner("");
  const takes = (c) => Boolean(c.capabilities && c.capabilities.images);
  const images = takes(card);
  const attach = $("attach");
  if (attach && cards.some(takes)) attach.hidden = !images;
  else if (attach) attach.remove(); // absent, not just hidden: the server takes no images
  showPicker(card, cards);
  document.body.dataset.ready = "1";
  updateComposer();
}

// The picked model's name, and the picker of a server of several models with their states.
export function showPicker(card, cards) {
  const images = Boolean(card.capabilities && card.capabilities.images);
  $("model-name").textContent = "model: " + card.id + (images ? " (images)" : "");
  const picker = $("model-picker");
  const several = cards.length > 1;
  picker.hidden = !several;
  if (several) {
    const state = (c) => (c.status && c.status.value ? " (" + c.status.value + ")" : "");
    picker.replaceChildren(...cards.map((c) => el("option", { value: c.id, text: c.id + state(c) })));
    picker.value = card.id;
  }
  document.body.dataset.loading = "0";
}

// The picked model is loading for this request (the server loads it on demand).
export function showLoading(card) {
  $("model-name").textContent = "loading " + card.id + "…";
  document.body.dataset.loading = "1";
  document.body.dataset.loaded = card.id; // (the last model the page saw load)
}

export function showKeyForm(error) {
  document.body.dataset.ready = "0";
  $("key-form").hidden = false;
  showBanner(error);
  $("key-input").value = "";
  $("key-input").focus();
  updateComposer();
}

// -- the whole page ------------------------------------------------------------------------------
export function render() {
  const conv = store.current();
  const busy = store.streaming();
  renderConversations();
  $("title").textContent = conv.title;
  renderSettings();
  const list = $("messages");
  const nodes = conv.messages.map((m, i) => messageNode(conv, m, i));
  list.replaceChildren(...nodes);
  liveNode = busy && busy.conv === conv ? nodes[conv.messages.indexOf(busy.reply)] : null;
  if (!conv.messages.length) list.append(el("div", { class: "empty muted", text: "Say something to start." }));
  list.scrollTop = list.scrollHeight;
  updateComposer();
}
