// The chat page `gemstage serve` answers GET / with: one self-contained HTML document (its
// script, styles, fonts and libraries inline; nothing fetched from elsewhere) that talks to
// /v1/chat/completions, /v1/models and /health. Its source is web/ at the repository root,
// bundled into the binary at build time (src/server/CMakeLists.txt, docs/chat-page.md).
#pragma once

#include <string_view>

namespace gemstage::server {

std::string_view chat_page_html();

}  // namespace gemstage::server
