// The tensor table: every checkpoint tensor gemstage knows, declared once, with everything the
// rest of the engine needs to know about it. Loading validates against it (registry.h), the
// text and vision binders fill their weight structs from it, export plans each stage file from
// it (plan_stage_tensors, src/stage/bundle.cc), `info` groups parameters by its labels
// (tools/cmd_info.cc), and the decode byte count sums its per-token matrices (src/stage/stage.cc).
// A new tensor kind is one entry in tensor_table.cc: give it a key, a shape, the parts holding it,
// its storage class, decode_read_in if it is a matrix read per token, an info label and (to run it)
// a slot in TextWeights / VisionWeights; loading, binding, export, check, info and bench follow.
//
// This is gemma4-level: it names parts of the model (TensorPart), not stages. The stage layer
// maps its StageRole to the parts a stage holds.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"
#include "gemma4/config.h"
#include "io/safetensors.h"

namespace gemstage {

struct TextWeights;           // gemma4/registry.h
struct VisionWeights;         // gemma4/vision_model.h
struct AudioWeights;          // gemma4/audio_model.h
struct UnifiedVisionWeights;  // gemma4/unified_embedder.h
struct UnifiedAudioWeights;   // gemma4/unified_embedder.h

enum class TensorRole {
  Required,  // must be present with this shape
  Ignored,   // may be present (HF skips it: KV-shared layers' k/v/k_norm, the tied lm_head);
             // never read, never exported
};

// The parts of the model a weight source can hold; bit flags so one tensor can sit in several
// (embed_tokens is both the embedding table and the tied LM head).
enum TensorPart : uint8_t {
  kPartEmbeddings = 1,  // token embedding, PLE table, PLE projection and norm
  kPartLayer = 2,       // one decoder layer (TensorSpec::layer says which)
  kPartHead = 4,        // final norm and the tied LM head
  kPartVision = 8,      // vision tower and its embedder into the text width
  kPartAudio = 16,      // audio tower and its embedder into the text width
};
using PartMask = uint8_t;

// A weight source's holding: which parts, and for kPartLayer which layers.
struct PartSet {
  PartMask parts = 0;
  int layer_begin = 0;
  int layer_end = 0;
};

// The storage formats a tensor may take in a bundle; storage_dtype picks one for an export.
enum class TensorStorage {
  Matrix,        // follows --weights: f32, bf16, q8_0 or q4_0
  Vector,        // norms and scalars: float only (bf16 in a bf16 bundle, else f32)
  VisionMatrix,  // float only (f32 in an f32 bundle, else bf16): the tower is small and
                 // sensitive to clipping, so it is never quantized
  VisionVector,  // f32 always (norms, clip bounds, standardization)
  PleTable,      // its own option, --ple-weights (bf16, int8 = q8_0 or f32)
};

DType storage_dtype(TensorStorage s, DType weights, DType ple);

// Where binding puts a tensor: at most one pointer is set (none for Ignored tensors, and for
// tables built without a bind target).
struct TensorSlot {
  WeightView* view = nullptr;            // a view over the stored bytes
  std::vector<float>* floats = nullptr;  // widened to f32 once (small vectors)
  float* scalar = nullptr;               // element 0 as f32
};

struct TensorSpec {
  std::string key;  // the HF key, with the config's text prefix (both config layouts)
  Shape shape;
  TensorRole role = TensorRole::Required;
  PartMask held_by = 0;  // the parts whose weight source holds it
  int layer = -1;        // for kPartLayer: the decoder layer
  TensorStorage storage = TensorStorage::Matrix;
  // Parts whose stage reads the whole matrix once per decoded token (the decode byte count).
  // embed_tokens counts only as the head: the embeddings part gathers one row of it.
  PartMask decode_read_in = 0;
  // The share of it one decoded token reads (the MoE experts: top_k / num_experts of the rows).
  double decode_share = 1.0;
  const char* info_part = "";  // the `info` parameters-by-part label
  TensorSlot slot;
};

// The text decoder's tensors, in export order. With `bind`, slots point into it (its layers
// are resized to the config's); without, slots are empty.
std::vector<TensorSpec> text_tensor_specs(const ModelConfig& c, TextWeights* bind = nullptr);
// The vision tower's and embedder's tensors (none without a vision_config).
std::vector<TensorSpec> vision_tensor_specs(const ModelConfig& c, VisionWeights* bind = nullptr);
// The audio tower's and embedder's tensors (none without an audio_config). Stored like the
// vision tower's: matrices f32/bf16 (VisionMatrix), everything else f32 (VisionVector).
std::vector<TensorSpec> audio_tensor_specs(const ModelConfig& c, AudioWeights* bind = nullptr);
// gemma4_unified's image and audio embedders (as released: model.vision_embedder.*,
// model.embed_vision.* / model.embed_audio.* projections), stored like the towers' tensors.
std::vector<TensorSpec> unified_tensor_specs(const ModelConfig& c,
                                             UnifiedVisionWeights* vision = nullptr,
                                             UnifiedAudioWeights* audio = nullptr);
// Text, vision, audio: the whole table in export order.
std::vector<TensorSpec> tensor_table(const ModelConfig& c);

// True when a source holding `held` holds tensor s.
bool part_holds(const PartSet& held, const TensorSpec& s);

// Reads s from the store into its slot; a no-op for slot-less specs.
void bind_tensor(const TensorSpec& s, const TensorSource& store);

// Checkpoint parts gemstage accepts but does not run (audio): key prefix and `info` label.
bool is_unrun_tensor(const std::string& key);
extern const char* const kUnrunInfoPart;

}  // namespace gemstage
