// Shared by the `gemstage serve` tests: start a server on a free port, wait until it is ready,
// stop it with a signal, read its memory, parse server-sent events, and fail loudly.
import { spawn, execFileSync } from "node:child_process";
import fs from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";

// Sanitizer builds (CMake sets this for them) run several times slower.
export const SLOW = process.env.GEMSTAGE_SANITIZED === "1" ? 6 : 1;

export function fail(name, message) {
  console.error(`${name}: FAIL: ${message}`);
  process.exit(1);
}

// Every test takes <gemstage CLI> <tests/fixtures> [extra]; a missing binary or fixture is a
// broken setup, reported as a failure rather than a skip.
export function parseArgs(name, usage) {
  const [cli, fixtures, ...rest] = process.argv.slice(2);
  if (!cli || !fixtures) {
    console.error(`usage: node ${name}.mjs path/to/gemstage path/to/tests/fixtures ${usage ?? ""}`);
    process.exit(2);
  }
  if (!fs.existsSync(cli)) fail(name, `gemstage binary not found at ${cli}; build it first`);
  const model = path.join(fixtures, "gemma4-tiny", "model");
  if (!fs.existsSync(model)) fail(name, `fixture model not found at ${model}`);
  return { cli, fixtures, model, rest };
}

// The npm test packages; their absence fails the test (scripts/setup.sh installs them).
export async function importPackage(name, pkg) {
  try {
    const require = createRequire(import.meta.url);
    require.resolve(pkg);
    return await import(pkg);
  } catch (e) {
    fail(
      name,
      `the npm test package '${pkg}' is not installed (${e.message}).\n` +
        "Run scripts/setup.sh, or: cd tests/js && npm install",
    );
  }
}

const running = new Set();
process.on("exit", () => {
  for (const p of running) p.kill("SIGKILL");
});

// The checks a numbered test script uses: check(cond, message), eq(got, want, what) by JSON
// text, step(name, fn) which prints "ok N - name (ms)" or fails with the stack, and passed().
export function checks(name) {
  const check = (cond, message) => assert(name, cond, message);
  const eq = (got, want, what) =>
    check(JSON.stringify(got) === JSON.stringify(want),
          `${what}: got ${JSON.stringify(got)}, want ${JSON.stringify(want)}`);
  let count = 0;
  async function step(title, fn) {
    const t0 = Date.now();
    try {
      await fn();
    } catch (e) {
      check(false, `${title}: ${e.stack ?? e}`);
    }
    count++;
    console.log(`ok ${count} - ${title} (${Date.now() - t0} ms)`);
  }
  return { check, eq, step, passed: () => count };
}

export function assert(name, cond, message) {
  if (!cond) {
    for (const p of running) p.kill("SIGKILL");
    fail(name, message);
  }
}

