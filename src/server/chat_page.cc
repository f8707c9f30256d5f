#include "server/chat_page.h"

namespace gemstage::server {

namespace {

// Kept as one literal so the binary serves the page with no files beside it. Element ids are
// stable (#messages, #input, #send, #stop, #image, #audio, #new-chat, #system, #max-tokens,
// #temperature, #api-key, #status, #model): the browser test drives the page through them.
// Replies are written with textContent, never innerHTML, so model output cannot inject markup.
constexpr std::string_view kPage = R"PAGE(<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>gemstage chat</title>
<style>
  :root { --bg: #f6f7f9; --fg: #1d232b; --muted: #66707c; --user: #dbeafe; --bot: #ffffff;
          --line: #d7dce2; --accent: #2563eb; --error: #b91c1c; }
  * { box-sizing: border-box; }
  body { margin: 0; font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif;
         background: var(--bg); color: var(--fg); height: 100vh; display: flex;
         flex-direction: column; }
  header { display: flex; align-items: center; gap: 12px; padding: 10px 16px;
           border-bottom: 1px solid var(--line); background: #fff; }
  header h1 { font-size: 17px; margin: 0; }
  #model { color: var(--muted); font-size: 13px; }
  header .spacer { flex: 1; }
  button { font: inherit; border: 1px solid var(--line); background: #fff; border-radius: 6px;
           padding: 6px 12px; cursor: pointer; }
  button.primary { background: var(--accent); border-color: var(--accent); color: #fff; }
  button:disabled { opacity: .5; cursor: default; }
  details { padding: 6px 16px; background: #fff; border-bottom: 1px solid var(--line); }
  details label { display: inline-flex; align-items: center; gap: 6px; margin: 4px 14px 4px 0;
                  font-size: 13px; color: var(--muted); }
  details input, details textarea { font: inherit; border: 1px solid var(--line);
                                    border-radius: 4px; padding: 3px 6px; }
  #system { width: min(520px, 90vw); }
  #messages { flex: 1; overflow-y: auto; padding: 16px; display: flex; flex-direction: column;
              gap: 10px; }
  .msg { max-width: min(760px, 92%); padding: 8px 12px; border-radius: 10px;
         border: 1px solid var(--line); }
  .msg.user { align-self: flex-end; background: var(--user); border-color: #bfdbfe; }
  .msg.assistant { align-self: flex-start; background: var(--bot); }
  .msg.error { align-self: center; color: var(--error); border-color: #fecaca;
               background: #fef2f2; }
  .msg .role { font-size: 11px; text-transform: uppercase; letter-spacing: .05em;
               color: var(--muted); margin-bottom: 2px; }
  .msg .content { white-space: pre-wrap; overflow-wrap: anywhere; }
  .msg img { max-width: 220px; max-height: 220px; display: block; border-radius: 6px;
             margin-bottom: 6px; }
  .msg.assistant[data-done="false"] .content::after { content: "\25CF"; color: var(--muted);
                                                       animation: blink 1s infinite; }
  @keyframes blink { 50% { opacity: 0; } }
  .msg .meta { font-size: 11px; color: var(--muted); margin-top: 4px; }
  .msg .reasoning { font-size: 13px; color: var(--muted); margin-bottom: 6px; }
  .msg .reasoning summary { cursor: pointer; }
  .msg .reasoning-text { white-space: pre-wrap; overflow-wrap: anywhere; padding-left: 8px;
                         border-left: 2px solid var(--line); }
  .msg .tool-call { font-family: ui-monospace, monospace; font-size: 12px; margin-top: 6px;
                    padding: 4px 8px; border-radius: 6px; background: #f3f4f6;
                    white-space: pre-wrap; overflow-wrap: anywhere; }
  form { display: flex; gap: 8px; padding: 12px 16px; border-top: 1px solid var(--line);
         background: #fff; align-items: flex-end; }
  #input { flex: 1; resize: none; font: inherit; padding: 8px; border: 1px solid var(--line);
           border-radius: 8px; min-height: 42px; max-height: 200px; }
  #attach { position: relative; overflow: hidden; }
  #image, #audio { position: absolute; inset: 0; opacity: 0; cursor: pointer; }
  #attach-audio { position: relative; overflow: hidden; }
  #audio-attachment { display: none; align-items: center; gap: 6px; font-size: 12px; }
  #attachment { display: none; align-items: center; gap: 6px; font-size: 12px;
                color: var(--muted); }
  #attachment img { height: 36px; border-radius: 4px; }
  #status { font-size: 12px; color: var(--muted); padding: 0 16px 6px; background: #fff;
            min-height: 1em; }
</style>
</head>
<body>
<header>
  <h1>gemstage chat</h1>
  <span id="model">connecting&hellip;</span>
  <span class="spacer"></span>
  <button id="new-chat" type="button">New chat</button>
</header>
<details>
  <summary>Settings</summary>
  <label>System prompt <input id="system" placeholder="(none)"></label>
  <label>Max tokens <input id="max-tokens" type="number" min="1" value="256" style="width:6em"></label>
  <label>Temperature <input id="temperature" type="number" min="0" max="2" step="0.1" value="1"
    style="width:5em"></label>
  <label>API key <input id="api-key" type="password" placeholder="(none)"></label>
  <label title="the model thinks before it answers; its reasoning shows collapsed above the reply
(text messages only)"><input id="think" type="checkbox"> Think</label>
</details>
<main id="messages" aria-live="polite"></main>
<form id="composer">
  <span id="attachment"><img id="attachment-preview" alt="attached image">
    <button id="clear-image" type="button" title="remove the image">&times;</button></span>
  <button id="attach" type="button" title="attach a PNG or JPEG image">Image
    <input id="image" type="file" accept="image/png,image/jpeg"></button>
  <span id="audio-attachment"><span id="audio-name"></span>
    <button id="clear-audio" type="button" title="remove the recording">&times;</button></span>
  <button id="attach-audio" type="button" title="attach a recording (WAV, MP3, FLAC, OGG; at most 30 s)">Audio
    <input id="audio" type="file" accept=".wav,.mp3,.flac,.ogg,audio/wav,audio/mpeg,audio/flac,audio/ogg"></button>
  <textarea id="input" rows="1" placeholder="Message (Enter sends, Shift+Enter for a new line)"></textarea>
  <button id="send" class="primary" type="submit">Send</button>
  <button id="stop" type="button" disabled>Stop</button>
</form>
<div id="status"></div>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const conversation = [];  // OpenAI-style messages sent with every request
let attached = null;       // data URL of the image for the next message
let attachedAudio = null;  // {data: base64, format, url} of the recording for the next message
let controller = null;     // aborts the reply in flight

const apiKey = $("api-key");
apiKey.value = localStorage.getItem("gemstage-api-key") || "";
apiKey.addEventListener("change", () => localStorage.setItem("gemstage-api-key", apiKey.value));

function headers() {
  const h = { "Content-Type": "application/json" };
  if (apiKey.value) h["Authorization"] = "Bearer " + apiKey.value;
  return h;
}

function status(text) { $("status").textContent = text; }

function addMessage(role, text, image, audio) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const label = document.createElement("div");
  label.className = "role";
  label.textContent = role;
  div.appendChild(label);
  if (image) {
    const img = document.createElement("img");
    img.src = image;
    img.alt = "attached image";
    div.appendChild(img);
  }
  if (audio) {
    const player = document.createElement("audio");
    player.controls = true;
    player.src = audio;
    div.appendChild(player);
  }
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  div.appendChild(content);
  $("messages").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    const j = await r.json();
    $("model").textContent = r.ok ? j.data[0].id : (j.error && j.error.message) || r.statusText;
  } catch (e) {
    $("model").textContent = "server unreachable";
  }
}

// Reads a server-sent-events body and calls onChunk with each parsed "data:" JSON object.
// Events are separated by a blank line; "data: [DONE]" ends the stream.
async function readEvents(body, onChunk) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return false;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;  // comments and other fields
        const data = line.slice(5).trim();
        if (data === "[DONE]") return true;
        onChunk(JSON.parse(data));
      }
    }
  }
}

