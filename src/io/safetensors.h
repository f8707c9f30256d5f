// Safetensors checkpoints: one file or shards listed in model.safetensors.index.json.
// Every header is validated before any tensor data is touched; tensors stay in the mmap.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "io/mapped_file.h"

namespace gemstage {

struct SafetensorsEntry {
  std::string key;
  DType dtype;
  Shape shape;
  size_t begin = 0, end = 0;  // byte offsets into the data section
};

class SafetensorsFile {
 public:
  // Maps and validates: header length within the file, JSON well formed, known dtypes,
  // integer shapes, offsets inside the data section, sizes equal to numel * dtype size,
  // no two tensors overlapping.
  explicit SafetensorsFile(const std::string& path);

  const std::string& path() const { return file_.path(); }
  const std::map<std::string, SafetensorsEntry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  WeightView view(const std::string& key) const;

 private:
  MappedFile file_;
  size_t data_start_ = 0;
  std::map<std::string, SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

// Anything that hands out named weight views: a checkpoint directory or a bundle stage.
class TensorSource {
 public:
  virtual ~TensorSource() = default;
  virtual bool has(const std::string& key) const = 0;
  // Throws, naming the key, if absent.
  virtual WeightView view(const std::string& key) const = 0;
  // view(key).nbytes, for sources where a view costs more than its size (a generator).
  virtual size_t nbytes(const std::string& key) const { return view(key).nbytes; }
  // The file holding `key`, for messages.
  virtual std::string file_of(const std::string& key) const = 0;
  virtual std::vector<std::string> keys() const = 0;
};

// All tensors of a checkpoint directory, across shards.
class TensorStore : public TensorSource {
 public:
  static TensorStore open_dir(const std::string& dir);

  bool has(const std::string& key) const override { return where_.count(key) != 0; }
  const SafetensorsEntry* entry(const std::string& key) const;
  WeightView view(const std::string& key) const override;
  std::string file_of(const std::string& key) const override;
  std::vector<std::string> keys() const override;
  // Serves each tensor under canonical(stored key) from now on (a model whose checkpoints come
  // in two naming layouts; the file still holds the stored name). Two keys mapping to one name
  // are refused, naming both.
  void rename_keys(const std::function<std::string(const std::string&)>& canonical);

 private:
  std::string stored_key(const std::string& key) const;

  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> where_;
  std::map<std::string, std::string> stored_;  // served name -> name in the file, when renamed
};

}  // namespace gemstage
