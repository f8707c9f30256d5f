#include "tokenizer/utf8.h"

namespace gemstage::utf8 {

size_t sequence_length(std::string_view s, size_t pos) {
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  const unsigned char b0 = byte(pos);
  if (b0 < 0x80) return 1;
  size_t n = 0;
  char32_t min = 0;
  char32_t cp = 0;
  if ((b0 & 0xE0) == 0xC0) {
    n = 2, min = 0x80, cp = b0 & 0x1F;
  } else if ((b0 & 0xF0) == 0xE0) {
    n = 3, min = 0x800, cp = b0 & 0x0F;
  } else if ((b0 & 0xF8) == 0xF0) {
    n = 4, min = 0x10000, cp = b0 & 0x07;
  } else {
    return 0;
  }
  if (pos + n > s.size()) return 0;
  for (size_t i = 1; i < n; ++i) {
    const unsigned char b = byte(pos + i);
    if ((b & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (b & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  return n;
}

size_t find_invalid(std::string_view s) {
  size_t pos = 0;
  while (pos < s.size()) {
    if (static_cast<unsigned char>(s[pos]) < 0x80) {
      ++pos;
      continue;
    }
    const size_t n = sequence_length(s, pos);
    if (n == 0) return pos;
    pos += n;
  }
  return std::string_view::npos;
}

char32_t decode_at(std::string_view s, size_t pos, size_t* length) {
  const unsigned char b0 = static_cast<unsigned char>(s[pos]);
  size_t n = 1;
  char32_t cp = b0;
  if (b0 >= 0xF0) {
    n = 4, cp = b0 & 0x07;
  } else if (b0 >= 0xE0) {
    n = 3, cp = b0 & 0x0F;
  } else if (b0 >= 0xC0) {
    n = 2, cp = b0 & 0x1F;
  }
  for (size_t i = 1; i < n && pos + i < s.size(); ++i)
    cp = (cp << 6) | (static_cast<unsigned char>(s[pos + i]) & 0x3F);
  if (length) *length = n;
  return cp;
}

size_t previous_start(std::string_view s, size_t pos) {
  size_t i = pos - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  return i;
}

void append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

bool is_whitespace(char32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

bool is_word_char(char32_t cp) {
  if (cp < 0x80)
    return (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') || (cp >= '0' && cp <= '9') ||
           cp == '_';
  if (is_whitespace(cp)) return false;
  if (cp >= 0x2000 && cp <= 0x206F) return false;  // General Punctuation
  if (cp >= 0x3000 && cp <= 0x303F) return false;  // CJK Symbols and Punctuation
  if (cp >= 0xA0 && cp <= 0xBF) return false;      // Latin-1 punctuation and symbols
  return true;
}

// Python's str.isspace() (what Jinja's trim uses) adds the four information separators.
static bool is_python_space(char32_t cp) {
  return is_whitespace(cp) || (cp >= 0x1C && cp <= 0x1F);
}

std::string_view trim(std::string_view s) {
  size_t begin = 0;
  while (begin < s.size()) {
    size_t n = 0;
    const char32_t cp = decode_at(s, begin, &n);
    if (!is_python_space(cp)) break;
    begin += n;
  }
  size_t end = s.size();
  while (end > begin) {
    const size_t start = previous_start(s, end);
    if (!is_python_space(decode_at(s, start))) break;
    end = start;
  }
  return s.substr(begin, end - begin);
}

std::string byte_run_text(std::string_view bytes) {
  if (find_invalid(bytes) == std::string_view::npos) return std::string(bytes);
  std::string out;
  out.reserve(bytes.size() * 3);
  for (size_t i = 0; i < bytes.size(); ++i) out += "\xEF\xBF\xBD";
  return out;
}

}  // namespace gemstage::utf8
