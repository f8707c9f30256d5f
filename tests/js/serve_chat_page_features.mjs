// The chat page's features in headless Chromium (Debian's chromium, driven by playwright-core)
// against `gemstage serve` on the tiny fixture model, through a small proxy on another port. The
// proxy passes every request on to the server, except chat requests the test has queued a canned
// reply for: a random-weight model writes no markdown, and a reply that streams slowly enough to
// be stopped needs a clock the test controls. It also records each chat request the page sends.
//
// Checked: a streamed markdown reply (table, highlighted code whose copy button puts the exact
// code on the clipboard, $...$, $$...$$ and \(...\) math) whose finished blocks are not redrawn
// while later ones stream; a <script> and an onerror attribute in a reply shown as text and never
// run; reply statistics; dark mode from the system and from the toggle; edit-and-resend and
// regenerate against the real server, the earlier versions kept and reachable; two
// conversations surviving a reload; search, rename,
// delete, export and import; stop mid-stream with Escape; Shift+Enter; server errors (a bad
// image, a full context) shown in the conversation; a 390-px-wide viewport. Screenshots of the
// light, dark and narrow page are written to the directory given.
//
//   node tests/js/serve_chat_page_features.mjs path/to/gemstage path/to/tests/fixtures out-dir
import fs from "node:fs";
import http from "node:http";
import os from "node:os";
import path from "node:path";
import { SLOW, checks, importPackage, parseArgs, startServer, sleep } from "./serve_helpers.mjs";

const NAME = "serve_chat_page_features";
const { cli, model, rest } = parseArgs(NAME, "screenshot-dir");
const { check, eq, step, passed } = checks(NAME);
const shots = rest[0];
if (!shots) check(false, "no screenshot directory given");
fs.mkdirSync(shots, { recursive: true });
const { chromium } = await importPackage(NAME, "playwright-core");
const executablePath = process.env.CHROMIUM ?? "/usr/bin/chromium";
check(fs.existsSync(executablePath),
      `${executablePath} not found: install Debian's chromium (scripts/setup.sh does)`);
const timeout = 30000 * SLOW;

// A 512-token context, so a long message overflows it (the context-full error). One thread: the
// tiny model needs no more, and threads that wait on each other crawl when the machine is busy.
const server = await startServer(cli, model, ["-np", "1", "-t", "1", "-c", "512"]);

// --- the proxy -------------------------------------------------------------------------------
const sse = (chunk) => `data: ${JSON.stringify(chunk)}\n\n`;
const chunk = (delta, finish = null) => ({ id: "chatcmpl-canned", object: "chat.completion.chunk",
                                           created: 0, model: "model",
                                           choices: [{ index: 0, delta, finish_reason: finish }] });
const proxy = { canned: [], chats: [], aborted: 0, url: "" };
// A canned reply: its text in pieces, each after delayMs.
function cannedReply(text, { pieces = 24, delayMs = 15 } = {}) {
  const size = Math.ceil(text.length / pieces);
  const parts = [];
  for (let i = 0; i < text.length; i += size) parts.push(text.slice(i, i + size));
  return { parts, delayMs, completionTokens: parts.length };
}
async function serveCanned(reply, res) {
  let closed = false;
  res.on("close", () => { if (!res.writableFinished) { closed = true; proxy.aborted++; } });
  res.writeHead(200, { "Content-Type": "text/event-stream", "Cache-Control": "no-cache" });
  res.write(sse(chunk({ role: "assistant", content: "" })));
  for (const part of reply.parts) {
    await sleep(reply.delayMs);
    if (closed) return;
    res.write(sse(chunk({ content: part })));
  }
  res.write(sse(chunk({}, "stop")));
  res.write(sse({ id: "chatcmpl-canned", object: "chat.completion.chunk", created: 0, model: "model",
                  choices: [], usage: { prompt_tokens: 20, completion_tokens: reply.completionTokens,
                                        total_tokens: 20 + reply.completionTokens } }));
  res.end("data: [DONE]\n\n");
}
const proxyServer = http.createServer(async (req, res) => {
  const body = [];
  for await (const piece of req) body.push(piece);
  const bytes = Buffer.concat(body);
  if (req.method === "POST" && req.url === "/v1/chat/completions") {
    proxy.chats.push(JSON.parse(bytes.toString("utf8")));
    if (proxy.canned.length) return serveCanned(proxy.canned.shift(), res);
  }
  const upstream = http.request(server.url + req.url, { method: req.method, headers: req.headers },
                                (up) => { res.writeHead(up.statusCode, up.headers); up.pipe(res); });
  upstream.on("error", (e) => { if (!res.headersSent) res.writeHead(502); res.end(String(e)); });
  res.on("close", () => upstream.destroy());  // a stopped reply stops the server's generation
  upstream.end(bytes);
});
await new Promise((resolve) => proxyServer.listen(0, "127.0.0.1", resolve));
proxy.url = `http://127.0.0.1:${proxyServer.address().port}`;

