// Models by name on the command line (issue 47): wherever a subcommand takes --model or
// --model-draft, ORG/NAME[@REVISION] names a Hugging Face Hub model, resolved through the shared
// Hugging Face cache (downloaded when missing). A local path that exists always wins.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "tools/commands.h"

namespace gemstage::cli {

// Adds the resolution to the --model and --model-draft options of every registered subcommand,
// ahead of their own checks, so a command's action only ever sees a directory. Runs while CLI11
// parses; skipped when --help was asked for.
void accept_model_references(Registry& reg);

// What a --model value names: the value itself when it is an existing path (or not a model name
// at all), else the snapshot directory of the Hub model, announced on stderr with its commit.
std::string resolve_model_argument(const std::string& value);

}  // namespace gemstage::cli
