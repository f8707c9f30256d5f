// gemstage parity: where does a model (HF checkpoint or bundle) depart from a reference dump?
// Compares every tap, teacher-forces the reference sequence, measures the image's effect, finds
// the first diverging layer, and gates the result for CI.
#include <fstream>
#include <iostream>

#include "core/error.h"
#include "parity/gate.h"
#include "parity/parity.h"
#include "parity/plot.h"
#include "stage/sequence.h"
#include "tools/cli_common.h"
#include "tools/commands.h"

namespace gemstage::cli {

namespace {

struct ParityArgs {
  std::string model, reference, report, plot, ple_identity = "pad";
  std::vector<std::string> images, audios, gates;
  double tie_tol = 0.02, diverge_cos = 0.999;
  bool no_image_gate = false, no_audio_gate = false, verbose = false, quiet = false;
  int threads = 0;
  std::string cache_type = "auto";
};

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  if (!f) fail(path, ": cannot open for writing");
  f << text;
  if (!f) fail(path, ": write failed");
}

int run_parity_cmd(const ParityArgs& a, const RunContext& cx) {
  // Parse the gates first: a typo should not cost a model run.
  std::vector<Gate> gates;
  for (const std::string& g : a.gates) gates.push_back(parse_gate(g));
  if (a.tie_tol < 0) fail("--tie-tol must be >= 0");

  const ReferenceDump ref = load_reference(a.reference);
  auto model = std::make_unique<Sequence>(cx.models.open(a.model));
  apply_cache_type(*model, a.cache_type);
  print_model_notes(model->notes(), a.verbose);
  ParityOptions opt;
  opt.images = a.images;
  opt.tie_tol = a.tie_tol;
  opt.diverge_cos = a.diverge_cos;
  opt.image_gate = !a.no_image_gate;
  opt.audios = a.audios;
  opt.audio_gate = !a.no_audio_gate;
  if (a.ple_identity == "raw") {
    opt.ple_identity = PleIdentity::Raw;
    std::cerr
        << "warning: --ple-identity raw is a DIAGNOSTIC that reproduces the known "
           "staged-export bug (raw placeholder ids feed the PLE lookup); expect image/audio-row "
           "divergence\n";
  }
  ThreadPool pool(a.threads > 0 ? a.threads : default_thread_count());
  nlohmann::json report = run_parity(*model, ref, opt, pool);

  // Gates are evaluated against the report (an unknown metric is an error: exit 1).
  std::vector<GateResult> results = evaluate_gates(gates, report);
  bool all_pass = true;
  report["gates"] = nlohmann::json::array();
  for (const GateResult& g : results) {
    report["gates"].push_back({{"expr", g.gate.text},
                               {"metric", g.gate.metric},
                               {"op", g.gate.op},
                               {"threshold", g.gate.value},
                               {"actual", g.actual},
                               {"pass", g.pass}});
    all_pass = all_pass && g.pass;
  }
  report["pass"] = all_pass;

  if (!a.quiet) print_parity_table(report, std::cout);
  for (const GateResult& g : results)
    std::cout << (g.pass ? "gate PASS  " : "gate FAIL  ") << g.gate.text << "  (actual " << g.actual
              << ")\n";
  if (!a.report.empty()) write_text(a.report, report.dump(2) + "\n");
  if (!a.plot.empty()) write_text(a.plot, render_parity_svg(report));
  if (!all_pass) {
    std::cout << "parity: "
              << std::count_if(results.begin(), results.end(),
                               [](const GateResult& g) { return !g.pass; })
              << " of " << results.size() << " gate(s) failed\n";
    return 3;
  }
  return 0;
}

}  // namespace

void add_parity_command(CLI::App& app, Registry& reg) {
  auto a = std::make_shared<ParityArgs>();
  auto* sub = app.add_subcommand(
      "parity",
      "Compare a model or bundle against a reference tap dump: per-tap and per-layer errors, "
      "teacher-forced top-1, image and audio gates, first divergence");
  sub->add_option("-m,--model", a->model, "Hugging Face checkpoint directory or gemstage bundle")
      ->required();
  sub->add_option("-r,--reference", a->reference,
                  "reference dump directory (manifest.json + .npy taps, e.g. from "
                  "scripts/hf_dump.py or tests/fixtures/gemma4-tiny/*)")
      ->required();
  sub->add_option("--image", a->images,
                  "image file (PNG/JPEG) for the prompt's placeholders (default: the reference's "
                  "image.png, else its pixel_values.npy + image_position_ids.npy)");
  sub->add_option("--audio", a->audios,
                  "audio file for the prompt's audio placeholders (default: the reference "
                  "manifest's inputs.wav)");
  sub->add_option("--report", a->report, "write the JSON report here");
  sub->add_option("--plot", a->plot, "write an SVG plot of per-layer cosine and max-abs here");
  sub->add_option("--gate", a->gates,
                  "METRIC OP NUMBER, e.g. logits.max_abs<1e-4, teacher_forced>=0.95, "
                  "per_layer_inputs.image.cos_min>=0.999 (repeatable; exit 3 if any fails)")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  sub->add_option("--ple-identity", a->ple_identity,
                  "pad (HF, default) or raw (DIAGNOSTIC: reproduce the raw-placeholder-id PLE bug)")
      ->check(CLI::IsMember({"pad", "raw"}));
  sub->add_option("--tie-tol", a->tie_tol,
                  "a top-1 whose reference logit is within this of the reference max agrees")
      ->capture_default_str();
  sub->add_option("--diverge-cos", a->diverge_cos,
                  "a layer whose cosine falls below this counts as diverging (as does max-abs "
                  "over the manifest tolerance)")
      ->capture_default_str();
  sub->add_flag("--no-image-gate", a->no_image_gate,
                "skip the second run with the image replaced by a blank one");
  sub->add_flag("--no-audio-gate", a->no_audio_gate,
                "skip the second run with the audio replaced by silence");
  sub->add_option("-t,--threads", a->threads, "worker threads (default: all cores)");
  add_cache_type(sub, a->cache_type);
  sub->add_flag("-q,--quiet", a->quiet, "no table (gate lines only)");
  sub->add_flag("-v,--verbose", a->verbose, "list unused config fields and tensors");
  reg.add(sub, [a, &cx = reg.context] { return run_parity_cmd(*a, cx); });
}

}  // namespace gemstage::cli
