// `gemstage serve` through the official `openai` npm client, on the tiny fixture model:
// models, non-streamed and streamed chat, an image message, text completions, usage counts,
// greedy output equal to `gemstage generate`'s, every error case as the client's APIError (status,
// type, code, param), and a clean exit on SIGTERM with a stream in flight.
//
//   node tests/js/serve_openai.mjs path/to/gemstage path/to/tests/fixtures
import fs from "node:fs";
import path from "node:path";
import {
  checks, SLOW, dataUrl, generateJson, importPackage, parseArgs, sleep, startServer,
} from "./serve_helpers.mjs";

const NAME = "serve_openai";
const { cli, fixtures, model } = parseArgs(NAME);
const { default: OpenAI } = await importPackage(NAME, "openai");
const { check, eq, step, passed: passedCount } = checks(NAME);

const image = path.join(fixtures, "gemma4-tiny", "multimodal", "image.png");
const smallPng = path.join(fixtures, "image", "decode", "rgb_interlaced.png");
const prompt = "Hello there, how are you?";

// An APIError with this status and error code (and param), in OpenAI's error shape.
async function expectApiError(promise, status, code, param) {
  try {
    await promise;
  } catch (e) {
    check(e instanceof OpenAI.APIError, `expected an APIError, got ${e}`);
    eq(e.status, status, `status of "${e.message}"`);
    eq(e.code ?? null, code, `code of "${e.message}"`);
    if (param !== undefined) eq(e.param ?? null, param, `param of "${e.message}"`);
    check(typeof e.error?.message === "string" && e.error.message.length > 0, "no error message");
    check(typeof e.error?.type === "string", "no error type");
    return e;
  }
  check(false, `expected HTTP ${status} (${code}), but the request succeeded`);
}

const server = await startServer(cli, model, ["-np", "2", "-t", "2", "--shutdown-grace", "1"]);
const client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: "unused", maxRetries: 0,
                            timeout: 60000 * SLOW });

await step("GET /health: ready, with the slots -np asked for", async () => {
  const r = await fetch(`${server.url}/health`);
  eq(r.status, 200, "status");
  eq(await r.json(), {
    kv_budget: 131072, kv_rows_reserved: 0, pipeline_depth: 1, queued: 0,
    slot_states: [{ id: 0, rows: 0, state: "idle" }, { id: 1, rows: 0, state: "idle" }],
    slots: 2, slots_busy: 0, status: "ok",
  }, "health");
});

await step("GET /v1/models", async () => {
  const models = await client.models.list();
  eq(models.data.map((m) => m.id), ["model"], "model ids");
  eq(models.data[0].object, "model", "object");
});

const want = generateJson(cli, model, ["--temp", "0", "-n", "12", "-p", prompt]);
let whole;
await step("non-streamed chat equals gemstage generate (greedy)", async () => {
  whole = await client.chat.completions.create({
    model: "model", messages: [{ role: "user", content: prompt }], temperature: 0, max_tokens: 12,
  });
  eq(whole.object, "chat.completion", "object");
  eq(whole.choices.length, 1, "choices");
  eq(whole.choices[0].message.role, "assistant", "role");
  eq(whole.choices[0].message.content, want.text, "content");
  eq(whole.choices[0].finish_reason, want.finish_reason, "finish_reason");
  eq(whole.usage.prompt_tokens, want.prompt_tokens, "prompt_tokens");
  eq(whole.usage.completion_tokens, want.completion_tokens, "completion_tokens");
  eq(whole.usage.total_tokens, want.prompt_tokens + want.completion_tokens, "total_tokens");
});

await step("n: 2 gives two choices, each the greedy reply alone", async () => {
  const two = await client.chat.completions.create({
    model: "model", messages: [{ role: "user", content: prompt }], temperature: 0, max_tokens: 12,
    n: 2,
  });
  eq(two.choices.length, 2, "choices");
  for (const [i, c] of two.choices.entries()) {
    eq(c.index, i, "index");
    eq(c.message.content, want.text, `choice ${i} content`);
    eq(c.finish_reason, want.finish_reason, `choice ${i} finish_reason`);
  }
  eq(two.usage.prompt_tokens, want.prompt_tokens, "prompt_tokens");
  eq(two.usage.completion_tokens, 2 * want.completion_tokens, "completion_tokens");
});

