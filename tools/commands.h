// Each subcommand lives in its own tools/cmd_<name>.cc and registers itself here.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <memory>
#include <vector>

#include "stage/model.h"

namespace gemstage::cli {

// A registered subcommand runs this after parsing; it returns the process exit code.
using Action = std::function<int()>;

// What main decides before a command runs and hands to it (never process state): how it opens
// its models (under mpirun, rank 0 opens the job's bundle across the ranks) and how many calls
// it keeps in flight over stages in other processes.
struct RunContext {
  ModelOpener models;
  int pipeline_depth = 0;  // --pipeline-depth; 0: automatic (CallPipeline::depth)
};

// The registry owns every subcommand's option storage (args<T>()), so what CLI11 writes while
// parsing lives as long as the actions that read it. Storage owned by an action's captures is a
// trap: a lambda that never names a variable does not capture it, and CLI11 then writes into
// freed memory (`parse-output --model` once crashed that way).
struct Registry {
  std::vector<std::pair<CLI::App*, Action>> commands;
  std::vector<std::shared_ptr<void>> storage;
  RunContext context;  // filled in by main after parsing, before the action runs

  void add(CLI::App* sub, Action a) { commands.emplace_back(sub, std::move(a)); }
  // A default-constructed T that lives as long as the registry; bind options to its fields.
  template <class T>
  T& args() {
    auto p = std::make_shared<T>();
    T& ref = *p;
    storage.push_back(std::move(p));
    return ref;
  }
};

void add_info_command(CLI::App& app, Registry& reg);
void add_dump_command(CLI::App& app, Registry& reg);
void add_make_random_command(CLI::App& app, Registry& reg);
void add_export_command(CLI::App& app, Registry& reg);
void add_check_command(CLI::App& app, Registry& reg);
void add_generate_command(CLI::App& app, Registry& reg);
void add_chat_command(CLI::App& app, Registry& reg);
void add_bench_command(CLI::App& app, Registry& reg);
void add_tokenize_command(CLI::App& app, Registry& reg);
void add_detokenize_command(CLI::App& app, Registry& reg);
void add_parity_command(CLI::App& app, Registry& reg);
void add_serve_command(CLI::App& app, Registry& reg);
void add_run_stage_command(CLI::App& app, Registry& reg);
void add_template_command(CLI::App& app, Registry& reg);
void add_parse_output_command(CLI::App& app, Registry& reg);
// Models by name (tools/cmd_pull.cc, cmd_ls.cc, cmd_rm.cc; resolution in tools/model_ref.h).
void add_pull_command(CLI::App& app, Registry& reg);
void add_ls_command(CLI::App& app, Registry& reg);
void add_rm_command(CLI::App& app, Registry& reg);

}  // namespace gemstage::cli
