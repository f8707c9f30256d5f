// gemstage info: architecture, parameter counts per part, layer table with KV donors, memory.
#include <iomanip>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include "cache/kv_cache.h"
#include "core/error.h"
#include "gemma4/tensor_table.h"
#include "gemma4/unified_embedder.h"
#include "stage/bundle.h"
#include "stage/model.h"
#include "tools/cli_common.h"
#include "tools/commands.h"

namespace gemstage::cli {

namespace {

struct InfoArgs {
  std::string model;
  int64_t ctx = 0;
  bool verbose = false;
};

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  std::ostringstream os;
  os << std::fixed << std::setprecision(u ? 2 : 0) << b << " " << units[u];
  return os.str();
}

std::string human_count(double n) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(3);
  if (n >= 1e9)
    os << n / 1e9 << " B";
  else if (n >= 1e6)
    os << n / 1e6 << " M";
  else
    os << std::setprecision(0) << n;
  return os.str();
}

int run_info(const InfoArgs& a) {
  ModelConfig c;
  std::shared_ptr<TensorSource> src;
  std::vector<std::string> notes;
  std::optional<BundleManifest> bundle;
  if (is_bundle_dir(a.model)) {
    bundle = read_bundle_manifest(a.model);
    c = bundle->config;
    src = open_bundle_tensors(a.model, *bundle);
    notes = c.warnings;
  } else {
    // Opening runs what every command runs: the config, the tensor checks, the stages bound.
    auto m = Model::open(a.model);
    c = m->config();
    notes = m->notes();
    auto store = std::make_shared<TensorStore>(TensorStore::open_dir(a.model));
    canonicalize_checkpoint_keys(c, *store);
    src = store;
  }
  print_model_notes(notes, a.verbose);
  const TextConfig& t = c.text;
  const TensorSource& st = *src;

  // Parameter counts by part, from the tensors actually stored, labelled by the tensor table.
  std::map<std::string, std::pair<double, double>> parts;  // part -> (params, bytes)
  std::map<std::string, std::string> label;
  for (const TensorSpec& s : tensor_table(c)) label[s.key] = s.info_part;
  std::set<std::string> seen;
  for (const std::string& k : st.keys()) {
    if (!seen.insert(k).second) continue;
    const WeightView e = st.view(k);
    const auto it = label.find(k);
    const std::string part = it != label.end()    ? it->second
                             : is_unrun_tensor(k) ? kUnrunInfoPart
                                                  : "other";
    parts[part].first += static_cast<double>(shape_numel(e.shape));
    parts[part].second += static_cast<double>(e.nbytes);
  }

  std::cout << "model        " << a.model << (bundle ? " (gemstage bundle)" : "") << "\n";
  std::cout << "architecture " << (c.architecture.empty() ? "(none given)" : c.architecture)
            << (c.multimodal ? " (multimodal layout)" : " (text-only layout)") << "\n";
  std::cout << "text         D=" << t.hidden_size << " layers=" << t.num_hidden_layers
            << " heads=" << t.num_attention_heads << " kv_heads=" << t.num_key_value_heads
            << " head_dim=" << t.head_dim << "/" << t.global_head_dim
            << " (sliding/full) vocab=" << t.vocab_size << " PLE=" << t.ple_dim()
            << " window=" << t.sliding_window << " kv_shared=" << t.num_kv_shared_layers
            << " softcap=" << t.final_logit_softcapping << "\n";
  if (c.vision)
    std::cout << "vision       hidden=" << c.vision->hidden_size
              << " layers=" << c.vision->num_hidden_layers
              << " heads=" << c.vision->num_attention_heads << " patch=" << c.vision->patch_size
              << " pool=" << c.vision->pooling_kernel_size
              << (c.vision->use_clipped_linears ? " clipped-linears" : "") << "\n";
  if (c.unified_vision)
    std::cout << "vision       no tower: " << c.unified_vision->block() << "-px patches ("
              << c.unified_vision->patch_dim() << " values) -> embedder width "
              << c.unified_vision->mm_embed_dim << ", positions "
              << c.unified_vision->mm_posemb_size << " x 2, at most "
              << c.unified_vision->num_soft_tokens << " soft tokens per image\n";
  if (c.unified_audio)
    std::cout << "audio        no tower: frames of " << c.unified_audio->frame_samples
              << " samples (16 kHz) -> one soft token each\n\n";
  else if (c.audio)
    std::cout << "audio        hidden=" << c.audio->hidden_size
              << " layers=" << c.audio->num_hidden_layers
              << " heads=" << c.audio->num_attention_heads << " subsampling=["
              << c.audio->subsampling_channels[0] << ", " << c.audio->subsampling_channels[1]
              << "] conv_kernel=" << c.audio->conv_kernel_size
              << " chunk=" << c.audio->attention_chunk_size
              << " context_left=" << c.audio->attention_context_left
              << " output=" << c.audio->output_proj_dims
              << (c.audio->use_clipped_linears ? " clipped-linears" : "")
              << " (16 kHz log-mel, 25 soft tokens per second, at most 750 per clip)\n\n";
  else
    std::cout << "audio        none\n\n";

  std::cout << "parameters by part\n";
  double total_p = 0, total_b = 0;
  for (const auto& [name, pb] : parts) {
    std::cout << "  " << std::left << std::setw(48) << name << std::right << std::setw(12)
              << human_count(pb.first) << std::setw(14) << human_bytes(pb.second) << "\n";
    total_p += pb.first;
    total_b += pb.second;
  }
  std::cout << "  " << std::left << std::setw(48) << "total" << std::right << std::setw(12)
            << human_count(total_p) << std::setw(14) << human_bytes(total_b) << "\n\n";

  if (bundle) {
    std::cout << "stages (weights " << bundle->weights_format << ", PLE table "
              << bundle->ple_weights_format << ", max_context " << bundle->max_context << ")\n";
    for (const BundleStage& bs : bundle->stages)
      std::cout << "  " << std::left << std::setw(16) << bs.decl.id << std::setw(20)
                << stage_role_name(bs.decl.role) << std::setw(10)
                << (bs.decl.role == StageRole::TransformerLayers ? bs.decl.layers.str() : "-")
                << std::right << std::setw(14) << human_bytes(static_cast<double>(bs.bytes)) << "  "
                << bs.weights_file << "\n";
    if (!bundle->kept_bf16.empty()) {
      std::cout << "kept in bf16 (input width not a multiple of the 32-wide "
                << bundle->weights_format << " block): " << bundle->kept_bf16.size()
                << " tensor(s)\n";
      for (const std::string& k : bundle->kept_bf16) std::cout << "  " << k << "\n";
    }
    std::cout << "\n";
  }
  std::cout << "layers\n   #  type                head_dim kv_heads  mlp    kv\n";
  double kv_per_token = 0;
  for (size_t i = 0; i < t.layers.size(); ++i) {
    const LayerSpec& s = t.layers[i];
    std::string kv = s.kv_shared ? "shared <- layer " + std::to_string(s.kv_donor) : "own";
    if (s.is_donor) kv += " (donor)";
    if (s.k_eq_v) kv += ", k_eq_v (V = v_norm(raw K))";
    if (s.moe)
      kv += ", MoE: " + std::to_string(t.top_k_experts) + " of " + std::to_string(t.num_experts) +
            " experts x " + std::to_string(t.moe_intermediate_size);
    std::cout << "  " << std::setw(2) << i << "  " << std::left << std::setw(20)
              << layer_type_name(s.type) << std::right << std::setw(8) << s.head_dim << std::setw(9)
              << s.num_kv_heads << std::setw(7) << s.mlp_width << "    " << kv << "\n";
    if (!s.kv_shared && s.type == LayerType::Full)
      kv_per_token += 2.0 * s.num_kv_heads * s.head_dim;  // K and V values
  }
  double sliding_values = 0;
  bool q8_fits = true;  // every head a whole number of q8_0 blocks
  for (const LayerSpec& s : t.layers) {
    if (!s.kv_shared && s.type == LayerType::Sliding)
      sliding_values += 2.0 * s.num_kv_heads * s.head_dim * t.sliding_window;
    q8_fits = q8_fits && s.head_dim % kKvQ8Values == 0;
  }
  const int64_t ctx = a.ctx > 0 ? a.ctx : t.max_position_embeddings;
  std::cout << "\nmemory\n"
            << "  weights (mmapped)         " << human_bytes(total_b) << "\n"
            << "  KV cache (--cache-type)   sliding (fixed)  full per token  KV at context " << ctx
            << "\n";
  for (const KvType kt : {KvType::F32, KvType::BF16, KvType::Q8_0}) {
    std::cout << "  " << std::left << std::setw(26) << kv_type_name(kt) << std::right;
    if (kt == KvType::Q8_0 && !q8_fits) {
      std::cout << "n/a (a head_dim is not a multiple of 32)\n";
      continue;
    }
    const double b = kv_bytes_per_value(kt);
    std::cout << std::setw(15) << human_bytes(sliding_values * b) << std::setw(16)
              << human_bytes(kv_per_token * b) << std::setw(16)
              << human_bytes((sliding_values + kv_per_token * static_cast<double>(ctx)) * b)
              << "\n";
  }
  return 0;
}

}  // namespace

void add_info_command(CLI::App& app, Registry& reg) {
  auto a = std::make_shared<InfoArgs>();
  auto* sub = app.add_subcommand(
      "info", "Print architecture, parameter counts, layer table, KV donors and memory needs");
  sub->add_option("-m,--model", a->model, "Hugging Face checkpoint directory or gemstage bundle")
      ->required();
  sub->add_option("-c,--ctx-size", a->ctx,
                  "context size for the KV memory estimate (default: max_position_embeddings)");
  sub->add_flag("-v,--verbose", a->verbose, "list unused config fields and tensors");
  reg.add(sub, [a] { return run_info(*a); });
}

}  // namespace gemstage::cli