await step("streamed chat: role first, same content, finish, usage", async () => {
  const stream = await client.chat.completions.create({
    model: "model", messages: [{ role: "user", content: prompt }], temperature: 0, max_tokens: 12,
    stream: true, stream_options: { include_usage: true },
  });
  let content = "", role = null, finish = null, usage = null, chunks = 0;
  for await (const chunk of stream) {
    chunks++;
    eq(chunk.object, "chat.completion.chunk", "chunk object");
    if (chunk.usage) usage = chunk.usage;
    const c = chunk.choices[0];
    if (!c) continue;
    if (c.delta.role) role = c.delta.role;
    if (c.delta.content) content += c.delta.content;
    if (c.finish_reason) finish = c.finish_reason;
  }
  check(chunks >= 3, `only ${chunks} chunks`);
  eq(role, "assistant", "role");
  eq(content, want.text, "streamed content");
  eq(finish, want.finish_reason, "finish_reason");
  eq(usage.prompt_tokens, whole.usage.prompt_tokens, "prompt_tokens");
  eq(usage.completion_tokens, whole.usage.completion_tokens, "completion_tokens");
  eq(usage.total_tokens, whole.usage.total_tokens, "total_tokens");
  // The same prompt again: its prefix came back from a slot's caches, and usage says so.
  eq(whole.usage.prompt_tokens_details.cached_tokens, 0, "first request: nothing cached");
  check(usage.prompt_tokens_details.cached_tokens > 0,
        `cached_tokens ${usage.prompt_tokens_details.cached_tokens}`);
});

await step("streamed chat without include_usage has no usage chunk", async () => {
  const stream = await client.chat.completions.create({
    model: "model", messages: [{ role: "user", content: "Hi" }], max_tokens: 5, stream: true,
  });
  for await (const chunk of stream) check(!chunk.usage, "unexpected usage chunk");
});

await step("image message equals gemstage generate --image (greedy)", async () => {
  const wantImage = generateJson(cli, model,
                                 ["--temp", "0", "-n", "8", "--image", image, "-p", "What is this?"]);
  const r = await client.chat.completions.create({
    model: "model", temperature: 0, max_tokens: 8,
    messages: [{ role: "user", content: [
      { type: "image_url", image_url: { url: dataUrl(image, "image/png") } },
      { type: "text", text: "What is this?" },
    ] }],
  });
  eq(r.choices[0].message.content, wantImage.text, "content");
  eq(r.usage.prompt_tokens, wantImage.prompt_tokens, "prompt_tokens (with the image's tokens)");
  eq(r.usage.completion_tokens, wantImage.completion_tokens, "completion_tokens");
  // With tools (the tool path): the same prompt plus the tool declarations, and the same greedy
  // tokens when thinking is switched off explicitly (that prompt is the plain one).
  const withTools = await client.chat.completions.create({
    model: "model", max_tokens: 4, tools: [{ type: "function", function: { name: "get_weather",
      parameters: { type: "object", properties: { city: { type: "string" } } } } }],
    messages: [{ role: "user", content: [
      { type: "image_url", image_url: { url: dataUrl(image, "image/png") } },
      { type: "text", text: "What is this?" }] }],
  });
  check(withTools.usage.prompt_tokens > wantImage.prompt_tokens, "tool declarations in the prompt");
  const toolPath = await client.chat.completions.create({
    model: "model", temperature: 0, max_tokens: 8, chat_template_kwargs: { enable_thinking: false },
    messages: [{ role: "user", content: [
      { type: "image_url", image_url: { url: dataUrl(image, "image/png") } },
      { type: "text", text: "What is this?" }] }],
  });
  eq(toolPath.usage.prompt_tokens, wantImage.prompt_tokens, "tool path prompt_tokens");
  eq(toolPath.usage.completion_tokens, wantImage.completion_tokens, "tool path completion_tokens");
  eq(toolPath.choices[0].message.content, wantImage.text.trim() || null, "tool path content");
});

