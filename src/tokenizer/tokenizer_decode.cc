// Decoding: the decoder steps, the bytes one token adds, and the streaming decoder.
#include <algorithm>
#include <array>
#include <bit>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "core/error.h"
#include "io/mapped_file.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/tokenizer_impl.h"
#include "tokenizer/utf8.h"

namespace gemstage {

using nlohmann::json;
using namespace tokenizer_internal;

std::string TokenizerImpl::run_decoder(std::vector<std::string> tokens) const {
  if (!has_decoder) {
    // HF joins undecoded tokens with spaces.
    std::string out;
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (i) out.push_back(' ');
      out += tokens[i];
    }
    return out;
  }
  for (const DecoderOp& op : decoder) {
    switch (op.kind) {
      case DecoderOp::kReplace:
        for (std::string& t : tokens) replace_all(t, op.pattern, op.content);
        break;
      case DecoderOp::kByteFallback: {
        std::vector<std::string> out;
        out.reserve(tokens.size());
        std::string bytes;
        const auto flush = [&] {
          if (bytes.empty()) return;
          out.push_back(utf8::byte_run_text(bytes));
          bytes.clear();
        };
        for (std::string& t : tokens) {
          unsigned char b = 0;
          if (is_byte_token(t, &b)) {
            bytes.push_back(static_cast<char>(b));
          } else {
            flush();
            out.push_back(std::move(t));
          }
        }
        flush();
        tokens.swap(out);
        break;
      }
      case DecoderOp::kFuse: {
        std::string all;
        for (const std::string& t : tokens) all += t;
        tokens.assign(1, std::move(all));
        break;
      }
      case DecoderOp::kStrip: {
        const std::string& c = op.content;
        for (std::string& t : tokens) {
          size_t begin = 0, end = t.size();
          for (size_t i = 0; i < op.strip_start && end - begin >= c.size(); ++i) {
            if (t.compare(begin, c.size(), c) != 0) break;
            begin += c.size();
          }
          for (size_t i = 0; i < op.strip_stop && end - begin >= c.size(); ++i) {
            if (t.compare(end - c.size(), c.size(), c) != 0) break;
            end -= c.size();
          }
          t = t.substr(begin, end - begin);
        }
        break;
      }
    }
  }
  std::string out;
  for (const std::string& t : tokens) out += t;
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  const TokenizerImpl& impl = *impl_;
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (const int32_t id : ids) {
    const std::string& t = id_to_token(id);
    if (skip_special && impl.id_special[static_cast<size_t>(id)]) continue;
    tokens.push_back(t);
  }
  return impl.run_decoder(std::move(tokens));
}

std::string Tokenizer::token_bytes(int32_t id) const {
  const TokenizerImpl& impl = *impl_;
  std::string t = id_to_token(id);
  if (!impl.has_decoder) return t;
  for (const DecoderOp& op : impl.decoder) {
    if (op.kind == DecoderOp::kReplace) {
      replace_all(t, op.pattern, op.content);
    } else if (op.kind == DecoderOp::kByteFallback) {
      unsigned char b = 0;
      if (is_byte_token(t, &b)) t.assign(1, static_cast<char>(b));
    }
  }
  return t;
}

StreamDecoder::StreamDecoder(const Tokenizer& tokenizer, bool skip_special)
    : tokenizer_(tokenizer), skip_special_(skip_special) {}

void StreamDecoder::reset() {
  ids_.clear();
  read_begin_ = 0;
}

std::string StreamDecoder::push(int32_t id) {
  tokenizer_.id_to_token(id);  // reject a bad id now, not at some later push
  ids_.push_back(id);
  std::string piece = pending_text();
  if (piece.empty() || piece.ends_with("\xEF\xBF\xBD")) return {};  // maybe an unfinished sequence
  // The ids just emitted stay as context for the next decode; older ones are no longer needed.
  ids_.erase(ids_.begin(), ids_.begin() + static_cast<ptrdiff_t>(read_begin_));
  read_begin_ = ids_.size();
  return piece;
}

std::string StreamDecoder::flush() {
  std::string piece = pending_text();
  reset();
  return piece;
}

std::string StreamDecoder::pending_text() const {
  const std::span<const int32_t> all(ids_);
  const std::string prefix = tokenizer_.decode(all.subspan(0, read_begin_), skip_special_);
  const std::string text = tokenizer_.decode(all, skip_special_);
  if (text.compare(0, prefix.size(), prefix) == 0) return text.substr(prefix.size());
  // New bytes turned an already emitted byte run ill-formed; what was emitted stands, so decode
  // the new ids on their own.
  return tokenizer_.decode(all.subspan(read_begin_), skip_special_);
}

}  // namespace gemstage
