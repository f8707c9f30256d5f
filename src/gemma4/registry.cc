#include "gemma4/registry.h"

#include <set>
#include <sstream>

#include "core/error.h"
#include "kernels/weight_rows.h"

namespace gemstage {

std::vector<std::string> validate_tensors(const std::vector<TensorSpec>& specs,
                                          const TensorStore& store, const ModelConfig& c) {
  std::ostringstream problems;
  int n_problems = 0;
  std::set<std::string> known;
  for (const TensorSpec& sp : specs) {
    known.insert(sp.key);
    if (!store.has(sp.key)) {
      if (sp.role == TensorRole::Required) {
        problems << "\n  missing tensor " << sp.key << " (expected shape " << shape_str(sp.shape)
                 << ")";
        ++n_problems;
      }
      continue;
    }
    if (sp.role == TensorRole::Ignored) continue;
    const WeightView v = store.view(sp.key);
    const WeightView* e = &v;
    if (e->shape != sp.shape) {
      problems << "\n  " << store.file_of(sp.key) << ": tensor " << sp.key << ": expected shape "
               << shape_str(sp.shape) << ", found " << shape_str(e->shape);
      ++n_problems;
    }
    if (e->dtype != DType::F32 && e->dtype != DType::BF16 && e->dtype != DType::F16 &&
        e->dtype != DType::Q8_0 && e->dtype != DType::Q4_0) {
      problems << "\n  " << store.file_of(sp.key) << ": tensor " << sp.key << ": dtype "
               << dtype_name(e->dtype)
               << " is not supported (expected F32, BF16, F16, Q8_0 or Q4_0)";
      ++n_problems;
    }
  }
  if (n_problems)
    fail(c.source, ": the checkpoint does not match its config (", n_problems, " problem",
         n_problems > 1 ? "s" : "", "):", problems.str());
  std::vector<std::string> unknown;
  for (const std::string& k : store.keys()) {
    if (known.count(k)) continue;
    if (is_unrun_tensor(k)) continue;
    unknown.push_back(k);
  }
  return unknown;
}

std::vector<float> vector_to_f32(const WeightView& w) {
  std::vector<float> v(static_cast<size_t>(shape_numel(w.shape)));
  for (size_t i = 0; i < v.size(); ++i) v[i] = weight_at(w, static_cast<int64_t>(i));
  return v;
}

TextWeights bind_text_weights(const ModelConfig& c, const TensorSource& store,
                              const PartSet& held) {
  TextWeights w;
  for (const TensorSpec& s : text_tensor_specs(c, &w))
    if (s.role == TensorRole::Required && part_holds(held, s)) bind_tensor(s, store);
  for (int i = held.layer_begin; i < held.layer_end; ++i)
    w.layers[static_cast<size_t>(i)].bound = true;
  return w;
}

}  // namespace gemstage
