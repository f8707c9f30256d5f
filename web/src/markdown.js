// Markdown for the model's replies: GitHub-flavoured markdown (marked), TeX math (KaTeX), code
// highlighting (highlight.js, a small set of languages) and a sanitiser (DOMPurify) between the
// markdown's HTML and the page.
//
// Safety: a reply is text from a model, so any HTML in it is shown as text (the renderer escapes
// raw HTML blocks and inline tags), links cannot run script (DOMPurify drops javascript: URLs),
// and remote images are shown as links rather than fetched. DOMPurify then cleans the whole
// fragment in case anything slipped through the markdown layer.
//
// Streaming: MarkdownView splits the source into top-level blocks and re-renders only blocks whose
// source changed, so paragraphs, tables and code blocks that are complete stay the same DOM nodes
// (no flicker, selection and copy buttons keep working) while the last block grows.
import { Marked } from "marked";
import DOMPurify from "dompurify";
import katex from "katex";
import hljs from "highlight.js/lib/core";
import bash from "highlight.js/lib/languages/bash";
import c from "highlight.js/lib/languages/c";
import cpp from "highlight.js/lib/languages/cpp";
import csharp from "highlight.js/lib/languages/csharp";
import css from "highlight.js/lib/languages/css";
import diff from "highlight.js/lib/languages/diff";
import go from "highlight.js/lib/languages/go";
import java from "highlight.js/lib/languages/java";
import javascript from "highlight.js/lib/languages/javascript";
import json from "highlight.js/lib/languages/json";
import kotlin from "highlight.js/lib/languages/kotlin";
import markdown from "highlight.js/lib/languages/markdown";
import python from "highlight.js/lib/languages/python";
import rust from "highlight.js/lib/languages/rust";
import shell from "highlight.js/lib/languages/shell";
import sql from "highlight.js/lib/languages/sql";
import typescript from "highlight.js/lib/languages/typescript";
import xml from "highlight.js/lib/languages/xml";
import yaml from "highlight.js/lib/languages/yaml";

const languages = { bash, c, cpp, csharp, css, diff, go, java, javascript, json, kotlin, markdown,
                    python, rust, shell, sql, typescript, xml, yaml };
for (const [name, definition] of Object.entries(languages)) hljs.registerLanguage(name, definition);

export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (ch) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;",
                                                     '"': "&quot;", "'": "&#39;" })[ch]);
}

// --- math: $...$, \(...\) inline; $$...$$, \[...\] display -----------------------------------
// A single $ opens inline math only when a non-space follows it, and closes only after a
// non-space and when no digit follows ("$5 and $10" stays text), as pandoc does.
const inlineMath = [
  { re: /^\$\$((?:\\[\s\S]|[^\\$])+?)\$\$/, display: true },
  { re: /^\\\[([\s\S]+?)\\\]/, display: true },
  { re: /^\\\(([\s\S]+?)\\\)/, display: false },
  { re: /^\$(?![\s$])((?:\\[\s\S]|[^\\$\n])+?)(?<!\s)\$(?!\d)/, display: false },
];
const blockMath = [
  /^ {0,3}\$\$([\s\S]+?)\$\$[^\S\n]*(?:\n|$)/,
  /^ {0,3}\\\[([\s\S]+?)\\\][^\S\n]*(?:\n|$)/,
];

