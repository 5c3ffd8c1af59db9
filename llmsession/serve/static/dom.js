// Building the page's DOM: element lookup and creation, and the rendering primitives (text, code
// blocks, the banner).
//
// Safety: nodes are made with createElement and filled with textContent only. Nothing the model
// writes, nor anything read back from localStorage, is ever parsed as HTML; the page's
// Content-Security-Policy refuses inline scripts besides.

export const $ = (id) => document.getElementById(id);

// An element with its properties (class, text, dataset, on<event> listeners, else attributes) and
// children (null, undefined and false are left out).
export function el(tag, props, ...children) {
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

// The error line under the top bar; empty text hides it.
export function showBanner(text) {
  const banner = $("banner");
  banner.textContent = text || "";
  banner.hidden = !text;
}

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

export function codeBlock(code, language) {
  return el(
    "div",
    { class: "code" },
    el("div", { class: "code-bar" }, el("span", { class: "lang", text: language || "code" }), copyButton(code)),
    el("pre", {}, el("code", { text: code })),
  );
}

// Text as paragraphs of plain text, and ``` fenced blocks as code (a block still open while
// the reply streams is code too).
export function renderText(container, text) {
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