await step("multi-turn chat with a system prompt", async () => {
  const r = await client.chat.completions.create({
    model: "model", max_tokens: 6, seed: 3,
    messages: [
      { role: "system", content: "You are terse." },
      { role: "user", content: "Hi" },
      { role: "assistant", content: "Hello." },
      { role: "user", content: [{ type: "text", text: "Again" }] },
    ],
  });
  check(r.usage.completion_tokens >= 1 && r.usage.completion_tokens <= 6, "completion_tokens");
  // Seeded sampling is reproducible.
  const again = await client.chat.completions.create({
    model: "model", max_tokens: 6, seed: 3,
    messages: [
      { role: "system", content: "You are terse." },
      { role: "user", content: "Hi" },
      { role: "assistant", content: "Hello." },
      { role: "user", content: [{ type: "text", text: "Again" }] },
    ],
  });
  eq(again.choices[0].message.content, r.choices[0].message.content, "seeded reply");
});

await step("text completions (plain and streamed) equal gemstage generate --raw", async () => {
  const wantRaw = generateJson(cli, model, ["--raw", "--temp", "0", "-n", "10", "-p", "Once upon"]);
  const r = await client.completions.create({
    model: "model", prompt: "Once upon", temperature: 0, max_tokens: 10,
  });
  eq(r.object, "text_completion", "object");
  eq(r.choices[0].text, wantRaw.text, "text");
  eq(r.usage.prompt_tokens, wantRaw.prompt_tokens, "prompt_tokens");
  eq(r.usage.completion_tokens, wantRaw.completion_tokens, "completion_tokens");
  const stream = await client.completions.create({
    model: "model", prompt: "Once upon", temperature: 0, max_tokens: 10, stream: true,
  });
  let text = "", finish = null;
  for await (const chunk of stream) {
    text += chunk.choices[0]?.text ?? "";
    finish = chunk.choices[0]?.finish_reason ?? finish;
  }
  eq(text, wantRaw.text, "streamed text");
  eq(finish, wantRaw.finish_reason, "finish_reason");
  const ids = await client.completions.create({ model: "model", prompt: [2, 5, 9], max_tokens: 2 });
  eq(ids.usage.prompt_tokens, 3, "a token-id prompt's prompt_tokens");
});

await step("request errors are APIErrors with status, code and param", async () => {
  const chat = (body) => client.chat.completions.create({ model: "model", ...body });
  const user = (content) => ({ role: "user", content });
  const img = (url) => user([{ type: "image_url", image_url: { url } }]);
  await expectApiError(chat({ messages: [] }), 400, "empty_array", "messages");
  await expectApiError(chat({ messages: [{ role: "narrator", content: "x" }] }), 400,
                       "invalid_value", "messages[0].role");
  await expectApiError(chat({ messages: [user("x")], max_tokens: "ten" }), 400, "invalid_type",
                       "max_tokens");
  await expectApiError(chat({ messages: [user(42)] }), 400, "invalid_type", "messages[0].content");
  await expectApiError(chat({ messages: [user("x")], n: 3 }), 400, "invalid_value", "n");
  await expectApiError(chat({ messages: [user("x")], n: 2, stream: true }), 400,
                       "unsupported_value", "n");
  await expectApiError(chat({ messages: [img("https://example.com/cat.png")] }), 400,
                       "unsupported_image_url", "messages[0].content[0].image_url.url");
  await expectApiError(chat({ messages: [img("data:image/png;base64,%%%")] }), 400,
                       "invalid_base64", "messages[0].content[0].image_url.url");
  await expectApiError(chat({ messages: [img("data:image/png;base64,aGVsbG8=")] }), 400,
                       "invalid_image", "messages[0].content[0].image_url.url");
  await expectApiError(chat({ messages: [user("x")], stream: true, temperature: 5 }), 400,
                       "invalid_value", "temperature");
  await expectApiError(client.completions.create({ model: "model", prompt: ["a", "b"] }), 400,
                       "unsupported_value", "prompt");
  // Token ids are a prompt too, each below the fixture's vocabulary size of 2048.
  await expectApiError(client.completions.create({ model: "model", prompt: [2, 2048] }), 400,
                       "invalid_value", "prompt[1]");
  // What the client cannot send malformed, fetch can.
  const raw = await fetch(`${server.url}/v1/chat/completions`, {
    method: "POST", headers: { "Content-Type": "application/json" }, body: "{\"messages\": [",
  });
  eq(raw.status, 400, "malformed JSON status");
  eq((await raw.json()).error.code, "invalid_json", "malformed JSON code");
  await expectApiError(client.get("/nothing/here"), 404, "not_found", null);
  const wrongMethod = await fetch(`${server.url}/v1/chat/completions`);
  eq(wrongMethod.status, 405, "GET on a POST route");
  eq(wrongMethod.headers.get("allow"), "POST", "Allow header");
});

