// The page's state and its storage: conversations in localStorage (this browser), the API key in
// sessionStorage (this tab). The state is private to this module; the others read it and change it
// through the small functions below. No DOM here: a storage problem is returned as a message.

const STORE = "llmsession.chat.v1";
const KEY = "llmsession.apiKey";
export const UNTITLED = "New chat";
const DEFAULTS = {
  system: "",
  temperature: 0.7,
  maxTokens: 512,
  schema: "",
  tools: "",
  toolChoice: "auto",
  parallelCalls: true,
};
export const CHOICES = ["auto", "required", "none"];

let conversations = [];
let currentId = null;
let model = null; // the card of /v1/models once connected: the model requests go to
let cards = []; // every model the server serves
let busy = null; // {controller, conv, reply} while a reply streams
let attachments = []; // data: URLs of images to send with the next message
let editing = null; // the index of the user message being edited
let ended = 0; // replies ended since the page loaded

// -- reading -------------------------------------------------------------------------------------
export const allConversations = () => conversations;
export const current = () => find(currentId);
export const isCurrent = (conv) => conv.id === currentId;
export const connectedModel = () => model;
export const modelCards = () => cards;
export const streaming = () => busy;
export const pendingImages = () => attachments;
export const editedIndex = () => editing;

function find(id) {
  return conversations.find((c) => c.id === id) || null;
}

// -- loading and saving --------------------------------------------------------------------------
function newId() {
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 10);
}

export function str(value, fallback = "") {
  return typeof value === "string" ? value : fallback;
}

