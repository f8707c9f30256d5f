// `gemstage parity`: run a model (HF checkpoint or bundle) on a reference dump's inputs, compare
// every tap present in both, teacher-force the reference sequence, measure how much the image
// matters, and locate the first divergence. The result is one JSON report (schema in
// docs/parity.md); the table, the plot and the gates all read it.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "gemma4/placeholder_policy.h"
#include "parity/reference.h"
#include "stage/sequence.h"

namespace gemstage {

constexpr int kParityReportVersion = 1;

struct ParityOptions {
  std::vector<std::string> images;  // image files overriding the reference's image
  std::vector<std::string> audios;  // audio files overriding the reference's clip
  PleIdentity ple_identity = PleIdentity::Pad;
  double tie_tol = 0.02;       // a top-1 within this many logits of the reference max agrees
  double diverge_cos = 0.999;  // a layer whose cosine falls below this diverges
  bool image_gate = true;      // also run with the image replaced by a blank one
  bool audio_gate = true;      // also run with the audio replaced by silence of the same length
  int64_t max_step_rows = 64;  // per-step teacher-forcing rows kept in the report
};

// Row classes for per-row statistics.
enum class RowClass { Text, Image, Special, Audio };
const char* row_class_name(RowClass c);
// Image / video placeholders are image rows and audio placeholders audio rows (their rows carry
// tower features); bos, eos, pad, boi/eoi, boa/eoa are special rows; the rest are text rows.
RowClass classify_token(const ModelConfig& c, int64_t id);

nlohmann::json run_parity(Sequence& model, const ReferenceDump& ref, const ParityOptions& opt,
                          ThreadPool& pool);

// The human-readable table of a report.
void print_parity_table(const nlohmann::json& report, std::ostream& os);

// The layer where parity is first lost, in the order vision -> audio -> embeddings -> layers ->
// head, from
// the per-layer statistics of a report's taps (also stored in report["first_divergence"]).
nlohmann::json find_first_divergence(const nlohmann::json& taps, double diverge_cos);

}  // namespace gemstage
