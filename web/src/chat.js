// The page's pieces that touch no element: the server-sent-events reader, error replies,
// attachments (files to message parts), the reply statistics line and ids.

// Reads a server-sent-events body and calls onChunk with each parsed "data:" JSON object.
// Events are separated by a blank line; "data: [DONE]" ends the stream (true). A body that ends
// without it was cut short (false).
export async function readEvents(body, onChunk) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return false;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;  // comments and other fields
        const data = line.slice(5).trim();
        if (data === "[DONE]") {
          reader.cancel().catch(() => {});
          return true;
        }
        onChunk(JSON.parse(data));
      }
    }
  }
}

// An Error for a non-2xx reply: the server's own message (OpenAI's {"error": {...}} shape) with
// its code, and a hint for the errors a chat user can act on.
export async function apiError(response) {
  let message = `${response.status} ${response.statusText}`.trim(), code = "";
  try {
    const j = await response.json();
    if (j.error) {
      message = j.error.message || message;
      code = j.error.code || j.error.type || "";
    }
  } catch (e) {}
  const hints = {
    context_length_exceeded: "Start a new chat, or delete or shorten earlier messages.",
    model_loading: "The model is still loading; try again in a moment.",
    missing_api_key: "Set the API key in Settings.",
    invalid_api_key: "Check the API key in Settings.",
  };
  if (response.status === 503 && !hints[code] && code !== "model_loading")
    hints[code] = "The server is busy or unavailable; try again shortly.";
  const e = new Error(message + (hints[code] ? " " + hints[code] : ""));
  e.code = `HTTP ${response.status}` + (code ? ` \u00B7 ${code}` : "");
  return e;
}

// --- attachments -----------------------------------------------------------------------------
const AUDIO_FORMATS = { wav: "wav", mp3: "mp3", flac: "flac", ogg: "ogg", oga: "ogg", opus: "ogg" };
const AUDIO_TYPES = { "audio/wav": "wav", "audio/x-wav": "wav", "audio/wave": "wav",
                      "audio/mpeg": "mp3", "audio/mp3": "mp3", "audio/flac": "flac",
                      "audio/x-flac": "flac", "audio/ogg": "ogg" };
const TEXT_EXTENSIONS = new Set(("txt md markdown rst csv tsv json jsonl xml html htm css js mjs " +
  "cjs ts tsx jsx py rb go rs c cc cpp cxx h hh hpp java kt kts swift cs php pl sh bash zsh fish " +
  "ps1 bat sql yaml yml toml ini cfg conf log tex bib r m scala lua dart vue svelte cmake " +
  "makefile dockerfile gitignore env diff patch").split(" "));
// The server decodes these containers (docs/video.md); a browser often gives no type for .mkv.
const VIDEO_TYPES = { mp4: "video/mp4", m4v: "video/mp4", mov: "video/quicktime",
                      webm: "video/webm", mkv: "video/x-matroska" };
// The server takes request bodies up to 32 MiB by default (--max-body), and base64 adds a third.
const MAX_IMAGE_BYTES = 20 << 20, MAX_AUDIO_BYTES = 20 << 20, MAX_VIDEO_BYTES = 20 << 20,
      MAX_TEXT_BYTES = 1 << 20;

function extension(name) {
  const dot = name.lastIndexOf(".");
  return dot < 0 ? name.toLowerCase() : name.slice(dot + 1).toLowerCase();
}

export function classifyFile(file) {
  const ext = extension(file.name), type = (file.type || "").toLowerCase();
  if (type.startsWith("image/")) return "image";
  if (type.startsWith("audio/") || AUDIO_FORMATS[ext]) return "audio";
  if (type.startsWith("video/") || VIDEO_TYPES[ext]) return "video";
  if (type.startsWith("text/") || TEXT_EXTENSIONS.has(ext) || /json|xml|javascript|yaml|toml/.test(type))
    return "text";
  if (!type) return "text";  // unknown: read it, and refuse it below if it is binary
  throw new Error(`cannot attach a ${type} file: attach images, recordings (WAV, MP3, FLAC, OGG), ` +
                  "videos (MP4, MOV, WebM, MKV) or text files");
}

export function readAsDataUrl(blob) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error || new Error("could not read the file"));
    reader.readAsDataURL(blob);
  });
}

// The server takes PNG and JPEG; other images the browser can decode (WebP, GIF, BMP, AVIF) are
// redrawn as PNG here.
async function imageDataUrl(file) {
  if (file.type === "image/png" || file.type === "image/jpeg") return readAsDataUrl(file);
  let bitmap;
  try {
    bitmap = await createImageBitmap(file);
  } catch (e) {
    throw new Error("this browser cannot decode the image; attach a PNG or JPEG");
  }
  const canvas = document.createElement("canvas");
  canvas.width = bitmap.width;
  canvas.height = bitmap.height;
  canvas.getContext("2d").drawImage(bitmap, 0, 0);
  return canvas.toDataURL("image/png");
}