async function send(text) {
  const content = [];
  if (attached) content.push({ type: "image_url", image_url: { url: attached } });
  if (attachedAudio)
    content.push({ type: "input_audio",
                   input_audio: { data: attachedAudio.data, format: attachedAudio.format } });
  content.push({ type: "text", text });
  const user = { role: "user", content: attached || attachedAudio ? content : text };
  addMessage("user", text, attached, attachedAudio && attachedAudio.url);
  clearImage();
  clearAudio();
  conversation.push(user);

  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...conversation);
  const request = { messages, stream: true, stream_options: { include_usage: true } };
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (maxTokens > 0) request.max_tokens = maxTokens;
  const temperature = parseFloat($("temperature").value);
  if (!Number.isNaN(temperature)) request.temperature = temperature;
  // The thinking switch takes the server's tool path, which renders text messages only.
  const media = conversation.some((m) => Array.isArray(m.content) &&
                                         m.content.some((p) => p.type !== "text"));
  if ($("think").checked && !media) request.chat_template_kwargs = { enable_thinking: true };

  const bubble = addMessage("assistant", "");
  bubble.dataset.done = "false";
  const out = bubble.querySelector(".content");
  let reply = "", reasoning = "", finish = null, usage = null, reasoningText = null;
  const toolCalls = [];
  // Reasoning streams into a collapsed block above the reply; tool calls show below it.
  const showReasoning = (piece) => {
    if (!reasoningText) {
      const details = document.createElement("details");
      details.className = "reasoning";
      const summary = document.createElement("summary");
      summary.textContent = "Reasoning";
      details.appendChild(summary);
      reasoningText = document.createElement("div");
      reasoningText.className = "reasoning-text";
      details.appendChild(reasoningText);
      bubble.insertBefore(details, out);
    }
    reasoning += piece;
    reasoningText.textContent = reasoning;
  };
  const showToolCall = (call) => {
    toolCalls.push({ id: call.id, type: "function", function: call.function });
    const div = document.createElement("div");
    div.className = "tool-call";
    div.textContent = "\u2192 " + call.function.name + "(" + call.function.arguments + ")";
    bubble.appendChild(div);
  };
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  status("generating\u2026");
  const started = performance.now();
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(request), signal: controller.signal,
    });
    if (!r.ok) {
      let message = r.status + " " + r.statusText;
      try { message = (await r.json()).error.message; } catch (e) {}
      throw new Error(message);
    }
    const complete = await readEvents(r.body, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) return;
      if (choice.delta && choice.delta.reasoning_content) showReasoning(choice.delta.reasoning_content);
      if (choice.delta && choice.delta.content) {
        reply += choice.delta.content;
        out.textContent = reply;
        bubble.scrollIntoView({ block: "end" });
      }
      for (const call of (choice.delta && choice.delta.tool_calls) || []) showToolCall(call);
      if (choice.finish_reason) finish = choice.finish_reason;
    });
    if (!complete) throw new Error("the stream ended early");
    const turn = { role: "assistant", content: reply };
    if (toolCalls.length) turn.tool_calls = toolCalls;
    conversation.push(turn);
    const seconds = (performance.now() - started) / 1000;
    const meta = document.createElement("div");
    meta.className = "meta";
    meta.textContent = (usage ? usage.completion_tokens + " tokens, " : "") +
        seconds.toFixed(2) + " s" + (finish ? ", " + finish : "");
    bubble.appendChild(meta);
    status("");
  } catch (e) {
    if (e.name === "AbortError") {
      // A stopped reply still belongs to the conversation as far as it got.
      conversation.push({ role: "assistant", content: reply });
      status("stopped");
    } else {
      conversation.pop();  // the user turn failed; it can be sent again
      addMessage("error", String(e.message || e));
      status("");
    }
  } finally {
    bubble.dataset.done = "true";
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
    $("input").focus();
  }
}

