// The chat page of `llmsession serve`: the wiring. Vanilla JavaScript modules, no build step,
// nothing from elsewhere: it talks only to this server's OpenAI endpoints.
//
//   dom.js    element lookup and creation, text and code rendering (never HTML parsing)
//   store.js  the state, localStorage (conversations) and sessionStorage (the API key)
//   api.js    the server: /v1/models, and complete(), an async generator of a reply's deltas
//   view.js   rendering the conversations, messages, numbers, settings and composer
//   main.js   what the user does, and a reply's flow from the request to its numbers
//
// The page's <body> says data-ready (connected), data-busy (a reply streams) and data-ended
// (replies ended since the page loaded), for tests and tools.

import { HttpError, Unreachable, buildRequest, complete, modelCards } from "./api.js";
import { $, showBanner } from "./dom.js";
import * as store from "./store.js";
import * as view from "./view.js";

const MAX_IMAGES = 8; // in one request, the server's (serve/images.py): each turn sends the chat's again

let missedSave = false; // another tab saved while a reply streamed here

function save() {
  const problem = store.save();
  if (problem) showBanner(problem);
}

function load() {
  const problem = store.load();
  if (problem) showBanner(problem);
}

// -- the connection ------------------------------------------------------------------------------
async function connect() {
  let cards;
  try {
    cards = await modelCards(store.apiKey());
  } catch (error) {
    if (error instanceof Unreachable) showBanner("Cannot reach the server: " + error.message);
    else if (error instanceof HttpError && error.status === 401) {
      const refused = store.apiKey() !== null;
      store.forgetApiKey();
      askKey(refused ? "The API key was refused: " + error.message : "");
    } else if (error instanceof HttpError) showBanner("The server answered /v1/models with: " + error.message);
    else throw error;
    return;
  }
  const [card, chats] = chosen(cards);
  store.setModel(card, chats);
  view.showConnected(card, chats);
}

// The models that chat (embedding models say they do not once loaded), and the one picked.
function chosen(cards) {
  const chats = cards.filter((c) => !c.capabilities || c.capabilities.chat !== false);
  const kept = chats.length ? chats : cards;
  const picked = store.connectedModel();
  return [kept.find((c) => picked && c.id === picked.id) || kept[0], kept];
}

// After a reply on a server of several models: the picker's states as the server has them now
// (the banner, the key form and a load under way are left as they are).
async function refreshModels() {
  if (!store.connectedModel()) return;
  let cards;
  try {
    cards = await modelCards(store.apiKey());
  } catch (_) {
    return; // (the next request says what is wrong)
  }
  const [card, chats] = chosen(cards);
  store.setModel(card, chats);
  if (!store.streaming()) view.showPicker(card, chats);
}

// Another model picked: requests go to it from now on (the server loads it for the first).
function pick(id) {
  const cards = store.modelCards();
  const card = cards.find((c) => c.id === id);
  if (!card) return;
  store.setModel(card, cards);
  if (!(card.capabilities && card.capabilities.images)) {
    store.takeAttachments(); // (images for a model that takes none would be refused)
    view.renderAttachments();
  }
  view.showConnected(card, cards);
}

function askKey(error) {
  store.setModel(null);
  view.showKeyForm(error);
}

// -- a reply -------------------------------------------------------------------------------------
// Streams one reply into `conv` (its history as it is now) and measures it.
async function respond(conv) {
  const card = store.connectedModel();
  if (!card) {
    showBanner("Not connected to the server yet.");
    return;
  }
  showBanner(""); // (what it said was about an earlier request)
  const built = buildRequest(conv, card.id);
  if (built.error) {
    view.showSettingsError(built.error);
    view.openSettings(true);
    return;
  }
  const controller = new AbortController();
  const reply = store.startReply(conv, controller, Boolean(built.body.response_format));
  save();
  view.render();
  const started = performance.now();
  const loading = card.status && card.status.value !== "loaded"; // (its first request loads it)
  if (loading) view.showLoading(card);
  let first = null;
  let usage = null;
  let finish = null;
  let failed; // the error's message, if the reply failed
  let pieces = 0; // deltas with text or calls (about a token each: what a stopped reply has)
  try {
    for await (const delta of complete(built.body, { key: store.apiKey(), signal: controller.signal })) {
      if (delta.usage) usage = delta.usage;
      if (delta.content || delta.toolCalls || delta.reasoning) {
        store.applyDelta(reply, delta);
        pieces += 1;
        if (first === null) first = performance.now();
      }
      if (delta.finish) finish = delta.finish;
      view.updateLive();
    }
  } catch (error) {
    // (stopped after the server said the calls were complete: they stand)
    if (error.name === "AbortError") finish = finish === "tool_calls" ? finish : "stopped";
    else failed = error.message;
    if (error instanceof HttpError && error.status === 401) {
      store.forgetApiKey();
      askKey("The API key was refused: " + error.message);
    }
  } finally {
    controller.abort(); // (a reply the page stopped reading for any reason is not decoded on)
  }
  const stats = store.stats(started, first, performance.now(), usage, finish, pieces);
  document.body.dataset.ended = String(store.endReply(reply, { finish, error: failed, stats }));
  if (missedSave) {
    missedSave = false;
    const problem = store.adoptSaved(conv); // (another tab saved while this one streamed)
    if (problem) showBanner(problem);
  }
  save();
  view.render();
  if (loading) view.showPicker(card, store.modelCards()); // (its load is over)
  if (store.modelCards().length > 1) refreshModels(); // (what is loaded now)
}

