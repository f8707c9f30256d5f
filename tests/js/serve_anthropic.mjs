// `gemstage serve`'s Anthropic Messages API through the official `@anthropic-ai/sdk` client, on
// the tiny fixture model: text equal to `gemstage generate`'s greedy output, the same text
// streamed as Messages events, an image block (also with tools and thinking), a stop sequence, a
// tool round trip (tools, tool_use history, tool_result), thinking on, count_tokens, the
// x-api-key header, and errors in Anthropic's shape.
//
//   node tests/js/serve_anthropic.mjs path/to/gemstage path/to/tests/fixtures
import fs from "node:fs";
import path from "node:path";
import {
  checks, SLOW, generateJson, importPackage, parseArgs, startServer,
} from "./serve_helpers.mjs";

const NAME = "serve_anthropic";
const { cli, fixtures, model } = parseArgs(NAME);
const { default: Anthropic } = await importPackage(NAME, "@anthropic-ai/sdk");
const { check, eq, step, passed: passedCount } = checks(NAME);

// An APIError with this status and Anthropic error type.
async function expectApiError(promise, status, type, pattern) {
  try {
    await promise;
  } catch (e) {
    check(e instanceof Anthropic.APIError, `expected an APIError, got ${e}`);
    eq(e.status, status, `status of "${e.message}"`);
    eq(e.error?.type, "error", "error envelope type");
    eq(e.error?.error?.type, type, `error type of "${e.message}"`);
    if (pattern) check(pattern.test(e.error.error.message), `message "${e.error.error.message}"`);
    return e;
  }
  check(false, `expected HTTP ${status} (${type}), but the request succeeded`);
}

// The whole prompt: Anthropic counts tokens read from a cache apart from input_tokens.
const promptTokens = (u) =>
  u.input_tokens + (u.cache_read_input_tokens ?? 0) + (u.cache_creation_input_tokens ?? 0);

const textOf = (msg) => msg.content.filter((b) => b.type === "text").map((b) => b.text).join("");

const server = await startServer(cli, model, ["-np", "2", "-t", "2", "--api-key", "test-key"]);
const client = new Anthropic({ baseURL: server.url, apiKey: "test-key", maxRetries: 0,
                               timeout: 60000 * SLOW });
const prompt = "Hello there, how are you?";
const want = generateJson(cli, model, ["--temp", "0", "-n", "12", "-p", prompt]);

let whole;
await step("non-streamed message equals gemstage generate (greedy)", async () => {
  whole = await client.messages.create({
    model: "model", max_tokens: 12, temperature: 0,
    messages: [{ role: "user", content: prompt }],
  });
  eq(whole.type, "message", "type");
  eq(whole.role, "assistant", "role");
  check(/^msg_/.test(whole.id), `id ${whole.id}`);
  eq(textOf(whole), want.text.trim(), "text");
  eq(whole.stop_reason, want.finish_reason === "stop" ? "end_turn" : "max_tokens", "stop_reason");
  eq(promptTokens(whole.usage), want.prompt_tokens, "input_tokens");
  eq(whole.usage.output_tokens, want.completion_tokens, "output_tokens");
});

await step("streamed message: the events the SDK assembles into the same message", async () => {
  const stream = client.messages.stream({
    model: "model", max_tokens: 12, temperature: 0,
    messages: [{ role: "user", content: prompt }],
  });
  const kinds = [];
  stream.on("streamEvent", (ev) => kinds.push(ev.type));
  const final = await stream.finalMessage();
  eq(kinds[0], "message_start", "first event");
  eq(kinds[kinds.length - 1], "message_stop", "last event");
  check(kinds.includes("message_delta"), `no message_delta in ${kinds}`);
  eq(textOf(final), textOf(whole), "streamed text");
  eq(final.stop_reason, whole.stop_reason, "stop_reason");
  eq(final.usage.output_tokens, whole.usage.output_tokens, "output_tokens");
});

await step("a repeated prompt reports the tokens read from the cache", async () => {
  const again = await client.messages.create({
    model: "model", max_tokens: 12, temperature: 0,
    messages: [{ role: "user", content: prompt }],
  });
  eq(whole.usage.cache_read_input_tokens, 0, "first request: nothing cached");
  check(again.usage.cache_read_input_tokens > 0,
        `cache_read_input_tokens ${again.usage.cache_read_input_tokens}`);
  eq(again.usage.cache_creation_input_tokens, 0, "cache_creation_input_tokens");
  eq(promptTokens(again.usage), whole.usage.input_tokens, "input + cache_read = the prompt");
  eq(textOf(again), textOf(whole), "same text");
});

