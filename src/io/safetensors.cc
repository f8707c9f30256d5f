#include "io/safetensors.h"

#include <algorithm>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace gemstage {

namespace {
constexpr size_t kMaxHeaderBytes = size_t{100} << 20;  // the format's own limit is 100 MB

size_t checked_u64(const nlohmann::json& v, const std::string& where) {
  if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<int64_t>() >= 0))
    fail(where, " must be a non-negative integer, found ", v.dump());
  return v.get<size_t>();
}
}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) : file_(path) {
  const size_t size = file_.size();
  if (size < 8) fail(path, ": truncated safetensors file (", size, " bytes, need at least 8)");
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; --i) hlen = (hlen << 8) | file_.data()[i];
  if (hlen > size - 8)
    fail(path, ": header length ", hlen, " runs past the end of the file (", size,
         " bytes); the file is truncated or not safetensors");
  if (hlen > kMaxHeaderBytes) fail(path, ": header length ", hlen, " exceeds the 100 MB limit");
  data_start_ = 8 + static_cast<size_t>(hlen);
  const size_t data_size = size - data_start_;
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(file_.data() + 8, file_.data() + 8 + hlen);
  } catch (const nlohmann::json::exception& e) {
    fail(path, ": header is not valid JSON (", e.what(), ")");
  }
  if (!header.is_object()) fail(path, ": header is not a JSON object");
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& key = it.key();
    const auto& v = it.value();
    if (key == "__metadata__") {
      if (!v.is_object()) fail(path, ": __metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m)
        if (m.value().is_string()) metadata_[m.key()] = m.value().get<std::string>();
      continue;
    }
    const std::string where = path + ": tensor " + key;
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") ||
        !v.contains("data_offsets"))
      fail(where, ": entry needs dtype, shape and data_offsets");
    SafetensorsEntry e;
    e.key = key;
    if (!v["dtype"].is_string() || !dtype_from_safetensors(v["dtype"].get<std::string>(), &e.dtype))
      fail(where, ": unknown dtype ", v["dtype"].dump());
    if (!v["shape"].is_array()) fail(where, ": shape is not an array");
    size_t numel = 1;
    for (const auto& d : v["shape"]) {
      const size_t n = checked_u64(d, where + " shape entry");
      if (n != 0 && numel > std::numeric_limits<size_t>::max() / n)
        fail(where, ": shape overflows");
      numel *= n;
      e.shape.push_back(static_cast<int64_t>(n));
    }
    const auto& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2) fail(where, ": data_offsets must be [begin, end]");
    e.begin = checked_u64(off[0], where + " data_offsets[0]");
    e.end = checked_u64(off[1], where + " data_offsets[1]");
    if (e.begin > e.end) fail(where, ": data_offsets begin ", e.begin, " > end ", e.end);
    if (e.end > data_size)
      fail(where, ": data_offsets end ", e.end, " is past the data section (", data_size,
           " bytes); the file is truncated");
    const size_t es = dtype_size(e.dtype);
    if (numel > std::numeric_limits<size_t>::max() / es) fail(where, ": byte size overflows");
    if (numel * es != e.end - e.begin)
      fail(where, ": shape ", shape_str(e.shape), " x ", dtype_name(e.dtype), " needs ", numel * es,
           " bytes but data_offsets span ", e.end - e.begin);
    entries_.emplace(key, std::move(e));
  }
  std::vector<const SafetensorsEntry*> sorted;
  for (const auto& [k, e] : entries_)
    if (e.end > e.begin) sorted.push_back(&e);
  std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < sorted.size(); ++i)
    if (sorted[i]->begin < sorted[i - 1]->end)
      fail(path, ": tensors ", sorted[i - 1]->key, " and ", sorted[i]->key,
           " overlap in the data section");
}

WeightView SafetensorsFile::view(const std::string& key) const {
  auto it = entries_.find(key);
  if (it == entries_.end()) fail(path(), ": no tensor ", key);
  const auto& e = it->second;
  WeightView w;
  w.name = key;
  w.dtype = e.dtype;
  w.shape = e.shape;
  w.data = file_.data() + data_start_ + e.begin;
  w.file = {file_.row_fd(), file_.data(), file_.size()};
  w.nbytes = e.end - e.begin;
  return w;
}

