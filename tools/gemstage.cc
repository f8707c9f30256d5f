// gemstage: one CLI, subcommands in the llama.cpp style.
#include <CLI/CLI.hpp>
#include <iostream>

#include "core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"gemstage: Gemma 4 E-series as a pipeline of checked stages"};
  app.require_subcommand(1);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const gemstage::Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