await step("count_tokens equals the message's input_tokens", async () => {
  const n = await client.messages.countTokens({
    model: "model", messages: [{ role: "user", content: prompt }],
  });
  eq(n.input_tokens, promptTokens(whole.usage), "input_tokens");
});

await step("image block equals gemstage generate --image (greedy)", async () => {
  const image = path.join(fixtures, "gemma4-tiny", "multimodal", "image.png");
  const wantImage = generateJson(cli, model,
                                 ["--temp", "0", "-n", "8", "--image", image, "-p", "What is this?"]);
  const r = await client.messages.create({
    model: "model", max_tokens: 8, temperature: 0,
    messages: [{ role: "user", content: [
      { type: "image", source: { type: "base64", media_type: "image/png",
                                 data: fs.readFileSync(image).toString("base64") } },
      { type: "text", text: "What is this?" },
    ] }],
  });
  eq(textOf(r), wantImage.text.trim(), "text");
  eq(promptTokens(r.usage), wantImage.prompt_tokens, "input_tokens (with the image's tokens)");
});

await step("image block with tools and thinking: the image's rows are in the prompt", async () => {
  const image = path.join(fixtures, "gemma4-tiny", "multimodal", "image.png");
  const tools = [{ name: "get_weather", input_schema: { type: "object",
                                                        properties: { city: { type: "string" } } } }];
  const request = (withImage) => ({
    model: "model", max_tokens: 4, tools, thinking: { type: "enabled", budget_tokens: 1024 },
    messages: [{ role: "user", content: [
      ...(withImage ? [{ type: "image", source: { type: "base64", media_type: "image/png",
                                                  data: fs.readFileSync(image).toString("base64") } }]
                    : []),
      { type: "text", text: "Weather where this was taken?" }] }],
  });
  const withImage = await client.messages.create(request(true));
  const without = await client.messages.create(request(false));
  // The fixture image is 56 soft tokens (gemma4-tiny/multimodal/manifest.json) plus its markers.
  eq(promptTokens(withImage.usage), promptTokens(without.usage) + 58, "input_tokens with the image");
  const final = await client.messages.stream(request(true)).finalMessage();
  eq(promptTokens(final.usage), promptTokens(withImage.usage), "streamed input_tokens");
  // An image in a tool_result (a screenshot tool, an image file an agent's Read tool returns).
  const roundTrip = (result) => client.messages.create({
    model: "model", max_tokens: 4, tools, messages: [
      { role: "user", content: "Take a screenshot." },
      { role: "assistant", content: [{ type: "tool_use", id: "toolu_1", name: "get_weather",
                                        input: { city: "Oslo" } }] },
      { role: "user", content: [{ type: "tool_result", tool_use_id: "toolu_1", content: result }] },
    ] });
  const shot = await roundTrip([{ type: "text", text: "Done." }, { type: "image", source: {
    type: "base64", media_type: "image/png", data: fs.readFileSync(image).toString("base64") } }]);
  const text = await roundTrip([{ type: "text", text: "Done." }]);
  eq(promptTokens(shot.usage), promptTokens(text.usage) + 58, "input_tokens with the tool_result image");
});

await step("a matched stop sequence is the stop_reason, with its string", async () => {
  const text = textOf(whole);
  const ch = [...text][0];  // the reply's first character
  check(ch !== undefined, "the greedy reply has no text");
  const request = { model: "model", max_tokens: 12, temperature: 0, stop_sequences: ["\u0001", ch],
                    messages: [{ role: "user", content: prompt }] };
  const r = await client.messages.create(request);
  eq(r.stop_reason, "stop_sequence", "stop_reason");
  eq(r.stop_sequence, ch, "stop_sequence");
  check(!textOf(r).includes(ch), `the text ${JSON.stringify(textOf(r))} is cut before ${ch}`);
  const final = await client.messages.stream(request).finalMessage();
  eq(final.stop_reason, "stop_sequence", "streamed stop_reason");
  eq(final.stop_sequence, ch, "streamed stop_sequence");
  eq(whole.stop_sequence, null, "no stop_sequence without one");
});

