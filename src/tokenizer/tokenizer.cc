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
#include "tokenizer/utf8.h"

namespace gemstage {

using nlohmann::json;

namespace {

// ---------------------------------------------------------------------------------------------
// Streaming read of tokenizer.json. The vocabulary (262k entries) and merges (515k pairs) are
// collected straight into flat vectors; a DOM of them alone costs more than the whole load budget.
// Everything else is small and kept as a json DOM.

struct RawTokenizerFile {
  json rest;  // the document without model.vocab and model.merges
  std::vector<std::pair<std::string, int64_t>> vocab;
  bool has_vocab = false;
  bool has_merges = false;
  size_t merge_count = 0;
  // Called once model.vocab is complete, and for each merge in file order; merges that precede
  // the vocabulary in the file are buffered by the receiver.
  std::function<void()> on_vocab_end;
  std::function<void(std::string_view, std::string_view)> on_merge;
};

class TokenizerSax : public nlohmann::json_sax<json> {
 public:
  TokenizerSax(RawTokenizerFile& out, const std::string& path) : out_(out), path_(path) {}

  bool null() override { return value(json(nullptr)); }
  bool boolean(bool v) override { return value(json(v)); }
  bool number_integer(number_integer_t v) override {
    if (mode_ == Mode::kVocab) return vocab_entry(v);
    return value(json(v));
  }
  bool number_unsigned(number_unsigned_t v) override {
    if (mode_ == Mode::kVocab) {
      if (v > static_cast<number_unsigned_t>(INT64_MAX)) return vocab_entry(-1);
      return vocab_entry(static_cast<int64_t>(v));
    }
    return value(json(v));
  }
  bool number_float(number_float_t v, const string_t&) override {
    if (mode_ == Mode::kVocab)
      fail(path_, ": model.vocab[\"", pending_key_, "\"] is not an integer id");
    return value(json(v));
  }
  bool string(string_t& v) override {
    if (mode_ == Mode::kVocab)
      fail(path_, ": model.vocab[\"", pending_key_, "\"] is not an integer id");
    if (mode_ == Mode::kMerges) return merge_string(v);
    return value(json(std::move(v)));
  }
  bool binary(binary_t&) override { return value(json(nullptr)); }

  bool start_object(std::size_t) override {
    if (mode_ == Mode::kMerges) merge_bad();
    if (mode_ == Mode::kVocab)
      fail(path_, ": model.vocab[\"", pending_key_, "\"] is not an integer id");
    if (at_model_member("vocab")) {
      mode_ = Mode::kVocab;
      out_.has_vocab = true;
      keys_.back().clear();
      return true;
    }
    return open(json::object());
  }
  bool end_object() override {
    if (mode_ == Mode::kVocab) {
      mode_ = Mode::kNone;
      out_.on_vocab_end();
      return true;
    }
    return close();
  }
  bool start_array(std::size_t) override {
    if (mode_ == Mode::kVocab)
      fail(path_, ": model.vocab[\"", pending_key_, "\"] is not an integer id");
    if (mode_ == Mode::kMerges) {
      if (merge_depth_ != 0) merge_bad();
      merge_depth_ = 1;
      merge_parts_ = 0;
      return true;
    }
    if (at_model_member("merges")) {
      mode_ = Mode::kMerges;
      out_.has_merges = true;
      merge_depth_ = 0;
      keys_.back().clear();
      return true;
    }
    return open(json::array());
  }
  bool end_array() override {
    if (mode_ == Mode::kMerges) {
      if (merge_depth_ == 1) {
        if (merge_parts_ != 2) merge_bad();
        out_.on_merge(merge_left_, merge_right_);
        ++out_.merge_count;
        merge_parts_ = 0;
        merge_depth_ = 0;
      } else {
        mode_ = Mode::kNone;
      }
      return true;
    }
    return close();
  }
  bool key(string_t& k) override {
    if (mode_ == Mode::kVocab) {
      pending_key_ = std::move(k);
      return true;
    }
    keys_.back() = std::move(k);
    return true;
  }
  bool parse_error(std::size_t position, const std::string&,
                   const nlohmann::detail::exception& ex) override {
    fail(path_, ": not valid JSON (byte ", position, "): ", ex.what(),
         "; expected a Hugging Face tokenizer.json");
  }

 private:
  enum class Mode { kNone, kVocab, kMerges };

