// The chat page of `gemstage serve` in headless Chromium (Debian's chromium, driven by
// playwright-core): type a message, send it, watch the reply stream in and match what the API
// says for the same request (the page renders replies as markdown, so the text compared is what
// the message's Copy button puts on the clipboard); then attach an image and send a second turn,
// and a video for a third; then, with Thinking on, a reply carrying reasoning and a tool call
// (canned server events, since a random-weight model writes neither) shows the reasoning
// collapsed and the call; save a screenshot. serve_chat_page_features.mjs covers the rest.
//
//   node tests/js/serve_chat_page.mjs path/to/gemstage path/to/tests/fixtures screenshot.png
import fs from "node:fs";
import path from "node:path";
import { SLOW, assert, importPackage, parseArgs, startServer } from "./serve_helpers.mjs";

const NAME = "serve_chat_page";
const { cli, fixtures, model, rest } = parseArgs(NAME, "screenshot.png");
const screenshot = rest[0];
const check = (cond, message) => assert(NAME, cond, message);
if (!screenshot) check(false, "no screenshot path given");
const { chromium } = await importPackage(NAME, "playwright-core");
const executablePath = process.env.CHROMIUM ?? "/usr/bin/chromium";
check(fs.existsSync(executablePath),
      `${executablePath} not found: install Debian's chromium (scripts/setup.sh does)`);

