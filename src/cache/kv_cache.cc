#include "cache/kv_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "core/error.h"

namespace gemstage {

const char* kv_type_name(KvType t) {
  switch (t) {
    case KvType::BF16:
      return "bf16";
    case KvType::Q8_0:
      return "q8_0";
    case KvType::F32:
      break;
  }
  return "f32";
}

bool kv_type_from_name(const std::string& s, KvType* out) {
  if (s == "f32")
    *out = KvType::F32;
  else if (s == "bf16")
    *out = KvType::BF16;
  else if (s == "q8_0")
    *out = KvType::Q8_0;
  else
    return false;
  return true;
}

double kv_bytes_per_value(KvType t) {
  switch (t) {
    case KvType::BF16:
      return 2.0;
    case KvType::Q8_0:
      return static_cast<double>(sizeof(KvQ8Block)) / kKvQ8Values;
    case KvType::F32:
      break;
  }
  return 4.0;
}

void quantize_kv_q8(const float* x, int64_t values, KvQ8Block* out) {
  for (int64_t b = 0; b < values / kKvQ8Values; ++b) {
    const float* v = x + b * kKvQ8Values;
    float amax = 0;
    for (int64_t i = 0; i < kKvQ8Values; ++i) amax = std::max(amax, std::fabs(v[i]));
    // The codes divide by the scale as stored (f16), so a value decodes to within half a code.
    const uint16_t dh = f32_to_f16(amax / 127.0f);
    const float d = f16_to_f32(dh);
    const float inv = d > 0 ? 1.0f / d : 0.0f;
    KvQ8Block& o = out[b];
    o.d = dh;
    for (int64_t i = 0; i < kKvQ8Values; ++i)
      o.q[i] = static_cast<int8_t>(std::clamp(std::nearbyint(v[i] * inv), -127.0f, 127.0f));
  }
}

float kv_q8_value(const KvQ8Block* p, int64_t i) {
  const KvQ8Block& b = p[i / kKvQ8Values];
  return f16_to_f32(b.d) * static_cast<float>(b.q[i % kKvQ8Values]);
}

LayerKvCache::LayerKvCache(CacheKind kind, int64_t width, int64_t window, int64_t max_context,
                           KvType kv_type)
    : kind_(kind),
      width_(width),
      window_(window),
      ring_(window + kRollbackSlack),
      max_context_(max_context),
      kv_type_(kv_type) {
  if (kv_type_ == KvType::Q8_0 && width_ % kKvQ8Values != 0)
    fail("a q8_0 KV cache needs rows of a multiple of ", kKvQ8Values, " values; this layer's are ",
         width_, " wide (use --cache-type-k/-v bf16)");
  if (kind_ == CacheKind::Ring) resize_rows(static_cast<size_t>(ring_ * width_));
}

void LayerKvCache::resize_rows(size_t n) {
  if (kv_type_ == KvType::F32) {
    k_.resize(n);
    v_.resize(n);
  } else if (kv_type_ == KvType::BF16) {
    k16_.resize(n);
    v16_.resize(n);
  } else {
    kq8_.resize(n / kKvQ8Values);
    vq8_.resize(n / kKvQ8Values);
  }
}

size_t LayerKvCache::held_values() const {
  return std::max({k_.size(), k16_.size(), kq8_.size() * kKvQ8Values});
}

void LayerKvCache::widen(bool is_k, int64_t pos, int64_t offset, int64_t n, float* out) const {
  switch (kv_type_) {
    case KvType::F32: {
      const float* r = (is_k ? k_at<float>(pos) : v_at<float>(pos)) + offset;
      std::copy(r, r + n, out);
      return;
    }
    case KvType::BF16: {
      const uint16_t* r = (is_k ? k_at<uint16_t>(pos) : v_at<uint16_t>(pos)) + offset;
      for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(r[i]);
      return;
    }
    case KvType::Q8_0: {
      const KvQ8Block* r = is_k ? k_at<KvQ8Block>(pos) : v_at<KvQ8Block>(pos);
      for (int64_t i = 0; i < n; ++i) out[i] = kv_q8_value(r, offset + i);
      return;
    }
  }
}

bool LayerKvCache::truncate(int64_t n) {
  if (n < 0 || n > n_) return false;
  // After the rollback a query at n needs positions n-window+1..n-1 still in the ring.
  if (kind_ == CacheKind::Ring && n_ - n > ring_ - window_) return false;
  n_ = n;
  return true;
}

bool LayerKvCache::start_at(int64_t first) {
  if (n_ != 0 || kind_ != CacheKind::Ring || first < 0 || first > max_context_) return false;
  n_ = oldest_ = first;
  return true;
}

void LayerKvCache::append(const float* k, const float* v, int64_t rows) {
  if (n_ + rows > max_context_)
    fail("context limit reached: ", n_ + rows, " tokens exceed the cache size of ", max_context_,
         " (raise --ctx-size / -c, up to the model's max_position_embeddings)");
  if (kind_ == CacheKind::Growing) {
    // Grow geometrically so long prefills stay linear; never beyond max_context.
    const size_t need = static_cast<size_t>((n_ + rows) * width_);
    const size_t held = held_values();
    if (need > held)
      resize_rows(std::min(static_cast<size_t>(max_context_ * width_), std::max(need, held * 2)));
  }
  // Only the last `window` rows of a long chunk survive in a ring.
  const int64_t skip = kind_ == CacheKind::Ring ? std::max<int64_t>(0, rows - ring_) : 0;
  for (int64_t r = skip; r < rows; ++r) {
    const int64_t s = slot(n_ + r);
    if (kv_type_ == KvType::F32) {
      std::memcpy(k_.data() + s * width_, k + r * width_,
                  static_cast<size_t>(width_) * sizeof(float));
      std::memcpy(v_.data() + s * width_, v + r * width_,
                  static_cast<size_t>(width_) * sizeof(float));
    } else if (kv_type_ == KvType::Q8_0) {
      quantize_kv_q8(k + r * width_, width_, kq8_.data() + s * width_ / kKvQ8Values);
      quantize_kv_q8(v + r * width_, width_, vq8_.data() + s * width_ / kKvQ8Values);
    } else {
      for (int64_t i = 0; i < width_; ++i) {
        k16_[static_cast<size_t>(s * width_ + i)] = f32_to_bf16(k[r * width_ + i]);
        v16_[static_cast<size_t>(s * width_ + i)] = f32_to_bf16(v[r * width_ + i]);
      }
    }
  }
  n_ += rows;
  if (kind_ == CacheKind::Ring) oldest_ = std::max(oldest_, n_ - ring_);
}

KvCache::KvCache(int num_layers, std::span<const LayerCachePlan> plan, int64_t max_context,
                 KvType kv_type)
    : max_context_(max_context), kv_type_(kv_type) {
  if (max_context <= 0) fail("context size must be positive");
  layers_.resize(static_cast<size_t>(num_layers));
  for (const LayerCachePlan& p : plan) {
    if (p.layer < 0 || p.layer >= num_layers)
      fail("KV cache plan: layer ", p.layer, " is outside [0, ", num_layers, ")");
    layers_[static_cast<size_t>(p.layer)] =
        std::make_unique<LayerKvCache>(p.kind, p.width, p.window, max_context, kv_type);
  }
}

size_t KvCache::bytes() const {
  size_t n = 0;
  for (const auto& l : layers_)
    if (l) n += l->bytes();
  return n;
}

}  // namespace gemstage

namespace gemstage {

bool KvCache::can_truncate(int64_t n) const {
  if (n < 0 || n > n_past_) return false;
  for (const auto& l : layers_)
    if (l && l->kind() == CacheKind::Ring && l->size() - n > kRollbackSlack) return false;
  return true;
}

bool KvCache::truncate(int64_t n) {
  if (!can_truncate(n)) return false;
  for (const auto& l : layers_)
    if (l) l->truncate(n);
  n_past_ = n;
  return true;
}

void KvCache::drop_uncommitted() {
  for (const auto& l : layers_)
    if (l && l->size() > n_past_) l->truncate(n_past_);
}

}  // namespace gemstage
