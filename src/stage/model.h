// A loaded model: config, stages with their weights bound, and the bundle's or checkpoint's
// notes. Read-only once open, so any number of sequences (stage/sequence.h) run on one Model at
// the same time; share it as std::shared_ptr<const Model>.
//
// An HF checkpoint directory runs as the three-stage chain embeddings, layers [0, L),
// final_norm_head over the memory-mapped checkpoint; a bundle runs its exported stages.
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cache/kv_cache.h"
#include "gemma4/config.h"
#include "io/safetensors.h"
#include "stage/contract.h"
#include "stage/remote_stage.h"
#include "stage/stage.h"

namespace gemstage {

class Model {
 public:
  // path: an HF checkpoint directory or a gemstage bundle. Opens every stage here.
  static std::shared_ptr<const Model> open(const std::string& path);
  // Opens a bundle's `placement.local` stages here and the others through placement.remote (or
  // not at all, without it: a worker process that runs only its own stages).
  static std::shared_ptr<const Model> open(const std::string& path,
                                           const StagePlacementOptions& placement);
  ~Model();

  const ModelConfig& config() const { return *config_; }
  const std::string& path() const { return path_; }
  bool is_bundle() const { return is_bundle_; }
  // The directory holding tokenizer.json and friends (the checkpoint, or the bundle's copies).
  const std::string& assets_dir() const { return path_; }
  const std::vector<std::string>& notes() const { return notes_; }

  const std::vector<StageDecl>& stage_decls() const { return decls_; }
  // One entry per stage decl: the stage opened here, or null where it runs elsewhere
  // (remote_stages()) or, in a worker process, not at all.
  const std::vector<std::unique_ptr<Stage>>& stages() const { return stages_; }
  // One entry per stage decl: the handle of a stage another process runs, else null.
  const std::vector<std::unique_ptr<RemoteStage>>& remote_stages() const { return remote_; }
  // Empty while every remote stage answers; else why one stopped (its RemoteStage::failure).
  std::string stage_failure() const;
  // The stage with this id; null if there is none.
  const Stage* find_stage(const std::string& id) const;
  const Stage& embeddings() const;

  // The longest context a sequence may have: a bundle's declared max_context (its caches were
  // planned for it), else the model's max_position_embeddings.
  int64_t max_context() const { return max_context_; }
  // The KV row type a new sequence gets: BF16 for quantized (Q8_0/Q4_0) transformer weights,
  // whose own rounding is far larger and which gain half the cache traffic at depth; F32 for f32
  // and bf16 weights, which compute in f32 as the reference does.
  KvType default_kv_type() const { return default_kv_type_; }

  // A number for a new sequence's rows in the processes of remote stages, unique among this
  // model's sequences (each keeps its cache group there under it).
  uint64_t new_remote_sequence_id() const { return next_remote_id_.fetch_add(1); }

  // Bytes of every matrix the transformer and head stages read for one decoded token.
  double decode_weight_bytes() const;
  // The embeddings stage's vision tower; null for checkpoints without vision_config.
  const VisionTower* vision() const { return embeddings().vision(); }
  // The embeddings stage's audio tower; null for checkpoints without audio_config.
  const AudioTower* audio() const { return embeddings().audio(); }
  const TextModel& embeddings_model() const { return embeddings().text(); }

 private:
  Model() = default;

  std::string path_;
  bool is_bundle_ = false;
  // Stages keep references into the config, so it stays at one address.
  std::unique_ptr<ModelConfig> config_;
  std::vector<std::unique_ptr<Stage>> stages_;
  std::vector<std::unique_ptr<RemoteStage>> remote_;
  std::vector<StageDecl> decls_;
  std::vector<std::string> notes_;
  int64_t max_context_ = 0;
  KvType default_kv_type_ = KvType::F32;
  mutable std::atomic<uint64_t> next_remote_id_{1};
};

// Opens a front end's models. In a run spread over MPI ranks, rank 0's opener holds the job's
// bundle and its stage placement (src/distributed makes it), so opening that bundle opens this
// process's stages here and the others as remote clients; every other path (a drafter, a
// reference checkpoint) and every path of a one-process run opens whole. A value the front end
// hands to what opens models (commands, the server), never process state.
class ModelOpener {
 public:
  ModelOpener() = default;
  ModelOpener(std::string bundle, StagePlacementOptions placement);
  std::shared_ptr<const Model> open(const std::string& path) const;
  // Whether this opener places a bundle across processes.
  bool places_stages() const { return placement_.has_value(); }

 private:
  std::string bundle_;
  std::optional<StagePlacementOptions> placement_;
};

}  // namespace gemstage