const mathExtensions = [
  {
    name: "mathBlock",
    level: "block",
    start(src) {
      const m = /^ {0,3}(?:\$\$|\\\[)/m.exec(src);
      return m ? m.index : undefined;
    },
    tokenizer(src) {
      for (const re of blockMath) {
        const m = re.exec(src);
        if (m) return { type: "mathBlock", raw: m[0], text: m[1].trim() };
      }
      return undefined;
    },
    renderer(token) {
      return `<div class="math math-display">${escapeHtml(token.text)}</div>\n`;
    },
  },
  {
    name: "mathInline",
    level: "inline",
    start(src) {
      const i = src.search(/\$|\\\(|\\\[/);
      return i < 0 ? undefined : i;
    },
    tokenizer(src) {
      for (const { re, display } of inlineMath) {
        const m = re.exec(src);
        if (m) return { type: "mathInline", raw: m[0], text: m[1].trim(), display };
      }
      return undefined;
    },
    renderer(token) {
      const cls = token.display ? "math math-display" : "math";
      return `<span class="${cls}">${escapeHtml(token.text)}</span>`;
    },
  },
];

// --- the markdown layer ----------------------------------------------------------------------
// A single newline is a line break, as in GitHub comments: models write poems, addresses and
// step lists one line each without the two trailing spaces plain markdown would need.
const md = new Marked({ gfm: true, breaks: true });
md.use({
  extensions: mathExtensions,
  renderer: {
    // Raw HTML from the model is text, never markup.
    html({ text }) {
      return escapeHtml(text);
    },
    // A fenced block: highlighted when its language is one we carry, escaped otherwise.
    code({ text, lang }) {
      const language = (lang || "").trim().split(/\s+/)[0].toLowerCase();
      const known = language && hljs.getLanguage(language);
      const body = known ? hljs.highlight(text, { language, ignoreIllegals: true }).value
                         : escapeHtml(text);
      return `<div class="code-block"><div class="code-head"><span class="code-lang">` +
             `${escapeHtml(language || "text")}</span></div><pre><code class="hljs` +
             `${known ? " language-" + escapeHtml(language) : ""}">${body}</code></pre></div>\n`;
    },
    // Images the model names are links: the page fetches nothing a reply points at.
    image({ href, text }) {
      return `<a href="${escapeHtml(href)}">${escapeHtml(text || href)}</a>`;
    },
  },
});

const purify = DOMPurify(window);
purify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A" && node.hasAttribute("href")) {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

// Sanitised DOM for some tokens of a lexed source, with math typeset and tables made scrollable.
function renderTokens(tokens, links) {
  const list = tokens.slice();
  list.links = links;
  const html = md.parser(list).trim();  // the newline after the last tag is no content
  const fragment = purify.sanitize(html, {
    RETURN_DOM_FRAGMENT: true,
    ADD_ATTR: ["target"],
    FORBID_TAGS: ["style", "form", "img", "video", "audio", "iframe"],
  });
  for (const el of fragment.querySelectorAll(".math")) {
    const tex = el.textContent;
    try {
      katex.render(tex, el, { displayMode: el.classList.contains("math-display"),
                              throwOnError: false, output: "htmlAndMathml" });
    } catch (e) {
      el.textContent = tex;  // KaTeX refused even in lenient mode: keep the source
      el.classList.add("math-error");
    }
  }
  for (const table of fragment.querySelectorAll("table")) {
    const wrap = document.createElement("div");
    wrap.className = "table-wrap";
    table.replaceWith(wrap);
    wrap.appendChild(table);
  }
  for (const head of fragment.querySelectorAll(".code-head")) {
    const button = document.createElement("button");
    button.type = "button";
    button.className = "copy-code";
    button.textContent = "Copy";
    button.setAttribute("aria-label", "Copy code");
    head.appendChild(button);
  }
  return fragment;
}

// One rendered markdown document that can be fed a growing source.
export class MarkdownView {
  constructor(element) {
    this.element = element;
    this.blocks = [];  // {raw, node}: one rendered top-level block each
  }

  update(source) {
    const tokens = md.lexer(source);
    const wanted = tokens.filter((t) => t.type !== "space" && t.type !== "def");
    let i = 0;
    for (; i < wanted.length; i++) {
      const token = wanted[i];
      const old = this.blocks[i];
      if (old && old.raw === token.raw) continue;
      const node = document.createElement("div");
      node.className = "md-block";
      node.appendChild(renderTokens([token], tokens.links));
      if (old) old.node.replaceWith(node);
      else this.element.appendChild(node);
      this.blocks[i] = { raw: token.raw, node };
    }
    for (const stale of this.blocks.splice(i)) stale.node.remove();
  }
}

// A whole source at once (stored messages).
export function renderMarkdown(element, source) {
  element.textContent = "";
  new MarkdownView(element).update(source);
}
