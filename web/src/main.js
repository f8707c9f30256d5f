// The chat page of `gemstage serve`: conversations kept in the browser, replies streamed from
// POST /v1/chat/completions and rendered as markdown, the server's state from GET /health, and
// the model's name and context size from GET /v1/models (and GET /props where a server has it).
//
// Element ids are stable (the browser tests drive the page through them): #messages, #input,
// #send, #stop, #file, #new-chat, #settings-toggle, #system, #temperature, #top-p, #top-k,
// #min-p, #max-tokens, #think, #api-key, #status, #model, #context-size, #health, #conversations,
// #search, #export, #import, #theme-toggle, #attachments.
import { MarkdownView, renderMarkdown } from "./markdown.js";
import { ConversationStore } from "./store.js";
import { Thread } from "./thread.js";
import { readEvents, apiError, classifyFile, readAttachment, userContent, formatStats,
         newId, titleFrom, recordingToWav, readAsDataUrl } from "./chat.js";

const $ = (id) => document.getElementById(id);
const el = (tag, props = {}, ...children) => {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("aria-") || k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const c of children) if (c) node.append(c);
  return node;
};

// --- settings (localStorage) -----------------------------------------------------------------
const SETTINGS_KEY = "gemstage-settings";
const API_KEY_KEY = "gemstage-api-key";  // the key the earlier page kept it under
const THEME_KEY = "gemstage-theme";
const settingFields = { system: "system", temperature: "temperature", top_p: "top-p",
                        top_k: "top-k", min_p: "min-p", max_tokens: "max-tokens" };

function loadSettings() {
  let saved = {};
  try { saved = JSON.parse(localStorage.getItem(SETTINGS_KEY) || "{}") || {}; } catch (e) {}
  for (const [key, id] of Object.entries(settingFields)) $(id).value = saved[key] ?? "";
  $("think").checked = !!saved.think;
  $("api-key").value = localStorage.getItem(API_KEY_KEY) || "";
}
function saveSettings() {
  const s = { think: $("think").checked };
  for (const [key, id] of Object.entries(settingFields)) s[key] = $(id).value;
  localStorage.setItem(SETTINGS_KEY, JSON.stringify(s));
  localStorage.setItem(API_KEY_KEY, $("api-key").value);
}
function headers() {
  const h = { "Content-Type": "application/json" };
  if ($("api-key").value) h.Authorization = "Bearer " + $("api-key").value;
  return h;
}

// The request's sampling fields: only those the user set; the rest are the server's defaults.
function samplingFields() {
  const out = {};
  const number = (id, parse, key) => {
    const text = $(id).value.trim();
    if (text === "") return;
    const v = parse(text);
    if (Number.isFinite(v)) out[key] = v;
  };
  number("temperature", parseFloat, "temperature");
  number("top-p", parseFloat, "top_p");
  number("top-k", (t) => parseInt(t, 10), "top_k");
  number("min-p", parseFloat, "min_p");
  number("max-tokens", (t) => parseInt(t, 10), "max_tokens");
  return out;
}

// --- theme -----------------------------------------------------------------------------------
const themes = ["system", "dark", "light"];
function applyTheme(theme) {
  if (theme === "system") delete document.documentElement.dataset.theme;
  else document.documentElement.dataset.theme = theme;
  const label = { system: "follow the system", dark: "dark", light: "light" }[theme];
  $("theme-toggle").setAttribute("aria-label", "Theme: " + label + " (click to change)");
  $("theme-toggle").title = "Theme: " + label;
  $("theme-toggle").textContent = { system: "\u25D0", dark: "\u263E", light: "\u2600" }[theme];
}
function currentTheme() {
  const t = localStorage.getItem(THEME_KEY);
  return themes.includes(t) ? t : "system";
}

// --- state -----------------------------------------------------------------------------------
const state = {
  store: null,
  headers: [],       // every conversation's header, newest first
  cache: new Map(),  // conversation id -> its Thread (the one the page edits)
  current: null,     // the open conversation's header, or null for a new, unsaved one
  pending: [],       // attachments for the next message
  live: null,        // the reply being streamed: {conversation, message, controller, bubble, view}
  search: "",
  nCtx: null,      // the context size /props or /v1/models gave
  kvBudget: null,  // /health's kv_budget
};
const memoryStore = {  // where IndexedDB is unavailable (private windows in some browsers)
  data: new Map(),
  async list() { return [...this.data.values()].map((v) => v.header).sort((a, b) => b.updated - a.updated); },
  async thread(id) { return this.data.get(id)?.thread ?? null; },
  async save(h, thread) { this.data.set(h.id, { header: { ...h }, thread }); },
  async saveHeader(h) { const v = this.data.get(h.id); if (v) v.header = { ...h }; },
  async remove(id) { this.data.delete(id); },
};

function status(text) { $("status").textContent = text; }

async function threadOf(id) {
  if (!state.cache.has(id)) {
    let thread;
    try {
      thread = Thread.fromRecord(await state.store.thread(id));
    } catch (e) {
      status("a saved conversation is damaged: " + (e.message || e));
      thread = new Thread();
    }
    state.cache.set(id, thread);
  }
  return state.cache.get(id);
}

