#include "tools/commands.h"

namespace gemstage::cli {
void add_dump_command(CLI::App& app, Registry& reg) {
  auto* sub = app.add_subcommand("dump", "(not yet implemented)");
  reg.add(sub, [] { return 2; });
}
}  // namespace gemstage::cli
