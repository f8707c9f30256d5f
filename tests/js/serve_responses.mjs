// `gemstage serve`'s OpenAI Responses API through the official `openai` npm client, on the tiny
// fixture model: output equal to `gemstage generate`'s greedy output, the same output streamed as
// typed events the client assembles, an input_image (also with tools), output_text logprobs, a
// function-call round trip (function_call and function_call_output items), reasoning effort, and
// errors in OpenAI's shape.
//
//   node tests/js/serve_responses.mjs path/to/gemstage path/to/tests/fixtures
import path from "node:path";
import {
  checks, SLOW, dataUrl, generateJson, importPackage, parseArgs, startServer,
} from "./serve_helpers.mjs";

const NAME = "serve_responses";
const { cli, fixtures, model } = parseArgs(NAME);
const { default: OpenAI } = await importPackage(NAME, "openai");
const { check, eq, step, passed: passedCount } = checks(NAME);

async function expectApiError(promise, status, code, param) {
  try {
    await promise;
  } catch (e) {
    check(e instanceof OpenAI.APIError, `expected an APIError, got ${e}`);
    eq(e.status, status, `status of "${e.message}"`);
    eq(e.code ?? null, code, `code of "${e.message}"`);
    if (param !== undefined) eq(e.param ?? null, param, `param of "${e.message}"`);
    return e;
  }
  check(false, `expected HTTP ${status} (${code}), but the request succeeded`);
}

const server = await startServer(cli, model, ["-np", "2", "-t", "2"]);
const client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: "unused", maxRetries: 0,
                            timeout: 60000 * SLOW });
const prompt = "Hello there, how are you?";
const want = generateJson(cli, model, ["--temp", "0", "-n", "12", "-p", prompt]);

let whole;
await step("non-streamed response equals gemstage generate (greedy)", async () => {
  whole = await client.responses.create({ model: "model", input: prompt, max_output_tokens: 12,
                                          temperature: 0 });
  eq(whole.object, "response", "object");
  check(/^resp_/.test(whole.id), `id ${whole.id}`);
  eq(whole.output_text, want.text.trim(), "output_text");
  eq(whole.status, want.finish_reason === "stop" ? "completed" : "incomplete", "status");
  eq(whole.usage.input_tokens, want.prompt_tokens, "input_tokens");
  eq(whole.usage.output_tokens, want.completion_tokens, "output_tokens");
  eq(whole.usage.total_tokens, want.prompt_tokens + want.completion_tokens, "total_tokens");
});

await step("streamed response: typed events the client assembles into the same output", async () => {
  const stream = client.responses.stream({ model: "model", input: prompt, max_output_tokens: 12,
                                           temperature: 0 });
  const types = [];
  let seq = -1;
  stream.on("event", (ev) => {
    types.push(ev.type);
    eq(ev.sequence_number, seq + 1, "sequence_number");
    seq = ev.sequence_number;
  });
  const final = await stream.finalResponse();
  eq(types[0], "response.created", "first event");
  check(["response.completed", "response.incomplete"].includes(types[types.length - 1]),
        `last event ${types[types.length - 1]}`);
  eq(final.output_text, whole.output_text, "streamed output_text");
  eq(final.status, whole.status, "status");
  eq(final.usage.input_tokens, whole.usage.input_tokens, "input_tokens");
  eq(final.usage.output_tokens, whole.usage.output_tokens, "output_tokens");
  eq(final.usage.total_tokens, whole.usage.total_tokens, "total_tokens");
  // The same input again: its prefix came back from a slot's caches, and usage says so.
  eq(whole.usage.input_tokens_details.cached_tokens, 0, "first request: nothing cached");
  check(final.usage.input_tokens_details.cached_tokens > 0,
        `cached_tokens ${final.usage.input_tokens_details.cached_tokens}`);
});

await step("input_image equals gemstage generate --image (greedy)", async () => {
  const image = path.join(fixtures, "gemma4-tiny", "multimodal", "image.png");
  const wantImage = generateJson(cli, model,
                                 ["--temp", "0", "-n", "8", "--image", image, "-p", "What is this?"]);
  const r = await client.responses.create({
    model: "model", max_output_tokens: 8, temperature: 0,
    input: [{ role: "user", content: [
      { type: "input_image", image_url: dataUrl(image, "image/png") },
      { type: "input_text", text: "What is this?" }] }],
  });
  eq(r.output_text, wantImage.text.trim(), "output_text");
  eq(r.usage.input_tokens, wantImage.prompt_tokens, "input_tokens (with the image's tokens)");
});

await step("input_image with function tools: the image's rows are in the prompt", async () => {
  const image = path.join(fixtures, "gemma4-tiny", "multimodal", "image.png");
  const tools = [{ type: "function", name: "get_weather",
                   parameters: { type: "object", properties: { city: { type: "string" } } } }];
  const request = (withImage) => ({
    model: "model", max_output_tokens: 4, tools,
    input: [{ role: "user", content: [
      ...(withImage ? [{ type: "input_image", image_url: dataUrl(image, "image/png") }] : []),
      { type: "input_text", text: "Weather where this was taken?" }] }],
  });
  const withImage = await client.responses.create(request(true));
  const without = await client.responses.create(request(false));
  // The fixture image is 56 soft tokens (gemma4-tiny/multimodal/manifest.json) plus its markers.
  eq(withImage.usage.input_tokens, without.usage.input_tokens + 58, "input_tokens with the image");
});