async function persist(conversation) {
  if (conversation.deleted) return;  // a reply that ended after its conversation was deleted
  conversation.updated = Date.now();
  // The list shows the conversation touched last first.
  const i = state.headers.indexOf(conversation);
  if (i > 0) state.headers.unshift(...state.headers.splice(i, 1));
  try {
    await state.store.save(conversation, (await threadOf(conversation.id)).toRecord());
  } catch (e) {
    status("could not save the conversation: " + (e.message || e));
  }
}

// --- the conversation list -------------------------------------------------------------------
// The stored headers, keeping the objects the page already holds (the open conversation's, the
// one a reply is streaming into), so a change made through one is seen through the other.
async function refreshList() {
  const known = new Map(state.headers.map((h) => [h.id, h]));
  state.headers = (await state.store.list()).map((h) => known.has(h.id) ? Object.assign(known.get(h.id), h) : h);
  renderList();
}

async function matches(header, needle) {
  if (header.title.toLowerCase().includes(needle)) return true;
  const thread = await threadOf(header.id);
  for (const m of thread.nodes.values()) if ((m.content || "").toLowerCase().includes(needle)) return true;
  return false;
}

async function renderList() {
  const needle = state.search.trim().toLowerCase();
  const shown = [];
  for (const h of state.headers) if (!needle || await matches(h, needle)) shown.push(h);
  if (needle !== state.search.trim().toLowerCase()) return;  // a newer search took over
  const list = $("conversations");
  list.textContent = "";
  for (const h of shown) {
    const current = state.current && state.current.id === h.id;
    const li = el("li", { class: "conv" + (current ? " current" : ""), "data-id": h.id });
    const open = el("button", { type: "button", class: "conv-open", text: h.title, title: h.title });
    if (current) open.setAttribute("aria-current", "true");
    open.addEventListener("click", () => openConversation(h.id));
    const rename = el("button", { type: "button", class: "conv-rename", text: "\u270E",
                                  "aria-label": "Rename " + h.title });
    rename.addEventListener("click", () => startRename(li, h));
    const remove = el("button", { type: "button", class: "conv-delete", text: "\u2715",
                                  "aria-label": "Delete " + h.title });
    remove.addEventListener("click", () => deleteConversation(h));
    li.append(open, rename, remove);
    list.append(li);
  }
  $("no-conversations").hidden = state.headers.length > 0;
}

function startRename(li, header) {
  const input = el("input", { class: "conv-title-input", value: header.title,
                              "aria-label": "New title for " + header.title });
  li.textContent = "";
  li.append(input);
  input.focus();
  input.select();
  let done = false;
  const finish = async (save) => {
    if (done) return;
    done = true;
    const title = input.value.trim();
    if (save && title && title !== header.title) {
      header.title = title;
      header.titleEdited = true;
      await state.store.saveHeader(header);
      if (state.current && state.current.id === header.id) showTitle();
    }
    renderList();
  };
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") { e.preventDefault(); finish(true); }
    if (e.key === "Escape") { e.preventDefault(); e.stopPropagation(); finish(false); }
  });
  input.addEventListener("blur", () => finish(true));
}

async function deleteConversation(header) {
  if (!confirm(`Delete "${header.title}"? This cannot be undone.`)) return;
  header.deleted = true;
  if (state.live && state.live.conversation.id === header.id) state.live.controller.abort();
  await state.store.remove(header.id);
  state.cache.delete(header.id);
  if (state.current && state.current.id === header.id) newChat();
  await refreshList();
}

function showTitle() {
  $("chat-title").textContent = state.current ? state.current.title : "New chat";
  document.title = (state.current ? state.current.title + " \u2013 " : "") + "gemstage chat";
}

async function openConversation(id) {
  const header = state.headers.find((h) => h.id === id);
  if (!header) return;
  state.current = header;
  await threadOf(id);
  renderConversation();
  showTitle();
  renderList();
  closeSidebar();
  $("input").focus();
}

function newChat() {
  state.current = null;
  renderConversation();
  showTitle();
  renderList();
  clearAttachments();
  status("");
  closeSidebar();
  $("input").focus();
}

// --- rendering messages ----------------------------------------------------------------------
function currentThread() {
  return state.current ? state.cache.get(state.current.id) || null : null;
}
function currentMessages() {
  const thread = currentThread();
  return thread ? thread.path() : [];
}

function renderConversation() {
  const box = $("messages");
  box.textContent = "";
  const messages = currentMessages();
  if (!messages.length) {
    box.append(el("div", { id: "empty", class: "empty" },
                  el("p", { text: "Ask anything. Attach images, recordings, videos or text files with the " +
                                  "paper clip, or drop them here." })));
  }
  const thread = currentThread();
  for (const m of messages) box.append(messageElement(m, thread));
  updateContextUsed();
  scrollToEnd(true);
}