// The same request through the API, for what the page must show.
async function apiReply(messages, extra = {}) {
  const r = await fetch(`${server.url}/v1/chat/completions`, {
    method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ messages, temperature: 0, max_tokens: 8, ...extra }),
  });
  const j = await r.json();
  check(r.status === 200, `API status ${r.status}: ${JSON.stringify(j)}`);
  return j.choices[0].message.content;
}

const MARKDOWN_CODE = 'def greet(name):\n    """Say hello."""\n    return f"Hello, {name}!"  # <b>not bold</b>';
const MARKDOWN = [
  "## Results",
  "",
  "Here is a **summary** with inline math $E = mc^2$ and \\(a^2 + b^2 = c^2\\).",
  "",
  "| Name | Score | Notes |",
  "|------|------:|-------|",
  "| Ada | 91 | first |",
  "| Grace | 87 | `code` in a cell |",
  "",
  "```python",
  MARKDOWN_CODE,
  "```",
  "",
  "$$\\int_0^1 x^2\\,dx = \\frac{1}{3}$$",
  "",
  "Raw HTML stays text: <script>window.__replyRan = 1</script> and " +
    "<img src=x onerror=\"window.__replyRan = 2\">.",
  "",
  "- one",
  "- two",
].join("\n");

const browser = await chromium.launch({ executablePath, args: ["--no-sandbox"], headless: true });
const pageErrors = [], foreign = [];
async function newPage(context) {
  const page = await context.newPage();
  page.on("pageerror", (e) => pageErrors.push(String(e)));
  page.on("request", (r) => {
    if (!r.url().startsWith(proxy.url) && !r.url().startsWith("data:") && !r.url().startsWith("blob:"))
      foreign.push(r.url());
  });
  return page;
}
// Waits until the texts of selector's elements are want (the page renders after async storage
// reads), then compares, so a mismatch fails with both lists.
async function texts(page, selector, want, what) {
  await page.waitForFunction(([sel, w]) => JSON.stringify([...document.querySelectorAll(sel)]
                               .map((n) => n.textContent)) === JSON.stringify(w),
                             [selector, want], { timeout: 5000 * SLOW }).catch(() => {});
  eq(await page.locator(selector).allTextContents(), want, what);
}
const luminance = (page, selector) => page.$eval(selector, (node) => {
  const [r, g, b] = getComputedStyle(node).backgroundColor.match(/\d+/g).map(Number);
  return (0.2126 * r + 0.7152 * g + 0.0722 * b) / 255;
});

