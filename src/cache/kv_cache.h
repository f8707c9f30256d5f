// KV caches. Sliding layers keep a ring of `window` rows (a query needs at most window-1 past
// keys plus itself); full layers grow to the context; KV-shared layers own nothing and read their
// donor's cache. K is stored after k_norm + RoPE, V after its scale-free norm.
//
// Rows are f32, bf16 or q8_0 (KvType). At long context the full layers' caches are what a decoded
// token reads besides the weights (E2B at 32k: seven full-layer reads of 134 MB each in f32), so
// bf16 halves that traffic and the cache's memory; f32 keeps an f32 checkpoint bit-faithful to HF.
// q8_0 (llama.cpp's -ctk/-ctv q8_0) stores each 32 values of a row as int8 codes with one f16
// scale, 34 bytes: 0.53x bf16, what lets a long context fit (docs/kv-cache.md). The attention
// kernels read q8_0 rows block by block, never widening the cache.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace gemstage {

enum class KvType : uint8_t { F32, BF16, Q8_0 };

// One q8_0 block of a cache row: 32 values as round(x / d) in [-127, 127] and the f16 bits of
// d = max|x| / 127 (llama.cpp's block_q8_0 layout, 34 bytes). A q8_0 row of width W is W / 32
// blocks, so a head's part of a row starts on a block when head_dim is a multiple of 32.
inline constexpr int64_t kKvQ8Values = 32;
struct KvQ8Block {
  uint16_t d;
  int8_t q[kKvQ8Values];
};
static_assert(sizeof(KvQ8Block) == 34);

// Rows of `values` floats -> values / 32 blocks (values a multiple of 32).
void quantize_kv_q8(const float* x, int64_t values, KvQ8Block* out);
// Element arithmetic on a row pointer of each cache type: the row `n` values on, and value i.
template <typename T>
const T* kv_advance(const T* p, int64_t n) {
  if constexpr (std::is_same_v<T, KvQ8Block>)
    return p + n / kKvQ8Values;
  else
    return p + n;
}
float kv_q8_value(const KvQ8Block* p, int64_t i);
template <typename T>
size_t kv_row_bytes(int64_t values) {
  if constexpr (std::is_same_v<T, KvQ8Block>)
    return static_cast<size_t>(values / kKvQ8Values) * sizeof(KvQ8Block);
  else
    return static_cast<size_t>(values) * sizeof(T);
}
// Bytes one position of width `values` takes in a cache of type t (K or V alone).
double kv_bytes_per_value(KvType t);
// Ring: a sliding-window layer's ring of the last rows; Growing: a full-attention layer's rows
// from position 0, grown up to the context size.
enum class CacheKind : uint8_t { Ring, Growing };

// One layer that keeps its own K/V (KV-shared layers have no entry: they read their donor's).
struct LayerCachePlan {
  int layer = 0;
  CacheKind kind = CacheKind::Growing;
  int64_t width = 0;   // K (and V) floats per position: kv heads * head_dim
  int64_t window = 0;  // Ring: the sliding window
};
const char* kv_type_name(KvType t);
// "f32" / "bf16" / "q8_0"; false for anything else.
bool kv_type_from_name(const std::string& s, KvType* out);

// Rows a sliding ring keeps beyond the window, so a cache can be rolled back this far.
constexpr int64_t kRollbackSlack = 512;

class LayerKvCache {
 public:
  LayerKvCache(CacheKind kind, int64_t width, int64_t window, int64_t max_context,
               KvType kv_type = KvType::F32);

