// Bundles the chat page into one self-contained HTML document: the page's script and its npm
// libraries (esbuild, minified), its styles and KaTeX's with the math fonts inlined as WOFF2 data
// URLs, and the bundled libraries' licence texts in a closing comment. Nothing is fetched from
// another origin at run time.
//
//   node web/build.mjs --html out/chat_page.html --inc out/chat_page.html.inc
//
// --inc writes the document as a C++ string literal that src/server/chat_page.cc includes; CMake
// runs this at build time (src/server/CMakeLists.txt).
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";

const here = path.dirname(fileURLToPath(import.meta.url));
const modules = path.join(here, "node_modules");

function fail(message) {
  console.error(`web/build.mjs: ${message}`);
  process.exit(1);
}

const { values: args } = parseArgs({ options: { html: { type: "string" }, inc: { type: "string" } } });
if (!args.html && !args.inc) fail("usage: node web/build.mjs [--html FILE] [--inc FILE]");
if (!fs.existsSync(path.join(modules, ".package-lock.json")))
  fail(`the page's npm packages are not installed in ${modules}: run 'npm ci' in web/ ` +
       "(scripts/setup.sh does)");

const esbuild = await import("esbuild");

// The script: src/main.js and what it imports, one IIFE.
const script = await esbuild.build({
  entryPoints: [path.join(here, "src", "main.js")],
  bundle: true,
  minify: true,
  format: "iife",
  target: ["es2020", "chrome90", "firefox90", "safari15"],
  legalComments: "none",  // the licences go in whole at the end of the document
  write: false,
  logLevel: "warning",
});
let js = script.outputFiles[0].text;

// KaTeX's stylesheet, its fonts as WOFF2 data URLs (every browser the script targets reads WOFF2;
// the WOFF and TTF copies would only add weight).
const katexDist = path.join(modules, "katex", "dist");
let katexCss = fs.readFileSync(path.join(katexDist, "katex.min.css"), "utf8");
katexCss = katexCss.replace(
  /src:url\(fonts\/([\w-]+)\.woff2\) format\("woff2"\)(?:,url\(fonts\/[\w-]+\.\w+\) format\("\w+"\))*/g,
  (_, font) => {
    const bytes = fs.readFileSync(path.join(katexDist, "fonts", font + ".woff2"));
    return `src:url(data:font/woff2;base64,${bytes.toString("base64")}) format("woff2")`;
  });
if (/url\((?!data:)/.test(katexCss)) fail("katex.min.css still refers to a file after inlining its fonts");
const ownCss = fs.readFileSync(path.join(here, "src", "style.css"), "utf8");
const css = (await esbuild.transform(katexCss + "\n" + ownCss, { loader: "css", minify: true })).code;

// Inside <script> and <style> only the closing tag's text can end the element early; in a script
// "<\/" means the same as "</" wherever it can occur (strings, templates, regular expressions).
js = js.replace(/<\/(script)/gi, "<\\/$1");
if (/<\/style/i.test(css)) fail("the stylesheet contains '</style'");

// Licences of what the bundle carries, as the packages ship them.
const bundled = ["marked", "dompurify", "highlight.js", "katex"];
let notices = "Third-party software in this page, with its licence:\n";
for (const name of bundled) {
  const dir = path.join(modules, name);
  const pkg = JSON.parse(fs.readFileSync(path.join(dir, "package.json"), "utf8"));
  const file = fs.readdirSync(dir).find((f) => /^licen[cs]e/i.test(f));
  if (!file) fail(`no licence file in ${dir}`);
  notices += `\n=== ${name} ${pkg.version} (${pkg.license}) ===\n` +
             fs.readFileSync(path.join(dir, file), "utf8");
}
notices = notices.replace(/--/g, "- -");  // "--" may not appear inside an HTML comment

const template = fs.readFileSync(path.join(here, "src", "index.html"), "utf8");
const parts = template.split("/*@STYLE@*/");
if (parts.length !== 2) fail("src/index.html must contain /*@STYLE@*/ once");
const [head, rest] = parts;
const tail = rest.split("//@SCRIPT@");
if (tail.length !== 2) fail("src/index.html must contain //@SCRIPT@ once");
const html = head + css + tail[0] + js + tail[1] + "<!--\n" + notices + "-->\n";
const bytes = Buffer.from(html, "utf8");

function writeIfChanged(file, content) {
  fs.mkdirSync(path.dirname(file), { recursive: true });
  if (fs.existsSync(file) && fs.readFileSync(file).equals(Buffer.from(content))) return;
  const tmp = file + ".tmp";
  fs.writeFileSync(tmp, content);
  fs.renameSync(tmp, file);
}
if (args.html) writeIfChanged(path.resolve(args.html), bytes);
// A C++ string literal, one source line per line of the page: printable ASCII as itself, the
// rest (quotes, backslashes, '?', control and UTF-8 bytes) as three-digit octal escapes, which
// cannot run into the characters after them.
function cppLiteral(data) {
  const lines = [];
  let line = '"';
  for (const byte of data) {
    if (byte === 10) {
      lines.push(line + '\\n"');
      line = '"';
      continue;
    }
    const plain = byte >= 32 && byte < 127 && byte !== 34 && byte !== 92 && byte !== 63;
    line += plain ? String.fromCharCode(byte) : "\\" + byte.toString(8).padStart(3, "0");
    if (line.length >= 200) {
      lines.push(line + '"');
      line = '"';
    }
  }
  lines.push(line + '"');
  return lines.join("\n") + "\n";
}
if (args.inc)
  writeIfChanged(path.resolve(args.inc),
                 "// Generated by web/build.mjs from web/src; not for editing.\n" + cppLiteral(bytes));
const kib = (n) => (n / 1024).toFixed(0) + " KiB";
console.log(`chat page: ${kib(bytes.length)} (script ${kib(js.length)}, styles and fonts ${kib(css.length)}, ` +
            `licences ${kib(notices.length)})`);