const server = await startServer(cli, model, ["-np", "1", "-t", "2"]);
const browser = await chromium.launch({ executablePath, args: ["--no-sandbox"], headless: true });
const timeout = 30000 * SLOW;
try {
  const page = await browser.newPage({ viewport: { width: 900, height: 820 } });
  await page.context().grantPermissions(["clipboard-read", "clipboard-write"], { origin: server.url });
  // The reply as the page holds it: its Copy button's text on the clipboard.
  const copied = async (bubble) => {
    await bubble.locator(".copy-msg").click();
    return await page.evaluate(() => navigator.clipboard.readText());
  };
  const pageErrors = [];
  page.on("pageerror", (e) => pageErrors.push(String(e)));
  // Self-contained: any request to another origin is a failure.
  const foreign = [];
  page.on("request", (r) => {
    if (!r.url().startsWith(server.url)) foreign.push(r.url());
  });
  await page.goto(server.url + "/");
  await page.waitForFunction(() => document.getElementById("model").textContent === "model",
                             null, { timeout });
  await page.click("#settings-toggle");  // the settings panel
  await page.fill("#temperature", "0");
  await page.fill("#max-tokens", "48");

  // The same request through the API, for the reply the page must show.
  const text = "Hello there, how are you?";
  const api = async (messages) => {
    const r = await fetch(`${server.url}/v1/chat/completions`, {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ messages, temperature: 0, max_tokens: 48 }),
    });
    return (await r.json()).choices[0].message.content;
  };
  const want1 = await api([{ role: "user", content: text }]);

  await page.fill("#input", text);
  await page.click("#send");
  const bubble1 = page.locator(".msg.assistant").nth(0);
  await bubble1.locator(".meta").waitFor({ timeout });  // written once the stream completed
  const got1 = await copied(bubble1);
  check(got1 === want1, `page reply ${JSON.stringify(got1)} != API reply ${JSON.stringify(want1)}`);
  check(got1.length > 0, "the reply is empty");
  check((await bubble1.locator(".content").textContent()).trim().length > 0, "the reply shows nothing");
  check(/tokens/.test(await bubble1.locator(".meta").textContent()), "no usage line");

  // Second turn with an image attached through the file input.
  const image = path.join(fixtures, "gemma4-tiny", "multimodal", "image.png");
  await page.setInputFiles("#file", image);
  await page.locator("#attachments .chip[data-kind=image]").waitFor({ state: "visible", timeout });
  await page.fill("#input", "What is in this picture?");
  await page.press("#input", "Enter");
  const bubble2 = page.locator(".msg.assistant").nth(1);
  await bubble2.locator(".meta").waitFor({ timeout });
  check(await page.locator(".msg.user").nth(1).locator("img").count() === 1,
        "the user message does not show its image");
  check(await page.locator(".msg.error").count() === 0,
        `error shown: ${await page.locator(".msg.error").allTextContents()}`);
  check(await page.locator("#attachments .chip").count() === 0, "the attachment was not cleared");
  const want2 = await api([
    { role: "user", content: text },
    { role: "assistant", content: want1 },
    { role: "user", content: [
      { type: "image_url", image_url: { url: `data:image/png;base64,${fs.readFileSync(image).toString("base64")}` } },
      { type: "text", text: "What is in this picture?" },
    ] },
  ]);
  const got2 = await copied(bubble2);
  check(got2 === want2, `second reply ${JSON.stringify(got2)} != API reply ${JSON.stringify(want2)}`);

  // A video turn: an MP4 attached is sent as a video_url part and shown with a player; the reply
  // is the API's for the request the page sent.
  const video = path.join(fixtures, "video", "h264_1fps_32x24.mp4");
  await page.setInputFiles("#file", video);
  await page.locator("#attachments .chip[data-kind=video]").waitFor({ state: "visible", timeout });
  const sent = page.waitForRequest((r) => r.url().endsWith("/v1/chat/completions"));
  await page.fill("#input", "What happens in this video?");
  await page.press("#input", "Enter");
  const videoRequest = JSON.parse((await sent).postData());
  const videoPart = videoRequest.messages.at(-1).content.find((p) => p.type === "video_url");
  check(videoPart?.video_url?.url === `data:video/mp4;base64,${fs.readFileSync(video).toString("base64")}`,
        "the video is not sent as its bytes in a video_url part");
  const bubbleVideo = page.locator(".msg.assistant").nth(2);
  await bubbleVideo.locator(".meta").waitFor({ timeout });
  check(await page.locator(".msg.error").count() === 0,
        `error shown: ${await page.locator(".msg.error").allTextContents()}`);
  check(await page.locator(".msg.user").nth(2).locator("video").count() === 1,
        "the user message does not show its video");
  const wantVideo = await api(videoRequest.messages);
  const gotVideo = await copied(bubbleVideo);
  check(gotVideo === wantVideo, `video reply ${JSON.stringify(gotVideo)} != API reply ${JSON.stringify(wantVideo)}`);

  // Third turn, Think on: the request asks for thinking, and the page shows the reasoning in a
  // collapsed block and the tool call. The reply is canned at the network layer.
  const sse = (chunk) => `data: ${JSON.stringify(chunk)}\n\n`;
  const chunk = (delta, finish = null) => ({ object: "chat.completion.chunk",
                                             choices: [{ index: 0, delta, finish_reason: finish }] });
  let thirdRequest = null;
  await page.route("**/v1/chat/completions", (route) => {
    thirdRequest = JSON.parse(route.request().postData());
    route.fulfill({ status: 200, contentType: "text/event-stream", body:
      sse(chunk({ role: "assistant", content: "" })) +
      sse(chunk({ reasoning_content: "The user wants " })) +
      sse(chunk({ reasoning_content: "the weather." })) +
      sse(chunk({ content: "Checking." })) +
      sse(chunk({ tool_calls: [{ index: 0, id: "call_1", type: "function",
                                 function: { name: "get_weather",
                                             arguments: "{\"city\":\"Paris\"}" } }] })) +
      sse(chunk({}, "tool_calls")) + "data: [DONE]\n\n" });
  });
  await page.click("#new-chat");  // thinking renders text conversations (no image turn)
  if (await page.isHidden("#settings")) await page.click("#settings-toggle");
  await page.check("#think");
  await page.fill("#input", "Weather in Paris?");
  await page.press("#input", "Enter");
  const bubble3 = page.locator(".msg.assistant").nth(0);
  await bubble3.locator(".meta").waitFor({ timeout });
  await page.unroute("**/v1/chat/completions");
  check(thirdRequest?.chat_template_kwargs?.enable_thinking === true,
        `Think did not ask for thinking: ${JSON.stringify(thirdRequest?.chat_template_kwargs)}`);
  check(await bubble3.locator("details.reasoning").count() === 1, "no reasoning block");
  check(!(await bubble3.locator("details.reasoning").evaluate((d) => d.open)),
        "the reasoning block is not collapsed");
  check(await bubble3.locator(".reasoning-text").textContent() === "The user wants the weather.",
        `reasoning ${await bubble3.locator(".reasoning-text").textContent()}`);
  check(await bubble3.locator(".content").textContent() === "Checking.",
        `reply text ${JSON.stringify(await bubble3.locator(".content").textContent())}`);
  check(await bubble3.locator(".tool-call").textContent() === "\u2192 get_weather({\"city\":\"Paris\"})",
        `tool call ${await bubble3.locator(".tool-call").textContent()}`);
  check(/tool_calls/.test(await bubble3.locator(".meta").textContent()), "finish reason");

  check(pageErrors.length === 0, `page errors: ${pageErrors.join("; ")}`);
  check(foreign.length === 0, `requests to other origins: ${foreign.join(", ")}`);
  fs.mkdirSync(path.dirname(screenshot), { recursive: true });
  await page.screenshot({ path: screenshot, fullPage: true });
  check(fs.statSync(screenshot).size > 1000, "the screenshot is empty");
} finally {
  await browser.close();
}
const status = await server.stop("SIGTERM");
check(status.code === 0, `server exit status ${JSON.stringify(status)}\n${server.stderr()}`);
console.log(`serve_chat_page: four replies in Chromium (text, image, video, reasoning + tool call); screenshot at ${screenshot}`);