export async function readAttachment(file, kind) {
  const size = (n) => `${(n / (1 << 20)).toFixed(0)} MB`;
  if (kind === "image") {
    if (file.size > MAX_IMAGE_BYTES) throw new Error(`images larger than ${size(MAX_IMAGE_BYTES)} are refused`);
    return { kind, name: file.name, dataUrl: await imageDataUrl(file) };
  }
  if (kind === "audio") {
    if (file.size > MAX_AUDIO_BYTES) throw new Error(`recordings larger than ${size(MAX_AUDIO_BYTES)} are refused`);
    const format = AUDIO_FORMATS[extension(file.name)] || AUDIO_TYPES[(file.type || "").toLowerCase()];
    if (!format) throw new Error("send WAV, MP3, FLAC or OGG audio");
    return { kind, name: file.name, format, dataUrl: await readAsDataUrl(file) };
  }
  if (kind === "video") {
    if (file.size > MAX_VIDEO_BYTES) throw new Error(`videos larger than ${size(MAX_VIDEO_BYTES)} are refused`);
    // The server wants data:video/...; name the type from the extension where the browser gave none.
    const type = (file.type || "").startsWith("video/") ? file.type : VIDEO_TYPES[extension(file.name)];
    if (!type) throw new Error("send MP4, MOV, WebM or MKV video");
    const url = await readAsDataUrl(file);
    return { kind, name: file.name, dataUrl: `data:${type};base64,` + url.slice(url.indexOf(",") + 1) };
  }
  if (file.size > MAX_TEXT_BYTES) throw new Error(`text files larger than ${size(MAX_TEXT_BYTES)} are refused`);
  const text = await file.text();
  if (text.slice(0, 8192).includes("\u0000"))
    throw new Error("this is not a text file; attach images, recordings or text files");
  return { kind: "text", name: file.name, text };
}

// A recording (whatever MediaRecorder wrote: WebM/Opus, OGG, MP4) as a 16 kHz mono 16-bit WAV,
// the input the audio tower takes and a format the server decodes on every platform.
export async function recordingToWav(blob) {
  const AudioCtx = window.AudioContext || window.webkitAudioContext;
  const decoder = new AudioCtx();
  let decoded;
  try {
    decoded = await decoder.decodeAudioData(await blob.arrayBuffer());
  } finally {
    decoder.close();
  }
  const rate = 16000;
  const frames = Math.max(1, Math.ceil(decoded.duration * rate));
  const offline = new OfflineAudioContext(1, frames, rate);
  const source = offline.createBufferSource();
  source.buffer = decoded;
  source.connect(offline.destination);  // the context mixes the channels down to its one
  source.start();
  const samples = (await offline.startRendering()).getChannelData(0);
  const out = new DataView(new ArrayBuffer(44 + samples.length * 2));
  const text = (at, s) => { for (let i = 0; i < s.length; i++) out.setUint8(at + i, s.charCodeAt(i)); };
  text(0, "RIFF");
  out.setUint32(4, 36 + samples.length * 2, true);
  text(8, "WAVE");
  text(12, "fmt ");
  out.setUint32(16, 16, true);         // the fmt chunk's size
  out.setUint16(20, 1, true);          // PCM
  out.setUint16(22, 1, true);          // one channel
  out.setUint32(24, rate, true);
  out.setUint32(28, rate * 2, true);   // bytes per second
  out.setUint16(32, 2, true);          // bytes per frame
  out.setUint16(34, 16, true);         // bits per sample
  text(36, "data");
  out.setUint32(40, samples.length * 2, true);
  for (let i = 0; i < samples.length; i++) {
    const v = Math.max(-1, Math.min(1, samples[i]));
    out.setInt16(44 + i * 2, v < 0 ? v * 0x8000 : v * 0x7fff, true);
  }
  return new Blob([out.buffer], { type: "audio/wav" });
}

// A user message as the API's content: a string, or parts when it has attachments. A text file
// goes in as a text part naming the file, its contents fenced.
export function userContent(m) {
  const attachments = m.attachments || [];
  if (!attachments.length) return m.content;
  const parts = [];
  for (const a of attachments) {
    if (a.kind === "image") parts.push({ type: "image_url", image_url: { url: a.dataUrl } });
    else if (a.kind === "audio")
      parts.push({ type: "input_audio",
                   input_audio: { data: a.dataUrl.slice(a.dataUrl.indexOf(",") + 1), format: a.format } });
    else if (a.kind === "video") parts.push({ type: "video_url", video_url: { url: a.dataUrl } });
    else if (a.kind === "text") {
      const fence = a.text.includes("```") ? "~~~~" : "```";
      parts.push({ type: "text", text: `File ${a.name}:\n${fence}\n${a.text}\n${fence}` });
    }
  }
  if (m.content) parts.push({ type: "text", text: m.content });
  return parts;
}

// --- statistics ------------------------------------------------------------------------------
// The line under a reply. Speed is the decode rate: the tokens after the first over the time
// from the first to the last (the first token's wait is the prompt's processing, shown apart).
export function formatStats(s) {
  const parts = [];
  const n = s.completionTokens;
  if (n != null) parts.push(`${n} token${n === 1 ? "" : "s"}`);
  else if (s.chunks) parts.push(`${s.chunks} pieces (the server sent no usage)`);
  const tps = s.serverTokensPerSecond ??
      (n != null && n > 1 && s.genMs > 0 ? (n - 1) / (s.genMs / 1000) : null);
  if (tps != null) parts.push(`${tps.toFixed(1)} tokens/s`);
  if (s.ttftMs != null) parts.push(`first token ${(s.ttftMs / 1000).toFixed(2)} s`);
  parts.push(`${(s.totalMs / 1000).toFixed(2)} s`);
  if (s.promptTokens != null) parts.push(`prompt ${s.promptTokens} tokens`);
  if (s.finish) parts.push(s.finish);
  return parts;
}

// crypto.randomUUID exists only in secure contexts, and the page is often opened over plain http.
export function newId() {
  return Date.now().toString(36) + "-" + Math.random().toString(36).slice(2, 10);
}

export function titleFrom(text, attachments) {
  const line = text.trim().split("\n")[0].trim();
  const base = line || (attachments[0] ? attachments[0].name : "New chat");
  return base.length > 60 ? base.slice(0, 57) + "\u2026" : base;
}