function attachmentElements(attachments) {
  const wrap = el("div", { class: "attachments" });
  for (const a of attachments || []) {
    if (a.kind === "image") {
      const img = el("img", { src: a.dataUrl, alt: "attached image " + (a.name || "") });
      img.addEventListener("click", () => img.classList.toggle("zoomed"));
      wrap.append(img);
    } else if (a.kind === "audio") {
      wrap.append(el("audio", { controls: true, src: a.dataUrl, "aria-label": "recording " + a.name }));
    } else if (a.kind === "video") {
      wrap.append(el("video", { controls: true, src: a.dataUrl, preload: "metadata",
                                "aria-label": "video " + a.name }));
    } else if (a.kind === "text") {
      const d = el("details", { class: "file-part" },
                   el("summary", { text: `${a.name} (${a.text.length.toLocaleString()} characters)` }),
                   el("pre", { text: a.text }));
      wrap.append(d);
    }
  }
  return wrap;
}

function actionButton(cls, text, label, fn) {
  const b = el("button", { type: "button", class: cls, text, "aria-label": label });
  b.addEventListener("click", fn);
  return b;
}

// "< 2/3 >" under a message that has other versions (edits of it, or replies written again).
function versionsElement(m, thread) {
  const siblings = thread ? thread.siblings(m) : [m];
  if (siblings.length < 2) return null;
  const i = siblings.indexOf(m);
  const go = (j) => () => {
    if (state.live) { status("wait for the reply, or stop it, before switching versions"); return; }
    thread.select(siblings[j].id);
    persist(state.current);
    renderConversation();
  };
  const prev = actionButton("prev-version", "\u2039", "Previous version", go(i - 1));
  const next = actionButton("next-version", "\u203A", "Next version", go(i + 1));
  prev.disabled = i === 0;
  next.disabled = i === siblings.length - 1;
  return el("span", { class: "versions" }, prev,
            el("span", { class: "version-count", text: `${i + 1}/${siblings.length}`,
                         "aria-label": `version ${i + 1} of ${siblings.length}` }), next);
}

function messageElement(m, thread = currentThread()) {
  const node = el("article", { class: "msg " + m.role, "data-id": m.id });
  node.append(el("div", { class: "role", text: m.role }));
  const bubble = el("div", { class: "bubble" });
  node.append(bubble);
  if (m.role === "user") {
    if (m.attachments && m.attachments.length) bubble.append(attachmentElements(m.attachments));
    bubble.append(el("div", { class: "content", text: m.content }));
    node.append(el("div", { class: "actions" }, versionsElement(m, thread),
      actionButton("copy-msg", "Copy", "Copy this message", () => copyText(m.content, "message copied")),
      actionButton("edit", "Edit", "Edit this message and send it again", () => startEdit(node, m))));
  } else if (m.role === "assistant") {
    node.dataset.done = m.pending ? "false" : "true";
    if (m.pending) node.setAttribute("aria-busy", "true");
    const content = el("div", { class: "content markdown" });
    if (m.reasoning) bubble.append(reasoningBlock(m.reasoning));
    bubble.append(content);
    for (const call of m.toolCalls || []) bubble.append(toolCallElement(call));
    if (m.pending && state.live && state.live.message === m) {
      state.live.bubble = node;
      state.live.view = new MarkdownView(content);
      state.live.view.update(m.content);
    } else {
      renderMarkdown(content, m.content);
      if (m.stats) bubble.append(metaElement(m.stats));
    }
    if (!m.pending) node.append(assistantActions(m, thread));
  } else {
    bubble.append(el("div", { class: "content", text: m.content }));
    if (m.code) bubble.append(el("div", { class: "code", text: m.code }));
    node.append(el("div", { class: "actions" },
      actionButton("retry", "Retry", "Send the conversation again", () => retry(m))));
  }
  return node;
}

function assistantActions(m, thread = currentThread()) {
  return el("div", { class: "actions" }, versionsElement(m, thread),
    actionButton("copy-msg", "Copy", "Copy this reply", () => copyText(m.content, "reply copied")),
    actionButton("regenerate", "Regenerate", "Write this reply again", () => regenerate(m)));
}

function reasoningBlock(text) {
  const details = el("details", { class: "reasoning" }, el("summary", { text: "Reasoning" }),
                     el("div", { class: "reasoning-text", text }));
  return details;
}

function toolCallElement(call) {
  return el("div", { class: "tool-call",
                     text: "\u2192 " + call.function.name + "(" + call.function.arguments + ")" });
}

function metaElement(stats) {
  return el("div", { class: "meta", text: formatStats(stats).join(" \u00B7 ") });
}

function updateContextUsed() {
  const messages = currentMessages();
  const last = [...messages].reverse().find((m) => m.stats && m.stats.promptTokens != null);
  const used = last ? last.stats.promptTokens + (last.stats.completionTokens || 0) : null;
  // "context used 211 / 8,192 tokens" says the size too; the size alone shows until then.
  $("context-size").hidden = used != null;
  $("context-used").textContent = used == null ? "" :
      "context used " + used.toLocaleString() + ((state.nCtx ?? state.kvBudget) ? " / " + (state.nCtx ?? state.kvBudget).toLocaleString() : "") + " tokens";
}

