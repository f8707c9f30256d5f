// The chat page of `gemstage serve` on the audio fixture model in headless Chromium: attach a
// recording through the page's file input, send, and check that the reply (as the message's Copy
// button puts it on the clipboard) equals what the API gives for the same input_audio request and
// that the user message shows a player. Then record from the microphone (Chromium's fake capture
// device, which plays a beep) and check the page sends it as a 16 kHz mono WAV and shows the reply
// the API gives for the same request.
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

// One thread: the tiny model needs no more, and threads that wait on each other crawl when the
// machine is busy (this test timed out under a loaded CTest run with two).
const server = await startServer(cli, model, ["-np", "1", "-t", "1"]);
// The fake media flags give the page a microphone (a beep) and accept its permission prompt.
const browser = await chromium.launch({
  executablePath, headless: true,
  args: ["--no-sandbox", "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream"],
});
const timeout = 30000 * SLOW;
try {
  const page = await browser.newPage();
  await page.context().grantPermissions(["clipboard-read", "clipboard-write", "microphone"],
                                        { origin: server.url });
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

  // A recording from the microphone: about 1.5 s, attached as a WAV.
  await page.click("#record");
  await page.waitForFunction(() => document.getElementById("record").getAttribute("aria-pressed") === "true",
                             null, { timeout });
  await page.waitForTimeout(1500);
  await page.click("#record");
  const chip = page.locator("#attachments .chip[data-kind=audio]");
  await chip.waitFor({ timeout });
  check(/^recording .*\.wav$/.test(await chip.locator(".name").textContent()), "recording's name");
  const sent = page.waitForRequest((r) => r.url().endsWith("/v1/chat/completions"));
  await page.fill("#input", "And now?");
  await page.press("#input", "Enter");
  const request = JSON.parse((await sent).postData());
  const part = request.messages.at(-1).content.find((p) => p.type === "input_audio");
  check(part && part.input_audio.format === "wav", `recording part ${JSON.stringify(part)?.slice(0, 200)}`);
  const wavBytes = Buffer.from(part.input_audio.data, "base64");
  check(wavBytes.toString("ascii", 0, 4) === "RIFF" && wavBytes.toString("ascii", 8, 12) === "WAVE",
        "the recording is not a WAV file");
  check(wavBytes.readUInt16LE(22) === 1 && wavBytes.readUInt32LE(24) === 16000 &&
        wavBytes.readUInt16LE(34) === 16, "the recording is not 16 kHz mono 16-bit");
  const seconds = wavBytes.readUInt32LE(40) / 32000;
  check(seconds > 0.8 && seconds < 5, `the recording lasts ${seconds} s`);
  let peak = 0;
  for (let i = 44; i + 1 < wavBytes.length; i += 2) peak = Math.max(peak, Math.abs(wavBytes.readInt16LE(i)));
  check(peak > 1000, `the recording is silent (peak ${peak})`);
  const bubble2 = page.locator(".msg.assistant").nth(1);
  await bubble2.locator(".meta").waitFor({ timeout });
  check(await page.locator(".msg.error").count() === 0,
        `error shown: ${await page.locator(".msg.error").allTextContents()}`);
  check(await page.locator(".msg.user").nth(1).locator("audio").count() === 1,
        "the second user message does not show its recording");
  const r2 = await fetch(`${server.url}/v1/chat/completions`, {
    method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ messages: request.messages, temperature: 0, max_tokens: 8 }),
  });
  const body2 = await r2.text();
  check(r2.status === 200, `API status ${r2.status}: ${body2}`);
  const want2 = JSON.parse(body2).choices[0].message.content;
  await bubble2.locator(".copy-msg").click();
  const got2 = await page.evaluate(() => navigator.clipboard.readText());
  check(got2 === want2, `recorded turn: page reply ${JSON.stringify(got2)} != API reply ${JSON.stringify(want2)}`);
  check(pageErrors.length === 0, `page errors: ${pageErrors.join("; ")}`);
} finally {
  await browser.close();
}
const status = await server.stop("SIGTERM");
check(status.code === 0, `server exit status ${JSON.stringify(status)}\n${server.stderr()}`);
console.log("serve_chat_page_audio: an attached and a recorded clip got the API's replies");
