// What a loaded tokenizer holds (tokenizer.h's Tokenizer shares one): the vocabulary, the merges,
// the added tokens and the normalizer / pre-tokenizer / decoder steps, with the tables that make
// lookups fast. Internal to src/tokenizer. tokenizer_load.cc reads tokenizer.json into it,
// tokenizer.cc encodes, tokenizer_decode.cc decodes.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace gemstage {

namespace tokenizer_internal {

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

inline void replace_all(std::string& s, std::string_view pattern, std::string_view content) {
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

inline bool is_byte_token(std::string_view t, unsigned char* byte) {
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

}  // namespace tokenizer_internal

struct RawTokenizerFile;  // tokenizer_load.cc

struct TokenizerImpl {
  std::string path;
  // A deque: growing it (added tokens past the vocabulary) must not move the strings the vocab
  // map keys point into.
  std::deque<std::string> id_to_token;
  std::vector<uint8_t> id_known;    // id_to_token[id] names a token
  std::vector<uint8_t> id_special;  // id is an added token flagged special
  // Model vocabulary; keys point into id_to_token, or into shadowed_vocab for the rare entry
  // whose id an added token with different text took over.
  tokenizer_internal::VocabIndex vocab;
  std::deque<std::string> shadowed_vocab;
  std::unordered_map<std::string, int32_t> added_by_content;
  std::vector<AddedToken> added;
  tokenizer_internal::AddedTokenTrie
      raw_trie;  // added tokens with normalized=false, matched on the input
  tokenizer_internal::AddedTokenTrie
      normalized_trie;  // normalized=true ones, matched after normalization
  std::vector<tokenizer_internal::NormalizerOp> normalizer;
  std::vector<tokenizer_internal::PreTokenizerOp> pre_tokenizer;
  bool has_decoder = false;
  std::vector<tokenizer_internal::DecoderOp> decoder;

  // BPE model
  tokenizer_internal::MergeTable merges;
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
  void parse_normalizer(const nlohmann::json& j);
  void parse_pre_tokenizer(const nlohmann::json& j);
  void parse_decoder(const nlohmann::json& j);
  void parse_post_processor(const nlohmann::json& j);
  void add_added_token(AddedToken t);
  void rebuild_tries();

  std::string normalize(std::string_view text) const;
  void split_added(std::string_view text, const tokenizer_internal::AddedTokenTrie& trie,
                   bool parse_special, std::vector<tokenizer_internal::Segment>& out) const;
  void pre_tokenize(std::string_view text, std::vector<std::string_view>& out) const;
  void encode_plain(std::string_view normalized, bool parse_special,
                    std::vector<int32_t>& ids) const;
  void bpe_word(std::string_view word, std::vector<int32_t>& ids) const;
  void bpe_uncached(std::string_view word, std::vector<int32_t>& ids) const;
  std::string run_decoder(std::vector<std::string> tokens) const;
};

}  // namespace gemstage