function atBottom() {
  const box = $("messages");
  return box.scrollHeight - box.scrollTop - box.clientHeight < 60;
}
function scrollToEnd(force) {
  const box = $("messages");
  if (force || atBottom()) box.scrollTop = box.scrollHeight;
}

// --- copying ---------------------------------------------------------------------------------
// navigator.clipboard exists only in secure contexts (https, localhost); a page opened over plain
// http from another machine falls back to a selected textarea and execCommand.
async function copyText(text, done = "copied") {
  try {
    if (navigator.clipboard && window.isSecureContext) await navigator.clipboard.writeText(text);
    else {
      const area = el("textarea", { value: text });
      area.style.position = "fixed";
      area.style.opacity = "0";
      document.body.append(area);
      area.select();
      const ok = document.execCommand("copy");
      area.remove();
      if (!ok) throw new Error("the browser refused");
    }
    status(done);
  } catch (e) {
    status("could not copy: " + (e.message || e));
  }
}

// --- editing, regenerating, retrying ---------------------------------------------------------
function startEdit(node, m) {
  if (state.live) { status("wait for the reply, or stop it, before editing"); return; }
  const area = el("textarea", { class: "edit-input", value: m.content, "aria-label": "Edit the message" });
  const save = el("button", { type: "button", class: "primary edit-send", text: "Send" });
  const cancel = el("button", { type: "button", class: "edit-cancel", text: "Cancel" });
  const box = el("div", { class: "edit-box" }, area, el("div", { class: "row" }, cancel, save));
  const bubble = node.querySelector(".bubble");
  const actions = node.querySelector(".actions");
  bubble.hidden = true;
  actions.hidden = true;
  node.append(box);
  area.focus();
  area.setSelectionRange(area.value.length, area.value.length);
  const close = () => { box.remove(); bubble.hidden = false; actions.hidden = false; };
  cancel.addEventListener("click", close);
  save.addEventListener("click", async () => {
    const text = area.value;
    if (state.live || (!text.trim() && !(m.attachments && m.attachments.length))) return;
    // The edit is a new version beside the old message; the old one and its replies stay.
    const thread = currentThread();
    thread.add({ id: newId(), role: "user", content: text, attachments: m.attachments || [],
                 created: Date.now() }, m.parent);
    renderConversation();
    await generate(state.current);
  });
  area.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); save.click(); }
    if (e.key === "Escape") { e.preventDefault(); e.stopPropagation(); close(); }
  });
}

// A new reply beside this one, to the same history.
async function regenerate(m) {
  if (state.live) return;
  const thread = currentThread();
  thread.leaf = m.parent;
  renderConversation();
  await generate(state.current);
}

// The error goes, and so does a reply it cut short; the request is sent again.
async function retry(m) {
  if (state.live) return;
  const thread = currentThread();
  let parent = thread.get(m.parent);
  thread.remove(m.id);
  if (parent && parent.role === "assistant" && parent.stats && parent.stats.finish === "failed") {
    thread.remove(parent.id);
    parent = thread.get(parent.parent);
  }
  thread.leaf = parent ? parent.id : null;
  renderConversation();
  if (parent && parent.role === "user") await generate(state.current);
  else await persist(state.current);
}

// --- sending ---------------------------------------------------------------------------------
function setGenerating(on) {
  // The conversation is a live region: busy while a reply streams, so a screen reader reads the
  // reply once it is whole rather than every piece.
  if (on) $("messages").setAttribute("aria-busy", "true");
  else $("messages").removeAttribute("aria-busy");
  $("send").hidden = on;
  $("stop").hidden = !on;
  $("send").disabled = on;
}

function apiMessages(messages) {
  const out = [];
  const system = $("system").value.trim();
  if (system) out.push({ role: "system", content: system });
  for (const m of messages) {
    if (m.role === "user") out.push({ role: "user", content: userContent(m) });
    else if (m.role === "assistant") {
      if (!m.content && !(m.toolCalls && m.toolCalls.length)) continue;  // stopped before a word
      const turn = { role: "assistant", content: m.content };
      if (m.toolCalls && m.toolCalls.length) turn.tool_calls = m.toolCalls;
      out.push(turn);
    }
  }
  return out;
}

async function submit() {
  const text = $("input").value;
  if (state.live) return;
  if (!text.trim() && !state.pending.length) return;
  let conversation = state.current;
  if (!conversation) {
    const now = Date.now();
    conversation = { id: newId(), title: titleFrom(text, state.pending), created: now, updated: now };
    state.cache.set(conversation.id, new Thread());
    state.current = conversation;
    state.headers.unshift(conversation);
    showTitle();
  }
  // The open conversation's thread is loaded (openConversation waited for it); taking it without
  // waiting keeps a second Enter from sending twice before state.live is set.
  const thread = state.cache.get(conversation.id);
  thread.add({ id: newId(), role: "user", content: text, attachments: state.pending.slice(),
               created: Date.now() }, thread.leaf);
  $("input").value = "";
  autosize();
  clearAttachments();
  renderConversation();
  renderList();
  await generate(conversation);
}

