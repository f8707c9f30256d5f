// Bundles: a model exported as a pipeline of stages.
//
//   BUNDLE/manifest.json      versioned schema (format "gemstage-bundle", schema_version 2):
//                             the model config, weight formats, max_context, copied files with
//                             SHA-256, and per stage: id, role, layer range, contract, weights
//                             file + SHA-256 + size, cache groups, KV donor map
//   BUNDLE/<stage id>.gsw     the stage's weights (stage/weights_file.h), tensors 64-byte aligned
//   BUNDLE/config.json, tokenizer.json, tokenizer_config.json, preprocessor_config.json, ...
//                             copied verbatim from the checkpoint
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "gemma4/assistant_model.h"
#include "gemma4/config.h"
#include "io/safetensors.h"
#include "stage/contract.h"

namespace gemstage {

// Version 2: the embeddings stage takes no positions (the transformer stages do) and may take
// image_soft_tokens. Version 1 bundles are still read (see read_bundle_manifest).
constexpr int kBundleSchemaVersion = 2;
constexpr int kBundleSchemaVersionV1 = 1;

struct CacheGroup {
  std::string kind;  // "sliding" or "full"
  std::vector<int> layers;
  int64_t capacity = 0, window = 0;
};

struct BundleStage {
  StageDecl decl;
  std::string weights_file, sha256;
  uint64_t bytes = 0;
  std::vector<CacheGroup> cache_groups;
  std::vector<std::pair<int, int>> kv_donors;  // (shared layer, donor)
};

// The MTP drafter as its own stage (export -md): placed with the last transformer stage, whose
// KV caches it reads (docs/gemma4-mtp.md); its weights file holds the drafter's tensors
// (matrices in the bundle's format, vectors f32), drafter_config.json its checkpoint config.
struct BundleDrafter {
  std::string id, placed_with, config_file, config_sha256, weights_file, sha256;
  uint64_t bytes = 0;
  int reads_sliding = -1, reads_full = -1;  // the target layers whose K/V it reads (-1: none)
};

struct BundleManifest {
  nlohmann::json raw;
  ModelConfig config;
  std::string weights_format, ple_weights_format;
  int64_t max_context = 0;
  std::vector<BundleStage> stages;
  std::vector<std::pair<std::string, std::string>> copied_files;  // (name, sha256)
  std::optional<BundleDrafter> drafter;
  // Matrices a q8_0 / q4_0 bundle stores in bf16: their input width is not a multiple of the
  // 32-wide block (export's per-tensor fallback).
  std::vector<std::string> kept_bf16;
};

bool is_bundle_dir(const std::string& path);
// Parses and validates the schema (not hashes or weights: see check_bundle).
BundleManifest read_bundle_manifest(const std::string& dir);

struct ExportOptions {
  std::string stages = "1";      // "0:21,21:42" or a stage count
  std::string weights = "bf16";  // f32 | bf16 | q8_0 | q4_0
  // auto: f32 for f32 bundles, else bf16 (the table is only gathered, never multiplied);
  // int8 stores it as Q8_0 blocks (half the size of bf16).
  std::string ple_weights = "auto";  // auto | f32 | bf16 | int8
  int64_t max_context = 0;           // 0: the model's max_position_embeddings
  bool progress = true;
  // Write into an output folder that holds files other than a gemstage bundle (they are left
  // alone). Without it such a folder is refused; an existing bundle is always replaced.
  bool force = false;
  // What the manifest names as the source ("source_model"); empty: the checkpoint's path.
  std::string source_description;
  // A gemma4_assistant (MTP) drafter checkpoint written as the bundle's drafter stage (-md).
  std::string drafter;
};

// Streams tensors from the checkpoint into stage files; never holds a whole model in memory.
// Every file is written as NAME.gemstage-partial, synced and hashed, and renamed into place only
// when all of them are complete, manifest.json last: a failed or interrupted export leaves no
// manifest.json and no new final-named file (a failure removes its partial files; an existing
// bundle in out_dir stays intact until the new one is complete, then is replaced).
void export_bundle(const std::string& hf_dir, const std::string& out_dir, const ExportOptions& opt);
// The same from any tensor source that follows the tensor table of config_dir/config.json (e.g.
// make-random's generator, which writes a random model straight into a 4-bit bundle without a
// bf16 checkpoint first); config_dir also holds the files copied into the bundle.
void export_bundle_from(const TensorSource& store, const std::string& config_dir,
                        const std::string& out_dir, const ExportOptions& opt);

struct CheckOptions {
  std::string reference_model;  // optional HF dir: compare the bundle's logits against it
  double reference_atol = -1;   // -1: a default that depends on the weight format
};

// Runs every check, printing one PASS/FAIL line each; returns the number of failures.
int check_bundle(const std::string& dir, const CheckOptions& opt, std::ostream& log);

std::string sha256_file(const std::string& path);

// The bundle's drafter stage (null when it has none), checked against the bundle's model.
std::unique_ptr<AssistantModel> open_bundle_drafter(const std::string& dir,
                                                    const BundleManifest& m);

// -md PATH: a gemma4_assistant checkpoint directory, or a bundle whose drafter stage (export -md)
// is taken, so a drafter quantized at export serves other targets of its shape too. Fails, saying
// what to pass instead, for a bundle without one.
std::unique_ptr<AssistantModel> open_drafter(const std::string& path);

// Every stage's weights of a bundle as one tensor source (a key held by two stages, such as the
// tied embedding, resolves to the first).
std::shared_ptr<TensorSource> open_bundle_tensors(const std::string& dir, const BundleManifest& m);

}  // namespace gemstage