  // True when the next value is the direct member `name` of the top-level "model" object.
  bool at_model_member(const char* name) const {
    return stack_.size() == 2 && keys_[0] == "model" && keys_[1] == name && stack_[1]->is_object();
  }
  bool vocab_entry(int64_t id) {
    if (id < 0 || id >= (int64_t{1} << 26))
      fail(path_, ": model.vocab[\"", pending_key_, "\"] has id ", id,
           ", outside [0, 2^26); the file is not a tokenizer vocabulary");
    out_.vocab.emplace_back(std::move(pending_key_), id);
    return true;
  }
  bool merge_string(std::string& s) {
    if (merge_depth_ == 1) {
      if (merge_parts_ == 0)
        std::swap(merge_left_, s);
      else if (merge_parts_ == 1)
        std::swap(merge_right_, s);
      ++merge_parts_;
      return true;
    }
    // Legacy form "left right": exactly one separating space, as HF requires.
    const size_t space = s.find(' ');
    if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos)
      fail(path_, ": model.merges[", out_.merge_count, "] = \"", s,
           "\" is not of the form \"left right\"");
    const std::string_view all(s);
    out_.on_merge(all.substr(0, space), all.substr(space + 1));
    ++out_.merge_count;
    return true;
  }
  [[noreturn]] void merge_bad() {
    fail(path_, ": model.merges[", out_.merge_count,
         "] must be a \"left right\" string or a [left, right] pair of strings");
  }
  bool value(json v) {
    if (stack_.empty()) {
      out_.rest = std::move(v);
      return true;
    }
    json& top = *stack_.back();
    if (top.is_array())
      top.push_back(std::move(v));
    else
      top[keys_.back()] = std::move(v);
    return true;
  }
  bool open(json v) {
    json* slot = nullptr;
    if (stack_.empty()) {
      out_.rest = std::move(v);
      slot = &out_.rest;
    } else {
      json& top = *stack_.back();
      if (top.is_array()) {
        top.push_back(std::move(v));
        slot = &top.back();
      } else {
        slot = &top[keys_.back()];
        *slot = std::move(v);
      }
    }
    stack_.push_back(slot);
    keys_.emplace_back();
    return true;
  }
  bool close() {
    stack_.pop_back();
    keys_.pop_back();
    return true;
  }

  RawTokenizerFile& out_;
  const std::string& path_;
  std::vector<json*> stack_;
  std::vector<std::string> keys_;
  Mode mode_ = Mode::kNone;
  std::string pending_key_;
  int merge_depth_ = 0;
  int merge_parts_ = 0;
  std::string merge_left_, merge_right_;
};

// String -> id map over strings owned elsewhere (stable addresses). Open addressing; each slot
// keeps the full hash and, for the short keys that are nearly all of a vocabulary, a copy of the
// bytes, so a probe costs one cache miss. ~262k entries are built at load and probed for every
// merge (three times) and every character encoded.
class VocabIndex {
 public:
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < n * 2) cap <<= 1;
    slots_.assign(cap, Slot{});
    mask_ = cap - 1;
    size_ = 0;
  }
  // Inserts, or re-points an existing key (the later id wins).
  void assign(const std::string* key, int32_t id) {
    if ((size_ + 1) * 2 > slots_.size()) grow();
    const uint64_t h = hash(*key);
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (!s.key) {
        s.hash = h;
        s.key = key;
        s.id = id;
        s.length = key->size() <= kInline ? static_cast<uint8_t>(key->size()) : kLong;
        if (s.length != kLong) std::memcpy(s.bytes, key->data(), key->size());
        ++size_;
        return;
      }
      if (s.hash == h && equal(s, *key)) {
        s.key = key;
        s.id = id;
        return;
      }
    }
  }
  // Id of the key, or -1.
  int32_t find(std::string_view key) const { return find(key, hash(key)); }
  int32_t find(std::string_view key, uint64_t h) const {
    const Slot* s = slot_of(key, h);
    return s ? s->id : -1;
  }
  // For batched lookups: start fetching the slot a later find(key, h) will read first.
  void prefetch(uint64_t h) const {
    if (!slots_.empty()) __builtin_prefetch(&slots_[h & mask_]);
  }
  // The stored key pointer for key, or nullptr.
  const std::string* stored_key(std::string_view key) const {
    const Slot* s = slot_of(key, hash(key));
    return s ? s->key : nullptr;
  }

 private:
  static constexpr size_t kInline = 11;
  static constexpr uint8_t kLong = 255;
  struct Slot {
    uint64_t hash = 0;
    const std::string* key = nullptr;
    int32_t id = -1;
    uint8_t length = 0;  // bytes held inline, or kLong
    char bytes[kInline] = {};
  };
  static bool equal(const Slot& s, std::string_view key) {
    if (s.length == kLong) return *s.key == key;
    return s.length == key.size() && std::memcmp(s.bytes, key.data(), key.size()) == 0;
  }
  const Slot* slot_of(std::string_view key, uint64_t h) const {
    if (slots_.empty()) return nullptr;
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (!s.key) return nullptr;
      if (s.hash == h && equal(s, key)) return &s;
    }
  }

 public:
  static uint64_t hash(std::string_view s) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (s.size() * 0xC2B2AE3D27D4EB4Full);
    size_t i = 0;
    for (; i + 8 <= s.size(); i += 8) {
      uint64_t chunk;
      std::memcpy(&chunk, s.data() + i, 8);
      h = std::rotl(h ^ (chunk * 0x87C37B91114253D5ull), 31) * 0x4CF5AD432745937Full;
    }
    uint64_t tail = 0;
    if (i < s.size()) std::memcpy(&tail, s.data() + i, s.size() - i);
    h ^= tail * 0x87C37B91114253D5ull;
    // murmur3 fmix64: every input bit reaches the low bits used for the slot index.
    h ^= h >> 33;
    h *= 0xFF51AFD7ED558CCDull;
    h ^= h >> 33;
    h *= 0xC4CEB9FE1A85EC53ull;
    h ^= h >> 33;
    return h;
  }

 private:
  void grow() {
    std::vector<Slot> old = std::move(slots_);
    reserve(std::max<size_t>(16, old.size()));
    for (const Slot& s : old)
      if (s.key) assign(s.key, s.id);
  }
  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

