// Encoding: added tokens, the normalizer, the pre-tokenizer's splits and byte-fallback BPE
// with its word cache; the lookups of ids and names.
#include "tokenizer/tokenizer.h"

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
#include "tokenizer/tokenizer_impl.h"
#include "tokenizer/utf8.h"

namespace gemstage {

using nlohmann::json;
using namespace tokenizer_internal;

std::string TokenizerImpl::normalize(std::string_view text) const {
  std::string s(text);
  for (const NormalizerOp& op : normalizer) {
    switch (op.kind) {
      case NormalizerOp::kReplace:
        replace_all(s, op.pattern, op.content);
        break;
      case NormalizerOp::kPrepend:
        if (!s.empty()) s.insert(0, op.content);
        break;
      case NormalizerOp::kNfcTrivial:
        // Below U+0300 nothing composes or decomposes, so NFC is the identity there. Anything
        // else would need the Unicode composition tables, which this build does not carry.
        for (size_t pos = 0; pos < s.size();) {
          size_t n = 0;
          if (utf8::decode_at(s, pos, &n) >= 0x300)
            fail(path,
                 ": the NFC normalizer is only implemented for text below U+0300, and the "
                 "input contains a character at or above it");
          pos += n;
        }
        break;
    }
  }
  return s;
}

void TokenizerImpl::split_added(std::string_view text, const AddedTokenTrie& trie,
                                bool parse_special, std::vector<Segment>& out) const {
  size_t emitted = 0;  // end of the last segment pushed
  const auto allowed = [&](int32_t t) { return parse_special || !added[t].special; };
  size_t pos = 0;
  while (pos < text.size()) {
    if (trie.empty() || !trie.may_start(static_cast<unsigned char>(text[pos]))) {
      ++pos;
      continue;
    }
    const auto [token, length] = trie.longest_at(text, pos, allowed);
    if (token < 0) {
      ++pos;
      continue;
    }
    const AddedToken& t = added[token];
    size_t start = pos, stop = pos + length;
    pos = stop;
    if (t.single_word) {
      const bool word_before =
          start > 0 && utf8::is_word_char(utf8::decode_at(text, utf8::previous_start(text, start)));
      const bool word_after = stop < text.size() && utf8::is_word_char(utf8::decode_at(text, stop));
      if (word_before || word_after) continue;
    }
    if (t.lstrip)
      while (start > emitted) {
        const size_t prev = utf8::previous_start(text, start);
        if (!utf8::is_whitespace(utf8::decode_at(text, prev))) break;
        start = prev;
      }
    if (t.rstrip)
      while (stop < text.size()) {
        size_t n = 0;
        if (!utf8::is_whitespace(utf8::decode_at(text, stop, &n))) break;
        stop += n;
      }
    if (start > emitted) out.push_back({emitted, start, -1});
    out.push_back({start, stop, token});
    emitted = pos = stop;
  }
  if (emitted < text.size()) out.push_back({emitted, text.size(), -1});
}

void TokenizerImpl::pre_tokenize(std::string_view text, std::vector<std::string_view>& out) const {
  std::vector<std::string_view> pieces{text}, next;
  for (const PreTokenizerOp& op : pre_tokenizer) {
    next.clear();
    for (std::string_view piece : pieces) {
      // (begin, end, is_match) runs covering the piece.
      std::vector<std::tuple<size_t, size_t, bool>> runs;
      size_t pos = 0;
      for (size_t hit; (hit = piece.find(op.pattern, pos)) != std::string_view::npos;
           pos = hit + op.pattern.size()) {
        if (hit > pos) runs.emplace_back(pos, hit, false);
        runs.emplace_back(hit, hit + op.pattern.size(), true);
      }
      if (pos < piece.size()) runs.emplace_back(pos, piece.size(), false);

      std::vector<std::pair<size_t, size_t>> spans;
      switch (op.behavior) {
        case SplitBehavior::kRemoved:
          for (auto [b, e, m] : runs)
            if (!m) spans.emplace_back(b, e);
          break;
        case SplitBehavior::kIsolated:
          for (auto [b, e, m] : runs) spans.emplace_back(b, e);
          break;
        case SplitBehavior::kContiguous: {
          bool prev_match = false;
          for (auto [b, e, m] : runs) {
            if (m && prev_match)
              spans.back().second = e;
            else
              spans.emplace_back(b, e);
            prev_match = m;
          }
          break;
        }
        case SplitBehavior::kMergedWithPrevious: {
          bool prev_match = false;
          for (auto [b, e, m] : runs) {
            if (m && !prev_match && !spans.empty())
              spans.back().second = e;
            else
              spans.emplace_back(b, e);
            prev_match = m;
          }
          break;
        }
        case SplitBehavior::kMergedWithNext: {
          bool prev_match = false;
          std::vector<std::pair<size_t, size_t>> reversed;
          for (auto it = runs.rbegin(); it != runs.rend(); ++it) {
            auto [b, e, m] = *it;
            if (m && !prev_match && !reversed.empty())
              reversed.back().first = b;
            else
              reversed.emplace_back(b, e);
            prev_match = m;
          }
          spans.assign(reversed.rbegin(), reversed.rend());
          break;
        }
      }
      for (auto [b, e] : spans)
        if (e > b) next.push_back(piece.substr(b, e - b));
    }
    pieces.swap(next);
  }
  out.insert(out.end(), pieces.begin(), pieces.end());
}

void TokenizerImpl::bpe_word(std::string_view word, std::vector<int32_t>& ids) const {
  if (word.size() > kCacheMaxWordBytes) return bpe_uncached(word, ids);
  std::string key(word);
  {
    std::lock_guard<std::mutex> lock(cache_mutex);
    if (auto it = cache.find(key); it != cache.end()) {
      ids.insert(ids.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = ids.size();
  bpe_uncached(word, ids);
  std::lock_guard<std::mutex> lock(cache_mutex);
  if (cache.size() >= kCacheLimit) cache.clear();
  cache.emplace(std::move(key),
                std::vector<int32_t>(ids.begin() + static_cast<ptrdiff_t>(first), ids.end()));
}

void TokenizerImpl::bpe_uncached(std::string_view word, std::vector<int32_t>& ids) const {
  if (ignore_merges)
    if (const int32_t whole = vocab.find(word); whole >= 0) {
      ids.push_back(whole);
      return;
    }

  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
    bool alive;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  bool last_is_unk = false;
  const auto push = [&](int32_t id) {
    const auto index = static_cast<int32_t>(symbols.size());
    symbols.push_back({id, index - 1, index + 1, true});
  };
  for (size_t pos = 0; pos < word.size();) {
    const size_t n = utf8::sequence_length(word, pos);
    const std::string_view ch = word.substr(pos, n);
    pos += n;
    if (const int32_t single = vocab.find(ch); single >= 0) {
      push(single);
      last_is_unk = false;
      continue;
    }
    if (byte_fallback) {
      bool all = true;
      for (const char c : ch) all = all && byte_ids[static_cast<unsigned char>(c)] >= 0;
      if (all) {
        for (const char c : ch) push(byte_ids[static_cast<unsigned char>(c)]);
        last_is_unk = false;
        continue;
      }
    }
    if (!model_unk)
      fail(path, ": the text contains \"", ch,
           "\", which is not in the vocabulary, and model.unk_token is not set");
    if (!(fuse_unk && last_is_unk)) push(*model_unk);
    last_is_unk = true;
  }
  if (symbols.empty()) return;
  symbols.back().next = -1;

  struct Candidate {
    int32_t rank;
    int32_t pos;
    int32_t merged;
    int32_t left_id;  // the pair when queued, to validate without a table probe
    int32_t right_id;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::vector<Candidate> storage;
  storage.reserve(symbols.size() * 2);
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue(
      std::greater<Candidate>(), std::move(storage));
  const auto consider = [&](int32_t left) {
    const int32_t right = symbols[left].next;
    if (right < 0) return;
    if (const MergeTable::Entry* e = merges.find(symbols[left].id, symbols[right].id))
      queue.push({e->rank, left, e->merged, symbols[left].id, symbols[right].id});
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols.size()); ++i) consider(i);

  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.pos];
    if (!left.alive || left.next < 0) continue;
    Symbol& right = symbols[left.next];
    // One side may have been merged into something else since this was queued. Like HF, the
    // entry still applies if the pair there now merges to the same token.
    if (left.id != top.left_id || right.id != top.right_id) {
      const MergeTable::Entry* e = merges.find(left.id, right.id);
      if (!e || e->merged != top.merged) continue;
    }
    left.id = top.merged;
    right.alive = false;
    left.next = right.next;
    if (left.next >= 0) symbols[left.next].prev = top.pos;
    if (left.prev >= 0) consider(left.prev);
    consider(top.pos);
  }
  for (int32_t i = 0; i >= 0; i = symbols[i].next) ids.push_back(symbols[i].id);
}

void TokenizerImpl::encode_plain(std::string_view text, bool parse_special,
                                 std::vector<int32_t>& ids) const {
  const std::string normalized = normalize(text);
  std::vector<Segment> segments;
  if (normalized_trie.empty())
    segments.push_back({0, normalized.size(), -1});
  else
    split_added(normalized, normalized_trie, parse_special, segments);
  std::vector<std::string_view> words;
  for (const Segment& seg : segments) {
    if (seg.token >= 0) {
      ids.push_back(added[seg.token].id);
      continue;
    }
    words.clear();
    pre_tokenize(std::string_view(normalized).substr(seg.begin, seg.end - seg.begin), words);
    for (std::string_view w : words) bpe_word(w, ids);
  }
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special,
                                       bool parse_special) const {
  const TokenizerImpl& impl = *impl_;
  if (const size_t bad = utf8::find_invalid(text); bad != std::string_view::npos)
    fail("tokenizer input is not valid UTF-8 (first bad byte at offset ", bad,
         "); convert the text to UTF-8 first");
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  if (add_special) ids.insert(ids.end(), impl.prefix.begin(), impl.prefix.end());
  std::vector<Segment> segments;
  if (impl.raw_trie.empty())
    segments.push_back({0, text.size(), -1});
  else
    impl.split_added(text, impl.raw_trie, parse_special, segments);
  for (const Segment& seg : segments) {
    if (seg.token >= 0)
      ids.push_back(impl.added[seg.token].id);
    else
      impl.encode_plain(text.substr(seg.begin, seg.end - seg.begin), parse_special, ids);
  }
  if (add_special) ids.insert(ids.end(), impl.suffix.begin(), impl.suffix.end());
  return ids;
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  return impl_->lookup(token);
}

int32_t Tokenizer::require_id(std::string_view token) const {
  if (auto id = impl_->lookup(token)) return *id;
  fail(impl_->path, ": has no token \"", token,
       "\"; this tokenizer does not belong to a Gemma 4 model");
}

bool Tokenizer::has_id(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->id_to_token.size() &&
         impl_->id_known[static_cast<size_t>(id)];
}

const std::string& Tokenizer::id_to_token(int32_t id) const {
  const TokenizerImpl& impl = *impl_;
  if (id < 0 || static_cast<size_t>(id) >= impl.id_to_token.size() ||
      !impl.id_known[static_cast<size_t>(id)])
    fail("token id ", id, " is not in the vocabulary of ", impl.path, " (", vocab_size(), " ids)");
  return impl.id_to_token[static_cast<size_t>(id)];
}

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->id_special.size() &&
         impl_->id_special[static_cast<size_t>(id)];
}

size_t Tokenizer::vocab_size() const {
  return impl_->id_to_token.size();
}

const std::vector<AddedToken>& Tokenizer::added_tokens() const {
  return impl_->added;
}

std::optional<int32_t> Tokenizer::bos_id() const {
  return impl_->bos;
}

std::optional<int32_t> Tokenizer::eos_id() const {
  return impl_->eos;
}

std::optional<int32_t> Tokenizer::pad_id() const {
  return impl_->pad;
}

std::optional<int32_t> Tokenizer::unk_id() const {
  return impl_->unk;
}

const std::vector<int32_t>& Tokenizer::special_prefix() const {
  return impl_->prefix;
}

const std::vector<int32_t>& Tokenizer::special_suffix() const {
  return impl_->suffix;
}

const std::string& Tokenizer::source_path() const {
  return impl_->path;
}

}  // namespace gemstage