async function generate(conversation) {
  const thread = state.cache.get(conversation.id);
  const message = { id: newId(), role: "assistant", content: "", reasoning: "", toolCalls: [],
                    pending: true, created: Date.now() };
  const request = { messages: apiMessages(thread.path()), stream: true,
                    stream_options: { include_usage: true }, ...samplingFields() };
  if ($("think").checked) request.chat_template_kwargs = { enable_thinking: true };
  thread.add(message, thread.leaf);
  const controller = new AbortController();
  state.live = { conversation, message, controller, bubble: null, view: null };
  if (state.current && state.current.id === conversation.id) {
    $("empty")?.remove();
    $("messages").append(messageElement(message));
    scrollToEnd(true);
  }
  setGenerating(true);
  status("waiting for the model\u2026");
  pollHealthSoon();
  await persist(conversation);

  const started = performance.now();
  let first = null, usage = null, timings = null, finish = null, chunks = 0;
  let frame = 0, lastSave = Date.now();
  const live = state.live;
  const paint = () => {
    frame = 0;
    if (!live.bubble) return;
    const follow = atBottom();
    live.view.update(message.content);
    const bubble = live.bubble.querySelector(".bubble");
    if (message.reasoning) {
      let block = bubble.querySelector(".reasoning");
      if (!block) {
        block = reasoningBlock("");
        bubble.prepend(block);
      }
      block.querySelector(".reasoning-text").textContent = message.reasoning;
    }
    const shown = bubble.querySelectorAll(".tool-call");
    message.toolCalls.forEach((call, i) => {
      const node = toolCallElement(call);
      if (shown[i]) shown[i].replaceWith(node);
      else bubble.append(node);
    });
    if (follow) scrollToEnd(true);
  };
  const schedule = () => { if (!frame) frame = requestAnimationFrame(paint); };

  let failure = null;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(request), signal: controller.signal,
    });
    if (!r.ok) throw await apiError(r);
    status("generating\u2026");
    const complete = await readEvents(r.body, (chunk) => {
      if (chunk.error) {
        const e = new Error(chunk.error.message || "the server reported an error");
        e.code = chunk.error.code || chunk.error.type;
        throw e;
      }
      if (chunk.usage) usage = chunk.usage;
      if (chunk.timings) timings = chunk.timings;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) return;
      const delta = choice.delta || {};
      const reasoning = delta.reasoning_content ?? delta.reasoning;
      let grew = false;
      if (reasoning) { message.reasoning += reasoning; grew = true; }
      if (delta.content) { message.content += delta.content; grew = true; }
      for (const call of delta.tool_calls || []) {
        // A call may arrive in pieces under one index: the first names it, the rest extend its
        // arguments (OpenAI's streaming shape).
        const index = call.index ?? message.toolCalls.length;
        const known = message.toolCalls[index];
        if (known && !call.id) known.function.arguments += call.function?.arguments || "";
        else message.toolCalls[index] = { id: call.id, type: "function",
                                          function: { name: call.function?.name || "",
                                                      arguments: call.function?.arguments || "" } };
        grew = true;
      }
      if (grew) {
        chunks++;
        if (first === null) { first = performance.now(); status("generating\u2026"); }
        schedule();
        if (Date.now() - lastSave > 2000) { lastSave = Date.now(); persist(conversation); }
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    });
    if (!complete) throw new Error("the stream ended before the server finished the reply");
  } catch (e) {
    failure = e;
  }
  if (frame) cancelAnimationFrame(frame);
  paint();
  const ended = performance.now();
  const stopped = failure && failure.name === "AbortError";
  message.pending = false;
  message.stats = {
    promptTokens: usage ? usage.prompt_tokens : null,
    completionTokens: usage ? usage.completion_tokens : null,
    chunks,
    ttftMs: first !== null ? first - started : null,
    genMs: first !== null ? ended - first : null,
    totalMs: ended - started,
    finish: stopped ? "stopped" : failure ? "failed" : finish,
  };
  if (timings) {  // a server that measures for itself (llama.cpp's shape) knows better
    if (timings.predicted_per_second) message.stats.serverTokensPerSecond = timings.predicted_per_second;
    if (timings.prompt_ms != null) message.stats.promptMs = timings.prompt_ms;
  }
  if (!message.toolCalls.length) delete message.toolCalls;
  if (!message.reasoning) delete message.reasoning;
  if (failure && !stopped) {
    // Nothing arrived: the reply is replaced by the error; a partial one stays above it.
    if (!message.content && !message.reasoning && !message.toolCalls) thread.remove(message.id);
    thread.add({ id: newId(), role: "error", content: failure.message || String(failure),
                 code: failure.code || "", created: Date.now() }, thread.leaf);
  }
  state.live = null;
  setGenerating(false);
  status(stopped ? "stopped" : "");
  await persist(conversation);
  // Finish the streamed element in place rather than re-rendering: what the reader sees stays
  // the same nodes, scrolled where they were.
  const node = live.bubble;
  if (state.current && state.current.id === conversation.id && node && node.isConnected) {
    const follow = atBottom();
    if (thread.get(message.id)) {
      node.dataset.done = "true";
      node.removeAttribute("aria-busy");
      node.querySelector(".bubble").append(metaElement(message.stats));
      node.append(assistantActions(message, thread));
    } else {
      node.remove();
    }
    const last = thread.get(thread.leaf);
    if (last && last.role === "error") $("messages").append(messageElement(last, thread));
    updateContextUsed();
    if (follow) scrollToEnd(true);
  }
  renderList();
  pollHealthSoon();
  if (document.activeElement === document.body || !document.activeElement) $("input").focus();
}

