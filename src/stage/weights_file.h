// A stage's weights file (.gsw): memory-mappable, every tensor 64-byte aligned.
//
// Layout (little-endian):
//   bytes 0..7    magic "GSTW0001"
//   bytes 8..15   u64 header length H
//   bytes 16..    H bytes of JSON: {"tensors": {name: {"dtype": "Q4_0", "shape": [out, in],
//                 "offset": o, "nbytes": n}, ...}}; offsets are relative to the data start
//   data start    = 16 + H rounded up to 64; each tensor's offset is a multiple of 64
// Validation on open mirrors safetensors: header inside the file, known dtypes, integer
// shapes, nbytes equal to the dtype's size for that shape, offsets aligned, in range and
// non-overlapping.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "io/file_writer.h"
#include "io/mapped_file.h"
#include "io/safetensors.h"

namespace gemstage {

// Bytes a tensor of this dtype and shape occupies (block formats: rows x row bytes).
size_t tensor_bytes(DType t, const Shape& shape);
bool dtype_from_name(const std::string& s, DType* out);

class WeightsFileWriter {
 public:
  explicit WeightsFileWriter(std::string path);
  // Declare every tensor first (so the header can be written), then write them in order.
  void declare(const std::string& name, DType dtype, const Shape& shape);
  void begin_data();
  void write(const void* data, size_t n);  // appends to the current tensor
  void end_tensor();
  // Writes the last bytes and syncs the file to disk; errors name the file and errno text.
  void finish();

 private:
  struct Decl {
    std::string name;
    DType dtype;
    Shape shape;
    uint64_t offset, nbytes;
  };
  std::string path_;
  FileWriter out_;
  std::vector<Decl> decls_;
  uint64_t next_offset_ = 0;
  size_t current_ = 0;
  uint64_t written_in_current_ = 0, data_pos_ = 0;
};

class WeightsFile : public TensorSource {
 public:
  explicit WeightsFile(const std::string& path);

  bool has(const std::string& key) const override { return entries_.count(key) != 0; }
  WeightView view(const std::string& key) const override;
  std::string file_of(const std::string&) const override { return file_.path(); }
  std::vector<std::string> keys() const override;
  const std::string& path() const { return file_.path(); }

 private:
  MappedFile file_;
  size_t data_start_ = 0;
  std::map<std::string, SafetensorsEntry> entries_;
};

}  // namespace gemstage
