#include "stage/weights_file.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "kernels/quant.h"

namespace gemstage {

namespace {
constexpr char kMagic[8] = {'G', 'S', 'T', 'W', '0', '0', '0', '1'};
constexpr uint64_t kAlign = 64;
uint64_t align_up(uint64_t x) {
  return (x + kAlign - 1) / kAlign * kAlign;
}
}  // namespace

bool dtype_from_name(const std::string& s, DType* out) {
  if (s == "Q8_0") return (*out = DType::Q8_0), true;
  if (s == "Q4_0") return (*out = DType::Q4_0), true;
  return dtype_from_safetensors(s, out);
}

size_t tensor_bytes(DType t, const Shape& shape) {
  size_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || (d != 0 && n > std::numeric_limits<size_t>::max() / static_cast<size_t>(d) / 8))
      fail("tensor shape ", shape_str(shape), " is too large");
    n *= static_cast<size_t>(d);
  }
  if (t == DType::Q8_0 || t == DType::Q4_0) {
    if (shape.empty()) fail("a ", dtype_name(t), " tensor needs at least one dimension");
    const int64_t in = shape.back();
    const size_t rows = in ? n / static_cast<size_t>(in) : 0;
    return rows * quant_row_bytes(t, in);
  }
  return n * dtype_size(t);
}

WeightsFileWriter::WeightsFileWriter(std::string path) : path_(std::move(path)) {}

void WeightsFileWriter::declare(const std::string& name, DType dtype, const Shape& shape) {
  const uint64_t nbytes = tensor_bytes(dtype, shape);
  decls_.push_back({name, dtype, shape, next_offset_, nbytes});
  next_offset_ = align_up(next_offset_ + nbytes);
}

void WeightsFileWriter::begin_data() {
  nlohmann::json h;
  h["tensors"] = nlohmann::json::object();
  for (const Decl& d : decls_)
    h["tensors"][d.name] = {{"dtype", std::string(dtype_name(d.dtype))},
                            {"shape", d.shape},
                            {"offset", d.offset},
                            {"nbytes", d.nbytes}};
  const std::string header = h.dump();
  out_.open(path_);
  const uint64_t hl = header.size();
  out_.write(kMagic, 8);
  char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<char>((hl >> (8 * i)) & 0xff);
  out_.write(len, 8);
  out_.write(header);
  const uint64_t pos = 16 + hl;
  const std::string pad(align_up(pos) - pos, '\0');
  out_.write(pad);
  current_ = 0;
  written_in_current_ = 0;
  data_pos_ = 0;
}

void WeightsFileWriter::write(const void* data, size_t n) {
  if (current_ >= decls_.size()) fail(path_, ": more tensors written than declared");
  if (written_in_current_ + n > decls_[current_].nbytes)
    fail(path_, ": tensor ", decls_[current_].name, " written past its declared size");
  out_.write(data, n);
  written_in_current_ += n;
  data_pos_ += n;
}

void WeightsFileWriter::end_tensor() {
  const Decl& d = decls_.at(current_);
  if (written_in_current_ != d.nbytes)
    fail(path_, ": tensor ", d.name, " got ", written_in_current_, " bytes, declared ", d.nbytes);
  const uint64_t next =
      current_ + 1 < decls_.size() ? decls_[current_ + 1].offset : align_up(data_pos_);
  const std::string pad(next - data_pos_, '\0');
  out_.write(pad);
  data_pos_ = next;
  ++current_;
  written_in_current_ = 0;
}

void WeightsFileWriter::finish() {
  if (current_ != decls_.size())
    fail(path_, ": ", decls_.size() - current_, " declared tensors were not written");
  out_.commit();
}

WeightsFile::WeightsFile(const std::string& path) : file_(path) {
  const size_t size = file_.size();
  if (size < 16 || std::memcmp(file_.data(), kMagic, 8) != 0)
    fail(path, ": not a gemstage weights file (bad magic or truncated); re-export the bundle");
  uint64_t hl = 0;
  for (int i = 15; i >= 8; --i) hl = (hl << 8) | file_.data()[i];
  if (hl > size - 16)
    fail(path, ": header length ", hl, " runs past the end of the file (", size,
         " bytes): truncated");
  data_start_ = static_cast<size_t>(align_up(16 + hl));
  if (data_start_ > size) fail(path, ": truncated before the data section");
  const size_t data_size = size - data_start_;
  nlohmann::json h;
  try {
    h = nlohmann::json::parse(file_.data() + 16, file_.data() + 16 + hl);
  } catch (const nlohmann::json::exception& e) {
    fail(path, ": header is not valid JSON (", e.what(), ")");
  }
  if (!h.is_object() || !h.contains("tensors") || !h["tensors"].is_object())
    fail(path, ": header has no tensors object");
  std::vector<const SafetensorsEntry*> sorted;
  for (auto it = h["tensors"].begin(); it != h["tensors"].end(); ++it) {
    const std::string where = path + ": tensor " + it.key();
    const auto& v = it.value();
    SafetensorsEntry e;
    e.key = it.key();
    if (!v.is_object() || !v.contains("dtype") || !v["dtype"].is_string() ||
        !dtype_from_name(v["dtype"].get<std::string>(), &e.dtype))
      fail(where, ": missing or unknown dtype");
    if (!v.contains("shape") || !v["shape"].is_array()) fail(where, ": shape is not an array");
    for (const auto& d : v["shape"]) {
      if (!d.is_number_unsigned()) fail(where, ": shape entries must be non-negative integers");
      e.shape.push_back(d.get<int64_t>());
    }
    if (!v.contains("offset") || !v["offset"].is_number_unsigned() || !v.contains("nbytes") ||
        !v["nbytes"].is_number_unsigned())
      fail(where, ": offset and nbytes must be non-negative integers");
    e.begin = v["offset"].get<size_t>();
    const size_t nbytes = v["nbytes"].get<size_t>();
    if (e.begin % kAlign) fail(where, ": offset ", e.begin, " is not 64-byte aligned");
    if (e.begin > data_size || nbytes > data_size - e.begin)
      fail(where, ": data [", e.begin, ", ", e.begin + nbytes,
           ") is past the end of the data section (", data_size, " bytes): the file is truncated");
    if (nbytes != tensor_bytes(e.dtype, e.shape))
      fail(where, ": nbytes ", nbytes, " does not match ", dtype_name(e.dtype), " ",
           shape_str(e.shape), " (", tensor_bytes(e.dtype, e.shape), ")");
    e.end = e.begin + nbytes;
    auto [pos, inserted] = entries_.emplace(e.key, e);
    (void)inserted;
    sorted.push_back(&pos->second);
  }
  std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < sorted.size(); ++i)
    if (sorted[i]->begin < sorted[i - 1]->end)
      fail(path, ": tensors ", sorted[i - 1]->key, " and ", sorted[i]->key, " overlap");
}

WeightView WeightsFile::view(const std::string& key) const {
  auto it = entries_.find(key);
  if (it == entries_.end()) fail(path(), ": no tensor ", key);
  WeightView w;
  w.name = key;
  w.dtype = it->second.dtype;
  w.shape = it->second.shape;
  w.data = file_.data() + data_start_ + it->second.begin;
  w.file = {file_.row_fd(), file_.data(), file_.size()};
  w.nbytes = it->second.end - it->second.begin;
  return w;
}

std::vector<std::string> WeightsFile::keys() const {
  std::vector<std::string> k;
  for (const auto& [key, e] : entries_) k.push_back(key);
  return k;
}

}  // namespace gemstage