await step("response_format json_object and json_schema: valid at temperature 1, streamed too", async () => {
  const messages = [{ role: "user", content: "Describe a book as JSON." }];
  let finished = 0;
  for (let seed = 1; seed <= 4; seed++) {
    const r = await client.chat.completions.create({ model: "model", messages, temperature: 1,
      seed, max_tokens: 300, response_format: { type: "json_object" } });
    if (r.choices[0].finish_reason !== "stop") continue;
    finished++;
    const v = JSON.parse(r.choices[0].message.content);
    check(v !== null && typeof v === "object" && !Array.isArray(v), `not an object: ${v}`);
  }
  const schema = { type: "object", properties: { title: { type: "string", maxLength: 20 },
    pages: { type: "integer", minimum: 1, maximum: 2000 }, genres: { type: "array",
    items: { enum: ["novel", "poetry", "essay"] }, maxItems: 3 } },
    required: ["title", "pages", "genres"], additionalProperties: false };
  for (let seed = 1; seed <= 4; seed++) {
    const stream = await client.chat.completions.create({ model: "model", messages, temperature: 1,
      seed, max_tokens: 300, stream: true,
      response_format: { type: "json_schema", json_schema: { name: "book", schema, strict: true } } });
    let text = "", finish = null;
    for await (const chunk of stream) {
      text += chunk.choices[0]?.delta?.content ?? "";
      finish = chunk.choices[0]?.finish_reason ?? finish;
    }
    if (finish !== "stop") continue;
    finished++;
    const v = JSON.parse(text);
    eq(Object.keys(v).sort(), ["genres", "pages", "title"], `keys of ${text}`);
    check(Number.isInteger(v.pages) && v.pages >= 1 && v.pages <= 2000, `pages ${v.pages}`);
    check(v.genres.every((g) => ["novel", "poetry", "essay"].includes(g)), `genres ${v.genres}`);
  }
  check(finished >= 5, `only ${finished} of 8 samples finished`);
});

await step("logprobs / top_logprobs: one entry per token, streamed the same", async () => {
  const body = { model: "model", messages: [{ role: "user", content: prompt }], temperature: 0,
                 max_tokens: 6, logprobs: true, top_logprobs: 3 };
  const r = await client.chat.completions.create(body);
  const content = r.choices[0].logprobs.content;
  eq(content.length, r.usage.completion_tokens, "one entry per generated token");
  for (const e of content) {
    check(e.logprob <= 0 && Number.isFinite(e.logprob), `logprob ${e.logprob}`);
    eq(e.top_logprobs.length, 3, "top_logprobs");
    check(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob, "top_logprobs sorted");
    check(e.logprob <= e.top_logprobs[0].logprob + 1e-6, "the token is at most as likely as the top");
    const mass = e.top_logprobs.reduce((a, t) => a + Math.exp(t.logprob), 0);
    check(mass <= 1 + 1e-5, `top mass ${mass}`);
    if (!e.token.includes("\uFFFD")) eq(Buffer.from(e.bytes).toString("utf8"), e.token, "bytes");
  }
  const stream = await client.chat.completions.create({ ...body, stream: true });
  const streamed = [];
  for await (const chunk of stream) streamed.push(...(chunk.choices[0]?.logprobs?.content ?? []));
  eq(streamed.map((e) => e.logprob), content.map((e) => e.logprob), "streamed logprobs");
  await expectApiError(client.chat.completions.create({ ...body, logprobs: false }), 400,
                       "invalid_value", "top_logprobs");
  await expectApiError(client.chat.completions.create({ ...body, top_logprobs: 21 }), 400,
                       "invalid_value", "top_logprobs");
});

