// gemstage run-stage: one stage of a bundle (or of a checkpoint's three-stage chain) on its own,
// from named .npy inputs to named .npy outputs, checked against the stage's contract both ways.
// A transformer stage starts from a fresh cache (positions from 0: the rows of a first prefill
// call) or, with --past DIR, from the cache a `dump --cache-out` or an earlier `run-stage
// --cache-out` saved (positions from its n_past: a decode step, a later prefill chunk), and can
// save the cache it leaves. Someone integrating a single stage into another runtime feeds it the
// tensors their side produces and compares what comes out with what their side expects next.
// A bundle's drafter runs the same way: one draft step, reading the donor caches of the stage it
// is placed with from --past.
#include <filesystem>
#include <iostream>
#include <optional>

#include "core/error.h"
#include "io/npy.h"
#include "stage/bundle.h"
#include "stage/cache_files.h"
#include "stage/drafter_stage.h"
#include "stage/model.h"
#include "tools/cli_common.h"
#include "tools/commands.h"

namespace gemstage::cli {

namespace {

struct RunStageArgs {
  std::string model, stage, out;
  std::vector<std::string> inputs;  // NAME=FILE.npy
  std::string past, cache_out;      // KV cache directories (stage/cache_files.h)
  int64_t ctx = 0;
  int threads = 0;
  bool verbose = false;
};

std::string stage_list(const Model& m, const std::optional<BundleDrafter>& drafter) {
  std::string s;
  for (const StageDecl& d : m.stage_decls())
    s += (s.empty() ? "" : ", ") + d.id + " (" + stage_role_name(d.role) + ")";
  if (drafter) s += ", " + drafter->id + " (drafter)";
  return s;
}

void write_outputs(const TensorMap& outputs, const std::string& dir) {
  std::filesystem::create_directories(dir);
  for (const auto& [name, t] : outputs) {
    const std::string path = (std::filesystem::path(dir) / (name + ".npy")).string();
    save_npy(path, t);
    std::cerr << "wrote " << path << " " << elem_type_name(t.type()) << " " << shape_str(t.shape())
              << "\n";
  }
}

// One draft step of the bundle's drafter: the donor layers' caches come from --past, the saved
// cache group of the stage the drafter is placed with, and `position` must be the positions
// they hold.
int run_drafter_cmd(const RunStageArgs& a, const Model& model, const BundleManifest& m,
                    TensorMap inputs, int64_t ctx) {
  const BundleDrafter& d = *m.drafter;
  if (!a.cache_out.empty())
    fail("stage '", d.id, "' is a drafter, which only reads KV caches; --cache-out is for ",
         "transformer stages");
  if (a.past.empty())
    fail("stage '", d.id, "' (drafter) reads the KV caches of stage '", d.placed_with,
         "'; give them with --past DIR (written by `dump --cache-out OUT` as OUT/", d.placed_with,
         ")");
  const Stage* donor_stage = model.find_stage(d.placed_with);
  if (!donor_stage)
    fail(a.model, ": the drafter is placed with stage '", d.placed_with, "', which this bundle ",
         "does not have");
  const auto drafter = open_bundle_drafter(a.model, m);
  const auto cache = load_stage_cache(*donor_stage, a.past, ctx);
  DraftContext dc;
  dc.target_embed = &model.embeddings_model().weights().embed_tokens;
  for (const auto& [layer, slot] :
       {std::pair{d.reads_sliding, &dc.sliding}, std::pair{d.reads_full, &dc.full}}) {
    if (layer < 0) continue;
    *slot = cache->own(layer);
    if (!*slot)
      fail(a.past, ": the drafter reads target layer ", layer, ", which stage '", d.placed_with,
           "' does not keep");
  }
  dc.position = cache->n_past();
  ThreadPool pool(a.threads > 0 ? a.threads : default_thread_count());
  const double t0 = now_seconds();
  const TensorMap outputs =
      run_drafter_stage(pool, *drafter, drafter_stage_decl(*drafter, d.id), dc, std::move(inputs));
  const double t1 = now_seconds();
  write_outputs(outputs, a.out);
  std::cerr << "stage '" << d.id << "' (drafter) ran one draft step at position " << dc.position
            << " in " << t1 - t0 << " s\n";
  return 0;
}

int run_stage_cmd(const RunStageArgs& a) {
  // Parse the inputs before loading anything: a typo should not cost a model load.
  std::vector<std::pair<std::string, std::string>> files;
  for (const std::string& in : a.inputs) {
    const size_t eq = in.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == in.size())
      fail("--in '", in, "': expected NAME=FILE.npy, e.g. --in hidden_states=h.npy");
    const std::string name = in.substr(0, eq);
    for (const auto& [seen, _] : files)
      if (seen == name) fail("--in: input '", name, "' is given twice");
    files.emplace_back(name, in.substr(eq + 1));
  }
  const auto model = Model::open(a.model);
  print_model_notes(model->notes(), a.verbose);
  std::optional<BundleManifest> manifest;
  if (model->is_bundle()) manifest = read_bundle_manifest(a.model);
  const std::optional<BundleDrafter> no_drafter;
  const std::optional<BundleDrafter>& drafter = manifest ? manifest->drafter : no_drafter;
  const Stage* stage = model->find_stage(a.stage);
  const bool is_drafter = !stage && drafter && drafter->id == a.stage;
  if (!stage && !is_drafter)
    fail(a.model, ": no stage '", a.stage, "'; its stages are ", stage_list(*model, drafter));
  if (stage && stage->role() != StageRole::TransformerLayers &&
      (!a.past.empty() || !a.cache_out.empty()))
    fail("stage '", a.stage, "' is a ", stage_role_name(stage->role()),
         " stage, which keeps no KV cache; --past and --cache-out are for transformer stages");
  TensorMap inputs;
  for (const auto& [name, path] : files) inputs[name] = npy_to_host_tensor(load_npy(path), path);
  const int64_t ctx = a.ctx > 0 ? std::min(a.ctx, model->max_context()) : model->max_context();
  if (is_drafter) return run_drafter_cmd(a, *model, *manifest, std::move(inputs), ctx);