// Open-addressing map from a (left id, right id) pair to its merge; ~515k entries are probed in
// the innermost BPE loop, where std::unordered_map's node chasing is measurably slower.
class MergeTable {
 public:
  struct Entry {
    uint64_t key = kEmpty;
    int32_t rank = 0;
    int32_t merged = 0;
  };
  static constexpr uint64_t kEmpty = ~uint64_t{0};

  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < n * 2) cap <<= 1;
    slots_.assign(cap, Entry{});
    mask_ = cap - 1;
    size_ = 0;
  }
  // Later merges with the same pair replace earlier ones, as a HashMap collect does in HF.
  void insert(int32_t left, int32_t right, int32_t rank, int32_t merged) {
    if ((size_ + 1) * 2 > slots_.size()) grow();
    const uint64_t key = pack(left, right);
    for (size_t i = hash(key);; i = (i + 1) & mask_) {
      Entry& e = slots_[i];
      if (e.key == kEmpty || e.key == key) {
        size_ += e.key == kEmpty;
        e = Entry{key, rank, merged};
        return;
      }
    }
  }
  const Entry* find(int32_t left, int32_t right) const {
    if (slots_.empty()) return nullptr;
    const uint64_t key = pack(left, right);
    for (size_t i = hash(key);; i = (i + 1) & mask_) {
      const Entry& e = slots_[i];
      if (e.key == key) return &e;
      if (e.key == kEmpty) return nullptr;
    }
  }

 private:
  static uint64_t pack(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  size_t hash(uint64_t key) const {
    return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> 29) & mask_;
  }
  void grow() {
    std::vector<Entry> old = std::move(slots_);
    reserve(std::max<size_t>(1 << 16, old.size()));
    size_ = 0;
    for (const Entry& e : old)
      if (e.key != kEmpty)
        insert(static_cast<int32_t>(e.key >> 32), static_cast<int32_t>(e.key & 0xFFFFFFFFu), e.rank,
               e.merged);
  }
  std::vector<Entry> slots_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

struct NormalizerOp {
  enum Kind { kReplace, kPrepend, kNfcTrivial } kind;
  std::string pattern;
  std::string content;
};

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct PreTokenizerOp {
  std::string pattern;
  SplitBehavior behavior;
};

struct DecoderOp {
  enum Kind { kReplace, kByteFallback, kFuse, kStrip } kind;
  std::string pattern;
  std::string content;
  size_t strip_start = 0;
  size_t strip_stop = 0;
};

// Byte trie over added-token contents; finds the longest token starting at a position.
class AddedTokenTrie {
 public:
  void insert(std::string_view content, int32_t token_index) {
    if (content.empty()) return;
    if (nodes_.empty()) nodes_.emplace_back();
    first_byte_[static_cast<unsigned char>(content[0])] = true;
    int32_t node = 0;
    for (const char c : content) {
      const auto byte = static_cast<unsigned char>(c);
      int32_t next = child(node, byte);
      if (next < 0) {
        next = static_cast<int32_t>(nodes_.size());
        nodes_.emplace_back();
        nodes_[node].children.emplace_back(byte, next);
      }
      node = next;
    }
    nodes_[node].token = token_index;
  }
  bool empty() const { return nodes_.empty(); }
  bool may_start(unsigned char byte) const { return first_byte_[byte]; }

  // Longest allowed match at text[pos]: returns (token index, length) or (-1, 0).
  template <typename Allowed>
  std::pair<int32_t, size_t> longest_at(std::string_view text, size_t pos, Allowed allowed) const {
    std::pair<int32_t, size_t> best{-1, 0};
    int32_t node = 0;
    for (size_t j = pos; j < text.size(); ++j) {
      node = child(node, static_cast<unsigned char>(text[j]));
      if (node < 0) break;
      const int32_t t = nodes_[node].token;
      if (t >= 0 && allowed(t)) best = {t, j + 1 - pos};
    }
    return best;
  }

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> children;
    int32_t token = -1;
  };
  int32_t child(int32_t node, unsigned char byte) const {
    for (const auto& [b, next] : nodes_[node].children)
      if (b == byte) return next;
    return -1;
  }
  std::vector<Node> nodes_;
  std::array<bool, 256> first_byte_{};
};