function normalizeMessage(raw) {
  const m = raw && typeof raw === "object" ? raw : {};
  const role = ["user", "assistant", "tool"].includes(m.role) ? m.role : "user";
  const out = { role, content: str(m.content) };
  if (role === "assistant" && typeof m.reasoning === "string" && m.reasoning) out.reasoning = m.reasoning;
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

// The saved conversations read back (at least one, and one of them current): an error message
// when they could not be read, else "".
export function load() {
  let problem = "";
  try {
    const raw = JSON.parse(localStorage.getItem(STORE) || "null");
    if (raw && Array.isArray(raw.conversations)) {
      conversations = raw.conversations.map(normalize);
      currentId = str(raw.current);
    }
  } catch (error) {
    problem = "The saved conversations could not be read: " + error.message;
  }
  if (!conversations.length) addConversation();
  if (!find(currentId)) currentId = conversations[0].id;
  return problem;
}

// What another tab saved while a reply streamed here, read back, with `conv` (the reply's) as
// this tab has it: saving then keeps both tabs' work.
export function adoptSaved(conv) {
  const [own, shown] = [conversations, currentId];
  let problem = "";
  try {
    const raw = JSON.parse(localStorage.getItem(STORE) || "null");
    if (raw && Array.isArray(raw.conversations)) conversations = raw.conversations.map(normalize);
  } catch (error) {
    problem = "The saved conversations could not be read: " + error.message;
    conversations = own;
  }
  const at = conversations.findIndex((c) => c.id === conv.id);
  if (at >= 0) conversations[at] = conv;
  else if (own.includes(conv)) conversations.push(conv); // (deleted there while it answered here: kept)
  currentId = find(shown) ? shown : conversations.length ? conversations[0].id : addConversation().id;
  return problem;
}

// The conversations saved (without a reply still streaming): a message when not all of them could
// be, else "".
export function save() {
  const kept = conversations.map((c) => ({ ...c, messages: c.messages.filter((m) => !m.pending) }));
  try {
    localStorage.setItem(STORE, JSON.stringify({ conversations: kept, current: currentId }));
  } catch (error) {
    // Over the storage quota (images are kept as data: URLs): keep the text of every
    // conversation, not the images, rather than lose the newest messages on a reload.
    try {
      localStorage.setItem(STORE, JSON.stringify({ conversations: kept.map(withoutImages), current: currentId }));
      return "The browser's storage is full: the conversations were saved without their images.";
    } catch (again) {
      return "Could not save the conversations in this browser's storage: " + again.message;
    }
  }
  return "";
}

function withoutImages(conv) {
  return { ...conv, messages: conv.messages.map(({ images, ...rest }) => rest) };
}

// Whether a `storage` event is about the conversations (another tab saved them).
export const isStoreKey = (key) => key === STORE;

// -- the API key (this tab) ----------------------------------------------------------------------
export const apiKey = () => sessionStorage.getItem(KEY);
export const setApiKey = (key) => sessionStorage.setItem(KEY, key);
export const forgetApiKey = () => sessionStorage.removeItem(KEY);

// -- conversations -------------------------------------------------------------------------------
export function addConversation() {
  const from = current();
  const conv = {
    id: newId(),
    title: UNTITLED,
    settings: { ...(from ? from.settings : DEFAULTS) }, // a new chat starts with the settings in use
    messages: [],
  };
  conversations.unshift(conv);
  currentId = conv.id;
  return conv;
}

export function select(conv) {
  currentId = conv.id;
}

export function removeConversation(conv) {
  conversations = conversations.filter((c) => c !== conv);
  if (currentId === conv.id) {
    currentId = conversations.length ? conversations[0].id : null;
    if (!currentId) addConversation();
  }
}

export function rename(conv, title) {
  if (title.trim()) conv.title = title.trim();
}

// A new chat's title from its first message.
export function titleFrom(conv, text) {
  if (conv.title !== UNTITLED) return;
  const line = text.trim().split("\n")[0];
  conv.title = !line ? "Image" : line.length > 48 ? line.slice(0, 47) + "…" : line;
}

export function updateSettings(conv, values) {
  Object.assign(conv.settings, values);
}

// The settings' JSON fields parsed: {schema, tools} (those set), or {error}.
export function parseSettings(settings) {
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

// -- messages ------------------------------------------------------------------------------------
// A user's message at the end of the conversation: joined to the user's message there, if one
// got no reply (it failed, or the page was reloaded while it streamed), so roles alternate (the
// templates that require it refused every later request).
export function addMessage(conv, message) {
  const last = conv.messages[conv.messages.length - 1];
  if (!(message.role === "user" && last && last.role === "user")) {
    conv.messages.push(message);
    return;
  }
  last.content = [last.content, message.content].filter((text) => text).join("\n\n");
  if (message.images) last.images = [...(last.images || []), ...message.images];
}

// The calls of the conversation's last reply, if it made some that are not answered yet.
export function unansweredCalls(conv) {
  const last = conv.messages[conv.messages.length - 1];
  return last && last.role === "assistant" && !last.pending && !last.error ? last.toolCalls || [] : [];
}

export function dropFailedTail(conv) {
  while (conv.messages.length && conv.messages[conv.messages.length - 1].error) conv.messages.pop();
}

export function dropLastReplies(conv) {
  while (conv.messages.length && conv.messages[conv.messages.length - 1].role === "assistant") {
    conv.messages.pop();
  }
}

// The history up to the edited user message (its prefix is cached), that message with `text`.
export function editMessage(conv, index, text) {
  const edited = { ...conv.messages[index], content: text };
  conv.messages = conv.messages.slice(0, index);
  conv.messages.push(edited);
  editing = null;
}

// The results for the calls of `reply`, one tool message each.
export function addToolResults(conv, reply, results) {
  reply.toolCalls.forEach((call, i) => {
    conv.messages.push({ role: "tool", toolCallId: call.id, name: call.name, content: results[i] });
  });
}

export function setEditing(index) {
  editing = index;
}

// -- the reply streaming -------------------------------------------------------------------------
export function startReply(conv, controller, schema) {
  const reply = { role: "assistant", content: "", toolCalls: [], pending: true };
  if (schema) reply.schema = true;
  conv.messages.push(reply);
  busy = { controller, conv, reply };
  return reply;
}

// One streamed delta ({content, reasoning, toolCalls}) added to the reply (its reasoning is shown,
// not sent back: the templates that read it want only the last turn's, which the server keeps).
export function applyDelta(reply, delta) {
  if (delta.content) reply.content += delta.content;
  if (typeof delta.reasoning === "string" && delta.reasoning) reply.reasoning = (reply.reasoning || "") + delta.reasoning;
  for (const d of delta.toolCalls || []) {
    const index = Number.isInteger(d.index) ? d.index : 0;
    while (reply.toolCalls.length <= index) reply.toolCalls.push({ id: "", name: "", arguments: "" });
    const call = reply.toolCalls[index];
    if (typeof d.id === "string") call.id = d.id;
    const f = d.function || {};
    if (typeof f.name === "string") call.name = f.name;
    if (typeof f.arguments === "string") call.arguments += f.arguments;
  }
}

// The reply ended ({finish, error, stats}): the count of replies ended since the page loaded.
export function endReply(reply, { finish, error, stats }) {
  if (error !== undefined) reply.error = error;
  delete reply.pending;
  // A reply stopped (or failed) inside a call makes no call, as the server's own cut replies
  // do: half-written arguments would go back with every later turn and be refused there. A
  // failed reply is never sent back, so neither are its calls (results would answer none).
  if (finish !== "tool_calls" || error !== undefined) reply.toolCalls = [];
  if (!reply.toolCalls.length) delete reply.toolCalls;
  reply.stats = stats;
  busy = null;
  ended += 1;
  return ended;
}

// A reply's numbers from its times (performance.now()), usage, finish and streamed pieces.
export function stats(started, first, last, usage, finish, pieces) {
  const out = { finish: finish || (usage ? "stop" : "unknown") };
  if (first !== null) out.ttft = (first - started) / 1000;
  if (!usage && pieces > 1 && last > first) {
    // No usage (stopped): the pieces streamed stand in for tokens, marked as an estimate.
    out.approximate = true;
    out.completionTokens = pieces;
    out.tokensPerSecond = (pieces - 1) / ((last - first) / 1000);
  }
  if (usage) {
    out.promptTokens = usage.prompt_tokens;
    out.cachedTokens = (usage.prompt_tokens_details || {}).cached_tokens || 0;
    out.completionTokens = usage.completion_tokens;
    if (first !== null && usage.completion_tokens > 1 && last > first) {
      out.tokensPerSecond = (usage.completion_tokens - 1) / ((last - first) / 1000);
    }
  }
  return out;
}

// -- the connection and the composer -------------------------------------------------------------
export function setModel(card, all) {
  model = card;
  cards = card ? all || [card] : [];
}

// The images the next request of the current chat carries: its messages' (each request sends
// them again) and those attached.
export function imagesInRequest() {
  const conv = current();
  const sent = conv ? conv.messages.reduce((n, m) => n + (m.images || []).length, 0) : 0;
  return sent + attachments.length;
}

export function attach(url) {
  attachments.push(url);
}

export function unattach(index) {
  attachments.splice(index, 1);
}

// The images to send with a message, taken (none left attached).
export function takeAttachments() {
  const taken = attachments;
  attachments = [];
  return taken;
}