  ThreadPool pool(a.threads > 0 ? a.threads : default_thread_count());
  const auto cache = !a.past.empty() ? load_stage_cache(*stage, a.past, ctx)
                                     : stage->new_cache(ctx, model->default_kv_type());
  // The rows this call appends to the cache: one per position.
  const auto positions = inputs.find("positions");
  const int64_t rows = positions != inputs.end() && !positions->second.shape().empty()
                           ? positions->second.shape()[0]
                           : 0;
  const double t0 = now_seconds();
  const TensorMap outputs = stage->run(pool, std::move(inputs), cache.get(), {}, nullptr);
  const double t1 = now_seconds();
  if (cache) cache->advance(rows);  // the call completed: its rows are the group's now

  write_outputs(outputs, a.out);
  if (!a.cache_out.empty()) {
    save_stage_cache(*stage, *cache, a.cache_out);
    std::cerr << "wrote the KV cache of positions 0.." << cache->n_past() - 1 << " to "
              << a.cache_out << "\n";
  }
  std::cerr << "stage '" << stage->id() << "' ran in " << t1 - t0 << " s\n";
  return 0;
}

}  // namespace

void add_run_stage_command(CLI::App& app, Registry& reg) {
  auto a = std::make_shared<RunStageArgs>();
  auto* sub = app.add_subcommand(
      "run-stage",
      "Run one stage on named .npy tensors, checked against its contract, and write its outputs");
  sub->add_option("model", a->model, "gemstage bundle (or HF checkpoint directory)")->required();
  sub->add_option("stage", a->stage, "stage id, as in the bundle's manifest (see 'info')")
      ->required();
  sub->add_option("--in", a->inputs, "an input tensor: NAME=FILE.npy (repeat for each)");
  sub->add_option("--out", a->out, "directory for the outputs, one NAME.npy each")->required();
  sub->add_option(
      "--past", a->past,
      "a transformer stage: start from this saved KV cache (a directory written by "
      "dump --cache-out DIR, as DIR/<stage id>, or by run-stage --cache-out), positions "
      "continuing from those it holds; the drafter: the saved caches of the stage it is "
      "placed with");
  sub->add_option("--cache-out", a->cache_out,
                  "transformer stage: write the KV cache the call leaves to this directory");
  sub->add_option("-c,--ctx-size", a->ctx,
                  "KV cache context size (default: the model's max_position_embeddings)");
  sub->add_option("-t,--threads", a->threads, "threads (default: all cores)");
  sub->add_flag("-v,--verbose", a->verbose, "list unused config fields and tensors");
  reg.add(sub, [a] { return run_stage_cmd(*a); });
}

}  // namespace gemstage::cli