  CacheKind kind() const { return kind_; }
  KvType kv_type() const { return kv_type_; }
  int64_t width() const { return width_; }
  int64_t window() const { return window_; }  // the sliding window (a ring's; kept by both)
  int64_t size() const { return n_; }         // positions 0..n-1 have been appended
  // Row of position pos in the cache's type: T = float for F32, uint16_t (bf16 bits) for BF16,
  // KvQ8Block for Q8_0 (width / 32 blocks).
  template <typename T>
  const T* k_at(int64_t pos) const {
    return kv_advance(rows<T>(), slot(pos) * width_);
  }
  template <typename T>
  const T* v_at(int64_t pos) const {
    return kv_advance(rows<T>(false), slot(pos) * width_);
  }
  // Values [offset, offset + n) of position pos's K (is_k) or V row, widened to f32.
  void widen(bool is_k, int64_t pos, int64_t offset, int64_t n, float* out) const;
  // The first position whose rows the cache still holds: 0 for a growing cache, and for a ring
  // the oldest row it has not overwritten (a rollback does not bring older rows back). Rows
  // first_held()..size()-1 can be widened.
  int64_t first_held() const { return oldest_; }
  // Appends rows for positions size()..size()+rows-1 (rounded to nearest-even for BF16).
  void append(const float* k, const float* v, int64_t rows);
  // Starts an empty ring at position `first`, so that the rows appended next are those of
  // positions first.. (a ring restored from the rows it held); false if the cache is not empty,
  // is growing (its rows start at 0), or first is negative or beyond the context.
  bool start_at(int64_t first);
  // Forgets positions n.. (a chat whose new prompt diverges from what was cached). Sliding rings
  // keep kRollbackSlack extra rows so the window before n is still intact; false if too far back.
  bool truncate(int64_t n);
  size_t bytes() const {
    return (k_.capacity() + v_.capacity()) * sizeof(float) +
           (k16_.capacity() + v16_.capacity()) * sizeof(uint16_t) +
           (kq8_.capacity() + vq8_.capacity()) * sizeof(KvQ8Block);
  }

 private:
  // The K (or V) rows of the cache's type; null when T is not that type.
  template <typename T>
  const T* rows(bool k = true) const {
    if constexpr (std::is_same_v<T, float>)
      return kv_type_ == KvType::F32 ? (k ? k_ : v_).data() : nullptr;
    else if constexpr (std::is_same_v<T, uint16_t>)
      return kv_type_ == KvType::BF16 ? (k ? k16_ : v16_).data() : nullptr;
    else
      return kv_type_ == KvType::Q8_0 ? (k ? kq8_ : vq8_).data() : nullptr;
  }
  size_t held_values() const;
  void resize_rows(size_t n);
  int64_t slot(int64_t pos) const { return kind_ == CacheKind::Ring ? pos % ring_ : pos; }

  CacheKind kind_;
  int64_t width_, window_, ring_, max_context_;
  KvType kv_type_;
  int64_t n_ = 0;
  int64_t oldest_ = 0;                // first_held()
  std::vector<float> k_, v_;          // F32
  std::vector<uint16_t> k16_, v16_;   // BF16
  std::vector<KvQ8Block> kq8_, vq8_;  // Q8_0: width / 32 blocks a position
};

class KvCache {
 public:
  // A stage's cache group: the planned layers of a model with num_layers layers.
  KvCache(int num_layers, std::span<const LayerCachePlan> plan, int64_t max_context,
          KvType kv_type = KvType::F32);

  int64_t max_context() const { return max_context_; }
  KvType kv_type() const { return kv_type_; }
  // Positions 0..n_past()-1 are held; the next call's rows start at n_past().
  int64_t n_past() const { return n_past_; }
  // Records that a call's rows were appended to every layer (after the call's last layer ran).
  void advance(int64_t rows) { n_past_ += rows; }
  // The cache a layer keeps; null for a KV-shared layer or a layer outside this group.
  LayerKvCache* own(int layer) { return layers_[static_cast<size_t>(layer)].get(); }
  const LayerKvCache* own(int layer) const { return layers_[static_cast<size_t>(layer)].get(); }
  size_t bytes() const;
  // Rolls every layer back to n positions; false (and unchanged) if a sliding ring cannot.
  bool truncate(int64_t n);
  bool can_truncate(int64_t n) const;
  // Drops rows appended past n_past() by a call that did not complete (a later stage failed).
  void drop_uncommitted();

 private:
  std::vector<std::unique_ptr<LayerKvCache>> layers_;
  int64_t max_context_;
  KvType kv_type_;
  int64_t n_past_ = 0;
};

}  // namespace gemstage