await step("tool round trip: tools, assistant tool_calls, tool result; plain and streamed", async () => {
  // The request an agent sends after running the call it got back. A random-weight model rarely
  // writes a well-formed call itself, so this checks the round trip's shapes (tests/
  // api_tools_test.cc checks the mapping of real calls on canned output).
  const tools = [{ type: "function", function: {
    name: "get_weather", description: "Get the current weather for a city.",
    parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
  } }];
  const messages = [
    { role: "user", content: "Weather in Paris?" },
    { role: "assistant", content: null, tool_calls: [{ id: "call_1", type: "function",
      function: { name: "get_weather", arguments: JSON.stringify({ city: "Paris" }) } }] },
    { role: "tool", tool_call_id: "call_1", content: "15C sunny" },
  ];
  const r = await client.chat.completions.create({ model: "model", messages, tools,
                                                   tool_choice: "auto", max_tokens: 8,
                                                   temperature: 0 });
  const choice = r.choices[0];
  eq(choice.message.role, "assistant", "role");
  check(["stop", "length", "tool_calls"].includes(choice.finish_reason),
        `finish_reason ${choice.finish_reason}`);
  for (const call of choice.message.tool_calls ?? []) {
    eq(call.type, "function", "tool call type");
    check(typeof JSON.parse(call.function.arguments) === "object", "arguments are a JSON object");
  }
  const stream = await client.chat.completions.create({ model: "model", messages, tools,
                                                        max_tokens: 8, temperature: 0,
                                                        stream: true });
  let finish = null;
  for await (const chunk of stream) finish = chunk.choices[0]?.finish_reason ?? finish;
  check(["stop", "length", "tool_calls"].includes(finish), `streamed finish_reason ${finish}`);
  await expectApiError(client.chat.completions.create({ model: "model", messages, tools,
                                                       tool_choice: { type: "function",
                                                         function: { name: "nope" } } }),
                       400, "invalid_value", "tool_choice.function.name");
});

await step("tool_choice required / named: every sample at temperature 1 is a valid call", async () => {
  // The tiny model with the tokenizer that has Gemma's tool-call tokens.
  const os = await import("node:os");
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "gemstage-tools-"));
  for (const f of fs.readdirSync(model))
    if (!f.startsWith("tokenizer")) fs.symlinkSync(path.resolve(model, f), path.join(dir, f));
  const full = path.join(fixtures, "gemma4-tiny", "tokenizer_full");
  for (const f of fs.readdirSync(full)) fs.copyFileSync(path.join(full, f), path.join(dir, f));
  const toolServer = await startServer(cli, dir, ["-t", "2"]);
  const toolClient = new OpenAI({ baseURL: `${toolServer.url}/v1`, apiKey: "unused", maxRetries: 0,
                                  timeout: 60000 * SLOW });
  const tools = [
    { type: "function", function: { name: "get_weather", parameters: { type: "object",
      properties: { city: { type: "string", maxLength: 10 },
                    days: { type: "integer", minimum: 1, maximum: 7 } },
      required: ["city", "days"] } } },
    { type: "function", function: { name: "get_time", parameters: { type: "object",
      properties: { tz: { enum: ["UTC", "CET"] } }, required: ["tz"] } } }];
  const validate = (call) => {
    const a = JSON.parse(call.function.arguments);
    if (call.function.name === "get_time") return ["UTC", "CET"].includes(a.tz);
    return call.function.name === "get_weather" && typeof a.city === "string" &&
           [...a.city].length <= 10 && Number.isInteger(a.days) && a.days >= 1 && a.days <= 7;
  };
  try {
    for (let seed = 1; seed <= 6; seed++) {
      const named = seed > 3;
      const r = await toolClient.chat.completions.create({ model: "model", temperature: 1, seed,
        max_tokens: 200, messages: [{ role: "user", content: "Weather in Oslo?" }], tools,
        tool_choice: named ? { type: "function", function: { name: "get_weather" } } : "required",
        parallel_tool_calls: !named });
      const c = r.choices[0];
      eq(c.finish_reason, "tool_calls", `finish_reason (seed ${seed})`);
      check(c.message.tool_calls?.length >= 1, `no tool call: ${JSON.stringify(c.message)}`);
      if (named) eq(c.message.tool_calls.map((t) => t.function.name), ["get_weather"], "named");
      for (const call of c.message.tool_calls) check(validate(call), `invalid ${JSON.stringify(call)}`);
    }
  } finally {
    eq(await toolServer.stop("SIGTERM"), { code: 0, signal: null }, "tool server exit");
    fs.rmSync(dir, { recursive: true, force: true });
  }
});