function stop() {
  if (state.live) state.live.controller.abort();
}

// --- attachments -----------------------------------------------------------------------------
function renderAttachments() {
  const list = $("attachments");
  list.textContent = "";
  state.pending.forEach((a, i) => {
    const chip = el("li", { class: "chip", "data-kind": a.kind });
    if (a.kind === "image") chip.append(el("img", { src: a.dataUrl, alt: "" }));
    else chip.append(fileIcon(a.kind));
    chip.append(el("span", { class: "name", text: a.name }));
    chip.append(actionButton("remove", "\u00D7", "Remove " + a.name, () => {
      state.pending.splice(i, 1);
      renderAttachments();
    }));
    list.append(chip);
  });
}
// A note (audio), a camera (video) or a page (text) in the attachment's chip; drawn here, the
// page loads no icons.
function fileIcon(kind) {
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("viewBox", "0 0 24 24");
  svg.setAttribute("width", "22");
  svg.setAttribute("height", "22");
  svg.setAttribute("aria-hidden", "true");
  svg.setAttribute("fill", "none");
  svg.setAttribute("stroke", "currentColor");
  svg.setAttribute("stroke-width", "1.8");
  const path = document.createElementNS("http://www.w3.org/2000/svg", "path");
  path.setAttribute("d", {
    audio: "M9 18V5l11-2v13M9 18a3 3 0 1 1-6 0 3 3 0 0 1 6 0zM20 16a3 3 0 1 1-6 0 3 3 0 0 1 6 0z",
    video: "M3 6h13v12H3zM16 10l5-3v10l-5-3",
  }[kind] || "M6 2h8l5 5v15H6zM14 2v5h5M9 12h7M9 16h7");
  svg.append(path);
  return svg;
}

function clearAttachments() {
  state.pending = [];
  $("file").value = "";
  renderAttachments();
}
async function addFiles(files) {
  for (const file of files) {
    try {
      const kind = classifyFile(file);
      state.pending.push(await readAttachment(file, kind));
    } catch (e) {
      status(file.name + ": " + (e.message || e));
    }
  }
  $("file").value = "";
  renderAttachments();
}

// --- recording from the microphone ----------------------------------------------------------
// At most 30 s: the longest clip the audio tower takes (the server refuses longer ones).
const MAX_RECORDING_MS = 30000;
const recording = { recorder: null, started: 0, timer: 0 };

function showRecording() {
  const button = $("record");
  const on = !!recording.recorder;
  button.classList.toggle("recording", on);
  button.setAttribute("aria-pressed", String(on));
  button.setAttribute("aria-label", on ? "Stop recording" : "Record from the microphone");
  $("record-time").textContent = on ? Math.floor((Date.now() - recording.started) / 1000) + " s" : "";
}

async function toggleRecording() {
  if (recording.recorder) {
    recording.recorder.stop();
    return;
  }
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({ audio: true });
  } catch (e) {
    status("cannot record: " + (e.message || e.name || e));
    return;
  }
  const chunks = [];
  const recorder = new MediaRecorder(stream);
  recorder.ondataavailable = (e) => { if (e.data.size) chunks.push(e.data); };
  recorder.onstop = async () => {
    stream.getTracks().forEach((t) => t.stop());
    clearInterval(recording.timer);
    recording.recorder = null;
    showRecording();
    try {
      const wav = await recordingToWav(new Blob(chunks, { type: recorder.mimeType }));
      const name = "recording " + new Date().toTimeString().slice(0, 8).replace(/:/g, ".") + ".wav";
      state.pending.push({ kind: "audio", name, format: "wav", dataUrl: await readAsDataUrl(wav) });
      renderAttachments();
      status("");
    } catch (e) {
      status("could not use the recording: " + (e.message || e));
    }
  };
  recording.recorder = recorder;
  recording.started = Date.now();
  recorder.start();
  recording.timer = setInterval(() => {
    if (Date.now() - recording.started >= MAX_RECORDING_MS) recorder.stop();
    else showRecording();
  }, 250);
  showRecording();
  status("recording\u2026 (at most 30 s)");
}