await step("tool round trip: tools, tool_use history, tool_result; plain and streamed", async () => {
  // What an agent sends after running the call it got back (a random-weight model rarely writes
  // a well-formed call itself; tests/messages_api_test.cc maps real calls on canned output).
  const tools = [{ name: "get_weather", description: "Get the current weather for a city.",
                   input_schema: { type: "object", properties: { city: { type: "string" } },
                                   required: ["city"] } }];
  const messages = [
    { role: "user", content: "Weather in Paris?" },
    { role: "assistant", content: [
      { type: "text", text: "Let me check." },
      { type: "tool_use", id: "toolu_1", name: "get_weather", input: { city: "Paris" } }] },
    { role: "user", content: [
      { type: "tool_result", tool_use_id: "toolu_1", content: "15C sunny" }] },
  ];
  const request = { model: "model", max_tokens: 8, temperature: 0, system: "You are terse.",
                    messages, tools, tool_choice: { type: "auto" } };
  const r = await client.messages.create(request);
  check(["end_turn", "max_tokens", "tool_use"].includes(r.stop_reason),
        `stop_reason ${r.stop_reason}`);
  for (const b of r.content) {
    check(["text", "thinking", "tool_use"].includes(b.type), `block type ${b.type}`);
    if (b.type === "tool_use") check(typeof b.input === "object", "tool_use input is an object");
  }
  const final = await client.messages.stream(request).finalMessage();
  eq(final.content.map((b) => b.type), r.content.map((b) => b.type), "streamed block types");
  eq(textOf(final), textOf(r), "streamed text");
  eq(final.stop_reason, r.stop_reason, "streamed stop_reason");
  await expectApiError(client.messages.create({ model: "model", max_tokens: 8, messages, tools,
                                                tool_choice: { type: "tool", name: "nope" } }),
                       400, "invalid_request_error", /not among 'tools'/);
});

await step("thinking enabled renders and completes", async () => {
  const r = await client.messages.create({
    model: "model", max_tokens: 6, thinking: { type: "enabled", budget_tokens: 1024 },
    messages: [{ role: "user", content: "Think first." }],
  });
  check(r.usage.output_tokens >= 1 && r.usage.output_tokens <= 6, "output_tokens");
  // The switch reaches the chat template: the system turn gains the thinking token.
  const count = (thinking) => client.messages.countTokens({
    model: "model", thinking, messages: [{ role: "user", content: "Think first." }],
  });
  const on = await count({ type: "enabled", budget_tokens: 1024 });
  const off = await count({ type: "disabled" });
  eq(on.input_tokens, promptTokens(r.usage), "count_tokens with thinking");
  check(on.input_tokens > off.input_tokens, `thinking on ${on.input_tokens} <= off ${off.input_tokens}`);
});

await step("errors in Anthropic's shape: key, required fields, roles, blocks", async () => {
  const anonymous = new Anthropic({ baseURL: server.url, apiKey: "wrong", maxRetries: 0 });
  const body = { model: "model", max_tokens: 4, messages: [{ role: "user", content: "Hi" }] };
  const e = await expectApiError(anonymous.messages.create(body), 401, "authentication_error");
  check(e instanceof Anthropic.AuthenticationError, "not an AuthenticationError");
  await expectApiError(client.messages.create({ ...body, max_tokens: undefined }), 400,
                       "invalid_request_error", /'max_tokens' is required/);
  await expectApiError(client.messages.create({ ...body, messages: [{ role: "system",
                                                                       content: "x" }] }),
                       400, "invalid_request_error", /messages\[0\]/);
  await expectApiError(client.messages.create({ ...body, messages: [{ role: "user", content: [
    { type: "image", source: { type: "url", url: "http://169.254.169.254/" } }] }] }),
                       400, "invalid_request_error", /not fetched/);
  await expectApiError(client.messages.create({ ...body, messages: [{ role: "user", content: [
    { type: "document", source: { type: "text", data: "x" } }] }] }),
                       400, "invalid_request_error", /'document' is not supported/);
  const raw = await fetch(`${server.url}/v1/messages`, {
    method: "POST", headers: { "x-api-key": "test-key" }, body: "{\"messages\": [",
  });
  eq(raw.status, 400, "malformed JSON status");
  eq((await raw.json()).type, "error", "malformed JSON shape");
});

eq(await server.stop("SIGTERM"), { code: 0, signal: null }, "exit status after SIGTERM");
console.log(`serve_anthropic: all ${passedCount()} checks passed`);
