// Small UTF-8 helpers shared by the tokenizer and the chat formatter.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace gemstage::utf8 {

// Length in bytes of the well-formed sequence starting at s[pos], or 0 if it is not well formed
// (truncated, overlong, surrogate, above U+10FFFF, stray continuation byte).
size_t sequence_length(std::string_view s, size_t pos);

// Byte offset of the first ill-formed sequence, or npos when the whole string is valid.
size_t find_invalid(std::string_view s);

// The text a run of raw bytes reads as, by Hugging Face's byte-fallback rule: the run itself when
// it is well-formed UTF-8, else one U+FFFD per byte of the whole run. Decoded text and the text of
// a logprob's token both follow it, so the two never disagree.
std::string byte_run_text(std::string_view bytes);

// Code point at s[pos]; s must be valid there.
char32_t decode_at(std::string_view s, size_t pos, size_t* length = nullptr);
// Start of the code point that ends right before pos (pos > 0, s valid).
size_t previous_start(std::string_view s, size_t pos);

void append(std::string& out, char32_t cp);

// Unicode White_Space, the set Rust's `\s` (and so HF tokenizers) uses.
bool is_whitespace(char32_t cp);
// Approximates Rust's Unicode `\w`: ASCII letters, digits and '_' exactly; every non-ASCII code
// point that is not whitespace and not in the General Punctuation or CJK punctuation blocks
// counts as a word character.
bool is_word_char(char32_t cp);

// Strips whitespace on both ends exactly like Jinja's `trim` (Python str.strip()).
std::string_view trim(std::string_view s);

}  // namespace gemstage::utf8