function stop() {
  const busy = store.streaming();
  if (busy) busy.controller.abort();
}

// Whether a request for `conv` would not go out (no connection, settings that do not parse):
// `respond` then says why and sends nothing.
function unsendable(conv) {
  return !store.connectedModel() || Boolean(store.parseSettings(conv.settings).error);
}

async function send() {
  const input = $("input");
  const conv = store.current();
  if (store.streaming() || !store.connectedModel() || !conv) return;
  const text = input.value;
  if (!text.trim() && !store.pendingImages().length) return;
  if (store.unansweredCalls(conv).length) {
    // (words after calls with no result: the APIs refuse such a transcript, and every later turn would carry it)
    showBanner("Send the tool calls' results first (or regenerate the reply).");
    return;
  }
  if (unsendable(conv)) return respond(conv); // (shows the error)
  if (store.imagesInRequest() > MAX_IMAGES) {
    // (attached in another chat, or two drops at once: the server would refuse this turn and every later one)
    showBanner(`A request carries at most ${MAX_IMAGES} images, this chat's earlier ones included: remove some.`);
    return;
  }
  const message = { role: "user", content: text };
  const images = store.takeAttachments();
  if (images.length) message.images = images;
  store.dropFailedTail(conv);
  store.addMessage(conv, message); // (after a message no reply answered: one message, both texts)
  store.titleFrom(conv, text);
  input.value = "";
  view.renderAttachments();
  await respond(conv);
}

// -- what the view's controls do -----------------------------------------------------------------
const actions = {
  edit(index) {
    store.setEditing(index);
    view.render();
  },
  regenerate(conv) {
    if (store.streaming()) return;
    store.dropLastReplies(conv);
    if (conv.messages.length) respond(conv);
  },
  resendEdited(conv, index, text) {
    if (store.streaming()) return;
    if (unsendable(conv)) return respond(conv); // (says why; the history stays as it was)
    store.editMessage(conv, index, text);
    respond(conv);
  },
  // The results the user typed for the calls of the last reply, answered.
  answerTools(conv, reply, results) {
    if (store.streaming()) return;
    if (unsendable(conv)) return respond(conv);
    store.addToolResults(conv, reply, results);
    respond(conv);
  },
  open(conv) {
    store.select(conv);
    store.setEditing(null);
    save();
    view.render();
  },
  rename(conv, title) {
    store.rename(conv, title);
    save();
    view.render();
  },
  remove(conv) {
    if (!window.confirm("Delete the conversation “" + conv.title + "”?")) return;
    const busy = store.streaming();
    if (busy && busy.conv === conv) stop();
    store.removeConversation(conv);
    store.setEditing(null); // (the index was this conversation's)
    save();
    view.render();
  },
  unattach(index) {
    store.unattach(index);
    view.renderAttachments();
  },
};

function addFiles(files) {
  const card = store.connectedModel();
  if (!(card && card.capabilities && card.capabilities.images)) {
    showBanner("This server takes no images (it was started without a projector).");
    return;
  }
  let room = MAX_IMAGES - store.imagesInRequest();
  for (const file of files) {
    if (!file.type.startsWith("image/")) {
      showBanner("Not an image: " + file.name);
      continue;
    }
    if (room <= 0) {
      showBanner(`A request carries at most ${MAX_IMAGES} images, this chat's earlier ones included: start a new chat for more.`);
      break;
    }
    room -= 1;
    const reader = new FileReader();
    reader.addEventListener("load", () => {
      store.attach(reader.result);
      view.renderAttachments();
    });
    reader.readAsDataURL(file);
  }
}

function readSettings() {
  const conv = store.current();
  store.updateSettings(conv, view.readSettings());
  view.showSettingsError(store.parseSettings(conv.settings).error);
  save();
}

// -- events --------------------------------------------------------------------------------------
function bind() {
  $("new-chat").addEventListener("click", () => {
    const conv = store.current();
    if (store.streaming() || conv.messages.length || conv.title !== store.UNTITLED) store.addConversation(); // (else: this one)
    store.setEditing(null);
    save();
    view.render();
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
    if (event.key === "Escape" && store.streaming()) {
      event.preventDefault();
      stop();
    }
  });
  $("settings-toggle").addEventListener("click", () => view.openSettings($("settings").hidden));
  for (const field of view.settingsFields()) {
    field.addEventListener("input", readSettings);
    field.addEventListener("change", readSettings);
  }
  $("model-picker").addEventListener("change", (event) => pick(event.target.value));
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("key-input").value.trim();
    if (!key) return;
    store.setApiKey(key);
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
    if (!store.isStoreKey(event.key)) return;
    if (store.streaming()) missedSave = true; // (read back when the reply ends)
    else {
      store.setEditing(null);
      load();
      view.render();
    }
  });
}

document.addEventListener("DOMContentLoaded", () => {
  view.init(actions);
  bind();
  load();
  view.render();
  connect();
});
