// gemstage export / check: write a model as a bundle of stages, and prove a bundle's invariants.
#include <iostream>

#include "core/error.h"
#include "stage/bundle.h"
#include "tools/cli_common.h"
#include "tools/commands.h"

namespace gemstage::cli {

void add_export_command(CLI::App& app, Registry& reg) {
  struct Args {
    std::string model, out;
    ExportOptions opt;
  };
  auto a = std::make_shared<Args>();
  auto* sub = app.add_subcommand(
      "export", "Export an HF checkpoint as a bundle of stages with checked contracts");
  sub->add_option("-m,--model", a->model, "Hugging Face checkpoint directory")->required();
  sub->add_option("--out", a->out, "bundle directory to write")->required();
  sub->add_option("--stages", a->opt.stages,
                  "layer ranges such as 0:21,21:42, or N balanced stages")
      ->capture_default_str();
  sub->add_option("--weights", a->opt.weights, "f32 | bf16 | q8_0 | q4_0")
      ->check(CLI::IsMember({"f32", "bf16", "q8_0", "q4_0"}))
      ->capture_default_str();
  sub->add_option(
         "--ple-weights", a->opt.ple_weights,
         "per-layer embedding table: auto (f32 bundles: f32, else bf16) | bf16 | int8 | f32")
      ->check(CLI::IsMember({"auto", "bf16", "int8", "f32"}))
      ->capture_default_str();
  sub->add_option("--max-context", a->opt.max_context,
                  "context the caches are declared for (default: the model's maximum)");
  sub->add_option("--model-draft", a->opt.drafter,
                  "also write this gemma4_assistant (MTP) drafter as the bundle's drafter stage "
                  "(also -md), placed with the last transformer stage; matrices in --weights");
  sub->add_flag("--force", a->opt.force,
                "write into an --out folder that holds other files (they are left alone)");
  reg.add(sub, [a] {
    const double t0 = now_seconds();
    export_bundle(a->model, a->out, a->opt);
    std::cerr << "exported " << a->model << " -> " << a->out << " in " << now_seconds() - t0
              << " s; run 'gemstage check " << a->out << "' to verify it\n";
    return 0;
  });
}

void add_check_command(CLI::App& app, Registry& reg) {
  struct Args {
    std::string bundle;
    CheckOptions opt;
  };
  auto a = std::make_shared<Args>();
  auto* sub = app.add_subcommand(
      "check", "Verify a bundle: schema, hashes, contracts, coverage, donors, caches, probe");
  sub->add_option("bundle", a->bundle, "bundle directory")->required();
  sub->add_option("--reference", a->opt.reference_model,
                  "also compare logits against this HF checkpoint");
  sub->add_option("--reference-atol", a->opt.reference_atol,
                  "max-abs logits tolerance for --reference");
  reg.add(sub, [a] {
    const int failures = check_bundle(a->bundle, a->opt, std::cout);
    if (failures) {
      std::cout << failures << " check(s) failed: " << a->bundle << " is not a valid bundle\n";
      return 1;
    }
    std::cout << "bundle " << a->bundle << " is valid\n";
    return 0;
  });
}

}  // namespace gemstage::cli