// --- server state ----------------------------------------------------------------------------
async function loadServerInfo() {
  let name = null, nCtx = null;
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    const j = await r.json().catch(() => ({}));
    if (r.ok && j.data && j.data[0]) {
      const m = j.data[0];
      name = m.id;
      nCtx = m.max_model_len ?? m.context_length ?? m.meta?.n_ctx ?? null;
    } else {
      $("model").textContent = (j.error && j.error.message) || r.status + " " + r.statusText;
    }
  } catch (e) {
    $("model").textContent = "server unreachable";
  }
  // llama.cpp's GET /props carries the context size; use it where the server has it.
  try {
    const r = await fetch("/props", { headers: headers() });
    if (r.ok) {
      const p = await r.json();
      nCtx = p.n_ctx ?? p.default_generation_settings?.n_ctx ?? nCtx;
      if (!name && p.model_alias) name = p.model_alias;
      if (!name && p.model_path) name = p.model_path.split(/[\\/]/).pop();
      const info = [];
      if (p.modalities) info.push("inputs: text" + (p.modalities.vision ? ", images" : "") +
                                  (p.modalities.audio ? ", audio" : ""));
      if (p.build_info) info.push("build " + p.build_info);
      if (info.length) $("server-info").textContent = info.join(" \u00B7 ");
    }
  } catch (e) {}
  if (name) $("model").textContent = name;
  state.nCtx = nCtx;
  showContextSize();
}

// The context size from /props or /v1/models where the server says it there, else the KV budget
// /health reports (gemstage's: the most tokens one request can hold).
function showContextSize() {
  const n = state.nCtx ?? state.kvBudget;
  $("context-size").textContent = n ? n.toLocaleString() + " token context" : "";
  updateContextUsed();
}

let healthTimer = 0;
async function pollHealth() {
  clearTimeout(healthTimer);
  const h = $("health");
  if (!document.hidden) {
    try {
      const r = await fetch("/health");
      const j = await r.json().catch(() => ({}));
      if (j.status === "ok") {
        if (typeof j.kv_budget === "number" && j.kv_budget !== state.kvBudget) {
          state.kvBudget = j.kv_budget;
          showContextSize();
        }
        const busy = j.slots_busy ?? 0, slots = j.slots ?? 1, queued = j.queued ?? 0;
        h.dataset.state = busy > 0 || queued > 0 ? "busy" : "idle";
        h.textContent = "";
        h.append(el("span", { text: busy > 0 ? "busy" : "ready" }),
                 el("span", { class: "detail", text: `\u00B7 ${busy}/${slots} slots busy \u00B7 ${queued} queued` }));
        h.setAttribute("aria-label", `server ${busy > 0 ? "busy" : "ready"}: ${busy} of ${slots} slots busy, ${queued} queued`);
        if (state.live && !state.live.bubble?.querySelector(".md-block") && queued > 0)
          status(`waiting for a free slot (${queued} queued)\u2026`);
      } else {
        h.dataset.state = "down";
        h.textContent = (j.status || "HTTP " + r.status).replace(/_/g, " ");
        h.title = j.error || "GET /health";
      }
    } catch (e) {
      h.dataset.state = "down";
      h.textContent = "unreachable";
    }
  }
  healthTimer = setTimeout(pollHealth, state.live ? 1000 : 4000);
}
function pollHealthSoon() {
  clearTimeout(healthTimer);
  healthTimer = setTimeout(pollHealth, 50);
}

// --- export / import -------------------------------------------------------------------------
async function exportAll() {
  const conversations = [];
  for (const h of state.headers) {
    const record = (await threadOf(h.id)).toRecord();
    conversations.push({ ...h, leaf: record.leaf, messages: record.nodes.filter((m) => !m.pending) });
  }
  const blob = new Blob([JSON.stringify({ format: "gemstage-chat", version: 1, conversations }, null, 1)],
                        { type: "application/json" });
  const a = el("a", { href: URL.createObjectURL(blob),
                      download: "gemstage-chats-" + new Date().toISOString().slice(0, 10) + ".json" });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 10000);
  status(`exported ${conversations.length} conversation${conversations.length === 1 ? "" : "s"}`);
}

// Every conversation of an exported file, checked before anything is stored.
function validImport(data) {
  if (!data || data.format !== "gemstage-chat" || !Array.isArray(data.conversations))
    throw new Error("not a file written by Export (no \"format\": \"gemstage-chat\")");
  return data.conversations.map((c, i) => {
    if (!c || typeof c.title !== "string" || !Array.isArray(c.messages))
      throw new Error(`conversation ${i} has no title or no messages array`);
    const thread = Thread.fromRecord({ nodes: c.messages.map((m) => ({ ...m, pending: false })),
                                       leaf: c.leaf }, `conversation ${i}`);
    return { c, thread };
  });
}

async function importFile(file) {
  try {
    const conversations = validImport(JSON.parse(await file.text()));
    for (const { c, thread } of conversations) {
      // Imported conversations get new ids, so importing a file twice never overwrites.
      const header = { id: newId(), title: c.title, created: Number(c.created) || Date.now(),
                       updated: Number(c.updated) || Date.now(), titleEdited: !!c.titleEdited };
      state.cache.set(header.id, thread);
      await state.store.save(header, thread.toRecord());
    }
    await refreshList();
    status(`imported ${conversations.length} conversation${conversations.length === 1 ? "" : "s"}`);
  } catch (e) {
    status("import failed: " + (e.message || e));
  }
  $("import").value = "";
}

