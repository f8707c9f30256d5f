// Reading tokenizer.json (streamed: the vocabulary and merges never become a DOM) and
// tokenizer_config.json, and building the tables an encode needs.
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

namespace {

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

}  // namespace

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

}  // namespace gemstage
