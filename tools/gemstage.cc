// gemstage: one CLI, subcommands in the llama.cpp style. Each lives in tools/cmd_<name>.cc.
#include <CLI/CLI.hpp>
#include <cstring>
#include <iostream>
#include <memory>
#include <vector>

#include "core/cpu_features.h"
#include "core/error.h"
#include "core/platform.h"
#include "distributed/mpi_launch.h"
#include "io/mapped_file.h"
#include "stage/call_pipeline.h"
#include "tools/commands.h"
#include "tools/model_ref.h"

int main(int argc, char** argv) {
  // Activation buffers stay in the heap between layers (core/platform.cc says why).
  gemstage::platform::tune_allocator_for_reused_buffers();
  // A weights file truncated under a running command ends it with a message naming the file
  // rather than a bare "Bus error" (io/mapped_file.h).
  gemstage::install_mapped_file_fault_handler();
  CLI::App app{"gemstage: the Gemma 4 family as a pipeline of checked stages"};
  app.require_subcommand(1);
  // Options of a run spread over the ranks of an MPI job (issue 22), taken after any subcommand.
  app.fallthrough();
  std::string placement;
  double stage_timeout = 30;
  app.add_option("--placement", placement,
                 "under mpirun: which rank runs which stages, e.g. "
                 "\"0=embeddings,head 1=layers_0_13 2=layers_13_35\" (default: rank 0 "
                 "the embeddings and head, the other ranks the transformer stages in order)");
  app.add_option("--stage-timeout", stage_timeout,
                 "under mpirun: seconds a rank may stay silent (no answer, no heartbeat) before "
                 "its stage counts as failed")
      ->check(CLI::Range(1.0, 86400.0))
      ->capture_default_str();
  int pipeline_depth = 0;
  app.add_option(
         "--pipeline-depth", pipeline_depth,
         "under mpirun: calls serve and bench keep in flight at once, each over its share "
         "of the running sequences (0: auto, see docs/distributed.md \"Pipelining\"; 1: none)")
      ->check(CLI::Range(0, 64))
      ->capture_default_str();
  gemstage::cli::Registry reg;
  gemstage::cli::add_info_command(app, reg);
  gemstage::cli::add_dump_command(app, reg);
  gemstage::cli::add_make_random_command(app, reg);
  gemstage::cli::add_export_command(app, reg);
  gemstage::cli::add_check_command(app, reg);
  gemstage::cli::add_generate_command(app, reg);
  gemstage::cli::add_chat_command(app, reg);
  gemstage::cli::add_bench_command(app, reg);
  gemstage::cli::add_tokenize_command(app, reg);
  gemstage::cli::add_detokenize_command(app, reg);
  gemstage::cli::add_template_command(app, reg);
  gemstage::cli::add_parse_output_command(app, reg);
  gemstage::cli::add_parity_command(app, reg);
  gemstage::cli::add_serve_command(app, reg);
  gemstage::cli::add_run_stage_command(app, reg);
  gemstage::cli::add_pull_command(app, reg);
  gemstage::cli::add_ls_command(app, reg);
  gemstage::cli::add_rm_command(app, reg);
  // Every --model / --model-draft may name a Hub model (ORG/NAME[@REVISION], tools/model_ref.h).
  gemstage::cli::accept_model_references(reg);
  // llama.cpp spells serve's --parallel as -np; CLI11 only takes one-letter short names, so that
  // one spelling is translated before parsing.
  std::vector<char*> args(argv, argv + argc);
  // So are -ub (--ubatch-size) and --batch-size (the -b all generation commands share).
  char parallel[] = "--parallel", ubatch[] = "--ubatch-size", batch[] = "--chunk",
       timeout[] = "--timeout";
  if (argc > 1 && std::strcmp(argv[1], "serve") == 0)
    for (char*& arg : args) {
      if (std::strcmp(arg, "-np") == 0) arg = parallel;
      if (std::strcmp(arg, "-ub") == 0) arg = ubatch;
      if (std::strcmp(arg, "--batch-size") == 0) arg = batch;
      if (std::strcmp(arg, "-to") == 0) arg = timeout;
    }
  // llama.cpp's -md (--model-draft), -hf (a Hub model, here any --model), -ctk (--cache-type-k)
  // and -ctv (--cache-type-v) likewise.
  char model_draft[] = "--model-draft", model[] = "--model", cache_k[] = "--cache-type-k",
       cache_v[] = "--cache-type-v";
  for (char*& arg : args) {
    if (std::strcmp(arg, "-md") == 0) arg = model_draft;
    if (std::strcmp(arg, "-hf") == 0) arg = model;
    if (std::strcmp(arg, "-ctk") == 0) arg = cache_k;
    if (std::strcmp(arg, "-ctv") == 0) arg = cache_v;
  }
  try {
    app.parse(argc, args.data());
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {  // resolving a model name (a download) failed
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
#ifdef GEMSTAGE_HAVE_MPI
  std::unique_ptr<gemstage::DistributedSession> distributed;
#endif
  try {
    // A bad GEMSTAGE_ISA fails here, before any work, not inside the first kernel call.
    gemstage::cpu_tier_from_environment();
    if (gemstage::launched_as_mpi_ranks() || !placement.empty()) {
#ifdef GEMSTAGE_HAVE_MPI
      CLI::App* sub = nullptr;
      for (auto& [s, action] : reg.commands)
        if (s->parsed()) sub = s;
      const std::string name = sub ? sub->get_name() : "";
      if (name != "serve" && name != "generate" && name != "dump" && name != "bench" &&
          name != "parity")
        gemstage::fail("`", name,
                       "` runs in one process; under mpirun only serve, generate, dump, ",
                       "bench and parity spread stages over ranks");
      if (!gemstage::launched_as_mpi_ranks())
        gemstage::fail("--placement needs several ranks: mpirun -np K gemstage ", name, " ...");
      gemstage::DistributedOptions d;
      d.bundle = sub->get_option("--model")->as<std::string>();
      d.threads = sub->get_option("--threads")->as<int>();
      d.placement = placement;
      d.stage_timeout_seconds = stage_timeout;
      distributed = gemstage::DistributedSession::start(d);
      if (distributed->is_worker()) return distributed->run_worker();
      reg.context.models = distributed->models();
#else
      gemstage::fail(
          "this gemstage was built without MPI (apt-get install libopenmpi-dev "
          "openmpi-bin, then rebuild) and cannot run stages on several ranks");
#endif
    }
    reg.context.pipeline_depth = pipeline_depth;
    for (auto& [sub, action] : reg.commands)
      if (sub->parsed()) return action();
  } catch (const gemstage::Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  } catch (const std::bad_alloc&) {
    std::cerr << "error: out of memory\n";
    return 1;
  } catch (const std::exception& e) {
    // std::filesystem errors carry the path and errno text; report them like our own.
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