// --- layout: the side list on narrow screens -------------------------------------------------
function openSidebar() {
  $("app").classList.add("sidebar-open");
  $("scrim").hidden = false;
  $("toggle-sidebar").setAttribute("aria-expanded", "true");
  $("new-chat").focus();
}
function closeSidebar() {
  if (!$("app").classList.contains("sidebar-open")) return;
  $("app").classList.remove("sidebar-open");
  $("scrim").hidden = true;
  $("toggle-sidebar").setAttribute("aria-expanded", "false");
}

function autosize() {
  const input = $("input");
  input.style.height = "auto";
  input.style.height = Math.min(input.scrollHeight, 220) + "px";
}

// --- wiring ----------------------------------------------------------------------------------
function wire() {
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); submit(); });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      submit();
    }
  });
  $("input").addEventListener("input", autosize);
  $("input").addEventListener("paste", (e) => {
    const files = [...(e.clipboardData?.files || [])];
    if (files.length) { e.preventDefault(); addFiles(files); }
  });
  $("stop").addEventListener("click", stop);
  document.addEventListener("keydown", (e) => {
    const mod = e.ctrlKey || e.metaKey;
    if (mod && e.shiftKey && e.key.toLowerCase() === "o") { e.preventDefault(); newChat(); return; }
    if (mod && !e.shiftKey && e.key.toLowerCase() === "k") {
      e.preventDefault();
      if (window.matchMedia("(max-width: 760px)").matches) openSidebar();
      $("search").focus();
      return;
    }
    if (e.key !== "Escape") return;
    if (state.live) { e.preventDefault(); stop(); return; }
    if ($("app").classList.contains("sidebar-open")) closeSidebar();
    else if (!$("settings").hidden) toggleSettings(false);
  });
  $("new-chat").addEventListener("click", newChat);
  // The microphone needs a secure page (https, or localhost) and a browser that records.
  if (navigator.mediaDevices && navigator.mediaDevices.getUserMedia && window.MediaRecorder)
    $("record").addEventListener("click", toggleRecording);
  else $("record").hidden = true;
  $("file").addEventListener("change", () => addFiles([...$("file").files]));
  const main = $("main");
  main.addEventListener("dragover", (e) => { e.preventDefault(); main.classList.add("dragging"); });
  main.addEventListener("dragleave", (e) => { if (e.target === main || !main.contains(e.relatedTarget)) main.classList.remove("dragging"); });
  main.addEventListener("drop", (e) => {
    e.preventDefault();
    main.classList.remove("dragging");
    if (e.dataTransfer?.files?.length) addFiles([...e.dataTransfer.files]);
  });
  $("settings-toggle").addEventListener("click", () => toggleSettings());
  for (const id of [...Object.values(settingFields), "think", "api-key"])
    $(id).addEventListener("input", saveSettings);
  $("api-key").addEventListener("change", loadServerInfo);
  $("reset-settings").addEventListener("click", () => {
    for (const id of Object.values(settingFields)) if (id !== "system") $(id).value = "";
    saveSettings();
  });
  $("theme-toggle").addEventListener("click", () => {
    const next = themes[(themes.indexOf(currentTheme()) + 1) % themes.length];
    localStorage.setItem(THEME_KEY, next);
    applyTheme(next);
  });
  $("toggle-sidebar").addEventListener("click", openSidebar);
  $("close-sidebar").addEventListener("click", closeSidebar);
  $("scrim").addEventListener("click", closeSidebar);
  let searchTimer = 0;
  $("search").addEventListener("input", () => {
    clearTimeout(searchTimer);
    searchTimer = setTimeout(() => { state.search = $("search").value; renderList(); }, 120);
  });
  $("export").addEventListener("click", exportAll);
  $("import").addEventListener("change", () => { if ($("import").files[0]) importFile($("import").files[0]); });
  // One listener for every code block's copy button, present and future.
  $("messages").addEventListener("click", (e) => {
    const button = e.target.closest(".copy-code");
    if (!button) return;
    const code = button.closest(".code-block").querySelector("pre code");
    copyText(code.textContent, "code copied");
    button.textContent = "Copied";
    setTimeout(() => { button.textContent = "Copy"; }, 1500);
  });
  document.addEventListener("visibilitychange", () => { if (!document.hidden) pollHealthSoon(); });
}

function toggleSettings(open = $("settings").hidden) {
  $("settings").hidden = !open;
  $("settings-toggle").setAttribute("aria-expanded", String(open));
  if (open) $("system").focus();
}

async function start() {
  applyTheme(currentTheme());
  // The keyboard hint only where it fits on one line.
  const narrow = window.matchMedia("(max-width: 520px)");
  const placeholder = () => {
    $("input").placeholder = narrow.matches ? "Message" : "Message (Enter sends, Shift+Enter for a new line)";
  };
  narrow.addEventListener("change", placeholder);
  placeholder();
  loadSettings();
  wire();
  try {
    state.store = await ConversationStore.open();
  } catch (e) {
    state.store = memoryStore;
    status("this browser does not keep conversations here (IndexedDB: " + (e.message || e) + ")");
  }
  await refreshList();
  renderConversation();
  loadServerInfo();
  pollHealth();
  $("input").focus();
}

start();
