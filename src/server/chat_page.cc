#include "server/chat_page.h"

namespace gemstage::server {

namespace {

#if GEMSTAGE_CHAT_PAGE
// The bundled page as one string literal, written by web/build.mjs at build time. It is far
// longer than the 65536 characters the standard asks every compiler to take (GCC and Clang take
// any length), hence the one warning switched off around it.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Woverlength-strings"
constexpr char kPage[] =
#include "chat_page.html.inc"
    ;
#pragma GCC diagnostic pop
#else
// A build configured with GEMSTAGE_CHAT_PAGE=OFF (no Node.js to bundle web/): the API works as
// ever; the page says where it went.
constexpr char kPage[] = R"PAGE(<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>gemstage</title>
<meta name="viewport" content="width=device-width, initial-scale=1"></head>
<body style="font: 15px/1.5 system-ui, sans-serif; max-width: 40em; margin: 2em auto; padding: 0 1em">
<h1>gemstage serve</h1>
<p>This build has no chat page: it was configured with <code>-DGEMSTAGE_CHAT_PAGE=OFF</code>
(bundling the page needs Node.js; see docs/chat-page.md).</p>
<p>The API is here: <code>POST /v1/chat/completions</code>, <code>POST /v1/completions</code>,
<code>POST /v1/responses</code>, <code>POST /v1/messages</code>, <code>GET /v1/models</code>,
<code>GET /health</code>, <code>GET /metrics</code>.</p>
</body></html>
)PAGE";
#endif

}  // namespace

std::string_view chat_page_html() {
  return {kPage, sizeof kPage - 1};
}

}  // namespace gemstage::server