// A second server with every limit small: API key, body size, image size, context.
const strict = await startServer(cli, model, ["--api-key", "test-key", "--max-body", "8192",
                                              "--max-image-pixels", "300", "-c", "64", "-t", "1"]);
const strictClient = new OpenAI({ baseURL: `${strict.url}/v1`, apiKey: "test-key", maxRetries: 0 });
await step("API key, body limit, image limit and context length", async () => {
  const anonymous = new OpenAI({ baseURL: `${strict.url}/v1`, apiKey: "wrong", maxRetries: 0 });
  const body = { model: "model", messages: [{ role: "user", content: "Hi" }], max_tokens: 2 };
  const e = await expectApiError(anonymous.chat.completions.create(body), 401, "invalid_api_key");
  check(e instanceof OpenAI.AuthenticationError, "not an AuthenticationError");
  const noKey = await fetch(`${strict.url}/v1/models`);
  eq(noKey.status, 401, "no Authorization header");
  eq((await noKey.json()).error.code, "missing_api_key", "no Authorization header code");
  eq((await fetch(`${strict.url}/health`)).status, 200, "/health needs no key");
  const ok = await strictClient.chat.completions.create(body);
  check(ok.choices.length === 1, "the right key works");
  await expectApiError(strictClient.chat.completions.create({
    ...body, messages: [{ role: "user", content: "x".repeat(9000) }],
  }), 413, "request_too_large", null);
  await expectApiError(strictClient.chat.completions.create({
    ...body, messages: [{ role: "user", content: [
      { type: "image_url", image_url: { url: dataUrl(smallPng, "image/png") } }] }],
  }), 400, "invalid_image", "messages[0].content[0].image_url.url");
  const long = Array.from({ length: 80 }, (_, i) => `word${i}`).join(" ");
  await expectApiError(strictClient.chat.completions.create({
    ...body, messages: [{ role: "user", content: long }],
  }), 400, "context_length_exceeded", "messages");
  await expectApiError(strictClient.chat.completions.create({
    ...body, stream: true, messages: [{ role: "user", content: long }],
  }), 400, "context_length_exceeded", "messages");
});
eq(await strict.stop("SIGINT"), { code: 0, signal: null }, "exit status after SIGINT");

await step("SIGTERM with a stream in flight: the stream ends and the server exits 0", async () => {
  const stream = await client.chat.completions.create({
    model: "model", messages: [{ role: "user", content: "Talk" }], max_tokens: 100000,
    stream: true,
  });
  const t0 = Date.now();
  let chunks = 0, streamError = null;
  const consume = (async () => {
    try {
      for await (const _ of stream) chunks++;
    } catch (e) {
      streamError = e;  // cut short after the grace period: an error event
    }
  })();
  await sleep(100);
  const status = await server.stop("SIGTERM");
  await consume;
  eq(status, { code: 0, signal: null }, "exit status");
  check(chunks > 0, "no chunks before the shutdown");
  check(Date.now() - t0 < 20000 * SLOW, "shutdown took too long");
  if (streamError) check(/shutting down/.test(String(streamError.message)), `${streamError}`);
  check(/SIGTERM/.test(server.stderr()) && /stopped/.test(server.stderr()), server.stderr());
});

console.log(`serve_openai: all ${passedCount()} checks passed`);
