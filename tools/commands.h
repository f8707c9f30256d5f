// Each subcommand lives in its own tools/cmd_<name>.cc and registers itself here.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <vector>

namespace gemstage::cli {

// A registered subcommand runs this after parsing; it returns the process exit code.
using Action = std::function<int()>;

struct Registry {
  std::vector<std::pair<CLI::App*, Action>> commands;
  void add(CLI::App* sub, Action a) { commands.emplace_back(sub, std::move(a)); }
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

}  // namespace gemstage::cli
