// The chat page `gemstage serve` answers GET / with: one self-contained HTML document (inline
// CSS and JS, no external assets, no build step) that talks to /v1/chat/completions.
#pragma once

#include <string_view>

namespace gemstage::server {

std::string_view chat_page_html();

}  // namespace gemstage::server