// A run of text that is either an added token (token >= 0) or plain text [begin, end).
struct Segment {
  size_t begin;
  size_t end;
  int32_t token;  // index into TokenizerImpl::added, or -1
};

std::string json_brief(const json& j) {
  std::string s = j.dump();
  if (s.size() > 200) s = s.substr(0, 200) + "...";
  return s;
}

std::string token_name(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string())
    return v["content"].get<std::string>();
  return {};
}

void replace_all(std::string& s, std::string_view pattern, std::string_view content) {
  if (pattern.empty() || s.find(pattern) == std::string::npos) return;
  std::string out;
  out.reserve(s.size() + s.size() / 4);
  size_t pos = 0;
  for (size_t hit; (hit = s.find(pattern, pos)) != std::string::npos; pos = hit + pattern.size()) {
    out.append(s, pos, hit - pos);
    out.append(content);
  }
  out.append(s, pos, std::string::npos);
  s = std::move(out);
}

bool is_byte_token(std::string_view t, unsigned char* byte) {
  if (t.size() != 6 || t.substr(0, 3) != "<0x" || t[5] != '>') return false;
  unsigned value = 0;
  for (size_t i = 3; i < 5; ++i) {
    const char c = t[i];
    value <<= 4;
    if (c >= '0' && c <= '9')
      value |= static_cast<unsigned>(c - '0');
    else if (c >= 'A' && c <= 'F')
      value |= static_cast<unsigned>(c - 'A' + 10);
    else if (c >= 'a' && c <= 'f')
      value |= static_cast<unsigned>(c - 'a' + 10);
    else
      return false;
  }
  *byte = static_cast<unsigned char>(value);
  return true;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

struct TokenizerImpl {
  std::string path;
  // A deque: growing it (added tokens past the vocabulary) must not move the strings the vocab
  // map keys point into.
  std::deque<std::string> id_to_token;
  std::vector<uint8_t> id_known;    // id_to_token[id] names a token
  std::vector<uint8_t> id_special;  // id is an added token flagged special
  // Model vocabulary; keys point into id_to_token, or into shadowed_vocab for the rare entry
  // whose id an added token with different text took over.
  VocabIndex vocab;
  std::deque<std::string> shadowed_vocab;
  std::unordered_map<std::string, int32_t> added_by_content;
  std::vector<AddedToken> added;
  AddedTokenTrie raw_trie;         // added tokens with normalized=false, matched on the input
  AddedTokenTrie normalized_trie;  // normalized=true ones, matched after normalization
  std::vector<NormalizerOp> normalizer;
  std::vector<PreTokenizerOp> pre_tokenizer;
  bool has_decoder = false;
  std::vector<DecoderOp> decoder;

  // BPE model
  MergeTable merges;
  std::array<int32_t, 256> byte_ids{};
  bool byte_fallback = false;
  bool fuse_unk = false;
  bool ignore_merges = false;
  std::optional<int32_t> model_unk;

  std::vector<int32_t> prefix, suffix;
  std::optional<int32_t> bos, eos, pad, unk;

  // Word cache: BPE of a pre-token depends only on its bytes. Its cap bounds what a server
  // holds for it: an entry is ~350 bytes, so 16384 words are ~6 MB. At 65536 the 30-minute serve
  // soak, whose every prompt has a new number in it, saw RSS climb ~20 MB as the cache filled.
  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache;
  static constexpr size_t kCacheLimit = 1 << 14;
  static constexpr size_t kCacheMaxWordBytes = 256;

  std::optional<int32_t> lookup(std::string_view token) const {
    if (auto it = added_by_content.find(std::string(token)); it != added_by_content.end())
      return it->second;
    if (const int32_t v = vocab.find(token); v >= 0) return v;
    return std::nullopt;
  }

  void set_token(int32_t id, std::string content) {
    const auto index = static_cast<size_t>(id);
    if (index >= id_to_token.size()) {
      id_to_token.resize(index + 1);
      id_known.resize(index + 1, 0);
      id_special.resize(index + 1, 0);
    }
    id_to_token[index] = std::move(content);
    id_known[index] = 1;
  }

  // Loading state: the vocabulary usually precedes the merges in the file, so merges are resolved
  // to ids while the file streams by.
  bool vocab_loaded = false;
  size_t merge_count = 0;
  std::vector<std::pair<std::string, std::string>> early_merges;
  struct PendingMerge {
    std::string joined;  // left + right
    size_t left_size = 0;
  };
  static constexpr size_t kMergeBatch = 256;
  std::vector<PendingMerge> merge_batch = std::vector<PendingMerge>(kMergeBatch);
  size_t merge_batch_size = 0;

  void load_vocab(RawTokenizerFile& raw);
  void add_merge(std::string_view left, std::string_view right);
  void flush_merges();
  void build(RawTokenizerFile& raw);
  void parse_normalizer(const json& j);
  void parse_pre_tokenizer(const json& j);
  void parse_decoder(const json& j);
  void parse_post_processor(const json& j);
  void add_added_token(AddedToken t);
  void rebuild_tries();

  std::string normalize(std::string_view text) const;
  void split_added(std::string_view text, const AddedTokenTrie& trie, bool parse_special,
                   std::vector<Segment>& out) const;
  void pre_tokenize(std::string_view text, std::vector<std::string_view>& out) const;
  void encode_plain(std::string_view normalized, bool parse_special,
                    std::vector<int32_t>& ids) const;
  void bpe_word(std::string_view word, std::vector<int32_t>& ids) const;
  void bpe_uncached(std::string_view word, std::vector<int32_t>& ids) const;
  std::string run_decoder(std::vector<std::string> tokens) const;
};

void TokenizerImpl::load_vocab(RawTokenizerFile& raw) {
  int64_t max_id = -1;
  for (const auto& [tok, id] : raw.vocab) max_id = std::max(max_id, id);
  if (max_id < 0) return;
  id_to_token.assign(static_cast<size_t>(max_id + 1), std::string());
  id_known.assign(id_to_token.size(), 0);
  id_special.assign(id_to_token.size(), 0);
  vocab.reserve(raw.vocab.size());
  for (auto& [tok, id] : raw.vocab) {
    const auto index = static_cast<size_t>(id);
    if (id_known[index])
      fail(path, ": model.vocab gives id ", id, " to both \"", id_to_token[index], "\" and \"", tok,
           "\"");
    id_to_token[index] = std::move(tok);
    id_known[index] = 1;
    // In file order: a string listed twice keeps its later id, as a JSON object read into a map
    // does in HF.
    vocab.assign(&id_to_token[index], static_cast<int32_t>(id));
  }
  raw.vocab = {};
  vocab_loaded = true;
  // Gemma has about two merges per vocabulary entry; reserving avoids most rehashing.
  merges.reserve(id_to_token.size() * 2);
}

void TokenizerImpl::add_merge(std::string_view left, std::string_view right) {
  if (!vocab_loaded) {
    early_merges.emplace_back(left, right);
    return;
  }
  if (merge_batch_size == merge_batch.size()) flush_merges();
  PendingMerge& m = merge_batch[merge_batch_size++];
  m.joined.assign(left).append(right);
  m.left_size = left.size();
}

// Resolving a merge is three vocabulary probes, each a likely cache miss; a batch lets the
// prefetches of all of them overlap instead of paying the misses one after another.
void TokenizerImpl::flush_merges() {
  std::array<std::array<uint64_t, 3>, kMergeBatch> hashes;
  for (size_t i = 0; i < merge_batch_size; ++i) {
    const std::string_view joined(merge_batch[i].joined);
    const size_t ls = merge_batch[i].left_size;
    hashes[i] = {VocabIndex::hash(joined.substr(0, ls)), VocabIndex::hash(joined.substr(ls)),
                 VocabIndex::hash(joined)};
    for (const uint64_t h : hashes[i]) vocab.prefetch(h);
  }
  for (size_t i = 0; i < merge_batch_size; ++i) {
    const std::string_view joined(merge_batch[i].joined);
    const size_t ls = merge_batch[i].left_size;
    const std::string_view left = joined.substr(0, ls), right = joined.substr(ls);
    const auto rank = static_cast<int32_t>(merge_count++);
    const int32_t l = vocab.find(left, hashes[i][0]), r = vocab.find(right, hashes[i][1]),
                  m = vocab.find(joined, hashes[i][2]);
    if (l < 0 || r < 0 || m < 0)
      fail(path, ": model.merges[", rank, "] = [\"", left, "\", \"", right, "\"] uses a token (\"",
           l < 0   ? left
           : r < 0 ? right
                   : joined,
           "\") that is not in model.vocab");
    merges.insert(l, r, rank, m);
  }
  merge_batch_size = 0;
}

void TokenizerImpl::build(RawTokenizerFile& raw) {
  const json& root = raw.rest;
  if (!root.is_object())
    fail(path, ": top level is not a JSON object; expected a Hugging Face tokenizer.json");
  if (!root.contains("model") || !root["model"].is_object())
    fail(path, ": missing \"model\" object; expected a Hugging Face tokenizer.json");
  const json& model = root["model"];
  const std::string type = model.value("type", std::string("BPE"));
  if (type != "BPE")
    fail(path, ": model.type is \"", type, "\"; only BPE tokenizers (Gemma's) are supported");
  if (!raw.has_vocab || !vocab_loaded)
    fail(path, ": model.vocab is missing or empty; the file carries no vocabulary");
  if (!raw.has_merges) fail(path, ": model.merges is missing; a BPE model needs its merge list");
  for (const char* field : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (model.contains(field) && !model[field].is_null() && model[field] != "")
      fail(path, ": model.", field, " is set; not supported (Gemma does not use it)");
  if (model.contains("dropout") && !model["dropout"].is_null() && model["dropout"] != 0 &&
      model["dropout"] != 0.0)
    fail(path, ": model.dropout is set; BPE dropout is a training feature and is not supported");
  byte_fallback = model.value("byte_fallback", false);
  fuse_unk = model.value("fuse_unk", false);
  ignore_merges = model.value("ignore_merges", false);

  // Merges still batched, then any that came before the vocabulary in the file.
  flush_merges();
  for (const auto& [left, right] : early_merges) add_merge(left, right);
  flush_merges();
  early_merges = {};
  merge_batch = {};

  byte_ids.fill(-1);
  if (byte_fallback) {
    char name[8];
    for (int b = 0; b < 256; ++b) {
      std::snprintf(name, sizeof(name), "<0x%02X>", b);
      byte_ids[b] = vocab.find(name);
    }
  }
  if (model.contains("unk_token") && model["unk_token"].is_string()) {
    const std::string name = model["unk_token"].get<std::string>();
    const int32_t unk_index = vocab.find(name);
    if (unk_index < 0) fail(path, ": model.unk_token \"", name, "\" is not in model.vocab");
    model_unk = unk_index;
  }

  // Added tokens.
  if (root.contains("added_tokens") && !root["added_tokens"].is_null()) {
    const json& list = root["added_tokens"];
    if (!list.is_array()) fail(path, ": added_tokens is not an array");
    for (size_t i = 0; i < list.size(); ++i) {
      const json& e = list[i];
      if (!e.is_object() || !e.contains("id") || !e["id"].is_number_integer() ||
          !e.contains("content") || !e["content"].is_string())
        fail(path, ": added_tokens[", i, "] needs an integer \"id\" and a string \"content\"");
      AddedToken t;
      const int64_t id = e["id"].get<int64_t>();
      if (id < 0 || id >= (int64_t{1} << 26))
        fail(path, ": added_tokens[", i, "] has id ", id, ", outside [0, 2^26)");
      t.id = static_cast<int32_t>(id);
      t.content = e["content"].get<std::string>();
      if (t.content.empty()) fail(path, ": added_tokens[", i, "] has empty content");
      t.special = e.value("special", false);
      t.single_word = e.value("single_word", false);
      t.lstrip = e.value("lstrip", false);
      t.rstrip = e.value("rstrip", false);
      t.normalized = e.value("normalized", !t.special);
      add_added_token(std::move(t));
    }
  }

  parse_normalizer(root.value("normalizer", json(nullptr)));
  parse_pre_tokenizer(root.value("pre_tokenizer", json(nullptr)));
  parse_decoder(root.value("decoder", json(nullptr)));
  parse_post_processor(root.value("post_processor", json(nullptr)));
  rebuild_tries();

  const auto named = [&](const char* name) { return lookup(name); };
  bos = named("<bos>");
  eos = named("<eos>");
  pad = named("<pad>");
  unk = model_unk ? model_unk : named("<unk>");
}

void TokenizerImpl::add_added_token(AddedToken t) {
  const int32_t id = t.id;
  // The added token's text names the id from now on; a vocabulary entry that shared the id keeps
  // its string->id mapping (HF still finds it through the model) via shadowed_vocab.
  const auto index = static_cast<size_t>(id);
  if (index < id_to_token.size() && id_known[index] && id_to_token[index] != t.content) {
    if (vocab.stored_key(id_to_token[index]) == &id_to_token[index]) {
      shadowed_vocab.push_back(id_to_token[index]);
      vocab.assign(&shadowed_vocab.back(), id);
    }
  }
  set_token(id, t.content);
  id_special[index] = t.special ? 1 : 0;
  added_by_content[t.content] = id;
  for (auto& existing : added)
    if (existing.id == id) {
      existing = std::move(t);
      return;
    }
  added.push_back(std::move(t));
}

void TokenizerImpl::rebuild_tries() {
  raw_trie = AddedTokenTrie();
  normalized_trie = AddedTokenTrie();
  for (size_t i = 0; i < added.size(); ++i) {
    const AddedToken& t = added[i];
    if (t.normalized)
      normalized_trie.insert(normalize(t.content), static_cast<int32_t>(i));
    else
      raw_trie.insert(t.content, static_cast<int32_t>(i));
  }
}

void TokenizerImpl::parse_normalizer(const json& j) {
  if (j.is_null()) return;
  if (!j.is_object() || !j.contains("type"))
    fail(path, ": normalizer ", json_brief(j), " has no \"type\"");
  const std::string type = j["type"].get<std::string>();
  if (type == "Sequence") {
    for (const json& sub : j.value("normalizers", json::array())) parse_normalizer(sub);
  } else if (type == "Replace") {
    const json& pattern = j.value("pattern", json::object());
    if (!pattern.contains("String") || !pattern["String"].is_string())
      fail(path, ": normalizer Replace with pattern ", json_brief(pattern),
           " is not supported; only {\"String\": ...} patterns are (regex patterns are not)");
    normalizer.push_back({NormalizerOp::kReplace, pattern["String"].get<std::string>(),
                          j.value("content", std::string())});
  } else if (type == "Prepend") {
    normalizer.push_back({NormalizerOp::kPrepend, {}, j.value("prepend", std::string())});
  } else if (type == "NFC") {
    normalizer.push_back({NormalizerOp::kNfcTrivial, {}, {}});
  } else {
    fail(path, ": normalizer type \"", type,
         "\" is not supported (supported: Replace, Prepend, NFC, Sequence)");
  }
}

void TokenizerImpl::parse_pre_tokenizer(const json& j) {
  if (j.is_null()) return;
  if (!j.is_object() || !j.contains("type"))
    fail(path, ": pre_tokenizer ", json_brief(j), " has no \"type\"");
  const std::string type = j["type"].get<std::string>();
  if (type == "Sequence") {
    for (const json& sub : j.value("pretokenizers", json::array())) parse_pre_tokenizer(sub);
    return;
  }
  if (type != "Split")
    fail(path, ": pre_tokenizer type \"", type, "\" is not supported (supported: Split, Sequence)");
  const json& pattern = j.value("pattern", json::object());
  if (!pattern.contains("String") || !pattern["String"].is_string() ||
      pattern["String"].get<std::string>().empty())
    fail(path, ": pre_tokenizer Split with pattern ", json_brief(pattern),
         " is not supported; only non-empty {\"String\": ...} patterns are");
  if (j.value("invert", false))
    fail(path, ": pre_tokenizer Split with \"invert\": true is not supported");
  const std::string behavior = j.value("behavior", std::string("Removed"));
  SplitBehavior b;
  if (behavior == "Removed")
    b = SplitBehavior::kRemoved;
  else if (behavior == "Isolated")
    b = SplitBehavior::kIsolated;
  else if (behavior == "MergedWithPrevious")
    b = SplitBehavior::kMergedWithPrevious;
  else if (behavior == "MergedWithNext")
    b = SplitBehavior::kMergedWithNext;
  else if (behavior == "Contiguous")
    b = SplitBehavior::kContiguous;
  else
    fail(path, ": pre_tokenizer Split has unknown behavior \"", behavior, "\"");
  pre_tokenizer.push_back({pattern["String"].get<std::string>(), b});
}

void TokenizerImpl::parse_decoder(const json& j) {
  if (j.is_null()) return;
  has_decoder = true;
  if (!j.is_object() || !j.contains("type"))
    fail(path, ": decoder ", json_brief(j), " has no \"type\"");
  const std::string type = j["type"].get<std::string>();
  if (type == "Sequence") {
    for (const json& sub : j.value("decoders", json::array())) parse_decoder(sub);
  } else if (type == "Replace") {
    const json& pattern = j.value("pattern", json::object());
    if (!pattern.contains("String") || !pattern["String"].is_string())
      fail(path, ": decoder Replace with pattern ", json_brief(pattern),
           " is not supported; only {\"String\": ...} patterns are");
    DecoderOp op{DecoderOp::kReplace, pattern["String"].get<std::string>(),
                 j.value("content", std::string())};
    decoder.push_back(std::move(op));
  } else if (type == "ByteFallback") {
    decoder.push_back({DecoderOp::kByteFallback, {}, {}});
  } else if (type == "Fuse") {
    decoder.push_back({DecoderOp::kFuse, {}, {}});
  } else if (type == "Strip") {
    DecoderOp op{DecoderOp::kStrip, {}, j.value("content", std::string(" "))};
    op.strip_start = j.value("start", size_t{0});
    op.strip_stop = j.value("stop", size_t{0});
    if (op.content.empty() || utf8::sequence_length(op.content, 0) != op.content.size())
      fail(path, ": decoder Strip content must be one character");
    decoder.push_back(std::move(op));
  } else {
    fail(path, ": decoder type \"", type,
         "\" is not supported (supported: Replace, ByteFallback, Fuse, Strip, Sequence)");
  }
}

void TokenizerImpl::parse_post_processor(const json& j) {
  if (j.is_null()) return;
  if (!j.is_object() || !j.contains("type"))
    fail(path, ": post_processor ", json_brief(j), " has no \"type\"");
  const std::string type = j["type"].get<std::string>();
  if (type != "TemplateProcessing")
    fail(path, ": post_processor type \"", type, "\" is not supported (TemplateProcessing only)");
  const json& specials = j.value("special_tokens", json::object());
  bool seen_sequence = false;
  for (const json& item : j.value("single", json::array())) {
    if (item.contains("Sequence")) {
      seen_sequence = true;
      continue;
    }
    if (!item.contains("SpecialToken"))
      fail(path, ": post_processor.single item ", json_brief(item), " is not understood");
    const std::string name = item["SpecialToken"].value("id", std::string());
    std::vector<int32_t> ids;
    if (specials.contains(name) && specials[name].contains("ids")) {
      for (const json& id : specials[name]["ids"]) ids.push_back(id.get<int32_t>());
    } else if (auto id = lookup(name)) {
      ids.push_back(*id);
    } else {
      fail(path, ": post_processor names special token \"", name, "\", which has no id");
    }
    auto& dst = seen_sequence ? suffix : prefix;
    dst.insert(dst.end(), ids.begin(), ids.end());
  }
}

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
          if (utf8::find_invalid(bytes) == std::string::npos) {
            out.push_back(bytes);
          } else {
            // HF replaces a whole ill-formed run with one U+FFFD per byte.
            std::string bad;
            for (size_t i = 0; i < bytes.size(); ++i) bad += "\xEF\xBF\xBD";
            out.push_back(std::move(bad));
          }
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

// ---------------------------------------------------------------------------------------------

Tokenizer Tokenizer::from_file(const std::string& tokenizer_json_path) {
  const std::string text = read_text_file(tokenizer_json_path);
  auto impl = std::make_shared<TokenizerImpl>();
  impl->path = tokenizer_json_path;
  RawTokenizerFile raw;
  TokenizerImpl* target = impl.get();
  raw.on_vocab_end = [target, &raw] { target->load_vocab(raw); };
  raw.on_merge = [target](std::string_view l, std::string_view r) { target->add_merge(l, r); };
  TokenizerSax sax(raw, impl->path);
  if (!json::sax_parse(text, &sax))
    fail(tokenizer_json_path, ": not valid JSON; expected a Hugging Face tokenizer.json");
  impl->build(raw);
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::from_model_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path json_path = fs::path(dir) / "tokenizer.json";
  if (!fs::exists(json_path))
    fail(dir, ": no tokenizer.json in this directory; pass the Hugging Face model folder");
  Tokenizer tok = from_file(json_path.string());
  const fs::path config_path = fs::path(dir) / "tokenizer_config.json";
  if (!fs::exists(config_path)) return tok;

  TokenizerImpl& impl = *tok.impl_;
  const std::string config_name = config_path.string();
  json config;
  try {
    config = json::parse(read_text_file(config_name));
  } catch (const json::exception& e) {
    fail(config_name, ": not valid JSON: ", e.what());
  }
  if (!config.is_object()) fail(config_name, ": top level is not a JSON object");

  if (config.contains("added_tokens_decoder") && config["added_tokens_decoder"].is_object()) {
    bool added_any = false;
    std::unordered_set<int32_t> known_ids;
    for (const AddedToken& t : impl.added) known_ids.insert(t.id);
    for (const auto& [key, e] : config["added_tokens_decoder"].items()) {
      int64_t id = -1;
      try {
        id = std::stoll(key);
      } catch (const std::exception&) {
      }
      if (id < 0 || id >= (int64_t{1} << 26) || !e.is_object() || !e.contains("content") ||
          !e["content"].is_string())
        fail(config_name, ": added_tokens_decoder[\"", key,
             "\"] needs an integer key and a string \"content\"");
      if (known_ids.contains(static_cast<int32_t>(id))) continue;
      AddedToken t;
      t.id = static_cast<int32_t>(id);
      t.content = e["content"].get<std::string>();
      t.special = e.value("special", false);
      t.single_word = e.value("single_word", false);
      t.lstrip = e.value("lstrip", false);
      t.rstrip = e.value("rstrip", false);
      t.normalized = e.value("normalized", !t.special);
      impl.add_added_token(std::move(t));
      added_any = true;
    }
    if (added_any) impl.rebuild_tries();
  }

  const auto resolve = [&](const char* field, std::optional<int32_t>& slot) {
    if (!config.contains(field) || config[field].is_null()) return;
    const std::string name = token_name(config[field]);
    if (name.empty()) fail(config_name, ": ", field, " is neither a string nor {\"content\": ...}");
    auto id = impl.lookup(name);
    if (!id) fail(config_name, ": ", field, " \"", name, "\" is not a token of ", impl.path);
    slot = id;
  };
  resolve("bos_token", impl.bos);
  resolve("eos_token", impl.eos);
  resolve("pad_token", impl.pad);
  resolve("unk_token", impl.unk);

  if (config.contains("add_bos_token") && config["add_bos_token"].is_boolean()) {
    impl.prefix.clear();
    if (config["add_bos_token"].get<bool>()) {
      if (!impl.bos) fail(config_name, ": add_bos_token is true but there is no bos_token");
      impl.prefix.push_back(*impl.bos);
    }
  }
  if (config.contains("add_eos_token") && config["add_eos_token"].is_boolean()) {
    impl.suffix.clear();
    if (config["add_eos_token"].get<bool>()) {
      if (!impl.eos) fail(config_name, ": add_eos_token is true but there is no eos_token");
      impl.suffix.push_back(*impl.eos);
    }
  }
  return tok;
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

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  return impl_->lookup(token);
}

int32_t Tokenizer::require_id(std::string_view token) const {
  if (auto id = impl_->lookup(token)) return *id;
  fail(impl_->path, ": has no token \"", token,
       "\"; this tokenizer does not belong to a Gemma 4 model");
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

// ---------------------------------------------------------------------------------------------

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