function clearImage() {
  attached = null;
  $("image").value = "";
  $("attachment").style.display = "none";
}

$("image").addEventListener("change", () => {
  const file = $("image").files[0];
  if (!file) return;
  const reader = new FileReader();
  reader.onload = () => {
    attached = reader.result;
    $("attachment-preview").src = attached;
    $("attachment").style.display = "inline-flex";
  };
  reader.onerror = () => status("could not read " + file.name);
  reader.readAsDataURL(file);
});
$("clear-image").addEventListener("click", clearImage);
function clearAudio() {
  attachedAudio = null;
  $("audio").value = "";
  $("audio-attachment").style.display = "none";
}
$("audio").addEventListener("change", () => {
  const file = $("audio").files[0];
  if (!file) return;
  // input_audio names the format; the server decodes wav, mp3, flac and ogg.
  const ext = (file.name.split(".").pop() || "").toLowerCase();
  const format = { wav: "wav", mp3: "mp3", flac: "flac", ogg: "ogg", oga: "ogg" }[ext] ||
      { "audio/wav": "wav", "audio/x-wav": "wav", "audio/mpeg": "mp3", "audio/flac": "flac",
        "audio/ogg": "ogg" }[file.type];
  if (!format) { status(file.name + ": send WAV, MP3, FLAC or OGG audio"); clearAudio(); return; }
  const reader = new FileReader();
  reader.onload = () => {
    const url = reader.result;
    attachedAudio = { data: url.slice(url.indexOf(",") + 1), format, url };
    $("audio-name").textContent = file.name;
    $("audio-attachment").style.display = "inline-flex";
  };
  reader.onerror = () => status("could not read " + file.name);
  reader.readAsDataURL(file);
});
$("clear-audio").addEventListener("click", clearAudio);
$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("input").value;
  if (controller || (!text.trim() && !attached && !attachedAudio)) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => { if (controller) controller.abort(); });
$("new-chat").addEventListener("click", () => {
  if (controller) controller.abort();
  conversation.length = 0;
  $("messages").textContent = "";
  clearImage();
  clearAudio();
  status("");
});
loadModel();
$("input").focus();
</script>
</body>
</html>
)PAGE";

}  // namespace

std::string_view chat_page_html() {
  return kPage;
}

}  // namespace gemstage::server