TensorStore TensorStore::open_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  TensorStore s;
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  std::vector<std::string> shards;
  if (fs::exists(index)) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(read_text_file(index.string(), size_t{64} << 20));
    } catch (const nlohmann::json::exception& e) {
      fail(index.string(), ": not valid JSON (", e.what(), ")");
    }
    if (!j.contains("weight_map") || !j["weight_map"].is_object())
      fail(index.string(), ": missing the weight_map object");
    std::map<std::string, std::string> wanted;
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it.value().is_string())
        fail(index.string(), ": weight_map[", it.key(), "] is not a file name");
      const std::string f = it.value().get<std::string>();
      if (f.empty() || f.find('/') != std::string::npos || f.find('\\') != std::string::npos ||
          f == "." || f == "..")
        fail(index.string(), ": shard name '", f,
             "' must be a plain file name in the checkpoint directory");
      wanted[it.key()] = f;
      if (std::find(shards.begin(), shards.end(), f) == shards.end()) shards.push_back(f);
    }
    for (const auto& f : shards)
      if (!fs::exists(fs::path(dir) / f))
        fail(index.string(), " lists shard ", f, " but ", (fs::path(dir) / f).string(),
             " does not exist; download every shard");
    for (const auto& f : shards)
      s.files_.push_back(std::make_unique<SafetensorsFile>((fs::path(dir) / f).string()));
    for (size_t i = 0; i < s.files_.size(); ++i)
      for (const auto& [k, e] : s.files_[i]->entries()) {
        if (s.where_.count(k))
          fail(s.files_[i]->path(), ": tensor ", k, " also appears in ",
               s.files_[s.where_[k]]->path());
        s.where_[k] = i;
      }
    for (const auto& [k, f] : wanted) {
      auto it = s.where_.find(k);
      if (it == s.where_.end())
        fail(index.string(), ": tensor ", k, " is listed in shard ", f,
             " but that shard does not contain it");
    }
    return s;
  }
  const fs::path single = fs::path(dir) / "model.safetensors";
  if (!fs::exists(single))
    fail(dir,
         ": no model.safetensors or model.safetensors.index.json; point --model at a Hugging Face "
         "checkpoint directory");
  s.files_.push_back(std::make_unique<SafetensorsFile>(single.string()));
  for (const auto& [k, e] : s.files_[0]->entries()) s.where_[k] = 0;
  return s;
}

const SafetensorsEntry* TensorStore::entry(const std::string& key) const {
  auto it = where_.find(key);
  if (it == where_.end()) return nullptr;
  return &files_[it->second]->entries().at(stored_key(key));
}

WeightView TensorStore::view(const std::string& key) const {
  auto it = where_.find(key);
  if (it == where_.end()) fail("checkpoint has no tensor ", key);
  return files_[it->second]->view(stored_key(key));
}

std::string TensorStore::stored_key(const std::string& key) const {
  auto it = stored_.find(key);
  return it == stored_.end() ? key : it->second;
}

void TensorStore::rename_keys(const std::function<std::string(const std::string&)>& canonical) {
  std::map<std::string, size_t> where;
  std::map<std::string, std::string> stored;
  for (const auto& [key, file] : where_) {
    const std::string name = canonical(key);
    const std::string in_file = stored_key(key);
    if (!where.emplace(name, file).second)
      fail(files_[file]->path(), ": tensors ", stored.count(name) ? stored[name] : name, " and ",
           in_file, " are the same tensor ", name, " in two naming layouts; keep one");
    if (name != in_file) stored[name] = in_file;
  }
  where_ = std::move(where);
  stored_ = std::move(stored);
}

std::string TensorStore::file_of(const std::string& key) const {
  auto it = where_.find(key);
  return it == where_.end() ? std::string("(none)") : files_[it->second]->path();
}

std::vector<std::string> TensorStore::keys() const {
  std::vector<std::string> k;
  for (const auto& [key, i] : where_) k.push_back(key);
  return k;
}

}  // namespace gemstage
