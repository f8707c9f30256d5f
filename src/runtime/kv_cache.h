// KV caches. Sliding layers keep a ring of `window` rows (a query needs at most window-1 past
// keys plus itself); full layers grow to the context; KV-shared layers own nothing and read their
// donor's cache. K is stored after k_norm + RoPE, V after its scale-free norm, both f32.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "gemma4/config.h"

namespace gemstage {

// Rows a sliding ring keeps beyond the window, so a cache can be rolled back this far.
constexpr int64_t kRollbackSlack = 512;

class LayerKvCache {
 public:
  LayerKvCache(LayerType type, int64_t width, int64_t window, int64_t max_context);

  LayerType type() const { return type_; }
  int64_t width() const { return width_; }
  int64_t size() const { return n_; }  // positions 0..n-1 have been appended
  // Oldest position still held (sliding: n - window).
  int64_t first_held() const;
  const float* k_at(int64_t pos) const { return k_.data() + slot(pos) * width_; }
  const float* v_at(int64_t pos) const { return v_.data() + slot(pos) * width_; }
  // Appends rows for positions size()..size()+rows-1.
  void append(const float* k, const float* v, int64_t rows);
  // Forgets positions n.. (a chat whose new prompt diverges from what was cached). Sliding rings
  // keep kRollbackSlack extra rows so the window before n is still intact; false if too far back.
  bool truncate(int64_t n);
  size_t bytes() const { return (k_.capacity() + v_.capacity()) * sizeof(float); }

 private:
  int64_t slot(int64_t pos) const { return type_ == LayerType::Sliding ? pos % ring_ : pos; }

  LayerType type_;
  int64_t width_, window_, ring_, max_context_;
  int64_t n_ = 0;
  std::vector<float> k_, v_;
};

class KvCache {
 public:
  // Holds the own-KV layers in [layer_begin, layer_end) (-1: all): a stage's cache group.
  KvCache(const TextConfig& t, int64_t max_context, int layer_begin = 0, int layer_end = -1);

  int64_t max_context() const { return max_context_; }
  int64_t n_past() const { return n_past_; }
  void set_n_past(int64_t n) { n_past_ = n; }
  // The cache a layer reads (its donor's for shared layers); null for a layer outside this cache.
  LayerKvCache* own(int layer) { return layers_[static_cast<size_t>(layer)].get(); }
  const LayerKvCache* own(int layer) const { return layers_[static_cast<size_t>(layer)].get(); }
  size_t bytes() const;
  // Rolls every layer back to n positions; false (and unchanged) if a sliding ring cannot.
  bool truncate(int64_t n);
  bool can_truncate(int64_t n) const;

 private:
  std::vector<std::unique_ptr<LayerKvCache>> layers_;
  int64_t max_context_;
  int64_t n_past_ = 0;
};

}  // namespace gemstage
