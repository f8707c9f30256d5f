// The chat page of `gemstage serve` on the audio fixture model in headless Chromium: attach a
// recording through the page's file input, send, and check that the reply (as the message's Copy
// button puts it on the clipboard) equals what the API gives for the same input_audio request and
// that the user message shows a player.
//
//   node tests/js/serve_chat_page_audio.mjs path/to/gemstage path/to/tests/fixtures
import fs from "node:fs";
import path from "node:path";
import { SLOW, assert, importPackage, parseArgs, startServer } from "./serve_helpers.mjs";

const NAME = "serve_chat_page_audio";
const { cli, fixtures } = parseArgs(NAME);
const check = (cond, message) => assert(NAME, cond, message);
const model = path.join(fixtures, "gemma4-tiny-audio", "model");
const wav = path.join(fixtures, "gemma4-tiny-audio", "audio", "audio.wav");
check(fs.existsSync(model) && fs.existsSync(wav), `audio fixture not found under ${fixtures}`);
const { chromium } = await importPackage(NAME, "playwright-core");
const executablePath = process.env.CHROMIUM ?? "/usr/bin/chromium";
check(fs.existsSync(executablePath),
      `${executablePath} not found: install Debian's chromium (scripts/setup.sh does)`);

const server = await startServer(cli, model, ["-np", "1", "-t", "2"]);
const browser = await chromium.launch({ executablePath, args: ["--no-sandbox"], headless: true });
const timeout = 30000 * SLOW;
try {
  const page = await browser.newPage();
  await page.context().grantPermissions(["clipboard-read", "clipboard-write"], { origin: server.url });
  const pageErrors = [];
  page.on("pageerror", (e) => pageErrors.push(String(e)));
  await page.goto(server.url + "/");
  await page.waitForFunction(() => document.getElementById("model").textContent === "model",
                             null, { timeout });
  await page.click("#settings-toggle");
  await page.fill("#temperature", "0");
  await page.fill("#max-tokens", "8");

  const r = await fetch(`${server.url}/v1/chat/completions`, {
    method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify({
      messages: [{ role: "user", content: [
        { type: "input_audio",
          input_audio: { data: fs.readFileSync(wav).toString("base64"), format: "wav" } },
        { type: "text", text: "What do you hear?" },
      ] }],
      temperature: 0, max_tokens: 8,
    }),
  });
  const body = await r.text();
  check(r.status === 200, `API status ${r.status}: ${body}`);
  const want = JSON.parse(body).choices[0].message.content;

  await page.setInputFiles("#file", wav);
  await page.locator("#attachments .chip[data-kind=audio]").waitFor({ state: "visible", timeout });
  await page.fill("#input", "What do you hear?");
  await page.click("#send");
  const bubble = page.locator(".msg.assistant").nth(0);
  await bubble.locator(".meta").waitFor({ timeout });
  check(await page.locator(".msg.error").count() === 0,
        `error shown: ${await page.locator(".msg.error").allTextContents()}`);
  check(await page.locator(".msg.user").nth(0).locator("audio").count() === 1,
        "the user message does not show its recording");
  check(await page.locator("#attachments .chip").count() === 0, "the attachment was not cleared");
  await bubble.locator(".copy-msg").click();
  const got = await page.evaluate(() => navigator.clipboard.readText());
  check(got === want, `page reply ${JSON.stringify(got)} != API reply ${JSON.stringify(want)}`);
  check(pageErrors.length === 0, `page errors: ${pageErrors.join("; ")}`);
} finally {
  await browser.close();
}
const status = await server.stop("SIGTERM");
check(status.code === 0, `server exit status ${JSON.stringify(status)}\n${server.stderr()}`);
console.log("serve_chat_page_audio: a recording attached in the page got the API's reply");
