// Named intermediate tensors ("taps"), with the fixture file names: a run records the ones asked
// for, chunk by chunk, and writes one .npy per tap. Layered taps stack to [L, S, ...].
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace gemstage {

class TapRecorder {
 public:
  // names: the taps to keep; "all" keeps every tap the run produces.
  explicit TapRecorder(const std::vector<std::string>& names);
  TapRecorder() = default;

  bool wants(const std::string& name) const { return all_ || names_.count(name) != 0; }

  // Appends `rows` rows of shape row_shape to a sequence tap ([S, ...]).
  void append(const std::string& name, const Shape& row_shape, const float* data, int64_t rows);
  void append_ids(const std::string& name, const std::vector<int64_t>& ids);
  // Id tap whose rows have row_shape (e.g. image_position_ids: rows of {2}) -> [rows, ...].
  void append_ids(const std::string& name, const std::vector<int64_t>& ids, const Shape& row_shape);
  // Appends rows to layer `layer` of a layered tap ([L, S, ...]).
  void append_layer(const std::string& name, int layer, int num_layers, const Shape& row_shape,
                    const float* data, int64_t rows);

  // Appends rows of ids to layer `layer` of a layered id tap ([L, S, ...], e.g. the experts each
  // row chose per layer).
  void append_layer_ids(const std::string& name, int layer, int num_layers, const Shape& row_shape,
                        const int64_t* ids, int64_t rows);

  std::vector<std::string> recorded() const;
  // The assembled tensor of one tap (f32 taps), e.g. for in-process comparisons.
  FloatTensor get(const std::string& name) const;
  std::vector<int64_t> get_ids(const std::string& name) const;
  bool has(const std::string& name) const { return taps_.count(name) != 0; }
  void write_dir(const std::string& dir) const;

 private:
  struct Tap {
    bool is_ids = false;
    Shape row_shape;
    int num_layers = 0;                           // 0: sequence tap
    std::vector<std::vector<float>> parts;        // one per layer (or one)
    std::vector<int64_t> ids;                     // sequence id taps
    std::vector<std::vector<int64_t>> id_layers;  // layered id taps, one per layer
  };
  Tap& tap(const std::string& name, const Shape& row_shape, int num_layers);
  // A layered tap's layers stacked to [L, rows, ...], checking they have one length.
  template <typename T>
  static std::vector<T> stack_layers(const std::string& name,
                                     const std::vector<std::vector<T>>& layers, int64_t& rows,
                                     int64_t row);

  bool all_ = false;
  std::set<std::string> names_;
  std::map<std::string, Tap> taps_;
};

// Every tap name the text path can produce (for --taps help and validation).
const std::vector<std::string>& known_tap_names();

}  // namespace gemstage