// Starts `gemstage serve` on 127.0.0.1 with a free port; resolves once /health says ok.
export async function startServer(cli, model, args = [], { env = {} } = {}) {
  const proc = spawn(cli, ["serve", "-m", model, "--port", "0", ...args], {
    stdio: ["ignore", "ignore", "pipe"],
    env: { ...process.env, ...env },
  });
  running.add(proc);
  let stderr = "";
  const exited = new Promise((resolve) =>
    proc.on("exit", (code, signal) => {
      running.delete(proc);
      resolve({ code, signal });
    }),
  );
  const port = await new Promise((resolve, reject) => {
    const timer = setTimeout(
      () => reject(new Error(`no "listening on" line within ${30 * SLOW} s:\n${stderr}`)),
      30000 * SLOW,
    );
    proc.stderr.setEncoding("utf8");
    proc.stderr.on("data", (d) => {
      stderr += d;
      const m = /listening on http:\/\/127\.0\.0\.1:(\d+)/.exec(stderr);
      if (m) {
        clearTimeout(timer);
        resolve(Number(m[1]));
      }
    });
    exited.then(({ code, signal }) =>
      reject(new Error(`server exited (${code ?? signal}) before listening:\n${stderr}`)),
    );
  });
  const url = `http://127.0.0.1:${port}`;
  const t0 = Date.now();
  for (;;) {
    try {
      const r = await fetch(`${url}/health`);
      const j = await r.json();
      if (r.status === 200 && j.status === "ok") break;
      if (r.status !== 503 || j.status !== "loading")
        throw new Error(`unexpected /health ${r.status} ${JSON.stringify(j)}`);
    } catch (e) {
      if (!(e instanceof TypeError)) throw e;  // a TypeError is fetch's "cannot connect"
    }
    if (Date.now() - t0 > 30000 * SLOW) throw new Error(`not ready after ${30 * SLOW} s:\n${stderr}`);
    await sleep(20);
  }
  return {
    proc,
    port,
    url,
    pid: proc.pid,
    stderr: () => stderr,
    exited,
    // Sends the signal and resolves with the exit status.
    async stop(signal = "SIGTERM") {
      proc.kill(signal);
      return await exited;
    },
  };
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// Resident memory of a process in KiB, from /proc.
export function rssKiB(pid) {
  const m = /VmRSS:\s+(\d+) kB/.exec(fs.readFileSync(`/proc/${pid}/status`, "utf8"));
  return m ? Number(m[1]) : NaN;
}

// `gemstage generate --json` for the same prompt: the reference for greedy output.
export function generateJson(cli, model, args) {
  return JSON.parse(
    execFileSync(cli, ["generate", "-m", model, "--json", "-t", "1", ...args], {
      encoding: "utf8",
      stdio: ["ignore", "pipe", "ignore"],
    }),
  );
}

export function dataUrl(file, mime) {
  return `data:${mime};base64,${fs.readFileSync(file).toString("base64")}`;
}

// The events of a server-sent-events body: the payload of each "data:" line, in order.
// Throws when the framing is off (every event must be exactly one "data: " line).
export function sseEvents(text) {
  const events = text.split("\n\n");
  if (events.pop() !== "") throw new Error("the stream does not end with a blank line");
  return events.map((e) => {
    if (!e.startsWith("data: ") || e.includes("\n")) throw new Error(`malformed event ${JSON.stringify(e)}`);
    return e.slice(6);
  });
}

// Checks a whole chat-completion stream the way a strict client would and returns its content
// and usage. Throws with the reason when anything is off.
export function checkChatStream(text, { usage = true } = {}) {
  const data = sseEvents(text);
  if (data.at(-1) !== "[DONE]") throw new Error("no [DONE] at the end");
  const chunks = data.slice(0, -1).map((d) => JSON.parse(d));
  if (chunks.length < 2) throw new Error("too few chunks");
  const id = chunks[0].id;
  let content = "", finish = null, usageChunk = null;
  chunks.forEach((c, i) => {
    if (c.object !== "chat.completion.chunk") throw new Error(`chunk ${i}: object ${c.object}`);
    if (c.id !== id) throw new Error(`chunk ${i}: id changed`);
    if (c.choices.length === 0) {
      if (!c.usage || i !== chunks.length - 1) throw new Error(`chunk ${i}: stray usage chunk`);
      usageChunk = c.usage;
      return;
    }
    if (finish) throw new Error(`chunk ${i}: content after the finish chunk`);
    const ch = c.choices[0];
    if (i === 0 && ch.delta.role !== "assistant") throw new Error("the first chunk has no role");
    if (typeof ch.delta.content === "string") content += ch.delta.content;
    if (ch.finish_reason !== null) finish = ch.finish_reason;
  });
  if (!["stop", "length"].includes(finish)) throw new Error(`finish_reason ${finish}`);
  if (usage && !usageChunk) throw new Error("no usage chunk");
  if (usageChunk && usageChunk.total_tokens !== usageChunk.prompt_tokens + usageChunk.completion_tokens)
    throw new Error("usage does not add up");
  return { content, finish, usage: usageChunk };
}

export function percentile(sorted, p) {
  if (sorted.length === 0) return NaN;
  return sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))];
}
