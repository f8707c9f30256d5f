#include "tools/commands.h"

namespace gemstage::cli {
void add_make_random_command(CLI::App& app, Registry& reg) {
  auto* sub = app.add_subcommand("make-random", "(not yet implemented)");
  reg.add(sub, [] { return 2; });
}
}  // namespace gemstage::cli