try {
  const context = await browser.newContext({ viewport: { width: 1200, height: 860 },
                                             colorScheme: "light", acceptDownloads: true });
  await context.grantPermissions(["clipboard-read", "clipboard-write"], { origin: proxy.url });
  const page = await newPage(context);
  const clipboard = () => page.evaluate(() => navigator.clipboard.readText());
  const assistant = (i) => page.locator(".msg.assistant").nth(i);
  const waitDone = (locator) => locator.locator(".meta").waitFor({ timeout });

  await step("the page loads and shows the model, its context and the server's state", async () => {
    await page.goto(proxy.url + "/");
    await page.waitForFunction(() => document.getElementById("model").textContent === "model",
                               null, { timeout });
    await page.waitForFunction(() => /slots busy/.test(document.getElementById("health").textContent),
                               null, { timeout });
    check(/[01]\/1 slots busy/.test(await page.textContent("#health")),
          `health ${await page.textContent("#health")}`);
    // gemstage has no /props: the context size is /health's KV budget (-c 512).
    eq(await page.textContent("#context-size"), "512 token context", "context size");
  });

  await step("every control has a name a screen reader reads, and Tab reaches the message box", async () => {
    const unnamed = await page.evaluate(() => {
      const named = (n) => (n.getAttribute("aria-label") || n.title || n.placeholder ||
                            (n.labels && [...n.labels].map((l) => l.textContent).join("")) ||
                            n.textContent || "").trim();
      return [...document.querySelectorAll("button, input, textarea, select, a[href]")]
        .filter((n) => !named(n)).map((n) => n.outerHTML.slice(0, 80));
    });
    eq(unnamed, [], "controls without a name");
    await page.locator("#new-chat").focus();
    let reached = false;
    for (let i = 0; i < 30 && !reached; i++) {
      await page.keyboard.press("Tab");
      reached = await page.evaluate(() => document.activeElement.id === "input");
    }
    check(reached, "Tab never reaches the message box");
  });

  await step("a streamed markdown reply: table, highlighted code, math; finished blocks stay put", async () => {
    proxy.canned.push(cannedReply(MARKDOWN, { pieces: 60, delayMs: 60 }));
    await page.fill("#input", "Show me some markdown");
    await page.press("#input", "Enter");
    // A block is complete once the next one shows; from then on it must stay the same element
    // while the rest streams in: the heading once the table shows, the table once the code does.
    await page.waitForSelector(".msg.assistant table", { timeout });
    const heading = await page.$(".msg.assistant h2");
    await heading.evaluate((h) => { h.dataset.seen = "yes"; });
    await page.waitForSelector(".msg.assistant .code-block", { timeout });
    const table = await page.$(".msg.assistant table");
    await table.evaluate((t) => { t.dataset.seen = "yes"; });
    check(await page.locator(".msg.assistant .meta").count() === 0, "the reply ended before the checks began");
    await waitDone(assistant(0));
    check(await heading.evaluate((h) => h.isConnected && h.dataset.seen === "yes"),
          "the heading was redrawn while later blocks streamed");
    check(await table.evaluate((t) => t.isConnected && t.dataset.seen === "yes"),
          "the table was redrawn while later blocks streamed");
    const bubble = assistant(0);
    eq(await bubble.locator("h2").textContent(), "Results", "heading");
    eq(await bubble.locator("table th").allTextContents(), ["Name", "Score", "Notes"], "table header");
    eq(await bubble.locator("table tbody tr").count(), 2, "table rows");
    eq(await bubble.locator("table td code").textContent(), "code", "code in a cell");
    check(await bubble.locator(".code-block .hljs-keyword").count() > 0, "the code is not highlighted");
    eq(await bubble.locator(".code-lang").textContent(), "python", "code language label");
    eq(await bubble.locator("pre code").textContent(), MARKDOWN_CODE, "code text");
    // Math: two inline formulas and one display formula, each typeset by KaTeX with its TeX kept
    // in the MathML annotation.
    const tex = await bubble.locator(".katex annotation").allTextContents();
    eq(tex, ["E = mc^2", "a^2 + b^2 = c^2", "\\int_0^1 x^2\\,dx = \\frac{1}{3}"], "math");
    eq(await bubble.locator(".katex-display").count(), 1, "display math");
    eq(await bubble.locator("li").allTextContents(), ["one", "two"], "list");
    const meta = await bubble.locator(".meta").textContent();
    check(/\d+ tokens/.test(meta) && /tokens\/s/.test(meta) && /first token/.test(meta),
          `statistics line: ${meta}`);
  });

  await step("HTML in a reply is text: the script and the onerror never run", async () => {
    const bubble = assistant(0);
    const text = await bubble.locator(".content").textContent();
    check(text.includes("<script>window.__replyRan = 1</script>"), "the script tag is not shown as text");
    check(text.includes("<img src=x onerror="), "the img tag is not shown as text");
    eq(await bubble.locator("script, img").count(), 0, "elements made from the reply's HTML");
    await sleep(100);
    eq(await page.evaluate(() => window.__replyRan ?? null), null, "window.__replyRan");
  });

  await step("the code block's copy button puts the exact code on the clipboard", async () => {
    await assistant(0).locator(".copy-code").click();
    eq(await clipboard(), MARKDOWN_CODE, "clipboard");
    await page.screenshot({ path: path.join(shots, "chat-page-light.png") });
  });

  await step("dark mode follows the system, and the toggle overrides it", async () => {
    check(await luminance(page, "body") > 0.8, "the light page is not light");
    await page.emulateMedia({ colorScheme: "dark" });
    check(await luminance(page, "body") < 0.2, "the page does not follow the system's dark mode");
    await page.screenshot({ path: path.join(shots, "chat-page-dark.png") });
    await page.click("#theme-toggle");  // system -> dark
    check(await luminance(page, "body") < 0.2, "dark theme");
    await page.click("#theme-toggle");  // dark -> light, though the system says dark
    check(await luminance(page, "body") > 0.8, "the light theme does not override the system");
    await page.click("#theme-toggle");  // back to the system's
    check(await luminance(page, "body") < 0.2, "back to following the system");
    await page.emulateMedia({ colorScheme: "light" });
  });

  let firstTitle;
  await step("a real reply; copy message; edit and resend; regenerate", async () => {
    await page.click("#new-chat");
    await page.click("#settings-toggle");
    await page.fill("#temperature", "0");
    await page.fill("#max-tokens", "8");
    await page.click("#settings-toggle");
    await page.fill("#input", "Hello there");
    await page.click("#send");
    await waitDone(assistant(0));
    await assistant(0).locator(".copy-msg").click();
    eq(await clipboard(), await apiReply([{ role: "user", content: "Hello there" }]), "first reply");
    firstTitle = await page.textContent("#chat-title");
    eq(firstTitle, "Hello there", "title from the first message");

    const before = proxy.chats.length;
    await page.locator(".msg.user .edit").click();
    await page.fill(".edit-input", "Hello again");
    await page.click(".edit-send");
    await page.waitForFunction(() => document.querySelectorAll(".msg.assistant .meta").length === 1 &&
                               !document.querySelector(".msg.assistant[data-done=false]"), null, { timeout });
    eq(proxy.chats.length, before + 1, "requests after edit");
    const sent = proxy.chats.at(-1);
    eq(sent.messages, [{ role: "user", content: "Hello again" }], "edited request");
    eq(sent.temperature, 0, "temperature sent");
    eq(sent.max_tokens, 8, "max_tokens sent");
    eq(await page.locator(".msg.user .content").allTextContents(), ["Hello again"], "user messages");
    const want = await apiReply([{ role: "user", content: "Hello again" }]);
    await assistant(0).locator(".copy-msg").click();
    eq(await clipboard(), want, "reply to the edited message");
    // The first version and its reply are kept beside the edit.
    eq(await page.textContent(".msg.user .version-count"), "2/2", "versions of the user message");
    await page.click(".msg.user .prev-version");
    await texts(page, ".msg.user .content", ["Hello there"], "first version");
    await assistant(0).locator(".copy-msg").click();
    eq(await clipboard(), await apiReply([{ role: "user", content: "Hello there" }]), "first version's reply");
    await page.click(".msg.user .next-version");
    await texts(page, ".msg.user .content", ["Hello again"], "back to the edit");

    await assistant(0).locator(".regenerate").click();
    await page.waitForFunction(() => document.querySelectorAll(".msg.assistant .meta").length === 1 &&
                               !document.querySelector(".msg.assistant[data-done=false]"), null, { timeout });
    eq(proxy.chats.length, before + 2, "requests after regenerate");
    eq(proxy.chats.at(-1).messages, sent.messages, "the regenerate request repeats the history");
    eq(await page.locator(".msg.assistant").count(), 1, "replies shown after regenerate");
    eq(await assistant(0).locator(".version-count").textContent(), "2/2", "versions of the reply");
    await assistant(0).locator(".copy-msg").click();
    eq(await clipboard(), want, "regenerated reply (greedy, so the same)");
  });

  await step("Shift+Enter is a new line; a second conversation; both survive a reload", async () => {
    await page.keyboard.press("Control+Shift+O");  // new chat
    eq(await page.textContent("#chat-title"), "New chat", "title after Ctrl+Shift+O");
    await page.fill("#input", "Second");
    await page.press("#input", "Shift+Enter");
    await page.type("#input", "conversation");
    eq(await page.inputValue("#input"), "Second\nconversation", "Shift+Enter");
    eq(await page.locator(".msg").count(), 0, "Shift+Enter sent the message");
    await page.press("#input", "Enter");
    await waitDone(assistant(0));
    await page.reload();
    await page.waitForFunction(() => document.querySelectorAll("#conversations li").length === 3,
                               null, { timeout });
    eq(await page.locator("#conversations .conv-open").allTextContents(),
       ["Second", "Hello there", "Show me some markdown"], "conversations after reload");
    await page.locator("#conversations .conv-open", { hasText: "Hello there" }).click();
    await texts(page, ".msg.user .content", ["Hello again"], "restored user turn");
    eq(await page.locator(".msg.assistant .meta").count(), 1, "restored reply with its statistics");
    eq(await page.textContent(".msg.assistant .version-count"), "2/2", "restored versions");
    await page.locator("#conversations .conv-open", { hasText: "Second" }).click();
    await texts(page, ".msg.user .content", ["Second\nconversation"], "restored second");
    // Settings persist too.
    await page.click("#settings-toggle");
    eq(await page.inputValue("#max-tokens"), "8", "max tokens after reload");
    await page.click("#settings-toggle");
  });

  await step("search, rename, export, import and delete conversations", async () => {
    await page.keyboard.press("Control+K");
    check(await page.evaluate(() => document.activeElement.id) === "search", "Ctrl+K did not focus the search");
    await page.keyboard.type("markdown");
    await page.waitForFunction(() => document.querySelectorAll("#conversations li").length === 1,
                               null, { timeout });
    await page.fill("#search", "Hello again");  // matches message text, not only titles
    await page.waitForFunction(() => document.querySelectorAll("#conversations li").length === 1 &&
        document.querySelector("#conversations .conv-open").textContent === "Hello there", null, { timeout });
    await page.fill("#search", "");
    await page.waitForFunction(() => document.querySelectorAll("#conversations li").length === 3,
                               null, { timeout });
    await page.locator("#conversations li", { hasText: "Second" }).locator(".conv-rename").click();
    await page.fill(".conv-title-input", "Renamed chat");
    await page.press(".conv-title-input", "Enter");
    await page.locator("#conversations .conv-open", { hasText: "Renamed chat" }).waitFor({ timeout });

    const [download] = await Promise.all([page.waitForEvent("download"), page.click("#export")]);
    const exported = path.join(os.tmpdir(), `gemstage-chats-${process.pid}.json`);
    await download.saveAs(exported);
    const data = JSON.parse(fs.readFileSync(exported, "utf8"));
    eq(data.conversations.map((c) => c.title).sort(),
       ["Hello there", "Renamed chat", "Show me some markdown"], "exported titles");
    await page.setInputFiles("#import", exported);
    await page.waitForFunction(() => document.querySelectorAll("#conversations li").length === 6,
                               null, { timeout });
    fs.rmSync(exported);

    page.once("dialog", (d) => d.accept());
    await page.locator("#conversations li", { hasText: "Renamed chat" }).first().locator(".conv-delete").click();
    await page.waitForFunction(() => document.querySelectorAll("#conversations li").length === 5,
                               null, { timeout });
  });

  await step("Escape stops a reply mid-stream; the part that came stays", async () => {
    await page.click("#new-chat");
    const words = Array.from({ length: 80 }, (_, i) => `word${i}`).join(" ");
    proxy.canned.push(cannedReply(words, { pieces: 80, delayMs: 100 }));
    const abortedBefore = proxy.aborted;
    await page.fill("#input", "Count for me");
    await page.press("#input", "Enter");
    await page.waitForFunction(() => /word5/.test(document.querySelector(".msg.assistant .content")?.textContent),
                               null, { timeout });
    check(await page.isVisible("#stop"), "no Stop button while streaming");
    await page.keyboard.press("Escape");
    await waitDone(assistant(0));
    const text = await assistant(0).locator(".content").textContent();
    check(text.startsWith("word0 word1") && !text.includes("word79"), `stopped reply: ${text}`);
    check(/stopped/.test(await assistant(0).locator(".meta").textContent()), "the reply is not marked stopped");
    eq(await page.textContent("#status"), "stopped", "status");
    for (let i = 0; i < 50 && proxy.aborted === abortedBefore; i++) await sleep(20);
    eq(proxy.aborted, abortedBefore + 1, "streams the page closed");
    check(await page.isVisible("#send"), "Send did not come back");
  });

  await step("server errors show in the conversation: a bad image, a full context", async () => {
    await page.click("#new-chat");
    await page.setInputFiles("#file", { name: "broken.png", mimeType: "image/png",
                                        buffer: Buffer.from("this is not a PNG file") });
    await page.locator("#attachments .chip[data-kind=image]").waitFor({ timeout });
    await page.fill("#input", "What is in this picture?");
    await page.press("#input", "Enter");
    const error = page.locator(".msg.error");
    await error.waitFor({ timeout });
    const message = await error.locator(".content").textContent();
    check(/image/i.test(message), `bad image error: ${message}`);
    check(/HTTP 400/.test(await error.locator(".code").textContent()), "error status");
    eq(await page.locator("#attachments .chip").count(), 0, "attachments after sending");
    eq(await page.locator(".msg.user img").count(), 1, "the user message keeps its image");

    await page.click("#new-chat");
    await page.fill("#input", "lorem ipsum dolor sit amet ".repeat(200));
    await page.press("#input", "Enter");
    await error.waitFor({ timeout });
    const full = await error.locator(".content").textContent();
    check(/context/i.test(full) && /new chat/i.test(full), `context-full error: ${full}`);
    check(/context_length_exceeded/.test(await error.locator(".code").textContent()), "context error code");
  });

  await step("a 390-px-wide screen: no sideways scrolling, the list behind a button", async () => {
    await page.setViewportSize({ width: 390, height: 844 });
    check(!(await page.isVisible("#sidebar")), "the conversation list covers the chat");
    check(await page.isVisible("#input") && await page.isVisible("#send"), "composer not visible");
    // The list opens from the header; choosing a conversation closes it.
    await page.click("#toggle-sidebar");
    await page.locator("#conversations .conv-open", { hasText: "Show me some markdown" }).first().click();
    await page.waitForFunction(() => !document.getElementById("app").classList.contains("sidebar-open"),
                               null, { timeout });
    await page.locator(".msg.assistant table").waitFor({ timeout });
    const overflow = await page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
    check(overflow <= 0, `the page scrolls sideways by ${overflow} px`);
    const sendBox = await page.locator("#send").boundingBox();
    check(sendBox.x + sendBox.width <= 390, `Send is off screen at x=${sendBox.x}`);
    await page.screenshot({ path: path.join(shots, "chat-page-narrow.png") });
    // Escape closes the list too.
    await page.click("#toggle-sidebar");
    await page.locator("#conversations .conv-open").first().waitFor({ state: "visible", timeout });
    await page.keyboard.press("Escape");
    await page.waitForFunction(() => !document.getElementById("app").classList.contains("sidebar-open"),
                               null, { timeout });
  });

  check(pageErrors.length === 0, `page errors: ${pageErrors.join("; ")}`);
  check(foreign.length === 0, `requests to other origins: ${foreign.join(", ")}`);
  for (const name of ["chat-page-light.png", "chat-page-dark.png", "chat-page-narrow.png"])
    check(fs.statSync(path.join(shots, name)).size > 5000, `${name} is empty`);
} finally {
  await browser.close();
  proxyServer.close();
}
const status = await server.stop("SIGTERM");
check(status.code === 0, `server exit status ${JSON.stringify(status)}\n${server.stderr()}`);
console.log(`${NAME}: ${passed()} steps passed; screenshots in ${shots}`);