await step("logprobs of the output_text: include and top_logprobs, whole and streamed", async () => {
  const request = { model: "model", input: prompt, max_output_tokens: 12, temperature: 0,
                    include: ["message.output_text.logprobs"], top_logprobs: 2 };
  const r = await client.responses.create(request);
  const part = r.output.find((i) => i.type === "message").content[0];
  eq(part.text, whole.output_text, "the same greedy text");
  check(part.logprobs.length > 0, "no logprobs");
  eq(part.logprobs.map((e) => e.token).join("").trim(), part.text, "the tokens spell the text");
  for (const e of part.logprobs) {
    check(e.logprob <= 0, `logprob ${e.logprob}`);
    eq(e.top_logprobs.length, 2, "top_logprobs alternatives");
  }
  eq(r.top_logprobs, 2, "top_logprobs echoed");
  const streamed = [];
  const stream = client.responses.stream(request);
  stream.on("response.output_text.delta", (ev) => streamed.push(...ev.logprobs));
  await stream.finalResponse();
  eq(streamed, part.logprobs, "streamed logprobs");
});

await step("function-call round trip: function_call and function_call_output items", async () => {
  const tools = [{ type: "function", name: "get_weather", description: "Get the weather.",
                   parameters: { type: "object", properties: { city: { type: "string" } },
                                 required: ["city"] } }];
  const input = [
    { role: "user", content: "Weather in Paris?" },
    { type: "function_call", call_id: "call_1", name: "get_weather",
      arguments: JSON.stringify({ city: "Paris" }) },
    { type: "function_call_output", call_id: "call_1", output: "15C sunny" },
  ];
  const request = { model: "model", instructions: "Be brief.", input, tools, max_output_tokens: 8,
                    temperature: 0 };
  const r = await client.responses.create(request);
  for (const item of r.output) {
    check(["message", "reasoning", "function_call"].includes(item.type), `item ${item.type}`);
    if (item.type === "function_call") check(typeof JSON.parse(item.arguments) === "object", "args");
  }
  eq(r.instructions, "Be brief.", "instructions echoed");
  eq(r.tools.map((t) => t.name), ["get_weather"], "tools echoed");
  const final = await client.responses.stream(request).finalResponse();
  eq(final.output.map((i) => i.type), r.output.map((i) => i.type), "streamed item types");
  eq(final.output_text, r.output_text, "streamed output_text");
  await expectApiError(client.responses.create({ ...request, tool_choice: { type: "function",
                                                                             name: "nope" } }),
                       400, "invalid_value", "tool_choice.function.name");
});

await step("reasoning effort switches thinking in the chat template", async () => {
  const ask = (effort) => client.responses.create({ model: "model", input: "Think.",
                                                    max_output_tokens: 2, reasoning: { effort } });
  const on = await ask("high");
  const off = await ask("none");
  check(on.usage.input_tokens > off.usage.input_tokens,
        `effort high ${on.usage.input_tokens} <= none ${off.usage.input_tokens}`);
  eq(on.reasoning.effort, "high", "reasoning echoed");
});

await step("text.format json_schema: every sample at temperature 1 parses and validates", async () => {
  const schema = { type: "object", properties: {
    city: { type: "string", maxLength: 12 }, temp_c: { type: "integer", minimum: -40, maximum: 50 },
    sunny: { type: "boolean" } }, required: ["city", "temp_c", "sunny"],
    additionalProperties: false };
  let finished = 0;
  for (let seed = 1; seed <= 6; seed++) {
    const r = await client.responses.create({ model: "model", input: "Weather?", temperature: 1,
      max_output_tokens: 300, seed,
      text: { format: { type: "json_schema", name: "weather", schema, strict: true } } });
    eq(r.text.format.type, "json_schema", "format echoed");
    if (r.status !== "completed") continue;
    finished++;
    const v = JSON.parse(r.output_text);
    eq(Object.keys(v).sort(), ["city", "sunny", "temp_c"], `keys of ${r.output_text}`);
    check(typeof v.city === "string" && [...v.city].length <= 12, `city ${v.city}`);
    check(Number.isInteger(v.temp_c) && v.temp_c >= -40 && v.temp_c <= 50, `temp_c ${v.temp_c}`);
    check(typeof v.sunny === "boolean", `sunny ${v.sunny}`);
  }
  check(finished >= 4, `only ${finished} of 6 samples finished`);
});

await step("errors name the Responses field", async () => {
  await expectApiError(client.responses.create({ model: "model", input: "x",
                                                 previous_response_id: "resp_1" }),
                       400, "unsupported_value", "previous_response_id");
  await expectApiError(client.responses.create({ model: "model", input: [{ type: "web_search_call" }] }),
                       400, "unsupported_value", "input[0].type");
  await expectApiError(client.responses.create({ model: "model", input: "x",
                                                 tools: [{ type: "web_search" }] }),
                       400, "unsupported_value", "tools[0].type");
  await expectApiError(client.responses.create({ model: "model", input: "x",
                                                 text: { format: { type: "yaml" } } }),
                       400, "invalid_value", "text.format.type");
  await expectApiError(client.responses.create({ model: "model", input: "x", text: { format: {
    type: "json_schema", name: "s", schema: { type: "string", pattern: "a+" } } } }),
                       400, "unsupported_schema", "text.format.schema");
  await expectApiError(client.responses.create({ model: "model" }), 400,
                       "missing_required_parameter", "input");
});

eq(await server.stop("SIGTERM"), { code: 0, signal: null }, "exit status after SIGTERM");
console.log(`serve_responses: all ${passedCount()} checks passed`);
